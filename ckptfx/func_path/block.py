"""The torch.func path's block: one remat call as a function of a flat tensor tuple, and the
dispatch modes that keep its values in the forward and hand them back in the replay.

call.py (whose docstring states the path's Rules) makes a ``FuncBlock`` per call and runs its
forward under ``KeepMode``; the backward (``func_path.backward``) replays it under
``InjectMode``. Rules of this module:

1. **The forward keeps what the policy saves, nothing it cannot hand back exactly.** Views,
   in-place ops and random ops are always recomputed (a kept tensor would skip the aliasing,
   the write or the generator step the replay depends on); a kept output rewritten in place
   later in the forward is dropped (``KeepMode.finish``); ``checkpoint_name`` keeps the op
   that made the value, never an op of its own, so forward and replay run the same ops.
2. **The replay injects only where it matches the forward.** An op gets a kept value only at
   the same position, the same overload and the same sources (``_Sources``: an input, an
   earlier op's output, the same outside tensor); at the first difference injection stops
   and the rest is recomputed, which is always exact (call.py's Rule 6: autocast's cast
   cache can shift the replay's op sequence).
3. **Offloaded values travel as templates** (``_Kept`` / ``_OnHost``): the forward moves them
   to the host, the replay moves them back to their device and checks shape and dtype first.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable

import optree
import torch
from torch import nn
from torch.utils.checkpoint import SelectiveCheckpointContext

from ckptfx import _compat
from ckptfx._ops import op_info as _op_info
from ckptfx.kernel.replay_env import ReplayEnv
from ckptfx.policies.names import checkpoint_name
from ckptfx.policies.protocol import Offload, Policy, call_policy

__all__ = ["FuncBlock", "InjectMode", "KeepMode"]

_SAC_CTX = SelectiveCheckpointContext(is_recompute=False)


class FuncBlock:
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
        self.op_funcs: list[Any] = []  # every op of the forward, in order (see InjectMode)
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


class KeepMode(_compat.TorchDispatchMode):
    """Forward: ask the policy per op, keep what it saves, refuse outside tensors."""

    def __init__(self, block: FuncBlock) -> None:
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
            self.block.env.note_generators_of(args, kwargs)  # type: ignore[union-attr]
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


class InjectMode(_compat.TorchDispatchMode):
    """Backward replay: hand back the kept outputs instead of recomputing those ops.

    Ops are matched by position and overload; at the first op that differs from the forward
    (a different decomposition under grad tracking, or an op autograd adds, such as the copy
    of ``self`` an in-place ``mul_`` saves) injection stops and the rest is recomputed, which
    is always exact. Every op is compared, not only kept ones: after an added op, a kept
    position can hold another call of the same overload.
    """

    def __init__(self, block: FuncBlock, kept: tuple[torch.Tensor, ...],
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
                        # Back on its device outside the transforms: made under functorch's
                        # layers, the copy would be wrapped at this level and could not be
                        # injected below it.
                        with torch._C._DisableFuncTorch():
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
