"""The weight pass of a split (its dw) after a per-group dx, and the weight gradients
accumulated into ``.grad`` (after either pass).

Rules

1. dw is one weight backward: rooted at the edges from the intermediates into the weight
   side, seeded with the intermediates' weight halves (what a custom backward computed in dx,
   or what ``ckptfx.split.weight_calls.weight_halves`` computes from the gradients dx
   captured), and at the outputs that do not depend on the inputs, with their cotangents
   (``ckptfx.split.weight_groups`` Rule 1). It executes no node dx executed except the
   built-in intermediates, called without their hooks, so dx + dw do the work of one fused
   backward and every hook fires once. The seeds are listed in the order a fused backward
   produces them (cotangents first, then the intermediates as the engine runs them), so a
   weight reached at several places sums its gradients in a fused backward's order. The
   halves' call retains the replayed tensors it reads, the weight backward, the session's
   last consumer, drops them (``recompute_session_ctx``'s rule).

2. The gradients of the ``params=`` tensors are accumulated into ``.grad`` as ``backward()``
   would (``accumulate``): the first gradient becomes ``.grad`` (a clone where it shares
   memory with a tensor the caller holds; a sparse one as the shallow copy torch's
   ``AccumulateGrad`` makes), later ones are added to it. Under DDP the reducer writes
   ``.grad`` (``ckptfx.split.data_parallel``).
"""

from __future__ import annotations

from typing import Any, Hashable, Iterable, Sequence

import torch
from torch.autograd.graph import GradientEdge

from ckptfx.kernel.session import recompute_session_ctx
from ckptfx.split import data_parallel
from ckptfx.split.input_pass import Captured, is_custom
from ckptfx.split.weight_calls import weight_halves
from ckptfx.split.weight_groups import Node, WeightPlan

__all__ = ["UNKNOWN", "accumulate", "storage_ptrs", "weight_pass"]

# In a set of data pointers: a tensor whose memory could not be read (``storage_ptrs``).
UNKNOWN = -1


def weight_pass(
    key: Hashable,
    plan: WeightPlan,
    captured: Captured,
    out_edges: list[GradientEdge],
    cotangents: list[torch.Tensor | None],
    weights: list[torch.Tensor],
    param_slots: list[int],
    w_edges: list[GradientEdge],
    dp: data_parallel.DataParallel | None,
) -> list[torch.Tensor | None]:
    """Run the weight pass of one split; return the gradient of each weight (Rule 1).

    ``plan`` indexes into ``weights`` / ``w_edges`` and ``out_edges`` / ``cotangents``;
    ``captured`` holds what dx captured at the intermediates. The weight backward drops the
    session's replays and the graph.
    """
    wgrads: list[torch.Tensor | None] = [None] * len(weights)
    edges: list[GradientEdge] = [out_edges[i] for i in plan.roots]
    seeds: list[torch.Tensor | None] = [cotangents[i] for i in plan.roots]
    calls: list[tuple[Node, tuple[torch.Tensor | None, ...]]] = []
    targets: dict[Node, GradientEdge] = {}
    halves: list[tuple[Node, tuple[int, ...], Any]] = []
    for node, branch in plan.intermediates:
        got = captured.get(node)
        if got is None:
            continue  # no gradient reached it in dx, nor would in a fused backward
        grads_in, outs = got
        if is_custom(node) or all(o is not None for o in outs):
            halves.append((node, branch, outs))  # computed in dx already
            continue
        halves.append((node, branch, len(calls)))
        calls.append((node, grads_in))
        for i in branch:
            child, nr = node.next_functions[i]
            targets.setdefault(child, GradientEdge(child, nr))
    if not calls and not edges and not halves:
        return wgrads
    # The session's rule: every backward call but its last retains what it reads (freed
    # at the read, a replayed tensor's pages would be faulted in again by the next one).
    called: list[tuple[torch.Tensor | None, ...]] = []
    if calls:
        with recompute_session_ctx(key, retain_on_unpack=True):
            called = weight_halves(calls, list(targets.values()))
    with recompute_session_ctx(key, retain_on_unpack=False):
        for node, branch, outs in halves:
            fresh = isinstance(outs, int)
            nexts = node.next_functions
            for j, i in enumerate(branch):
                g = called[outs][i] if fresh else outs[j]
                if g is None:
                    continue
                child, nr = nexts[i]
                edges.append(GradientEdge(child, nr))
                seeds.append(_fit(g, child, nr) if fresh else g)
        reached = plan.weights
        if edges and reached:
            res: Sequence[torch.Tensor | None]
            if dp is not None and dp.ddp:
                res = dp.accumulate_through_ddp(weights, param_slots, w_edges, reached, edges,
                                                seeds, True)
            else:
                res = torch.autograd.grad(edges, [w_edges[i] for i in reached], seeds,
                                          allow_unused=True)
            for i, r in zip(reached, res):
                wgrads[i] = r
    return wgrads


