"""The torch.func path's backward: ``RematFunction``, one replay, one gradient per use.

call.py (whose docstring states the path's Rules) routes a remat call's differentiable
outputs through ``RematFunction`` at the level that differentiates it. Rules of this module:

1. **One gradient per use (func_path/call.py's Rule 3).** ``find_uses`` lists the graph edges that
   read an input, in the order the autograd engine adds their gradients; the forward takes
   one input per use, and the backward returns the gradient each use received in the
   replay (caught by node hooks), in that order, so the outer engine sums them as plain
   autograd does.
2. **The replay must rebuild the forward's graph.** The uses the replay finds are compared
   with the forward's; any difference is a ``CheckpointError``, never a wrong gradient.
3. **Levels below are identities (func_path/call.py's Rule 4).** At an outer grad level, and in
   forward mode, the outputs' gradients and tangents pass on unchanged.
4. **Cotangents enter the replay as they would enter the plain function's graph.** An output
   nothing read gets no gradient (not a materialized zero), and each other output gets the
   very tensor the outer engine holds (``_Seed``, not ``1.0 * g``). Values alone are not
   enough: a gradient laid out otherwise (a contiguous zero added into a transposed one,
   an expanded cotangent made dense) sends CPU kernels such as ``gelu_backward`` down
   another vectorization path, and the last bits change.
"""

from __future__ import annotations

from typing import Any

import torch

from ckptfx import _compat
from ckptfx.func_path.block import FuncBlock, InjectMode
from ckptfx.kernel.frame import CheckpointError

__all__ = ["RematFunction", "find_uses"]


