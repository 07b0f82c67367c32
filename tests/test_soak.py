"""Soak: 1,000 training steps per mode leave nothing behind.

Each mode runs a small checkpointed stack for 1,000 steps. After a few warm-up steps the
number of live tensors, ckptfx frames and recompute sessions is read (``gc`` after a
collection); after the 1,000 steps it must be the same: a leak of one object per step would
show as 1,000. Counting objects is exact where a resident-memory reading is noisy.
"""

from __future__ import annotations

import gc
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ckptfx
from ckptfx.kernel.frame import Frame

pytestmark = pytest.mark.usefixtures("no_hooks_left_behind", "no_sessions_left")

STEPS = 1000
WARMUP = 5


def _live() -> tuple[int, int, int]:
    gc.collect()
    tensors = frames = 0
    for obj in gc.get_objects():
        kind = type(obj)  # not isinstance: some objects warn when asked for __class__
        if issubclass(kind, torch.Tensor):
            tensors += 1
        elif kind is Frame:
            frames += 1
    return tensors, frames, len(ckptfx.recompute_session_stats())


def _stack() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Dropout(0.1), nn.Linear(8, 4))


def _modes() -> dict[str, Callable[[nn.Module, torch.Tensor, int], None]]:
    def checkpoint(block: nn.Module, x: torch.Tensor, step: int) -> None:
        ckptfx.checkpoint(block, ckptfx.checkpoint(block, x)).sum().backward()

    rematted = {}

    def remat(block: nn.Module, x: torch.Tensor, step: int) -> None:
        fn = rematted.setdefault("fn", ckptfx.remat(
            block, policy=ckptfx.checkpoint_policies.dots_saveable))
        fn(fn(x)).sum().backward()

    def session(block: nn.Module, x: torch.Tensor, step: int) -> None:
        with ckptfx.recompute_handle_collector_ctx() as handles:
            out = ckptfx.checkpoint(block, x).sum()
        sid = ("soak", step)
        try:
            for h in handles:
                ckptfx.recompute_handle(h, sid)
            with ckptfx.recompute_session_ctx(sid, retain_on_unpack=True):
                torch.autograd.grad(out, x, retain_graph=True)
            with ckptfx.recompute_session_ctx(sid):
                torch.autograd.grad(out, list(block.parameters()))
        finally:
            ckptfx.clear_recompute_session(sid)

    def vjp_split(block: nn.Module, x: torch.Tensor, step: int) -> None:
        out, dx_fn, dw_fn = ckptfx.vjp_split(lambda t: ckptfx.checkpoint(block, t), x,
                                             params=block.parameters())
        dx_fn(torch.ones_like(out))
        dw_fn()

    split = {}

    def grad_split(block: nn.Module, x: torch.Tensor, step: int) -> None:
        if "fns" not in split:
            def loss(params: dict, t: torch.Tensor) -> torch.Tensor:
                return torch.func.functional_call(
                    block, params, (ckptfx.checkpoint(F.gelu, t),)).sum()
            split["fns"] = ckptfx.grad_split(loss, x_argnums=1)
        dx_fn, dw_fn = split["fns"]
        dx_fn(dict(block.named_parameters()), x, session=step)
        dw_fn(step)

    def func_grad(block: nn.Module, x: torch.Tensor, step: int) -> None:
        fn = rematted.setdefault("plain", ckptfx.remat(lambda t: F.gelu(t).sin()))
        torch.func.grad(lambda t: fn(t).sum())(x.detach())

    return {"checkpoint": checkpoint, "remat": remat, "session": session,
            "vjp_split": vjp_split, "grad_split": grad_split, "torch.func.grad": func_grad}


@pytest.mark.parametrize("mode", list(_modes()))
def test_a_thousand_steps_leave_nothing_behind(mode: str) -> None:
    block = _stack()
    run = _modes()[mode]
    x = torch.randn(2, 4, requires_grad=True)
    for step in range(WARMUP):
        run(block, x, step)
    block.zero_grad(set_to_none=True)
    x.grad = None
    before = _live()
    for step in range(WARMUP, WARMUP + STEPS):
        run(block, x, step)
    block.zero_grad(set_to_none=True)
    x.grad = None
    assert _live() == before
