"""The weight pass of a split (its dw): one ``autograd.grad`` per weight group, sharing one
recompute session, and the gradients accumulated into ``.grad``.

Rules

1. dw runs one ``autograd.grad`` per parameter group, rooted at the intermediates with the
   captured gradients (and at outputs that do not depend on the inputs, with their cotangent),
   so it executes only weight-gradient ops. dx + dw do the work of one fused backward (shared
   weights used by several intermediates are the exception: their group re-runs the input ops
   between those intermediates, as torch's split does). The groups are
   ``ckptfx.split.weight_groups``'s; where blocks are small there is one group rooted at the
   outputs with their cotangents, for every weight (``ckptfx.split.weight_calls``).

2. The gradients of the ``params=`` tensors are accumulated into ``.grad`` as ``backward()``
   would, never aliasing a caller's tensor; under DDP the reducer writes ``.grad``
   (``ckptfx.split.data_parallel``).
"""

from __future__ import annotations

from typing import Any, Hashable, cast

import torch
from torch.autograd.graph import GradientEdge

from ckptfx.kernel.session import recompute_session_ctx
from ckptfx.split import data_parallel
from ckptfx.split.weight_groups import Node, WeightGroup

__all__ = ["weight_pass"]


def weight_pass(
    key: Hashable,
    groups: list[WeightGroup],
    captured: dict[Node, tuple[torch.Tensor | None, ...]],
    out_edges: list[GradientEdge | torch.Tensor],
    cotangents: list[torch.Tensor | None],
    weights: list[torch.Tensor],
    param_slots: list[int],
    w_edges: list[GradientEdge | torch.Tensor],
    dp: data_parallel.DataParallel | None,
) -> list[torch.Tensor | None]:
    """Run the weight pass of one split; return the gradient of each weight (Rules 1, 2).

    ``groups`` index into ``weights`` / ``w_edges`` and ``out_edges`` / ``cotangents``;
    ``captured`` holds the gradients dx captured at the groups' intermediates. The last
    group's pass drops the session's replays and the graph.
    """
    n = len(weights)
    wgrads: list[torch.Tensor | None] = [None] * n
    work: list[tuple[WeightGroup, list[GradientEdge | torch.Tensor],
                     list[torch.Tensor | None]]] = []
    for g in groups:
        edges: list[GradientEdge | torch.Tensor] = []
        seeds: list[torch.Tensor | None] = []
        for node in g.intermediates:
            for i, grad in enumerate(captured.get(node, ())):
                if grad is not None:
                    edges.append(GradientEdge(node, i))
                    seeds.append(grad)
        for i in g.roots:
            edges.append(out_edges[i])
            seeds.append(cotangents[i])
        if edges:
            work.append((g, edges, seeds))
    ddp = dp is not None and bool(dp.ddp)

    def run_group(g: WeightGroup, edges: list[GradientEdge | torch.Tensor],
                  seeds: list[torch.Tensor | None], last: bool) -> None:
        hooks = []
        try:
            if len(g.intermediates) > 1:
                # A root may also receive gradient through another root of the group:
                # pin each intermediate to what it received in dx.
                for node in g.intermediates:
                    saved = captured.get(node)
                    if saved is not None:
                        hooks.append(node.register_prehook(lambda _, s=saved: s))
            if ddp:
                res = dp.accumulate_through_ddp(  # type: ignore[union-attr]
                    weights, param_slots, w_edges, g.weights,
                    edges, seeds, last)
            else:
                # (edges are all GradientEdges, or all tensors for the whole pass)
                res = torch.autograd.grad(
                    cast(Any, edges), cast(Any, [w_edges[i] for i in g.weights]), seeds,
                    retain_graph=not last, allow_unused=True,
                )
        finally:
            for h in hooks:
                h.remove()
        for i, r in zip(g.weights, res):
            wgrads[i] = r

    # One retaining session context for every group but the last, one dropping
    # context for the last (a context per group bound and unbound every frame each
    # time: with one dw call per parameter that was most of a small block's dw).
    if len(work) > 1:
        with recompute_session_ctx(key, retain_on_unpack=True):
            for g, edges, seeds in work[:-1]:
                run_group(g, edges, seeds, False)
    if work:
        with recompute_session_ctx(key, retain_on_unpack=False):
            g, edges, seeds = work[-1]
            run_group(g, edges, seeds, True)
    # Accumulate into .grad as backward() would; never alias a caller's tensor.
    aliases = {c.untyped_storage().data_ptr() for c in cotangents if c is not None}
    for saved in captured.values():
        aliases.update(t.untyped_storage().data_ptr() for t in saved if t is not None)
    for i in param_slots:
        wg = wgrads[i]
        if wg is None or ddp:  # under DDP the reducer wrote .grad
            continue
        p = weights[i]
        if p.grad is None:
            p.grad = wg.clone() if wg.untyped_storage().data_ptr() in aliases else wg
            aliases.add(p.grad.untyped_storage().data_ptr())
        else:
            p.grad += wg
    return wgrads