def _fit(g: torch.Tensor, child: Node, nr: int) -> torch.Tensor:
    """``g`` reduced to the shape the edge's node expects, as the engine reduces a node's
    output (``sum_to``) before handing it on; dtype and device it converts at the root."""
    meta = child._input_metadata[nr]
    if not meta.is_nested_tensor and tuple(g.shape) != tuple(meta.shape):
        g = g.sum_to_size(meta.shape)
    return g


def storage_ptrs(t: torch.Tensor) -> tuple[int, ...] | None:
    """The data pointers of the memory ``t`` reads (a sparse tensor's indices and values);
    None where they cannot be read (a layout or subclass without storage)."""
    try:
        layout = t.layout
        if layout == torch.strided:
            return (t.untyped_storage().data_ptr(),)
        if layout == torch.sparse_coo:
            parts: Iterable[torch.Tensor] = (t._indices(), t._values())
        elif layout in (torch.sparse_csr, torch.sparse_bsr):
            parts = (t.crow_indices(), t.col_indices(), t.values())
        elif layout in (torch.sparse_csc, torch.sparse_bsc):
            parts = (t.ccol_indices(), t.row_indices(), t.values())
        else:
            return None
        return tuple(p.untyped_storage().data_ptr() for p in parts)
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def accumulate(p: torch.Tensor, g: torch.Tensor, shared: set[int]) -> None:
    """Add ``g`` to ``p.grad`` as ``backward()``'s ``AccumulateGrad`` would (Rule 2), post-
    accumulate-grad hooks included.

    ``shared`` holds the data pointers of tensors the caller may hold (cotangents, dx's
    results, captured gradients; ``UNKNOWN`` for one whose memory could not be read); a first
    gradient reading such memory (or any, with ``UNKNOWN`` there) is cloned, never aliased,
    and the new ``.grad``'s pointers join the set.
    """
    if p.grad is not None:
        if p.grad.is_sparse and not g.is_sparse:
            p.grad = g + p.grad  # a sparse .grad cannot hold a dense sum in place
        else:
            p.grad += g
        _post_accumulate_hooks(p)
        return
    ptrs = storage_ptrs(g)
    aliased = ptrs is None or UNKNOWN in shared or any(q in shared for q in ptrs)
    if g.layout == torch.sparse_coo:
        ind, val = g._indices(), g._values()
        if aliased or not (ind.is_contiguous() and val.is_contiguous()):
            new = g.clone()
        else:  # AccumulateGrad's shallow copy: the same indices and values, not coalesced
            new = torch.sparse_coo_tensor(ind, val, g.shape, check_invariants=False,
                                          is_coalesced=False)
    elif aliased or g.layout != torch.strided:
        new = g.clone()
    else:
        new = g
    p.grad = new
    shared.update(storage_ptrs(new) or ())
    _post_accumulate_hooks(p)


def _post_accumulate_hooks(p: torch.Tensor) -> None:
    """What ``AccumulateGrad`` runs after writing ``.grad``: the parameter's
    ``register_post_accumulate_grad_hook`` hooks (optimizer-in-backward steps), in order."""
    hooks = p._post_accumulate_grad_hooks
    if hooks:
        for hook in tuple(hooks.values()):
            hook(p)
