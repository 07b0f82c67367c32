"""The torch.func path of ``remat``: exact under every transform, remat'd where it saves memory.

torch.func transforms (grad, vjp, jacrev, jacfwd, hessian, vmap) switch saved-tensor hooks
off, so the kernel's frames cannot work under them. Rules:

1. **Forward mode and vmap run the block op by op.** When the innermost transform around the
   call is jvp (jvp, jacfwd) or vmap, nothing is saved for a backward at that level: the
   block runs as the plain function, so primal and tangent come from one computation and
   integer arguments and outputs are what they are.
2. **The differentiated level: forward op by op, backward by replay.** When the innermost
   transform is grad/vjp (grad, vjp, jacrev, hessian's inner jacrev, vmap(grad)), or under
   plain autograd for a block with torch.func inside, the block's forward runs op by op at
   every level (the levels below see exactly the plain function's ops: its jvp tangents,
   vmap batching, graphs of outer grad levels). Only at the innermost level its graph is
   dropped: its outputs pass through one ``RematFunction`` whose backward replays the block
   in the forward's RNG and autocast state, handing back the values the policy kept
   (offloaded ones from host memory) instead of recomputing those ops.
3. **One gradient per use.** Plain autograd adds the gradient of each graph edge that reads
   an input into the input's buffer, nodes in decreasing sequence number, each node's edges
   in order. The forward's graph at the differentiated level is walked once to list these
   uses; ``RematFunction`` takes the input once per use, and its backward returns the
   gradient each use received in the replay (caught by node hooks), in that order, so the
   outer engine sums them exactly as plain autograd does: bitwise, also for a weight shared
   within and across calls, or one tensor passed as two arguments.
4. **Levels below are identities.** ``RematFunction``'s backward at an outer grad level,
   and its jvp, pass the outputs' gradients and tangents on unchanged (rule 2 recorded the
   forward there op by op).
5. **Outside tensors.** Tensors the block reads from nn.Modules (the block itself when it is
   a module, its ``self``, modules among its arguments or in its closure) become explicit
   inputs, so ``functional_call``
   parameters get gradients. A graph edge at the differentiated level to any other tracked
   tensor (a closure or a global; under plain autograd, one requiring grad) would lose its
   gradient: a ``CheckpointError``. Outside constants are fine.

6. **Autocast's cast cache.** Inside one autocast region the cache hands every use of a leaf
   weight the same lower-precision cast, and the plain function adds all uses' gradients
   into that cast before converting them. A remat'd call's backward returns gradients for
   its inputs, not for a cast outside it, so where the cache shares a cast across a call
   (a call reads a cast made before it, or code after it reads the call's cast) ckptfx
   raises a ``CheckpointError`` naming the fix, ``cache_enabled=False`` (bitwise); the
   second case is caught in the backward, before any gradient is written. The replay hands
   back a kept value only to an op whose inputs come from where the forward op's came from
   (an input, an earlier op's output, the same outside tensor): the cache can shift the
   replay's op sequence against the forward's. An input the cache could not hold in the
   forward (an earlier call's output: not a leaf; or a view) is read through a view in
   the replay, whose own primals are leaves: the replay then casts it as often as the
   forward did, and builds the same graph.

Calls on this path have no kernel frame, so collectors and prefire do not see them, and
calling one inside ``recompute_session_ctx`` is a ``CheckpointError``.

Known limits: reverse-over-reverse where the cotangent itself depends on the differentiated
inputs may differ from the plain function in the last bits (the outer level differentiates
the replay, not the forward; hessian, jacrev of jacrev and grad of grad with a constant
cotangent are bitwise). Under a vmap over the backward that the forward did not run under
(jacrev's), the replay's forward runs outside that vmap, as the plain function's did, so its
random ops draw the forward's numbers once and only the backward is batched (jacfwd and
hessian fail for a block with random ops without remat too: they vmap the forward). Forward mode and vmap calls save no memory (there is nothing to
save); nor does a call whose innermost transform is vmap inside grad (``grad(vmap(f))``),
which runs op by op as rule 1 says.

This module is the path's entry (``call_function_path``) and its refusals (rules 5 and 6);
the block and the dispatch modes that keep and inject its values are in ``func_path.block``,
``RematFunction`` and the per-use gradients of its backward in ``func_path.backward``.
"""

from __future__ import annotations

from typing import Any, Callable

import optree
import torch
from torch import nn

from ckptfx import _compat
from ckptfx.func_path.backward import RematFunction, find_uses
from ckptfx.func_path.block import FuncBlock, KeepMode
from ckptfx.kernel.frame import CheckpointError, tls
from ckptfx.kernel.replay_env import ReplayEnv
from ckptfx.policies.tracer_stack import tracer_stack

