"""How a split calls the autograd engine: the fused pass where blocks are small, and the
weight halves of the intermediates, computed without their hooks.

Rules

1. The per-group pass (``ckptfx.split.weight_pass``) executes only weight-gradient work, but
   it costs Python in dx (the graph walk, a hook per intermediate) and two engine calls in
   dw. Where blocks are small that is most of dx + dw.

2. The *fused* pass is one ``autograd.grad`` in dx for the inputs and every weight: dw only
   hands out the gradients it kept (and accumulates ``.grad``). It is one fused backward, so
   every hook, ``retain_grad`` and custom ``autograd.Function`` backward runs once with a
   fused backward's gradients, and each block is read once; the weight-gradient work moves
   from dw into dx, and the weight gradients are held from dx to dw. It is taken where the
   shapes say the work is small (Rule 3) and, at any size, where the per-group pass cannot be
   exact (``ckptfx.split.input_pass`` Rule 2): a Python post-hook (``grad_fn.register_hook``)
   on a built-in intermediate, which in a fused backward sees the weight half of the node's
   outputs and may change it, or a sum of three or more weight gradients the weight pass
   would add in another order (``ckptfx.split.weight_groups`` Rule 3). Never under DDP or
   FSDP2, whose hooks must reduce in dw (``ckptfx.split.data_parallel``); there those graphs
   are refused.

3. The choice is made from shapes, never a clock (DESIGN invariant 7): the weight-gradient
   FLOPs are estimated as ``2 * rows * sum(w.numel())``, ``rows`` the largest row count
   (``numel / shape[-1]``) among the inputs and the cotangents, and the fused pass is taken
   when that is at most ``ENGINE_CALL_FLOPS`` per weight (``fused_backward_pays``).

4. The weight half of an intermediate (``weight_halves``) is computed by calling the node
   itself, which runs its ``apply`` without the engine, so none of its hooks (tensor hooks,
   ``retain_grad``, pre- and post-hooks) fires a second time: they fired in dx, once, as in a
   fused backward, and dx captured the gradient they left. The call runs inside a throwaway
   engine call whose only targets are the nodes behind the intermediates' weight edges, so
   a built-in node computes only those outputs (its ``should_compute_output`` reads the
   running graph task): the input half is not computed again. The targets are never
   reached, so their own hooks do not fire there; they fire once, in the weight backward
   that the results seed. The calls run on dw's thread, on the stream current there (the
   engine runs a node on its forward's stream): run the forward, dx and dw on one stream, as
   pipeline schedules do.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from ckptfx.split.weight_groups import Node

__all__ = ["ENGINE_CALL_FLOPS", "fused_backward_pays", "weight_halves"]

# Estimated weight-gradient FLOPs per weight below which the per-group pass's calls cost
# more than the work. Measured for the pass that preceded the fused one (a second plain
# weight backward from the outputs, which recomputed the input path in dw) on 6 MLP blocks
# (bench_overhead.py's, hidden = 4 d), against the per-group pass: 0.79x at ~130k FLOPs per
# weight (d=64, batch 8), 0.88x at ~530k (batch 32) but 1.07x at ~530k (d=128), 1.47x at
# 2.1M (d=256). The fused pass does less than that one did (no input path twice, no graph
# walk), so the bound is conservative for it. A fixed number: the choice must not depend on
# timing.
ENGINE_CALL_FLOPS = 300_000

# Tests and benchmarks force a pass: None (the rule), "per_group" or "fused". The per-group
# pass still yields to the fused one where only that is exact (Rule 2).
_force: str | None = None


def _rows(t: torch.Tensor | None) -> int:
    if t is None or t.dim() == 0:
        return 1
    return t.numel() // max(1, t.shape[-1])


def fused_backward_pays(cotangents: Sequence[torch.Tensor | None],
                        xs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor]) -> bool:
    """True when the fused pass is expected to cost less than the per-group one (Rule 3).

    Example::

        >>> w = [torch.zeros(256, 64), torch.zeros(256)]
        >>> fused_backward_pays([torch.zeros(8, 64)], [torch.zeros(8, 64)], w)
        True
    """
    if _force is not None:
        return _force == "fused"
    if not weights:
        return False
    rows = max([_rows(c) for c in cotangents] + [_rows(x) for x in xs] + [1])
    flops = 2 * rows * sum(w.numel() for w in weights)
    return flops <= ENGINE_CALL_FLOPS * len(weights)


class _Calls(torch.autograd.Function):
    """A throwaway node whose backward calls the intermediates (Rule 4)."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, job: list) -> torch.Tensor:
        ctx.job = job
        return anchor.clone()

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple[None, None]:
        job = ctx.job
        for i, (node, grads_in) in enumerate(job):
            out = node(*grads_in)
            job[i] = (node, out if isinstance(out, tuple) else (out,))
        return None, None


def weight_halves(calls: list[tuple[Node, tuple[torch.Tensor | None, ...]]],
                  targets: list[GradientEdge]) -> list[tuple[torch.Tensor | None, ...]]:
    """Each node's outputs for the gradients it received in dx, computed without its hooks
    and only where its edge leads to one of ``targets`` (Rule 4), in the order of ``calls``.

    ``targets`` are edges to the nodes behind the intermediates' weight edges (one per node
    suffices). Exceptions of a node (a saved tensor modified in place) propagate.
    """
    job: list[Any] = list(calls)
    anchor = torch.zeros((), requires_grad=True)
    with torch.enable_grad():
        root = _Calls.apply(anchor, job)
    # The anchor as a target makes the engine run _Calls; the others only mark the nodes.
    inputs: list[Any] = [get_gradient_edge(anchor), *targets]
    torch.autograd.grad(root, inputs, allow_unused=True)
    return [out for _, out in job]
