"""The weight groups of a split's autograd graph: which weights share where their gradient
paths leave the input path, and which input-path nodes a weight pass will execute.

Rules

1. A group holds the weights whose gradient paths leave the input path at the same nodes, its
   *intermediates* (the nodes of the input path from which a weight path leaves), plus the
   outputs that do not depend on the inputs on its weight paths (its roots). Two groups that
   meet at one weight are merged.

2. Between dx and dw the session keeps only the replayed tensors dw will read: during dx the
   unpack hook logs which autograd node read each replayed tensor, and when dx ends the tensors
   read only by nodes dw will not execute (activation outputs, softmax probabilities, dropout
   masks) are dropped from the session's replay (``weight_pass_nodes``, ``trim_session``;
   ``ckptfx.split.passes`` Rule 4, ``ckptfx.pipelining``).

The graph analysis follows the technique of ``torch.distributed.pipelining``'s
``stage_backward_input`` / ``stage_backward_weight``; the code is ckptfx's own.
"""

from __future__ import annotations

import collections
from typing import Any, Iterable, Sequence

from torch.autograd.graph import GradientEdge

__all__ = ["Node", "trim_session", "weight_pass_nodes"]

Node = Any  # torch.autograd.graph.Node (C++ nodes have no common Python base)


class WeightGroup:
    """Weights whose gradient paths leave the input path at the same nodes."""

    __slots__ = ("intermediates", "roots", "weights")

    def __init__(self) -> None:
        self.intermediates: list[Node] = []  # input-path nodes; their captured grads are roots
        self.roots: list[int] = []  # outputs that do not depend on the inputs; cotangent roots
        self.weights: list[int] = []  # indices into the split's weight list


def plan_groups(
    out_edges: Sequence[GradientEdge], x_nodes: set[Node], w_nodes: Sequence[Node | None]
) -> list[WeightGroup]:
    """Group the weights by where their gradient paths meet the input path."""
    stop = x_nodes | {n for n in w_nodes if n is not None}
    parents: dict[Node, list[Node]] = {}
    queue: collections.deque[Node] = collections.deque()
    for e in out_edges:
        if e.node not in parents:
            parents[e.node] = []
            queue.append(e.node)
    while queue:
        node = queue.popleft()
        if node in stop:  # an input's own history is not this split's business
            continue
        for child, _ in node.next_functions:
            if child is None:
                continue
            lst = parents.get(child)
            if lst is None:
                parents[child] = lst = []
                queue.append(child)
            lst.append(node)
    # The input path: every node from which an input is reachable.
    on_input_path = {n for n in x_nodes if n in parents}
    stack = list(on_input_path)
    while stack:
        for p in parents[stack.pop()]:
            if p not in on_input_path:
                on_input_path.add(p)
                stack.append(p)
    out_nodes: dict[Node, list[int]] = collections.defaultdict(list)
    for i, e in enumerate(out_edges):
        out_nodes[e.node].append(i)

    groups: list[WeightGroup] = []
    owner: dict[Node, WeightGroup] = {}
    for wi, w in enumerate(w_nodes):
        if w is None or w not in parents:
            continue  # unused weight: no gradient
        frontier: set[Node] = set()
        closure = {w}
        stack = [w]
        while stack:
            node = stack.pop()
            if node in out_nodes:
                frontier.add(node)
            for p in parents[node]:
                if p in on_input_path:
                    frontier.add(p)
                elif p not in closure:
                    closure.add(p)
                    stack.append(p)
        group: WeightGroup | None = None
        for f in frontier:
            g = owner.get(f)
            if g is not None and g is not group:
                if group is None:
                    group = g
                else:  # two groups meet at this weight: merge them
                    group.weights += g.weights
                    for n in (*g.intermediates, *(out_edges[i].node for i in g.roots)):
                        owner[n] = group
                    group.intermediates += g.intermediates
                    group.roots += g.roots
                    groups.remove(g)
        if group is None:
            group = WeightGroup()
            groups.append(group)
        group.weights.append(wi)
        for f in frontier:
            if owner.get(f) is group:
                continue
            owner[f] = group
            if f in on_input_path:
                group.intermediates.append(f)
            else:
                group.roots += out_nodes[f]
    for g in groups:
        g.weights.sort()
        g.roots.sort()
    return groups


def _leading_to(starts: Iterable[Node], targets: Iterable[Node], stop: set[Node]) -> set[Node]:
    """Nodes reachable from ``starts`` (inclusive) from which some target is reachable."""
    memo: dict[Node, bool] = {t: True for t in targets}
    for s in starts:
        if s in memo:
            continue
        memo[s] = False
        stack = [(s, iter(() if s in stop else s.next_functions))]
        while stack:
            node, it = stack[-1]
            for child, _ in it:
                if child is None:
                    continue
                if child not in memo:
                    memo[child] = False
                    stack.append((child, iter(() if child in stop else child.next_functions)))
                    break
                if memo[child]:
                    memo[node] = True
            else:
                stack.pop()
                if stack and memo[node]:
                    memo[stack[-1][0]] = True
    return {n for n, leads in memo.items() if leads}


def weight_pass_nodes(
    groups: Iterable[tuple[Iterable[Node], Iterable[Node]]], stop: Iterable[Node] = ()
) -> set[Node]:
    """The input-path nodes a weight pass will execute, given its parameter groups.

    Each group is ``(intermediates, weight_nodes)``. A weight pass rooted at a group's
    intermediates executes those nodes, plus (when a group has several intermediates, i.e. a
    weight used at several places) the nodes between them that lead to the group's weights.
    Nodes off the input path may be included too; they are harmless to the caller (trimming
    only looks at nodes the input pass executed).
    """
    keep: set[Node] = set()
    stop_set = set(stop)
    for intermediates, weights in groups:
        intermediates = list(intermediates)
        keep.update(intermediates)
        if len(intermediates) > 1:
            keep |= _leading_to(intermediates, weights, stop_set)
    return keep


def trim_session(session: Any, log: list, keep_nodes: set[Node]) -> None:
    """Drop from ``session``'s replays every tensor that the logged dx read and dw won't.

    ``log`` holds ``(holder, node)`` pairs appended by the unpack hook during a retaining dx
    pass; a tensor is dropped when every node that read it is outside ``keep_nodes``. Tensors
    dx never read are kept (dw may read them).
    """
    keep: set[Any] = set()
    drop: list[Any] = []
    for holder, node in log:
        if node is None or node in keep_nodes:
            keep.add(holder)
        else:
            drop.append(holder)
    for holder in drop:
        if holder in keep:
            continue
        frame = holder.frame
        replay = frame.session_replay if frame.session is session else None
        if replay is not None:
            replay[holder.index] = None
            frame.reads.pop(holder, None)  # frame.py Rule 4b: a bound consumer's copy too