__all__ = ["call_function_path"]


def modules_read_by(fun: Callable[..., Any], leaves: list[Any]) -> list[nn.Module]:
    """The outermost nn.Modules a function can read tensors from: the function itself when it
    is a module, among its arguments' leaves, its ``self``, and its closure."""
    found: list[nn.Module] = []
    if isinstance(fun, nn.Module):  # remat(module): the module itself is the block
        found.append(fun)
    for leaf in leaves:
        if isinstance(leaf, nn.Module):
            found.append(leaf)
    owner = getattr(fun, "__self__", None)
    if isinstance(owner, nn.Module):
        found.append(owner)
    for cell in getattr(fun, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        for leaf in optree.tree_leaves(value, none_is_leaf=True):
            if isinstance(leaf, nn.Module):
                found.append(leaf)
    unique: list[nn.Module] = []
    for m in found:  # drop modules nested in another one found
        if not any(m is u or any(m is s for s in u.modules()) for u in unique):
            unique = [u for u in unique if not any(u is s for s in m.modules())] + [m]
    return unique


def call_function_path(fun: Callable[..., Any], policy: Any, leaves: list[Any], spec: Any,
                       positions: list[int], tensors: list[torch.Tensor],
                       restore: Callable[[tuple, dict], tuple[tuple, dict]]) -> Any:
    """Run one remat call on the torch.func path; returns the block's outputs.

    Raises ``CheckpointError`` inside ``recompute_session_ctx``: this path has no kernel
    frame, so a session could neither find nor schedule the block's replay.
    """
    act = tls.activation
    if act is not None:
        raise CheckpointError(
            "ckptfx.remat: recompute sessions need plain autograd, but a remat'd block was "
            "called under a torch.func transform (or uses torch.func inside) while "
            f"recompute_session_ctx({act.session.id!r}) is open on this thread. Under "
            "torch.func each block is replayed once per backward without a session: close "
            "the session context around this call, or compute the gradient with "
            "torch.autograd (a block without torch.func inside) to use sessions and prefire."
        )
    bindings: list[tuple[nn.Module, list[str]]] = []
    bound: list[torch.Tensor] = []
    for module in modules_read_by(fun, [*leaves, *tensors]):
        named: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
        named.update(module.named_buffers(remove_duplicate=False))
        bindings.append((module, list(named)))
        bound.extend(named.values())
    block = FuncBlock(fun, policy, leaves, spec, positions, bindings, restore)
    inputs = (*tensors, *bound)
    if _compat.functorch_top_transform() not in (None, "grad"):
        # The innermost transform is forward mode or vmap: nothing is saved for a backward
        # at this level, and run op by op the block is exactly the plain function at every
        # level (one computation for primal and tangent; integer tensors as they are).
        return block.unflatten(block.run(inputs))
    return block.unflatten(_differentiated_call(block, inputs))


def _differentiated_call(block: FuncBlock, inputs: tuple[torch.Tensor, ...]
                         ) -> tuple[torch.Tensor, ...]:
    """The block under the reverse-mode level it is called at (see the module docstring)."""
    block.level = _compat.functorch_level()
    block.keys = [None] * len(inputs)
    cache = torch.is_autocast_cache_enabled()
    block.replay_as_view = [cache and isinstance(t, torch.Tensor)
                            and not (t.is_leaf and not t._is_view()) for t in inputs]
    edges: dict[tuple[int, int], tuple[int, Any]] = {}
    first = None
    level = block.level
    for i, t in enumerate(inputs):
        # Tracked at this level: under a transform, a tensor wrapped at it; a plain leaf
        # that requires grad there (a module's parameter inside torch.func.grad) belongs to
        # plain autograd, which sees the block op by op (Rule 4).
        if t.requires_grad and (level == 0 or _compat.functorch_tensor_level(t) >= level):
            if first is None:
                first = t
            e = torch.autograd.graph.get_gradient_edge(t)
            key = (id(e.node), e.output_nr)
            edges.setdefault(key, (i, e.node))
            block.keys[i] = key
    if first is None:  # nothing to differentiate at this level: the block as it is
        outs = block.run(inputs)
        _, outside = find_uses([o for o in outs if o.requires_grad], {}, None)
        if outside:  # ... unless it reads a tracked tensor from outside its arguments
            _refuse_outside(outside[0], block.level)
        return outs
    # The first sequence number after this one is the block's first node (a probe node
    # nobody reads, so no level's graph changes).
    start = _compat.node_sequence_nr(first.view_as(first).grad_fn) + 1
    block.env = ReplayEnv(inputs, True)
    block.input_tensors = inputs
    mode = KeepMode(block)
    names = tracer_stack.tracers
    names.append(mode)  # checkpoint_name in the block reaches mode.name
    try:
        with mode:
            outs = block.run(inputs)
    finally:
        names.pop()
    block.kept = tuple(mode.finish())
    diff: list[torch.Tensor] = []
    where: dict[int, int] = {}
    for p, o in enumerate(outs):
        if (o.requires_grad and id(o) not in where
                and not any(o is t for t in inputs)):  # an input returned as is stays itself
            where[id(o)] = len(diff)
            diff.append(o)
            block.diff_positions.append(p)
    uses, outside = find_uses(diff, edges, start)
    if outside:
        _refuse_outside(outside[0], block.level, edges)
    if not uses:
        return outs
    _guard_cached_casts(diff, edges, start)
    block.uses = [key for _, _, key, _ in uses]
    per_use = [inputs[edges[key][0]] for key in block.uses]
    # The outputs enter untracked at this level only: ``detach`` would drop the tangents
    # and graphs of the levels below too (forward mode in hessian, grad of grad).
    level = block.level
    untracked = [o.detach() if level == 0 else _compat.functorch_unwrap_level(o, level)
                 for o in diff]
    results = RematFunction.apply(block, len(diff), *untracked, *per_use, *inputs)
    return tuple(results[where[id(o)]] if id(o) in where else o for o in outs)


_SHARED_CAST_ADVICE = (
    "The plain function adds the gradients of every use of that one cast before converting "
    "them to the weight's dtype, and a remat'd call's backward cannot hand gradients to a "
    "cast outside it, so the result could not be shown bitwise exact. Turn the cache off "
    "for the region (torch.autocast(..., cache_enabled=False); the values are the same), "
    "or use each weight in one remat'd call per autocast region."
)


def _is_cast_of_input(node: Any, edges: dict[tuple[int, int], Any]) -> bool:
    """A dtype cast (autocast's, or ``.to``) of one of the block's inputs."""
    if type(node).__name__ != "ToCopyBackward0":
        return False
    nxt = node.next_functions
    return len(nxt) == 1 and nxt[0][0] is not None and (id(nxt[0][0]), nxt[0][1]) in edges


def _guard_cached_casts(roots: list[torch.Tensor], edges: dict[tuple[int, int], Any],
                        start: int) -> None:
    """Casts of the block's inputs that autocast may keep in its cast cache for the rest of
    the region: a later reader outside this call (another call, plain code) would extend
    a graph node this call's backward no longer feeds. Such a node only runs in the
    backward if something outside reached it: refuse there, before any gradient lands."""
    if not torch.is_autocast_cache_enabled():
        return
    seen: set[int] = set()
    stack = [r.grad_fn for r in roots if r.grad_fn is not None]
    while stack:
        node = stack.pop()
        if id(node) in seen or _compat.node_sequence_nr(node) < start:
            continue
        seen.add(id(node))
        for nxt, _ in node.next_functions:
            if nxt is None or id(nxt) in seen:
                continue
            if _is_cast_of_input(nxt, edges):
                seen.add(id(nxt))
                nxt.register_prehook(_refuse_shared_cast)
            elif type(nxt).__name__ != "AccumulateGrad":
                stack.append(nxt)


def _refuse_shared_cast(_grad_outputs: Any) -> None:
    raise CheckpointError(
        "ckptfx.remat on the torch.func path: code after a remat'd call (another call, or "
        "plain code) read the autocast cache's cast of a weight that the call had cast, "
        "inside one autocast region. " + _SHARED_CAST_ADVICE
    )


def _refuse_outside(node: Any, level: int, edges: dict[tuple[int, int], Any] | None = None
                    ) -> None:
    if edges is not None and _is_cast_of_input(node, edges):
        raise CheckpointError(
            "ckptfx.remat on the torch.func path: the block read a cast of one of its "
            "arguments that autocast's cast cache made before the call (an earlier call, or "
            "plain code, used the same weight in this autocast region). "
            + _SHARED_CAST_ADVICE
        )
    variable = getattr(node, "variable", None)
    what = "a tensor" if variable is None else f"a tensor of shape {tuple(variable.shape)}"
    why = ("that the torch.func transform around the call tracks" if level > 0
           else "that requires grad")
    raise CheckpointError(
        f"ckptfx.remat on the torch.func path: the block read {what} {why}, from outside "
        "the block's arguments (a closure or a global); its gradient would be lost. Pass it "
        "as an argument, or keep it in an nn.Module the block is a method of or receives."
    )
