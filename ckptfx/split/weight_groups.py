"""Where a split's weight pass starts: the nodes of the input path from which weight paths
leave, the outputs off the input path that lead to weights, and which replayed tensors dx
may drop.

Rules

1. The *input path* is every node from which an input is reachable; the *weight side* every
   other node from which a weight is reachable. An *intermediate* is an input-path node with
   an edge to the weight side (a linear's ``AddmmBackward0``: its edge to the weight leaves,
   its edge to the activation stays). The weight side reaches no input-path node (it would be
   on the input path then), so the weight pass, started at the intermediates' weight edges,
   executes no node dx executed (``WeightPlan``, ``plan_weight_pass``).

2. Between dx and dw the session keeps only the replayed tensors dw will read: during dx the
   unpack hook logs which autograd node read each replayed tensor, and when dx ends the tensors
   read only by nodes dw will not execute (activation outputs, softmax probabilities, dropout
   masks) are dropped from the session's replay (``trim_session``; ``ckptfx.split.passes``
   Rule 4). ``weight_pass_nodes`` is the set for torch's own split (``ckptfx.pipelining``),
   which re-executes input-path nodes between the intermediates of a shared weight.

3. A node's incoming gradients are summed in the order they arrive, and a sum of three or
   more depends on it. The weight pass hands the intermediates' gradients in at its start,
   a fused backward as each intermediate runs; where a weight-side node also receives from a
   weight-side producer that a fused backward runs before one of those intermediates (a
   recurrent cell's bias, added at every step, the first step's off the input path), the
   per-group pass cannot give that sum bit for bit, and ``WeightPlan.misordered`` names the
   node (``ckptfx.split.input_pass`` then takes the fused pass).

The graph walk follows the technique of ``torch.distributed.pipelining``'s
``stage_backward_input`` / ``stage_backward_weight``; the code is ckptfx's own.
"""

from __future__ import annotations

import collections
from typing import Any, Iterable, Sequence

from torch.autograd.graph import GradientEdge

__all__ = ["Node", "WeightPlan", "plan_weight_pass", "trim_session", "weight_pass_nodes"]

Node = Any  # torch.autograd.graph.Node (C++ nodes have no common Python base)


class WeightPlan:
    """Where dw starts (Rule 1).

    ``intermediates`` holds ``(node, branch)`` pairs, ``branch`` the indices of the node's
    edges into the weight side, in the order a fused backward executes the nodes (the engine
    runs the ready node with the highest sequence number first); ``roots`` the outputs on the
    weight side (they do not depend on the inputs); ``weights`` the weights reached at all;
    ``misordered`` a node where the weight pass would sum gradients in another order than a
    fused backward (Rule 3), or None.
    """

    __slots__ = ("intermediates", "misordered", "roots", "weights")

    def __init__(self) -> None:
        self.intermediates: list[tuple[Node, tuple[int, ...]]] = []
        self.roots: list[int] = []  # indices into the split's outputs
        self.weights: list[int] = []  # indices into the split's weight list
        self.misordered: Node | None = None


def plan_weight_pass(
    out_edges: Sequence[GradientEdge], x_nodes: set[Node], w_nodes: Sequence[Node | None]
) -> WeightPlan:
    """The intermediates, weight-side outputs and reached weights of a split's graph (Rule 1).

    Example::

        >>> x, w = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
        >>> y = (x * w).sum()
        >>> plan = plan_weight_pass([get_gradient_edge(y)], {get_gradient_edge(x).node},
        ...                         [get_gradient_edge(w).node])
        >>> [(n.name(), b) for n, b in plan.intermediates], plan.roots, plan.weights
        ([('MulBackward0', (1,))], [], [0])
    """
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
    plan = WeightPlan()
    weight_side: set[Node] = set()
    found: dict[Node, None] = {}  # the intermediates, in the order found
    for wi, w in enumerate(w_nodes):
        if w is None or w not in parents:
            continue  # unused weight: no gradient
        plan.weights.append(wi)
        if w not in weight_side:
            weight_side.add(w)
            stack.append(w)
    while stack:
        for p in parents[stack.pop()]:
            if p in on_input_path:
                found[p] = None
            elif p not in weight_side:
                weight_side.add(p)
                stack.append(p)
    plan.roots = [i for i, e in enumerate(out_edges) if e.node in weight_side]
    for node in sorted(found, key=lambda n: n._sequence_nr(), reverse=True):
        branch = tuple(i for i, (child, _) in enumerate(node.next_functions)
                       if child is not None and child in weight_side)
        plan.intermediates.append((node, branch))
    plan.misordered = _misordered(weight_side, parents, on_input_path,
                                  collections.Counter(e.node for e in out_edges))
    return plan


def _misordered(weight_side: set[Node], parents: dict[Node, list[Node]],
                on_input_path: set[Node], out_count: collections.Counter) -> Node | None:
    """A weight-side node whose gradients the weight pass would sum in another order than a
    fused backward (Rule 3), or None.

    A fused backward adds a node's incoming gradients as their producers run: the outputs'
    cotangents first, then in descending sequence number (the engine runs the ready node with
    the highest number, and a node's producers were made after it). The weight pass hands
    the intermediates' gradients in first, descending, then those of weight-side producers as
    they run. The orders differ where an intermediate producer's number is below a weight-side
    producer's; a sum of two is the same either way.
    """
    for node in weight_side:
        ps = parents.get(node, ())
        if len(ps) + out_count[node] < 3:
            continue
        direct = [p._sequence_nr() for p in ps if p in on_input_path]
        later = [p._sequence_nr() for p in ps if p not in on_input_path]
        if direct and later and min(direct) < max(later):
            return node
    return None


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