class RematFunction(torch.autograd.Function):
    """The backward of one remat call at the level that differentiates it (see func_path/call.py's
    Rules): an identity on the block's outputs whose gradients go to one input per use.

    Inputs: the ``FuncBlock``, ``n``, the ``n`` differentiable outputs of the block's forward
    (detached at that level), one input per use (``block.uses``: the tensor the use reads,
    repeated for each use), and every input of the block once (saved for the replay).
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(block: FuncBlock, n: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(t.view_as(t) for t in tensors[:n])

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        block, n = inputs[0], inputs[1]
        ctx.block = block
        ctx.n = n
        ctx.level = _compat.functorch_level()  # the transform level this node belongs to
        ctx.save_for_backward(*inputs[2 + n + len(block.uses):])
        # Rule 4: an output nothing read gets no gradient (None), as in plain autograd. A
        # materialized zero would be added into the gradient of the op that made it in the
        # replay (an output the block also reads on, like an aux): the sum's values are the
        # same, but its layout is the zeros' (contiguous) rather than the other term's, and
        # a CPU kernel downstream (gelu_backward) takes another vectorization path on it:
        # last-bit differences.
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        block: FuncBlock = ctx.block
        n_uses, n_in = len(block.uses), len(ctx.saved_tensors)
        if ctx.level != block.level:
            # A transform level below the one the call differentiates (grad of grad, or plain
            # autograd around torch.func): its forward was recorded op by op at that level,
            # so the outputs pass their gradients on to it unchanged.
            return (None, None, *grads, *(None,) * (n_uses + n_in))
        slots = [i for i in range(n_uses) if ctx.needs_input_grad[2 + ctx.n + i]]
        per_use: list[Any] = [None] * n_uses
        if slots and any(g is not None for g in grads):
            per_use = _per_use_gradients(block, ctx.saved_tensors, grads,
                                         {block.uses[i] for i in slots})
        return (None, None, *(None,) * ctx.n, *per_use, *(None,) * n_in)

    @staticmethod
    def jvp(ctx: Any, _block_tangent: Any, _n_tangent: Any, *tangents: torch.Tensor
            ) -> tuple[Any, ...]:
        # Forward mode below the differentiated level: the forward ran op by op there, so the
        # outputs' tangents are those of the outputs it produced.
        return tuple(tangents[: ctx.n])


def _per_use_gradients(block: FuncBlock, inputs: tuple[torch.Tensor, ...],
                       grads: tuple[torch.Tensor | None, ...], wanted: set[Any]) -> list[Any]:
    """Replay the block and return the gradient each use of an input received, in
    ``block.uses`` order (None for the uses of inputs not in ``wanted``)."""
    keys = [k for k in dict.fromkeys(block.uses) if k in wanted]  # one replay input per key
    index = {k: j for j, k in enumerate(keys)}
    primals = [inputs[block.keys.index(k)] for k in keys]
    expected = [k for k in block.uses if k in wanted]
    captured: list[Any] = [None] * len(expected)

    # Rule 6: where the forward's input could not be cached by autocast (not a leaf, or a
    # view), the replay reads it through a view too, so the replay casts it as often as the
    # forward did (its own primal is a leaf, which the cache would share).
    as_view = [any(block.replay_as_view[i] for i, k in enumerate(block.keys) if k == key)
               for key in keys]
    fed: list[torch.Tensor] = []

    def replay(*diff: torch.Tensor) -> tuple[torch.Tensor, ...]:
        fed[:] = [d.view_as(d) if v else d for d, v in zip(diff, as_view)]
        ts = list(inputs)
        for i, k in enumerate(block.keys):
            if k in index:
                ts[i] = fed[index[k]]
        with block.env.restored(), InjectMode(block, block.kept, tuple(ts)):  # type: ignore[union-attr]
            return block.run(tuple(ts))

    def hook_uses(outs: tuple[torch.Tensor, ...], diff: tuple[torch.Tensor, ...]) -> None:
        level = _compat.functorch_level()
        edges = {}
        for j, d in enumerate(fed):
            e = torch.autograd.graph.get_gradient_edge(d)
            edges[(id(e.node), e.output_nr)] = (keys[j], e.node)
        roots = [outs[p] for p in block.diff_positions]
        uses, _ = find_uses(roots, edges, None)
        got = [edges[key][0] for _, _, key, _ in uses]
        if got != expected:
            raise CheckpointError(
                "ckptfx.remat on the torch.func path: the block's replay built a different "
                f"autograd graph from its forward ({len(got)} uses of its inputs against "
                f"{len(expected)}); its gradients cannot be shown exact. Is the block a pure "
                "function of its arguments (no Python state that changes between calls)?"
            )
        by_node: dict[int, tuple[Any, list[tuple[int, int]]]] = {}
        for slot, (_, j, _, node) in enumerate(uses):
            by_node.setdefault(id(node), (node, []))[1].append((j, slot))
        for node, pairs in by_node.values():
            def hook(grad_inputs: Any, _grad_outputs: Any, pairs: Any = pairs) -> None:
                for j, slot in pairs:
                    g = grad_inputs[j]
                    captured[slot] = (None if g is None
                                      else _compat.functorch_unwrap_level(g, level))
            node.register_hook(hook)

    def dot(*diff: torch.Tensor) -> torch.Tensor:
        # A scalar whose gradient by each output is its cotangent, handed on as the very
        # tensor the outer engine passed (``_Seed``), so this is the vjp; unlike
        # torch.func.vjp's vjp_fn it runs the backward while its own transform level is
        # alive, which nested remat'd blocks (whose backward replays under a transform in
        # turn) need.
        outs = replay(*diff)
        hook_uses(outs, diff)
        return _Seed.apply(len(live), *(outs[p] for p, _ in live), *(g for _, g in live))

    # Only outputs that received a gradient take part (Rule 4): as in plain autograd, an
    # output nothing read adds nothing, not even a zero (see ``setup_context``).
    live = [(p, g) for p, g in zip(block.diff_positions, grads) if g is not None]

    def replay_hooked(*diff: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outs = replay(*diff)
        hook_uses(outs, diff)
        return tuple(outs[p] for p, _ in live)

    try:
        vjp_fn = None
        with _compat.functorch_vmaps_popped(inputs) as popped:
            # popped: a vmap over this backward that the forward did not run under
            # (jacrev's). The replay's forward runs outside it, as the plain function's
            # forward did, and only its backward is batched: under the vmap a random op
            # would draw batched numbers (or, in randomness="error" mode, refuse) where the
            # forward drew once.
            if popped or any(g is not None and g.is_complex() for g in grads):
                # torch annotates vjp's result with has_aux's aux
                outs, vjp_fn = torch.func.vjp(replay_hooked, *primals)  # type: ignore[misc]
            else:
                torch.func.grad(dot, argnums=tuple(range(len(primals))))(*primals)
        if vjp_fn is not None:
            vjp_fn(tuple(g for _, g in live))
    except RuntimeError as err:
        if "randomness" not in str(err):
            raise
        raise CheckpointError(
            "ckptfx.remat: this backward runs under vmap (a vmap over the backward) in "
            "randomness='error' mode, and replaying the block draws random numbers "
            "(dropout, rand_like, ...). Use torch.func.vmap(..., randomness='same' or "
            "'different') there, or take the random op out of the remat'd block."
        ) from err
    result: list[Any] = []
    it = iter(captured)
    for k in block.uses:
        result.append(next(it) if k in wanted else None)
    return result


class _Seed(torch.autograd.Function):
    """The replay's loss: a scalar (its value unused) whose backward hands each output its
    cotangent unchanged.

    Plain autograd passes the output's grad_fn the cotangent as the outer engine holds it.
    ``sum(out * g)`` would pass ``1.0 * g`` instead: the same values, but a new tensor laid
    out by the multiplication, dense where ``g`` is expanded (``loss = out.sum()`` hands an
    expanded cotangent) or strided otherwise, and CPU kernels take other vectorization paths
    by layout (``gelu_backward``: last-bit differences). Inputs: ``n``, the ``n`` outputs,
    their ``n`` cotangents.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(n: int, *tensors: torch.Tensor) -> torch.Tensor:
        return tensors[0].new_zeros(())

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        ctx.n = inputs[0]
        ctx.cotangents = inputs[1 + ctx.n:]

    @staticmethod
    def backward(ctx: Any, _grad: torch.Tensor) -> tuple[Any, ...]:
        return (None, *ctx.cotangents, *(None,) * ctx.n)


