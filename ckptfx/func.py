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
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable

import optree
import torch
from torch import nn
from torch.utils.checkpoint import SelectiveCheckpointContext

from . import _compat
from ._env import ReplayEnv
from .frame import CheckpointError, tls
from .policies import Offload, Policy, call_policy, checkpoint_name
from ._ops import op_info as _op_info
from ._tracers import tracer_stack as _trace_stack

__all__ = ["call_function_path"]

_SAC_CTX = SelectiveCheckpointContext(is_recompute=False)


class _Block:
    """One remat call on the torch.func path: the block as a function of a flat tensor tuple."""

    def __init__(self, fun: Callable[..., Any], policy: Any, leaves: list[Any], spec: Any,
                 positions: list[int], bindings: list[tuple[nn.Module, list[str]]],
                 restore: Callable[[tuple, dict], tuple[tuple, dict]]) -> None:
        self.fun = fun
        self.policy = policy
        self.leaves = leaves
        self.spec = spec
        self.positions = positions
        self.bindings = bindings
        self.restore = restore
        self.n_in = len(positions)
        self.out_spec: Any = None
        self.out_leaves: list[Any] = []
        self.out_positions: list[int] = []
        self.kept_ops: list[tuple[int, Any, Any, list[Any]]] = []  # index, op, spec, leaves
        self.op_funcs: list[Any] = []  # every op of the forward, in order (see _InjectMode)
        self.op_sources: list[tuple[Any, ...]] = []  # where each op's tensor arguments came from
        self.outside: list[torch.Tensor] = []  # tensors the forward's ops read from outside
        self.input_tensors: tuple[torch.Tensor, ...] = ()
        self.replay_as_view: list[bool] = []  # per input: replayed through a view (Rule 6)
        self.env: ReplayEnv | None = None
        self.kept: tuple[torch.Tensor, ...] = ()  # the kept outputs, in kept_ops order
        self.level = 0  # the transform level the call is differentiated at (0: autograd)
        self.keys: list[Any] = []  # per input: its autograd edge at that level, or None
        self.uses: list[Any] = []  # per use of an input, in the engine's order: its edge
        self.diff_positions: list[int] = []  # outputs that go through RematFunction
        self.n_out = 0
        self.runs = 0  # how often the block ran (forward + replays)
        self.injected = 0  # kept outputs handed to replays instead of recomputed

    def run(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        self.runs += 1
        filled = list(self.leaves)
        for j, t in zip(self.positions, tensors[: self.n_in]):
            filled[j] = t
        args, kwargs = self.restore(*optree.tree_unflatten(self.spec, filled))
        rest = iter(tensors[self.n_in:])
        with contextlib.ExitStack() as stack:
            for module, names in self.bindings:
                stack.enter_context(_compat.reparametrize_module(
                    module, {name: next(rest) for name in names}))
            out = self.fun(*args, **kwargs)
        leaves, spec = optree.tree_flatten(out, none_is_leaf=True)
        self.out_spec = spec
        self.out_positions = [j for j, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        self.out_leaves = [None if isinstance(x, torch.Tensor) else x for x in leaves]
        return tuple(leaves[j] for j in self.out_positions)

    def unflatten(self, outs: tuple[torch.Tensor, ...]) -> Any:
        leaves = list(self.out_leaves)
        for j, t in zip(self.out_positions, outs):
            leaves[j] = t
        return optree.tree_unflatten(self.out_spec, leaves)


class _KeepMode(_compat.TorchDispatchMode):
    """Forward: ask the policy per op, keep what it saves, refuse outside tensors."""

    def __init__(self, block: _Block) -> None:
        super().__init__()
        self.block = block
        self.index = 0
        # Only ckptfx's own policies see checkpoint_name; for them, remember which op made
        # each single-tensor output (weakly: an id alone could be reused by a later tensor).
        self.names = isinstance(block.policy, Policy)
        self.producer: dict[int, tuple[weakref.ref[torch.Tensor], int, Any, int]] = {}
        self.kept_index: set[int] = set()
        self.pending: list[tuple[Any, ...]] = []  # kept op outputs, checked by finish()
        self.funcs: list[Any] = []
        self.sources = _Sources(block.input_tensors, block.outside)
        # (op index, storage) of each in-place write: a write through a tensor that shares
        # storage but not the version counter (matmul's _unsafe_view of a kept mm) rewrites
        # a kept value without moving its _version.
        self.written: list[tuple[int, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        info = _op_info(func)
        if info.seeded:  # explicit generators: the replay starts them where the block did
            for g in (*args, kwargs.get("generator")):
                if isinstance(g, torch.Generator):
                    self.block.env.note_generator(g)  # type: ignore[union-attr]
        policy = self.block.policy
        sources = self.sources.of(args, kwargs) if policy is not None else ()
        out = func(*args, **kwargs)
        index, self.index = self.index, self.index + 1
        self.funcs.append(func)
        if policy is not None:
            self.sources.made(index, out, sources)
        if policy is not None:
            for i, name in info.writes:
                v = args[i] if i < len(args) else kwargs.get(name)
                for t in (v if isinstance(v, (list, tuple)) else (v,)):
                    if isinstance(t, torch.Tensor):
                        self.written.append((index, _storage(t)))
            if info.view or info.writes or info.seeded:
                # A view is free to recompute; handing back a kept tensor for a view or an
                # in-place op would skip the aliasing or the write the replay depends on, and
                # skipping a random op would shift the generator for every later one.
                return out
            decision = call_policy(policy, _SAC_CTX, func, args, kwargs)
            if decision is not False:
                self._keep(index, func, out, decision)
            elif self.names and isinstance(out, torch.Tensor) and not func.is_view:
                self.producer[id(out)] = (weakref.ref(out), index, func, out._version)
        return out

    def _keep(self, index: int, func: Any, out: Any, decision: Any,
              versions: list[int] | None = None) -> None:
        leaves, spec = optree.tree_flatten(out, none_is_leaf=True)
        template: list[Any] = []
        tensors: list[torch.Tensor] = []
        for o in leaves:
            if not isinstance(o, torch.Tensor):
                template.append(o)
                continue
            tensors.append(o)
            if isinstance(decision, Offload) and o.device.type != "cpu":
                template.append(_OnHost(o.device, o.shape, o.dtype))
            else:
                template.append(_Kept(o.shape, o.dtype))
        self.pending.append((index, func, spec, template, tensors,
                             versions or [t._version for t in tensors]))
        self.kept_index.add(index)

    def finish(self) -> list[torch.Tensor]:
        """The kept outputs to save: those not rewritten in place later in the forward (the
        replay must see the value the op produced, not a later one)."""
        kept: list[torch.Tensor] = []
        self.block.op_funcs = self.funcs
        self.block.op_sources = self.sources.per_op
        for index, func, spec, template, tensors, versions in self.pending:
            if any(t._version != v for t, v in zip(tensors, versions)):
                continue
            storages = {_storage(t) for t in tensors}
            if any(i > index and s in storages for i, s in self.written):
                continue
            self.block.kept_ops.append((index, func, spec, template))
            marks = [x for x in template if isinstance(x, _Kept)]
            kept.extend(t.to("cpu") if isinstance(m, _OnHost) else t
                        for t, m in zip(tensors, marks))
        self.pending = []
        return kept

    def name(self, x: Any, name: str) -> Any:
        """``checkpoint_name`` in this forward: keep the op that made ``x`` if the policy says.

        Returns ``x`` itself (no op), so the replay, where ``checkpoint_name`` is a plain
        identity, runs the same op sequence. Values made by view ops or multi-output ops are
        recomputed (always exact).
        """
        if not isinstance(x, torch.Tensor):
            return x
        t = _unwrap(x)
        entry = self.producer.get(id(t))
        if entry is None or entry[0]() is not t or entry[1] in self.kept_index:
            return x
        decision = call_policy(self.block.policy, _SAC_CTX, checkpoint_name, (x,), {"name": name})
        if decision is not False:  # the version the op left: a later rewrite voids the keep
            self._keep(entry[1], entry[2], t, decision, versions=[entry[3]])
        return x


class _InjectMode(_compat.TorchDispatchMode):
    """Backward replay: hand back the kept outputs instead of recomputing those ops.

    Ops are matched by position and overload; at the first op that differs from the forward
    (a different decomposition under grad tracking, or an op autograd adds, such as the copy
    of ``self`` an in-place ``mul_`` saves) injection stops and the rest is recomputed, which
    is always exact. Every op is compared, not only kept ones: after an added op, a kept
    position can hold another call of the same overload.
    """

    def __init__(self, block: _Block, kept: tuple[torch.Tensor, ...],
                 inputs: tuple[torch.Tensor, ...]) -> None:
        super().__init__()
        self.block = block
        self.index = 0
        self.by_op: dict[int, tuple[Any, Any, list[Any]]] = {}
        self.funcs = block.op_funcs
        self.expected_sources = block.op_sources
        self.sources = _Sources(inputs, None)
        it = iter(kept)
        for index, func, spec, template in block.kept_ops:
            filled = []
            for x in template:
                if isinstance(x, _Kept):
                    t = _unwrap(next(it))
                    if isinstance(x, _OnHost):
                        t = t.to(x.device, non_blocking=True)
                    if t.shape != x.shape or t.dtype != x.dtype:
                        return  # kept values do not line up with this replay: recompute all
                    filled.append(t)
                else:
                    filled.append(x)
            self.by_op[index] = (func, spec, filled)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        index, self.index = self.index, self.index + 1
        if not self.by_op:
            return func(*args, **(kwargs or {}))
        sources = self.sources.of(args, kwargs or {})
        if (index >= len(self.funcs) or self.funcs[index] is not func
                or self.expected_sources[index] != sources):
            self.by_op.clear()
            return func(*args, **(kwargs or {}))
        entry = self.by_op.get(index)
        if entry is not None:
            _, spec, leaves = entry
            self.block.injected += 1
            out = optree.tree_unflatten(spec, leaves)
        else:
            out = func(*args, **(kwargs or {}))
        self.sources.made(index, out, sources)
        return out


class _Sources:
    """Where the tensors an op reads come from: a block input (by position), an earlier op's
    output (by op index and output position), or a tensor from outside the block.

    The forward records this per op and the replay compares it before handing back a kept
    value: an op of the same overload at the same position is not enough, since the replay's
    op sequence can shift (autocast's cast cache: the forward's call found a weight's cast
    made by an earlier call, the replay casts it again), and a kept value would then go to
    another op's call.  Tensors are matched by identity under a weak reference, so an id
    reused by a later tensor never matches.
    """

    def __init__(self, inputs: tuple[torch.Tensor, ...],
                 outside: list[torch.Tensor] | None) -> None:
        self.by_id: dict[int, tuple[weakref.ref, tuple[Any, ...]]] = {}
        for i, t in enumerate(inputs):
            if isinstance(t, torch.Tensor):
                u = _unwrap(t)
                self.by_id.setdefault(id(u), (weakref.ref(u), ("in", i)))
        self.outside = outside  # the forward keeps outside tensors alive for the comparison
        self.held: set[int] = set()
        self.per_op: list[tuple[Any, ...]] = []

    def of(self, args: Any, kwargs: dict) -> tuple[Any, ...]:
        found = []
        for x in optree.tree_leaves((args, kwargs), none_is_leaf=True):
            if not isinstance(x, torch.Tensor):
                continue
            entry = self.by_id.get(id(x))
            if entry is not None and entry[0]() is x:
                found.append(entry[1])
            else:
                if self.outside is not None and id(x) not in self.held:
                    self.held.add(id(x))
                    self.outside.append(x)
                found.append(("outside", id(x)))
        return tuple(found)

    def made(self, index: int, out: Any, sources: tuple[Any, ...]) -> None:
        self.per_op.append(sources)
        for j, o in enumerate(optree.tree_leaves(out, none_is_leaf=True)):
            if isinstance(o, torch.Tensor):
                self.by_id[id(o)] = (weakref.ref(o), ("op", index, j))


class _Kept:
    """Template mark: a kept output, with the shape and dtype the forward's op gave it."""

    __slots__ = ("shape", "dtype")

    def __init__(self, shape: torch.Size, dtype: torch.dtype) -> None:
        self.shape = shape
        self.dtype = dtype


class _OnHost(_Kept):
    """Template mark: a kept output offloaded from ``device`` to host memory."""

    __slots__ = ("device",)

    def __init__(self, device: torch.device, shape: torch.Size, dtype: torch.dtype) -> None:
        super().__init__(shape, dtype)
        self.device = device


def _storage(t: torch.Tensor) -> int:
    """An id of the memory ``t`` lives in (its storage's address; 0 when it has none)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


def _unwrap(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor under functorch's wrappers (what a dispatch mode sees)."""
    return _compat.functorch_unwrap(t)


class RematFunction(torch.autograd.Function):
    """The backward of one remat call at the level that differentiates it (see the module
    docstring): an identity on the block's outputs whose gradients go to one input per use.

    Inputs: the ``_Block``, ``n``, the ``n`` differentiable outputs of the block's forward
    (detached at that level), one input per use (``block.uses``: the tensor the use reads,
    repeated for each use), and every input of the block once (saved for the replay).
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(block: _Block, n: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(t.view_as(t) for t in tensors[:n])

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        block, n = inputs[0], inputs[1]
        ctx.block = block
        ctx.n = n
        ctx.level = _compat.functorch_level()  # the transform level this node belongs to
        ctx.save_for_backward(*inputs[2 + n + len(block.uses):])

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        block: _Block = ctx.block
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


def _per_use_gradients(block: _Block, inputs: tuple[torch.Tensor, ...],
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
        with block.env.restored(), _InjectMode(block, block.kept, tuple(ts)):  # type: ignore[union-attr]
            return block.run(tuple(ts))

    def hook_uses(outs: tuple[torch.Tensor, ...], diff: tuple[torch.Tensor, ...]) -> None:
        level = _compat.functorch_level()
        edges = {}
        for j, d in enumerate(fed):
            e = torch.autograd.graph.get_gradient_edge(d)
            edges[(id(e.node), e.output_nr)] = (keys[j], e.node)
        roots = [outs[p] for p in block.diff_positions]
        uses, _ = _find_uses(roots, edges, None)
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

    def dot(*diff: torch.Tensor) -> torch.Tensor | None:
        # The gradient of sum(out * g) by out is exactly g (1.0 * g), so this is the vjp;
        # unlike torch.func.vjp's vjp_fn it runs the backward while its own transform
        # level is alive, which nested remat'd blocks (whose backward replays under a
        # transform in turn) need.
        outs = replay(*diff)
        hook_uses(outs, diff)
        total = None
        for p, g in zip(block.diff_positions, grads):
            if g is not None:
                term = (outs[p] * g).sum()
                total = term if total is None else total + term
        return total

    def replay_hooked(*diff: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outs = replay(*diff)
        hook_uses(outs, diff)
        return tuple(outs[p] for p in block.diff_positions)

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
            vjp_fn(tuple(torch.zeros_like(o) if g is None else g for o, g in zip(outs, grads)))
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


def _find_uses(roots: list[torch.Tensor], edges: dict[tuple[int, int], Any], start: int | None
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
    block = _Block(fun, policy, leaves, spec, positions, bindings, restore)
    inputs = (*tensors, *bound)
    if _compat.functorch_top_transform() not in (None, "grad"):
        # The innermost transform is forward mode or vmap: nothing is saved for a backward
        # at this level, and run op by op the block is exactly the plain function at every
        # level (one computation for primal and tangent; integer tensors as they are).
        return block.unflatten(block.run(inputs))
    return block.unflatten(_differentiated_call(block, inputs))


def _differentiated_call(block: _Block, inputs: tuple[torch.Tensor, ...]
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
        _, outside = _find_uses([o for o in outs if o.requires_grad], {}, None)
        if outside:  # ... unless it reads a tracked tensor from outside its arguments
            _refuse_outside(outside[0], block.level)
        return outs
    # The first sequence number after this one is the block's first node (a probe node
    # nobody reads, so no level's graph changes).
    start = _compat.node_sequence_nr(first.view_as(first).grad_fn) + 1
    block.env = ReplayEnv(inputs, True)
    block.input_tensors = inputs
    mode = _KeepMode(block)
    names = _trace_stack.tracers
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
    uses, outside = _find_uses(diff, edges, start)
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
