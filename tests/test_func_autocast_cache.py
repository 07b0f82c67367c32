"""remat on the torch.func path inside one autocast region: autocast's cast cache.

CPU/CUDA autocast caches the lower-precision cast of a leaf weight for the rest of the region,
so two uses of the weight in the region read one cast, and the plain function adds both
uses' gradients into that cast before converting them. A remat'd call's backward cannot feed a
cast outside it: ckptfx refuses (CheckpointError, before any gradient is written) where that
sharing crosses a remat'd call, and is bitwise everywhere else, including with the cache off.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ckptfx
from ckptfx import checkpoint_policies as cp
from tests.conftest import assert_tree_bitwise


def _inputs(square: bool = False):
    g = torch.Generator().manual_seed(0)
    p = {"w": torch.randn(8, 8, generator=g), "b": torch.randn(8, generator=g)}
    x = torch.randn(8 if square else 4, 8, generator=g)
    return p, x


def _linear_block(p, x):
    return F.linear(x, p["w"], p["b"]).tanh()


def _grads(loss, p, x):
    return torch.func.grad(loss, argnums=(0, 1))(p, x)


def _twice(block, cache_enabled=True):
    def loss(p, x):
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache_enabled):
            return block(p, block(p, x)).float().sum()
    return loss


def test_second_call_reading_the_first_calls_cached_cast_is_refused():
    p, x = _inputs()
    with pytest.raises(ckptfx.CheckpointError, match="autocast's cast cache.*cache_enabled=False"):
        _grads(_twice(ckptfx.remat(_linear_block)), p, x)


def test_plain_code_reading_a_remat_calls_cached_cast_is_refused_in_backward():
    """Before the fix this gave gradients that differ from the plain function's in the last
    bits, silently."""
    p, x = _inputs()

    def make(block):
        def loss(p, x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return F.linear(block(p, x), p["w"], p["b"]).float().sum()
        return loss

    with pytest.raises(ckptfx.CheckpointError, match="code after a remat'd call"):
        _grads(make(ckptfx.remat(_linear_block)), p, x)


@pytest.mark.parametrize("policy", [None, cp.dots_saveable, cp.everything_saveable])
def test_cache_off_is_bitwise_with_shared_weights(policy):
    p, x = _inputs()
    r = ckptfx.remat(_linear_block, policy=policy)
    assert_tree_bitwise(_grads(_twice(r, cache_enabled=False), p, x),
                        _grads(_twice(_linear_block, cache_enabled=False), p, x))


@pytest.mark.parametrize("policy", [None, cp.dots_saveable, cp.everything_saveable])
def test_one_call_per_weight_in_a_region_is_bitwise(policy):
    p, x = _inputs()

    def one(block):
        def loss(p, x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return block(p, x).float().sum()
        return loss

    r = ckptfx.remat(_linear_block, policy=policy)
    assert_tree_bitwise(_grads(one(r), p, x), _grads(one(_linear_block), p, x))


def test_kept_value_never_reaches_an_op_the_cache_shifted():
    """Call 2's forward finds w's cast in the cache; its replay casts w again, so the replay's
    op sequence is shifted against the forward's. With x and w of one shape, a value kept
    for one cast matched by op overload and position alone would go to the other cast."""
    p, x = _inputs(square=True)

    def block(p, x):
        unused = x @ p["w"]  # reads w's cast; the output does not depend on it
        y = x * 1.0
        y.masked_fill_(x > 0.5, 0.0)
        return y + 0.0 * unused.detach()

    r = ckptfx.remat(block, policy=cp.everything_saveable)
    assert_tree_bitwise(_grads(_twice(r), p, x), _grads(_twice(block), p, x))


@pytest.mark.parametrize("policy", [None, cp.everything_saveable])
def test_a_call_on_an_earlier_calls_output_replays_the_forwards_casts(policy):
    """Call 2's input is call 1's output, which autocast's cache cannot hold (not a leaf),
    so its forward casts ``x`` once per use; the replay's own primal is a leaf the cache
    would share. Read through a view there, the replay casts as often as the forward (the
    fuzzer's seed 51924 raised "the block's replay built a different autograd graph")."""
    p, x = _inputs()

    def block(p, x):
        y = x * 1.0
        y.add_(torch.softmax(x @ x.t() * 0.3, -1) @ x)
        return y

    r = ckptfx.remat(block, policy=policy)
    assert_tree_bitwise(_grads(_twice(r), p, x), _grads(_twice(block), p, x))