def find_uses(roots: list[torch.Tensor], edges: dict[tuple[int, int], Any], start: int | None
               ) -> tuple[list[tuple[int, int, Any, Any]], list[Any]]:
    """Walk the autograd graph from ``roots`` down to the inputs' edges (``edges``, keyed by
    (id(node), output_nr)). Returns the uses, (sequence number, edge index, key, node) per
    graph edge that reads an input, in the order the autograd engine adds their gradients
    (nodes by decreasing sequence number, each node's edges in order), and the nodes from
    outside the block it reached: leaves that are not inputs, and, when ``start`` (the first
    sequence number of the block) is given, nodes made before the block."""
    uses: list[tuple[int, int, Any, Any]] = []
    outside: list[Any] = []
    seen: dict[int, Any] = {}  # holds the nodes, so that no id is reused during the walk
    stack = []
    for r in roots:
        if r.grad_fn is None:
            outside.append(torch.autograd.graph.get_gradient_edge(r).node)
        else:
            stack.append(r.grad_fn)
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = node
        if start is not None and _compat.node_sequence_nr(node) < start:
            outside.append(node)
            continue
        for j, (nxt, nr) in enumerate(node.next_functions):
            if nxt is None:
                continue
            key = (id(nxt), nr)
            if key in edges:
                uses.append((_compat.node_sequence_nr(node), j, key, node))
            elif type(nxt).__name__ == "AccumulateGrad":
                outside.append(nxt)
            else:
                stack.append(nxt)
    uses.sort(key=lambda u: (-u[0], u[1]))
    return uses, outside
