"""The input-gradient pass of a split (its dx), in one of two forms, and what it leaves dw.

Rules

1. Per group (the default where blocks are not small): dx is one ``autograd.grad`` for the
   inputs. Each intermediate (``ckptfx.split.weight_groups`` Rule 1) carries a post-hook of
   the split for the call; it fires after every hook of the user on the node (tensor hooks,
   ``retain_grad``, pre-hooks and post-hooks registered earlier), and captures the
   gradients the node was applied to and its outputs on the weight edges. A custom
   ``autograd.Function``'s backward computes those outputs in dx already; a built-in node
   computes only its input half, and dw computes the weight half from the captured
   gradients without the node's hooks (``ckptfx.split.weight_calls`` Rule 4). So every hook
   on the graph fires once, in dx or in dw, with the gradients of a fused backward, and a
   custom backward runs once.

2. Where the per-group pass cannot be exact, the split takes the fused pass (Rule 3), and
   under DDP or FSDP2 (which must reduce in dw) raises ``CheckpointError`` before anything
   is computed. Two such places: a post-hook on a built-in intermediate, which in a fused
   backward receives the node's weight outputs too and may replace them (registering the
   capture hook shows whether the node has one: Python post-hooks of a node share one
   dict); and a weight-side node whose sum the weight pass would add in another order
   (``ckptfx.split.weight_groups`` Rule 3).

3. Fused (``ckptfx.split.weight_calls`` Rules 2, 3): one ``autograd.grad`` for the inputs
   and every weight; dx returns the input gradients and keeps the weight gradients for dw.

4. Per group, the unpack hook logs dx's reads of replayed tensors and drops those that only
   nodes dw will not execute read (``ckptfx.split.passes`` Rule 4): dw executes the built-in
   intermediates, nothing else dx executed. The fused pass reads each replay once and drops
   it at the read.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Sequence

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from ckptfx import lowering
from ckptfx.kernel.frame import CheckpointError, tls
from ckptfx.kernel.session import recompute_session_ctx
from ckptfx.split import weight_calls
from ckptfx.split.weight_groups import Node, WeightPlan, plan_weight_pass, trim_session

__all__ = ["Captured", "InputPass", "input_pass", "is_custom"]

# (gradients the node was applied to, its outputs on the weight edges), per intermediate
Captured = dict[Node, tuple[tuple[torch.Tensor | None, ...], tuple[torch.Tensor | None, ...]]]


class InputPass:
    """What dx computed and what it leaves dw (the gradients, the plan, the captures)."""

    __slots__ = ("mode", "grads", "wgrads", "plan", "captured", "out_edges", "w_edges",
                 "session")

    def __init__(self, mode: str) -> None:
        self.mode = mode  # "per_group" or "fused"
        self.grads: Sequence[torch.Tensor | None] = ()
        self.wgrads: list[torch.Tensor | None] = []  # fused: every weight's
        self.plan: WeightPlan | None = None
        self.captured: Captured = {}
        self.out_edges: list[GradientEdge] = []
        self.w_edges: list[GradientEdge] = []
        self.session: Any = None  # the Session, once a block joined it


def is_custom(node: Node) -> bool:
    """A custom ``autograd.Function``'s node (its backward computes all its outputs)."""
    return isinstance(node, torch.autograd.function.BackwardCFunction)


def _has_other_post_hooks(handle: Any) -> bool:
    """Whether the node of ``handle`` (the split's post-hook, just registered) has another
    Python post-hook: they share one dict. Unknown (no such dict in this torch): True."""
    ref = getattr(handle, "hooks_dict_ref", None)
    hooks = ref() if callable(ref) else None
    return hooks is None or len(hooks) > 1


