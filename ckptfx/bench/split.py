"""Replays per micro-batch of a split backward (dx, then k dw calls), counted.

A zero-bubble pipeline runs a micro-batch's backward as one input-gradient call (dx) and one
or more weight-gradient calls (dw, per parameter group). Each is its own autograd call, so
``torch.utils.checkpoint`` replays every checkpointed block once per call: 1 + k replays.
``ckptfx.checkpoint`` under one recompute session replays each block once, whatever k.

The counts come from a counter inside each block (never estimated), and each split's
gradients are compared bitwise (``torch.equal``) with one plain ``autograd.grad`` of the
same blocks without checkpointing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from typing import Callable, ContextManager, Sequence

import torch
import torch.utils.checkpoint as tcp

from ckptfx import checkpoint as cx_checkpoint
from ckptfx import clear_recompute_session, recompute_session_ctx

__all__ = ["SplitCount", "count_split_replays"]

Block = Callable[[torch.Tensor], torch.Tensor]
_sessions = itertools.count()


@dataclasses.dataclass(frozen=True)
class SplitCount:
    """Replays per block per micro-batch (the forward run not counted) for dx + k dw calls."""

    k: int
    torch_replays: float
    ckptfx_replays: float
    bitwise_equal: bool


def _groups(params: Sequence[torch.Tensor], k: int) -> list[list[torch.Tensor]]:
    return [list(params[i::k]) for i in range(k)]


def count_split_replays(blocks: Sequence[Block], params: Sequence[torch.Tensor],
                        x: torch.Tensor, k: int, seed: int = 0) -> SplitCount:
    """Run ``blocks`` in sequence on ``x`` three ways (plain, torch's checkpoint, ckptfx's
    checkpoint under one session), backward as dx + ``k`` dw calls over ``k`` groups of
    ``params``; count the blocks' runs. ``torch.manual_seed(seed)`` before each forward, so
    dropout draws the same masks."""
    if not 1 <= k <= len(params):
        raise ValueError(f"k must be between 1 and the number of parameters ({len(params)}), "
                         f"got {k}")
    runs = [0]

    def counted(b: Block) -> Block:
        def run(h: torch.Tensor) -> torch.Tensor:
            runs[0] += 1
            return b(h)
        return run

    fns = [counted(b) for b in blocks]
    groups = _groups(params, k)

    def forward(wrap: Callable[[Block, torch.Tensor], torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(seed)
        xr = x.detach().requires_grad_()
        h = xr
        for f in fns:
            h = wrap(f, h)
        return xr, h

    def split(xr: torch.Tensor, out: torch.Tensor, g: torch.Tensor,
              session: Callable[[bool], ContextManager[object]]) -> list[torch.Tensor]:
        """dx, then one dw call per group; ``session(retain)`` wraps each call."""
        with session(True):
            got = list(torch.autograd.grad(out, [xr], g, retain_graph=True))
        for i, grp in enumerate(groups):
            last = i == len(groups) - 1
            with session(not last):  # the last consumer lets the replayed tensors go
                got += torch.autograd.grad(out, grp, g, retain_graph=not last)
        return got

    xr, out = forward(lambda f, h: f(h))
    g = torch.ones_like(out)
    plain = torch.autograd.grad(out, [xr, *itertools.chain(*groups)], g)

    runs[0] = 0
    xr, out = forward(lambda f, h: tcp.checkpoint(f, h, use_reentrant=False))
    torch_grads = split(xr, out, g, lambda retain: contextlib.nullcontext())
    torch_runs = runs[0]

    runs[0] = 0
    sid = ("ckptfx.bench.split", next(_sessions))
    xr, out = forward(lambda f, h: cx_checkpoint(f, h))
    try:
        ckptfx_grads = split(xr, out, g, lambda retain: recompute_session_ctx(
            sid, retain_on_unpack=retain))
    finally:
        clear_recompute_session(sid)
    ckptfx_runs = runs[0]

    n = len(blocks)
    same = all(torch.equal(a, b) and torch.equal(a, c)
               for a, b, c in zip(plain, torch_grads, ckptfx_grads))
    return SplitCount(k, torch_runs / n - 1, ckptfx_runs / n - 1, same)
