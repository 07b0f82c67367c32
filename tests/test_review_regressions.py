"""Regression tests for bugs found in the code review of the ckptfx package.

Each test names the bug it pins down; all compare against the plain computation bitwise or
check liveness with weakref + gc.collect().
"""

from __future__ import annotations

import gc

import pytest
import torch

import ckptfx
from ckptfx import checkpoint_policies as cp


def _grads(fn, x0, w0):
    x = x0.clone().requires_grad_()
    w = w0.clone().requires_grad_()
    out = fn(x, w)
    return out.detach(), torch.autograd.grad(out.sum(), [x, w])


def _transpose_inplace_block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # The matmul output is kept by dots_saveable because the replay of exp's output reads
    # it; it is then rewritten in place. The kept value must be the pre-write one (or none).
    h = x @ w
    h2 = h.T.contiguous()
    h2.t_()
    h.add_(h2)
    return h.exp()


@pytest.mark.parametrize("policy", [None, cp.dots_saveable, cp.everything_saveable])
def test_value_kept_for_replay_then_rewritten_in_place(policy):
    # Bug: the tracer detached held values inside the dispatch mode, where the alias gets its
    # own version counter, so "not rewritten since" always held and the replay read (and
    # wrote into) the rewritten tensor: gradients off by ~1e9.
    torch.manual_seed(0)
    x0, w0 = torch.randn(4, 6), torch.randn(6, 6)
    ref_out, ref = _grads(_transpose_inplace_block, x0, w0)
    out, got = _grads(ckptfx.remat(_transpose_inplace_block, policy=policy), x0, w0)
    assert torch.equal(out, ref_out)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


def test_kept_output_modified_after_forward_is_recomputed_not_read():
    # Bug: a value kept for the replay (dots_saveable keeps the matmul output that relu's
    # replay reads) that the caller then modifies in place was silently read by the replay.
    # It is recomputed from the inputs instead: plain autograd, which never saved it (relu
    # saves its output), is not affected by the write either.
    def block(x, w):
        h = x @ w
        return h, h.relu()

    x = torch.randn(4, 6, requires_grad=True)
    w = torch.randn(6, 6, requires_grad=True)
    got = []
    for fn in (block, ckptfx.remat(block, policy=cp.dots_saveable)):
        h, r = fn(x, w)
        with torch.no_grad():
            h.add_(5)
        got.append(torch.autograd.grad(r.sum(), [x, w]))
    assert all(torch.equal(a, b) for a, b in zip(*got))


def test_saved_residual_modified_after_forward_raises_like_autograd():
    # Bug: saved-tensor hooks switch off autograd's version check; a residual kept by
    # everything_saveable and modified in place was handed to the backward silently.
    def block(x, w):
        return (x @ w).exp()

    x = torch.randn(4, 6, requires_grad=True)
    w = torch.randn(6, 6, requires_grad=True)
    plain = block(x, w)
    plain.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(plain.sum(), [x, w])
    out = ckptfx.remat(block, policy=cp.everything_saveable)(x, w)
    out.mul_(2)
    with pytest.raises(ckptfx.CheckpointError, match="modified in place"):
        torch.autograd.grad(out.sum(), [x, w])


@pytest.mark.parametrize("policy", [cp.everything_saveable, cp.dots_saveable, None])
def test_graph_dropped_without_backward_frees_frame(policy):
    # Bug: a kept output of an op that saves its own output (relu, exp) held its autograd
    # node through the packed tensor: a cycle through the C++ graph that gc cannot break,
    # so every graph dropped without a backward leaked with all its activations.
    w = torch.randn(8, 8, requires_grad=True)

    def block(x):
        return (x @ w).relu().exp().sin()

    x = torch.randn(4, 8, requires_grad=True)
    with ckptfx.recompute_handle_collector_ctx() as handles:
        out = ckptfx.remat(block, policy=policy)(x)
    assert len(handles) == 1 and handles[0].frame is not None
    del out
    gc.collect()
    assert handles[0].frame is None


def test_everything_saveable_still_exact_with_dropout_and_bf16():
    # The detached residuals of the leak fix must not change any gradient.
    torch.manual_seed(0)
    x0, w0 = torch.randn(4, 8), torch.randn(8, 8)

    def block(x, w):
        h = torch.nn.functional.dropout((x @ w).relu(), 0.3, training=True)
        return torch.softmax(h @ w, dim=-1).tanh()

    def run(fn):
        x = x0.clone().requires_grad_()
        w = w0.clone().requires_grad_()
        torch.manual_seed(7)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn(x, w)
        return torch.autograd.grad(out.float().sum(), [x, w])

    ref = run(block)
    got = run(ckptfx.remat(block, policy=cp.everything_saveable))
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