def input_pass(key: Hashable, outputs: list[torch.Tensor],
               cotangents: list[torch.Tensor | None], x_req: list[torch.Tensor],
               weights: list[torch.Tensor], data_parallel: bool, who: str,
               trim: bool, early_drop: bool) -> InputPass:
    """Run dx (Rules 1-4); ``data_parallel`` when DDP or FSDP2 ran the forward."""
    fused = (not data_parallel and bool(x_req) and bool(outputs)
             and weight_calls.fused_backward_pays(cotangents, x_req, weights))
    if fused:
        return _fused(key, outputs, cotangents, x_req, weights, who)
    res = InputPass("per_group")
    res.out_edges = [get_gradient_edge(o) for o in outputs]
    x_nodes = {get_gradient_edge(t).node for t in x_req}
    res.w_edges = [get_gradient_edge(w) for w in weights]
    res.plan = plan = plan_weight_pass(res.out_edges, x_nodes, [e.node for e in res.w_edges])
    if not (x_req and outputs):
        return res
    if plan.misordered is not None:  # Rule 2
        if data_parallel:
            raise CheckpointError(
                f"{who}: the autograd node {plan.misordered.name()} sums three or more weight "
                "gradients, one of them from the input path, in an order dx and dw cannot "
                "reproduce (weight_groups.py Rule 3: a recurrent cell's bias on the CPU, "
                "say), and under DDP or FSDP2 the split cannot run one fused pass instead. "
                "Use a plain backward() for this stage; nothing was computed")
        return _fused(key, outputs, cotangents, x_req, weights, who)
    captured = res.captured
    hooks = []
    hooked: Node | None = None
    try:
        for node, branch in plan.intermediates:
            h = node.register_hook(_capture(captured, node, branch, is_custom(node)))
            hooks.append(h)
            if hooked is None and not is_custom(node) and _has_other_post_hooks(h):
                hooked = node
        if hooked is not None:  # Rule 2
            for h in hooks:
                h.remove()
            hooks = []
            if data_parallel:
                raise CheckpointError(
                    f"{who}: the autograd node {hooked.name()}, where a weight gradient leaves "
                    "the input path, has a post-hook (grad_fn.register_hook): in a fused "
                    "backward it sees the weight gradient too, which dx and dw cannot split, "
                    "and under DDP or FSDP2 the split cannot run one fused pass instead. Use "
                    "a tensor hook (tensor.register_hook) or a pre-hook (register_prehook), "
                    "or a plain backward(); nothing was computed")
            return _fused(key, outputs, cotangents, x_req, weights, who)
        keep = {n for n, _ in plan.intermediates if not is_custom(n)}
        log: list = []
        with recompute_session_ctx(key, retain_on_unpack=True):
            act = tls.activation
            act.record(log, keep if trim and early_drop else None)
            try:
                res.grads = torch.autograd.grad(outputs, x_req, cotangents,
                                                retain_graph=True, allow_unused=True)
            except RuntimeError as err:
                lowering.explain_donated_buffers(err, who)
                raise
            finally:
                act.log = act.drop_unless = None
        if len(act.session.frames):
            res.session = act.session  # frames found lazily (no prefire)
        if trim:
            trim_session(act.session, log, keep)
        log.clear()
    finally:
        for h in hooks:
            h.remove()
    return res


def _capture(captured: Captured, node: Node, branch: tuple[int, ...], custom: bool
             ) -> Callable[[Any, Any], None]:
    def hook(grad_inputs: tuple[torch.Tensor | None, ...],
             grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        # grad_inputs are the node's outputs: keep those on the weight edges only (the input
        # half is dx's result). A custom node is not called again: drop what it received.
        captured[node] = (() if custom else tuple(grad_outputs),
                          tuple(grad_inputs[i] for i in branch))
    return hook


def _fused(key: Hashable, outputs: list[torch.Tensor], cotangents: list[torch.Tensor | None],
           x_req: list[torch.Tensor], weights: list[torch.Tensor], who: str) -> InputPass:
    """Rule 3: one backward for the inputs and the weights; the weights' kept for dw."""
    res = InputPass("fused")
    with recompute_session_ctx(key, retain_on_unpack=False):
        act = tls.activation
        try:
            # retain_graph: the graph, and with it the session's frames, lives until dw
            # releases it, so a clear in between abandons the split as in the other pass.
            grads = torch.autograd.grad(outputs, [*x_req, *weights], cotangents,
                                        retain_graph=True, allow_unused=True)
        except RuntimeError as err:
            lowering.explain_donated_buffers(err, who)
            raise
    if len(act.session.frames):
        res.session = act.session
    res.grads = grads[:len(x_req)]
    res.wgrads = list(grads[len(x_req):])
    return res
