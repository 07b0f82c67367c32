"""Regressions found by the second adversarial review (early stop, torch.func path, trace).

Each test compares gradients bitwise (torch.equal) with the plain computation.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import pytest
import torch

import ckptfx
import ckptfx.frame
from ckptfx import checkpoint_name, checkpoint_policies

X2 = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
X3 = torch.randn(2, 4, 6, generator=torch.Generator().manual_seed(1))
W = torch.randn(6, 6, generator=torch.Generator().manual_seed(2))


def _grads(run: Callable[..., torch.Tensor], inputs: list[torch.Tensor],
           amp: bool = False) -> list[torch.Tensor]:
    xs = [t.detach().clone().requires_grad_() for t in inputs]
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if amp else contextlib.nullcontext()
    with ctx:
        out = run(*xs)
    out.float().pow(2).sum().backward()
    return [x.grad for x in xs]


# -- 1. deferred early stop: an in-place op that packs its saved inputs before it runs --------


def test_early_stop_inplace_mul_by_tensor_as_last_op() -> None:
    # mul_ by a tensor that requires grad saves a copy of self, then runs; torch's C++ sets
    # _backward_hooks through the Python setter afterwards (an earlier deferred stop saw that
    # as "the next torch call" and raised a SystemError).
    calls = []

    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return (x @ w).mul_(w[0])

    ref = _grads(block, [X2, W])
    calls.clear()
    got = _grads(lambda x, w: ckptfx.checkpoint(block, x, w), [X2, W])
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert len(calls) == 2  # forward + one replay


def test_early_stop_inplace_mul_under_user_function_mode() -> None:
    from torch.overrides import TorchFunctionMode

    class Passthrough(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x @ w).div_(w[0].abs() + 1)

    with Passthrough():
        ref = _grads(block, [X2, W])
        got = _grads(lambda x, w: ckptfx.checkpoint(block, x, w), [X2, W])
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


# -- 2. torch.func path: kept outputs matched to the wrong op, or rewritten through an alias --


def _func_grads(fn: Callable[..., torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch.func.grad(lambda a, b: fn(a, b).pow(2).sum(), argnums=(0, 1))(x, W)


def test_func_path_keep_not_matched_to_an_earlier_call_after_inplace_op() -> None:
    # Under grad tracking, autograd copies ``self`` before ``mul_`` in the replay: the op
    # indices shift by one, and the kept position of ``v``'s mm then holds ``u``'s mm.
    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        a = x.clone()
        a.mul_(w[0])
        u = a @ w
        v = checkpoint_name(u.tanh() @ w, "v")
        return (u + v).tanh()

    r = ckptfx.remat(block, policy=checkpoint_policies.save_only_these_names("v"))
    ref = _func_grads(block, X2)
    got = _func_grads(r, X2)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


@pytest.mark.parametrize("policy", ["dots_saveable", "everything_saveable"])
def test_func_path_kept_mm_rewritten_through_matmul_alias(policy: str) -> None:
    # A 3-D matmul is mm + _unsafe_view: the view shares the mm's storage but not its version
    # counter, so an in-place write to the result used to leave the kept mm looking intact.
    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        a = x @ w
        a.add_(w[0])
        return (a @ w).tanh()

    r = ckptfx.remat(block, policy=getattr(checkpoint_policies, policy))
    ref = _func_grads(block, X3)
    got = _func_grads(r, X3)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


# -- 3. segment replay: the same alias seen by remat's trace ---------------------------------


def _add_after_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    a = x @ w
    a.add_(w[0])
    return (a @ w).tanh()


def _write_slice_after_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    a = x @ w
    a[..., :3].mul_(w[0, :3])
    return (a @ w).tanh()


def _write_unsafe_chunk(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    a = x @ w
    p, _ = torch.unsafe_chunk(a, 2, dim=-1)
    p.mul_(2.0)
    return (a @ w).tanh()


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fn", [_add_after_matmul, _write_slice_after_matmul,
                                _write_unsafe_chunk])
def test_remat_kept_mm_rewritten_through_matmul_alias(fn: Callable[..., torch.Tensor],
                                                      amp: bool) -> None:
    r = ckptfx.remat(fn, policy=checkpoint_policies.dots_saveable)
    ref = _grads(fn, [X3, W], amp)
    got = _grads(r, [X3, W], amp)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


def _ambient_autocast_block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu"):  # no dtype: the one autocast around it holds, even off
        y = x @ w
    return (y.float().sin() * 2).sum(0)


@pytest.mark.parametrize("forward_dtype,backward_dtype", [
    (torch.float16, None),   # forward in fp16-then-off, backward outside autocast (bf16)
    (None, torch.float16),   # forward outside autocast, backward in fp16-then-off
])
def test_replay_restores_the_autocast_dtype_of_an_off_region(
        forward_dtype: torch.dtype | None, backward_dtype: torch.dtype | None) -> None:
    # An "autocast off" state still carries a dtype and a cache flag, which an inner
    # torch.autocast("cpu") takes up: the replay must restore them, as torch's does.
    def around(dtype: torch.dtype | None) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        if dtype is not None:
            stack.enter_context(torch.autocast("cpu", dtype=dtype))
            stack.enter_context(torch.autocast("cpu", enabled=False))
        return stack

    results = {}
    for name, run in (("plain", _ambient_autocast_block),
                      ("torch", lambda a, b: torch.utils.checkpoint.checkpoint(
                          _ambient_autocast_block, a, b, use_reentrant=False)),
                      ("ckptfx", lambda a, b: ckptfx.checkpoint(_ambient_autocast_block, a, b))):
        x, w = X2.clone().requires_grad_(), W.clone().requires_grad_()
        with around(forward_dtype):
            out = run(x, w)
        with around(backward_dtype):
            results[name] = torch.autograd.grad(out.sum(), (x, w))
    for name in ("torch", "ckptfx"):
        assert all(torch.equal(a, b) for a, b in zip(results[name], results["plain"])), name
