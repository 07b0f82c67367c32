"""Recording a remat'd block: its ATen ops, which saved tensors are kept, and a replay plan.

Rules

1. The forward of a remat call runs under a ``Tracer``: a TorchDispatchMode that records each
   ATen op (after autocast, so a replay runs with autocast off) and a saved-tensor pack hook.
   Values are tracked by tensor identity: each op output is tagged with its *slot*; block
   inputs and tensors from outside (parameters, closures) get slots when first read.
   Autograd packs an op's saved inputs before the op reaches the mode and its saved outputs
   after, so every packed tensor is already tagged, or is an input or outside tensor.

1b. Some ops have autograd save an input they then fill (``rrelu_with_noise`` packs its
   ``noise`` buffer, then writes it): the backward reads the value the op left. The packs
   since the last op are settled when the next op dispatches: a pack of a tensor this op
   writes, made at this op's autograd sequence number (every pack of one op reads the
   number of the node autograd made for it; an op without a node reads its predecessor's),
   is the op's own input, and refers to the version the op leaves. Any other pack of a value
   later written in place is a write after a save (Rule 4).

2. The policy is asked once per op; its answer belongs to the op's outputs (for an in-place
   op, to the value it rewrote; a view of a kept value is kept with it). At a pack the
   value is: an *argument* (an input, an outside tensor, or a view of one: referenced, never
   copied), *saved* (kept), *offloaded* (kept on the host), or *recomputed* (a kernel
   ``Holder`` that the replay fills).

2b. As in JAX, a value the policy lets keep is kept when the backward *or the replay* reads
   it: such values are held during the forward and, at its end, those on the replay's
   frontier are kept, the rest released. A value kept only for the replay, by a policy's
   permission (``True``, ``PREFER_SAVE``), is single-use, as each residual is in one JAX
   backward: the first replay lets go of it after its last read, so the backward does not
   hold it beside what the replay rebuilt from it, and a later replay of the block (a second
   backward with ``retain_graph``, another session) recomputes it (torch's selective
   checkpoint raises there). If it was rewritten in place since the forward, the replay
   recomputes it too. ``MUST_SAVE`` values (ops never to run twice, e.g. collectives) and
   offloaded ones stay for the graph's life. Block inputs (and views of them) are filled by
   the replay from the frame's saved inputs, so a parent checkpoint hands them out once.

3. In-place writes are versioned per base storage (a view shares its base's). An op reads a
   value at a version; a pack keeps a value at a version. The replay of a recomputed value
   runs only the ops it transitively needs, reading kept values where a kept (slot, version)
   is still alive instead of recomputing it, and lets go of each value after the last op
   that reads it (the forward's memory profile, not every intermediate at once). Seeded
   random ops replay from the generator states they drew from in the forward (the global
   generators' and any explicit ``generator=``'s; Rule 3b), so skipping ops never shifts a
   dropout mask; the caller's generators are put back after the replay.

   3b. A generator state is stored only where the replay cannot know it otherwise (a CPU
   generator state is 5 KiB; one per dropout would make remat hold more than torch's
   checkpoint, which keeps one per block). The block's first draw from the CPU generator
   starts from the state the frame captured when the block began. A random op whose
   previous draw on the same generators was one random op drawing from exactly those
   continues from where that op left them: any replay that runs it runs that op first
   (``Segment.rng_prev``; usually it is needed anyway, as every dropout mask is).

4. The segment is replayed only if it is shown replayable; otherwise the frame re-runs the
   Python function (the kernel's default strategy). Not replayable: a buffer from
   ``torch.empty`` read before any recorded op wrote it (a custom kernel filled it; a view
   of it, such as the ``detach`` torch's factory adds when a reference to the new tensor is
   held, reads nothing), a write to an input or outside tensor, a write to a value after it
   was saved (Rule 1b), tensor subclasses, or autograd running inside the block (that
   re-run restores explicit generators too, to their state before the block's first draw).
   A block that is not replayable but whose live holders all stand for unwritten block
   inputs or recorded views of them (the policy kept everything else) has nothing to
   recompute: those are rebuilt from the saved inputs and no Python runs. An outside tensor
   modified in place between forward and backward is a ``CheckpointError``.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Callable, Hashable

import optree
import torch
from torch.utils.checkpoint import SelectiveCheckpointContext

from . import _collectives, _compat
from ._debug import user_call_site
from ._ops import _OP_INFO, op_info as _op_info
from .frame import CheckpointError, Frame, Holder, Replay, rerun_function
from .policies import Offload, call_policy, checkpoint_name
from ._tracers import active_tracer, reporting, tracer_stack as _stack

__all__ = ["Segment", "Tracer", "active_tracer", "reporting", "residual_unpack_hook"]

aten = torch.ops.aten
_token = itertools.count()


# -- residual holders (what a kept saved tensor is packed into) ------------------------------


def _check_version(t: torch.Tensor, version: int) -> torch.Tensor:
    # Saved-tensor hooks turn off autograd's own version check, so a kept tensor modified in
    # place after it was kept (e.g. a block output the caller rewrote) is caught here: a
    # stale residual must raise, never reach a gradient.
    if t._version != version:
        raise CheckpointError(
            f"ckptfx.remat: a tensor kept for the backward ({_describe(t)}) was modified in "
            f"place after it was kept (version {version}, now {t._version}); the backward "
            "would read the new values. Clone it before modifying it in place."
        )
    return t


class _Kept:
    """A saved tensor kept by the policy; unpacked as is (checked not to have changed)."""

    __slots__ = ("tensor", "version", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.version = tensor._version

    def get(self) -> torch.Tensor:
        return _check_version(self.tensor, self.version)


class _Offloaded:
    """A saved tensor moved to host memory in the forward, brought back for the backward."""

    __slots__ = ("tensor", "device", "version", "__weakref__")

    def __init__(self, tensor: torch.Tensor, pinned: bool) -> None:
        self.device = tensor.device
        self.version = tensor._version
        if tensor.device.type == "cpu":
            self.tensor = tensor
        else:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pinned)
            host.copy_(tensor, non_blocking=pinned)
            self.tensor = host

    def get(self) -> torch.Tensor:
        if self.device.type == "cpu":
            return _check_version(self.tensor, self.version)
        return self.tensor.to(self.device, non_blocking=True)


def residual_unpack_hook(packed: Any) -> torch.Tensor:
    """Unpack hook of remat frames: kernel holders replay, kept residuals are handed out."""
    if packed.__class__ is Holder:
        from .frame import unpack_hook

        return unpack_hook(packed)
    return packed.get()


class _DeadRef:
    """Stands in ``frame.holders`` for a pack that is kept, not recomputed."""

    __slots__ = ()

    def __call__(self) -> None:
        return None


_DEAD = _DeadRef()


# -- op facts, cached per OpOverload --------------------------------------------------------




# -- the recorded segment -------------------------------------------------------------------


class _Op:
    __slots__ = ("func", "spec", "leaves", "inputs", "outs", "rng", "site")

    def __init__(self, func: Any, spec: Any, leaves: list[Any],
                 inputs: list[tuple[int, int, int]], rng: Any, site: str | None) -> None:
        self.func = func
        self.spec = spec
        self.leaves = leaves          # tensor leaves replaced by None
        self.inputs = inputs          # (leaf position, slot, version read)
        self.outs: list[tuple[int, int]] = []  # (output leaf position, slot)
        self.rng = rng                # generator states to restore before replaying
        self.site = site

    def __str__(self) -> str:
        return str(self.func)


class Segment:
    """The recorded ops of one remat call and the replay strategy built on them."""

    def __init__(self) -> None:
        self.ops: list[_Op] = []
        self.producer: list[int] = []        # slot -> op that created the object (-1: none)
        self.base: list[int] = []            # slot -> slot of its base storage
        self.writers: dict[int, list[int]] = {}  # base slot -> ops that wrote it, in order
        self.input_slots: list[int] = []
        self.outside: dict[int, tuple[torch.Tensor, int]] = {}  # slot -> (tensor, version)
        self.targets: dict[int, tuple[int, int]] = {}  # holder position -> (slot, version)
        self.kept: dict[tuple[int, int], Callable[[], Any]] = {}  # (slot, version) -> weakref
        self.replayable = True
        self.why_not: str | None = None
        # Random op -> the random op before it on the same generators, for ops recorded
        # without generator states (Rule 3b): a replay that runs one runs the other first.
        self.rng_prev: dict[int, int] = {}
        self.subclass = False  # a tensor subclass reached the recorder
        self.last_plan: int = 0
        # Values the policy keeps because the replay (not autograd) reads them (Rule 2b):
        # single-use ones (the policy permitted the keep) and, for the graph's life, those it
        # insisted on (MUST_SAVE) or moved to the host.
        self.single_use: list[Any] = []
        self.extra: list[Any] = []
        # Ops that are collectives the policy did not ask to recompute: never replayed
        # (ckptfx._collectives Rule 2).
        self.collectives: set[int] = set()

    def not_replayable(self, why: str) -> None:
        if self.replayable:
            self.replayable = False
            self.why_not = why

    def version(self, slot: int) -> int:
        w = self.writers.get(self.base[slot])
        return 0 if w is None else len(w)

    # The replay strategy (frame.rerun) -------------------------------------------------

    def replay(self, frame: Frame, tensors: Replay) -> None:
        if not self.replayable and self._needs_python(frame):
            rerun_function(frame, tensors)
            return
        targets = [(pos, sv) for pos, sv in self.targets.items()
                   if frame.holders[pos]() is not None]
        if not targets:
            return
        # A single-use value rewritten in place since the forward is recomputed (Rule 2b).
        stale = {id(k) for k in self.single_use if k.tensor._version != k.version}
        available: dict[tuple[int, int], Any] = {}
        for sv, ref in self.kept.items():
            kept = ref()
            if kept is not None and id(kept) not in stale:
                available[sv] = kept
        plan = self._plan([sv for _, sv in targets], available)
        if self.collectives and not self.collectives.isdisjoint(plan):
            op = self.ops[min(self.collectives.intersection(plan))]
            raise CheckpointError(
                f"ckptfx.remat: the replay would run the collective {op.func} again (its "
                "kept output was modified in place after the forward); a replayed "
                "collective runs on this rank only. Clone the collective's output before "
                "modifying it, or have the policy answer MUST_RECOMPUTE for it if every "
                "rank replays it"
            )
        self.last_plan = len(plan)
        vals: list[Any] = [None] * len(self.producer)
        for slot, t in zip(self.input_slots, frame.saved_inputs()):
            vals[slot] = t
        for slot, (t, version) in self.outside.items():
            if t._version != version:
                raise CheckpointError(
                    f"ckptfx.remat: a tensor the block read from outside its arguments "
                    f"({_describe(t)}, e.g. a parameter or a closure) was modified in place "
                    "between the forward and the backward; the replay would read the new "
                    "values. Run the backward before updating it, or pass it as an argument."
                )
            if t.untyped_storage().nbytes() == 0 and t.numel():
                raise CheckpointError(
                    f"ckptfx.remat: a parameter the block read ({_describe(t)}) has no data "
                    "now: FSDP resharded it after the forward. A replay needs it unsharded: "
                    "run the replay inside the FSDP module's backward (remat around the "
                    "module call, whose output FSDP's pre-backward hook watches), or through "
                    "vjp_split / ckptfx.pipelining, which unshard before prefire"
                )
            vals[slot] = t
        # Values kept only because the replay reads them are single-use (Rule 2b): this
        # replay takes them over and lets go of each after its last read.
        self.single_use.clear()
        release = self._release_after(plan, targets, available)
        with _ReplayGuard(frame.env.device_type, frame.env.generators):
            for k, i in enumerate(plan):
                op = self.ops[i]
                leaves = list(op.leaves)
                for j, slot, version in op.inputs:
                    kept = available.get((slot, version))
                    leaves[j] = vals[slot] if kept is None else kept.get()
                args, kwargs = _unflatten(op.spec, leaves)
                rng = op.rng
                if rng is not None:
                    if rng is _BLOCK_START:
                        assert frame.env.cpu_rng is not None  # remat frames always capture it
                        torch.set_rng_state(frame.env.cpu_rng)
                    else:
                        _set_rng(rng)
                out = op.func(*args, **kwargs)
                if op.outs:
                    out_leaves = _out_leaves(out)
                    for j, slot in op.outs:
                        vals[slot] = out_leaves[j]
                drop = release[k]
                if drop is not None:
                    for r in drop:  # a slot (int) or a kept value's (slot, version)
                        if r.__class__ is int:
                            vals[r] = None
                        else:
                            del available[r]
        for pos, sv in targets:
            kept = available.get(sv)
            tensors[pos] = vals[sv[0]] if kept is None else kept.get()

    def _needs_python(self, frame: Frame) -> bool:
        """Rule 4: a block that is not replayable must re-run its Python function, unless
        every live holder stands for a block input as it came in, or a view of one (all
        else kept): then nothing needs recomputing, and the recorded view ops rebuild them
        from the frame's saved inputs."""
        if self.subclass:
            return True
        for pos, sv in self.targets.items():
            if frame.holders[pos]() is None:
                continue
            slot, version = sv
            if version or self.base[slot] in self.writers:
                return True
            for i in self._plan([sv], {}):
                info = _op_info(self.ops[i].func)
                if not info.view or info.writes or info.seeded:
                    return True
        return False

    def _release_after(self, plan: list[int], targets: list[tuple[int, tuple[int, int]]],
                       available: dict[tuple[int, int], Any]) -> list[list[Any] | None]:
        """Per step of ``plan``, what no later step reads or writes and no target is: slots
        (ints) and kept values (their (slot, version)). The replay lets go of them there, so
        its intermediates are freed as the forward freed them instead of all living until
        the replay ends."""
        ops = self.ops
        last: dict[Any, int] = {}
        for k, i in enumerate(plan):
            op = ops[i]
            for _, slot, version in op.inputs:
                last[slot] = k
                sv = (slot, version)
                if sv in available:
                    last[sv] = k
            for _, slot in op.outs:
                last[slot] = k
        for _, sv in targets:
            last.pop(sv[0], None)
            last.pop(sv, None)
        release: list[list[Any] | None] = [None] * len(plan)
        for r, k in last.items():
            drop = release[k]
            if drop is None:
                release[k] = [r]
            else:
                drop.append(r)
        return release

    def _plan(self, wanted: list[tuple[int, int]], available: dict) -> list[int]:
        """The ops to run, in recorded order, to rebuild ``wanted`` (Rule 3)."""
        needed: set[int] = set()
        stack = list(wanted)
        seen: set[tuple[int, int]] = set()
        while stack:
            sv = stack.pop()
            if sv in seen or sv in available:
                continue
            seen.add(sv)
            slot, version = sv
            ops = [self.producer[slot]]
            if version:
                ops.append(self.writers[self.base[slot]][version - 1])
            for i in ops:
                # a random op recorded without its generator states needs the one before it
                while i >= 0 and i not in needed:
                    needed.add(i)
                    stack.extend((s, v) for _, s, v in self.ops[i].inputs)
                    i = self.rng_prev.get(i, -1)
        return sorted(needed)


def _flatten(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], Any]:
    """Leaves of an op's arguments and how to rebuild them. Most ops take flat arguments:
    those skip the pytree library (the spec is then ``(len(args), kwarg names)``). A list of
    Python numbers (``view``'s sizes) is one leaf: only lists holding tensors (``cat``) or
    other lists are flattened, so that each tensor is a leaf of its own."""
    for a in args:
        if (type(a) is list or type(a) is tuple) and _nested(a):
            return optree.tree_flatten((args, kwargs), none_is_leaf=True)
    if kwargs:
        for a in kwargs.values():
            if (type(a) is list or type(a) is tuple) and _nested(a):
                return optree.tree_flatten((args, kwargs), none_is_leaf=True)
        return [*args, *kwargs.values()], (len(args), tuple(kwargs))
    return list(args), (len(args), ())


def _nested(seq: list | tuple) -> bool:
    """True if ``seq`` holds anything but Python scalars and None (tensors, lists, ...)."""
    for e in seq:
        t = type(e)
        if t is not int and t is not float and t is not bool and e is not None:
            return True
    return False


def _out_leaves(out: Any) -> Any:
    """An op's outputs as a flat sequence: optree's leaves (None a leaf), without optree for
    a tensor or a flat tuple or list of them (every op but a few)."""
    if type(out) is torch.Tensor:
        return (out,)
    if type(out) is tuple or type(out) is list:
        for e in out:
            if type(e) is not torch.Tensor and e is not None:
                return optree.tree_leaves(out, none_is_leaf=True)
        return out
    return optree.tree_leaves(out, none_is_leaf=True)


def _unflatten(spec: Any, leaves: list[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if type(spec) is tuple:
        n, names = spec
        return tuple(leaves[:n]), dict(zip(names, leaves[n:])) if names else {}
    return optree.tree_unflatten(spec, leaves)


def _describe(t: torch.Tensor) -> str:
    return f"{t.dtype} {list(t.shape)}"


# The state the CPU generator had when the block started (``frame.env.cpu_rng``).
_BLOCK_START = ("block start",)
_CPU_DEFAULT = frozenset({("default", "cpu", None)})


def _rng_states(device: Any, generators: list[torch.Generator]) -> tuple[Any, ...]:
    """The generator states a seeded op on ``device`` draws from: CPU's always, the device's,
    and those of the explicit generators it was given."""
    dev_state = None
    if isinstance(device, str):  # a factory op's device= keyword
        device = torch.device(device)
    if isinstance(device, torch.device) and device.type not in ("cpu", "meta"):
        mod = torch.get_device_module(device.type)
        index = device.index if device.index is not None else mod.current_device()
        dev_state = (mod, index, mod.get_rng_state(index))
    return torch.get_rng_state(), dev_state, [(g, g.get_state()) for g in generators]


def _set_rng(states: tuple[Any, ...]) -> None:
    cpu, dev, gens = states
    torch.set_rng_state(cpu)
    if dev is not None:
        mod, index, state = dev
        mod.set_rng_state(state, index)
    for g, state in gens:
        g.set_state(state)


class _ReplayGuard:
    """No grad, no autocast (ops were recorded after it), the caller's RNG put back: the
    global generators' and the explicit ``generators`` the block drew from."""

    def __init__(self, device_type: str | None, generators: Any = ()) -> None:
        self.device_type = device_type
        self.generators = generators

    def __enter__(self) -> None:
        self.grad = torch.is_grad_enabled()
        torch.set_grad_enabled(False)
        self.autocast = [torch.autocast("cpu", enabled=False)]
        if self.device_type is not None and torch.amp.is_autocast_available(self.device_type):
            self.autocast.append(torch.autocast(self.device_type, enabled=False))
        for a in self.autocast:
            a.__enter__()
        self.cpu_rng = torch.get_rng_state()
        self.gen_states = [(g, g.get_state()) for g in self.generators]
        self.dev_rng = None
        if self.device_type is not None:
            mod = torch.get_device_module(self.device_type)
            if mod.is_initialized():
                self.dev_rng = (mod, mod.get_rng_state())

    def __exit__(self, *exc: Any) -> None:
        torch.set_rng_state(self.cpu_rng)
        for g, state in self.gen_states:
            g.set_state(state)
        if self.dev_rng is not None:
            mod, state = self.dev_rng
            mod.set_rng_state(state)
        for a in reversed(self.autocast):
            a.__exit__(None, None, None)
        torch.set_grad_enabled(self.grad)


# -- the tracer -----------------------------------------------------------------------------

_NAME_OP = checkpoint_name
_SAC_CTX = SelectiveCheckpointContext(is_recompute=False)


_NONE_WRITTEN: frozenset[int] = frozenset()
_graph_task_id = _compat.current_graph_task_id
_next_sequence_nr = _compat.next_sequence_nr


class Tracer(_compat.TorchDispatchMode):
    """Records a remat forward into a ``Segment`` and packs its saved tensors (Rules 1-2)."""

    def __init__(self, frame: Frame, inputs: list[torch.Tensor], policy: Any,
                 input_names: list[str] | None = None) -> None:
        super().__init__()
        self.frame = frame
        self.policy = policy
        self.report = _stack.report
        self.sites = self.report is not None
        self.input_names = input_names
        self.attr = f"_ckptfx_{next(_token)}"
        self.seg = seg = Segment()
        self.decision: list[Any] = []      # slot -> True / MUST_SAVE (keep), False, Offload
        self.root: list[int] = []          # slot -> input/outside slot it views, or -1
        self.ids: dict[int, int] = {}      # id of input/outside tensor -> slot
        self.uninit: set[int] = set()      # base slots from torch.empty not yet written
        self.packed_bases: set[int] = set()
        # Packs of values since the last dispatch, settled at the next one (Rule 1b): (holder
        # position, slot, version, tensor, autograd sequence number, kept object or None).
        self.recent: list[tuple[int, int, int, torch.Tensor, int, Any]] = []
        self.dispatch_seq = -1  # the autograd sequence number the last op dispatched at
        self.refresh: list[Any] = []  # kept objects whose tensor an op just filled
        self.names: dict[int, tuple[str, str | None]] = {}
        # (slot, version) -> (tensor, its expected _version, decision): every value the policy
        # lets keep, held until ``finish`` picks those the replay reads (Rule 2b).
        self.held: dict[tuple[int, int], tuple[torch.Tensor, int, Any]] = {}
        self.pinned = frame.env.device_type is not None
        # Generator key -> the last random op that drew from it, and op -> its keys (Rule 3b).
        self.last_draw: dict[Hashable, int] = {}
        self.draw_keys: dict[int, frozenset[Any]] = {}
        # FSDP scopes and collectives (ckptfx._collectives), only where one can run.
        self.dist = _collectives.Watch() if _collectives.watch_needed() else None
        self.dist_log: Any = None
        for i, t in enumerate(inputs):
            if id(t) not in self.ids:
                self.ids[id(t)] = self._new_slot(-1, None, root=True)
            seg.input_slots.append(self.ids[id(t)])

    def _generator_states(self, index: int, device: Any, gens: list[torch.Generator]) -> Any:
        """What random op ``index`` replays its generators from (Rule 3b): nothing when the
        random op before it drew from the same generators and nothing else drew from them in
        between (the replay runs that op first and continues from where it left them),
        ``_BLOCK_START`` for the block's first draw from the CPU generator (the frame
        captured that state when the block started), else the states themselves."""
        if gens:
            keys: frozenset[Hashable] = frozenset(id(g) for g in gens)
        else:
            if isinstance(device, str):
                device = torch.device(device)
            dev = device if isinstance(device, torch.device) else torch.device("cpu")
            keys = frozenset({("default", dev.type, dev.index)})
        prev = {self.last_draw.get(k) for k in keys}
        for k in keys:
            self.last_draw[k] = index
        self.draw_keys[index] = keys
        if len(prev) == 1:
            p = next(iter(prev))
            if p is not None and self.draw_keys[p] == keys:
                self.seg.rng_prev[index] = p
                return None
            if (p is None and keys == _CPU_DEFAULT and self.frame.env.cpu_rng is not None):
                return _BLOCK_START
        return _rng_states(device, gens)

    def _new_slot(self, producer: int, base: int | None, root: bool = False) -> int:
        seg = self.seg
        slot = len(seg.producer)
        seg.producer.append(producer)
        seg.base.append(slot if base is None else base)
        self.decision.append(False)
        self.root.append(slot if root else -1)
        return slot

    def _slot(self, t: torch.Tensor) -> int:
        slot = t.__dict__.get(self.attr)
        if slot is not None:
            return slot
        slot = self.ids.get(id(t))
        if slot is None:  # a tensor from outside the block: a parameter, a closure, a constant
            slot = self.ids[id(t)] = self._new_slot(-1, None, root=True)
            self.seg.outside[slot] = (t, t._version)
        return slot

    # the dispatch side -----------------------------------------------------------------

    def __enter__(self) -> "Tracer":
        _stack.tracers.append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        _stack.tracers.pop()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        dist = self.dist
        collective = False
        if dist is not None:
            if self.dist_log is not None and self.dist_log.pending:
                self.dist_log.settle()
            if dist.outside(func, args):  # FSDP's own op: outside the block
                out = func(*args, **kwargs)
                dist.ran(func, args, out)
                return out
            collective = _collectives.is_collective(func)
        seg = self.seg
        info = _OP_INFO.get(func) or _op_info(func)
        leaves, spec = _flatten(args, kwargs)
        written: set[int] | frozenset[int] = _NONE_WRITTEN
        if info.writes:
            written = set()
            for i, name in info.writes:
                v = args[i] if i < len(args) else kwargs.get(name)
                if isinstance(v, torch.Tensor):
                    written.add(id(v))
                elif isinstance(v, (list, tuple)):
                    written.update(id(x) for x in v if isinstance(x, torch.Tensor))
        if self.refresh:
            self._refresh()
        seq = _next_sequence_nr()
        own = self._settle(written, seq) if self.recent else None
        self.dispatch_seq = seq
        inputs = []
        device = None
        attr, ids, base_of, writers, uninit = self.attr, self.ids, seg.base, seg.writers, self.uninit
        for j, a in enumerate(leaves):
            if isinstance(a, torch.Tensor):
                ta = type(a)
                if ta is not torch.Tensor and ta is not torch.nn.Parameter:
                    seg.not_replayable(f"{func} got a tensor subclass ({ta.__name__})")
                    seg.subclass = True
                slot = a.__dict__.get(attr)
                if slot is None:
                    slot = ids.get(id(a))
                    if slot is None:
                        slot = self._slot(a)
                base = base_of[slot]
                # A view (torch.empty_like's detach, when a reference to the new tensor is
                # held) reads no values.
                if uninit and base in uninit and id(a) not in written and not info.alias:
                    seg.not_replayable(
                        f"{func} read a torch.empty buffer that no recorded op wrote (a custom "
                        "kernel or an out-of-dispatcher write filled it)")
                w = writers.get(base)
                inputs.append((j, slot, len(w) if w else 0))
                leaves[j] = None
                if device is None and info.seeded:
                    device = a.device
        if _graph_task_id() != -1:
            seg.not_replayable("autograd ran inside the block")
        rng = None
        if info.seeded:  # only random ops take a generator (some positionally)
            gens = [a for a in args if isinstance(a, torch.Generator)]
            if kwargs.get("generator") is not None:
                gens.append(kwargs["generator"])
            for g in gens:
                self.frame.env.note_generator(g)  # for a replay that re-runs the function
            rng = self._generator_states(len(seg.ops), device or kwargs.get("device"), gens)
        out = func(*args, **kwargs)
        index = len(seg.ops)
        op = _Op(func, spec, leaves, inputs, rng,
                 user_call_site() if self.sites else None)
        seg.ops.append(op)
        if collective:
            decision = _collectives.collective_decision(self.policy, _SAC_CTX, func, args, kwargs)
            if decision is not False:
                seg.collectives.add(index)
            if self.dist_log is None:  # for a fallback re-run of the function
                self.dist_log = _collectives.log_for(self.frame)
            self.dist_log.record(func, args, kwargs, out)

        for i, name in info.writes:  # versions move on for every value this op rewrote
            v = args[i] if i < len(args) else kwargs.get(name)
            for t in (v if isinstance(v, (list, tuple)) else (v,)):
                if isinstance(t, torch.Tensor):
                    slot = self._slot(t)
                    base = seg.base[slot]
                    seg.writers.setdefault(base, []).append(index)
                    self.uninit.discard(base)
                    if seg.producer[base] < 0:
                        seg.not_replayable(f"{func} writes in place to a block input or an "
                                           "outside tensor")
                    if base in self.packed_bases:
                        seg.not_replayable(f"{func} writes in place to a value autograd saved")
        if own:
            self._own_inputs_written(own, args, kwargs)

        if not collective:
            decision = None
        decisions, roots = self.decision, self.root
        out_leaves = _out_leaves(out)
        for j, o in enumerate(out_leaves):
            if not isinstance(o, torch.Tensor):
                continue
            slot = o.__dict__.get(attr)
            if slot is None:
                slot = ids.get(id(o))
            if slot is None:  # a new value: ``_new_slot`` inlined (every op output comes here)
                slot = len(base_of)
                base = slot
                root = -1
                if info.alias and inputs:  # shares the input's storage: and its versions
                    src = inputs[0][1]
                    base = base_of[src]
                    root = roots[src]
                seg.producer.append(index)
                base_of.append(base)
                decisions.append(False)
                roots.append(root)
                o.__dict__[attr] = slot
                if info.empty:
                    uninit.add(slot)
                if info.view and inputs and decisions[inputs[0][1]] is not False:
                    decisions[slot] = decisions[inputs[0][1]]
                    op.outs.append((j, slot))
                    continue
            op.outs.append((j, slot))
            if collective:
                decisions[slot] = decision
                if decision is not False:
                    self._hold(slot, o, decision, id(o) in written)
            elif self.policy is not None:
                if decision is None:
                    decision = call_policy(self.policy, _SAC_CTX, func, args, kwargs)
                decisions[slot] = decision
                if decision is not False:
                    self._hold(slot, o, decision, id(o) in written)
        return out

    def _hold(self, slot: int, t: torch.Tensor, decision: Any, written: bool = False) -> None:
        if self.root[slot] >= 0:  # a view of an input or outside tensor: an argument
            return
        # The tensor itself, not a detach made here: below autograd a detach gets its own
        # version counter and would hide later in-place writes. It is detached in ``finish``
        # (held only during the forward, so no reference cycle). An in-place op's output is
        # bumped once more by autograd after this op returns.
        self.held[(slot, self.seg.version(slot))] = (t, t._version + written, decision)

    def name(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """``checkpoint_name`` inside this trace: the value of ``x`` carries the name.

        ``x`` itself is returned (no new tensor, no recorded op): a view would change what
        autocast caches and so the numerics, and the function re-run by a fallback replay,
        where ``checkpoint_name`` is a plain identity, must run the same ops.
        """
        slot = self._slot(x)
        self.names[slot] = (name, user_call_site() if self.sites else None)
        if self.policy is not None and self.root[slot] < 0:  # arguments are kept anyway
            decision = call_policy(self.policy, _SAC_CTX, _NAME_OP, (x,), {"name": name})
            if decision is not False:
                self.decision[slot] = decision
                self._hold(slot, x, decision)
        return x

    # the autograd side -----------------------------------------------------------------

    def pack(self, x: torch.Tensor) -> Any:
        frame = self.frame
        pos = len(frame.holders)
        if frame.metas is not None:
            frame.metas.append((x.shape, x.dtype, x.device))
        frame.note_op(pos)  # where a function re-run of this frame stops (frame.py Rule 6)
        slot = x.__dict__.get(self.attr)
        if slot is None:
            index = self.ids.get(id(x))
            if index is not None and index in self._input_index:
                return self._argument_holder(x, pos, index, index)
            frame.holders.append(_DEAD)
            index = self._slot(x)
            self._note("argument", x, index, 0)
            return _Kept(x)
        seg = self.seg
        w = seg.writers.get(seg.base[slot])
        version = len(w) if w else 0  # seg.version(slot), inlined: every pack comes here
        root = self.root[slot]
        if root >= 0:
            if root in self._input_index:
                return self._argument_holder(x, pos, slot, root)
            frame.holders.append(_DEAD)
            self._note("argument", x, root, 0)
            return _Kept(x)
        decision = self.decision[slot]
        if decision is False:
            holder = Holder(frame, pos)
            frame.holders.append(weakref.ref(holder))
            seg.targets[pos] = (slot, version)
            self.recent.append((pos, slot, version, x, frame.op_seq, None))
            return holder
        frame.holders.append(_DEAD)
        # A detached alias: an op that saves its own output (relu, exp, softmax) would
        # otherwise hold its node through the packed tensor, a cycle gc cannot see through
        # the C++ graph, leaking every graph that is dropped without a backward.
        kept = _compat.detach_unrecorded(x)
        if isinstance(decision, Offload):
            packed: _Kept | _Offloaded = _Offloaded(kept,
                                                   self.pinned and decision.dst == "pinned_host")
            self._note("offloaded", x, slot, version)
        else:
            packed = _Kept(kept)
            self._note("saved", x, slot, version)
        self.seg.kept.setdefault((slot, version), weakref.ref(packed))
        self.recent.append((pos, slot, version, x, frame.op_seq, packed))
        return packed

    def _settle(self, written: Any, seq: int) -> list[tuple[Any, ...]]:
        """At an op's dispatch, the values packed since the previous one (Rule 1b): those this
        op writes and packed as its own inputs are returned, the others count as saved."""
        made_node = seq != self.dispatch_seq  # autograd made a node for this op
        own = []
        base = self.seg.base
        for entry in self.recent:
            if made_node and entry[4] == seq and id(entry[3]) in written:
                own.append(entry)
            else:
                self.packed_bases.add(base[entry[1]])
        self.recent = []
        return own

    def _own_inputs_written(self, own: list[tuple[Any, ...]], args: tuple, kwargs: dict
                            ) -> None:
        """After an op filled buffers it had autograd save as its inputs (Rule 1b): what was
        packed is the value the op left, so the pack refers to that version."""
        seg = self.seg
        for pos, slot, version, x, _, packed in own:
            self.packed_bases.add(seg.base[slot])  # a later write is a write after the save
            new = (slot, seg.version(slot))
            if packed is None:
                seg.targets[pos] = new
                continue
            old = (slot, version)
            ref = seg.kept.get(old)
            if ref is not None and ref() is packed:
                del seg.kept[old]
            seg.kept.setdefault(new, weakref.ref(packed))
            report = self.report
            if report is not None:  # saved_residuals names the op that left the value
                for k in range(len(report) - 1, -1, -1):
                    entry = report[k]
                    if entry[0] is self and entry[2] is x and entry[3] == slot:
                        report[k] = (*entry[:4], new[1])
                        break
            if isinstance(packed, _Offloaded) and packed.device.type != "cpu":
                packed.tensor.copy_(x)  # moved to the host before the op filled it
            self.refresh.append(packed)

    def _refresh(self) -> None:
        # The version counter moves on after the op returns (above the dispatcher).
        for packed in self.refresh:
            packed.version = packed.tensor._version
        self.refresh = []

    def _argument_holder(self, x: torch.Tensor, pos: int, slot: int, root: int) -> Holder:
        # A block input (or a view of one) is filled by the replay from the frame's saved
        # inputs, never referenced directly: when the block is nested in a checkpoint, its
        # inputs are holders of the parent, which hands each tensor out once per backward;
        # the replay unpacks them once, however many ops saved them.
        holder = Holder(self.frame, pos)
        self.frame.holders.append(weakref.ref(holder))
        self.seg.targets[pos] = (slot, self.seg.version(slot))
        self._note("argument", x, root, 0)
        return holder

    @property
    def _input_index(self) -> dict[int, int]:
        cache = self.__dict__.get("_inputs_by_slot")
        if cache is None:
            cache = {slot: i for i, slot in enumerate(self.seg.input_slots)}
            self.__dict__["_inputs_by_slot"] = cache
        return cache

    def _note(self, kind: str, x: torch.Tensor, slot: int, version: int) -> None:
        if self.report is not None:
            self.report.append((self, kind, x, slot, version))

    def finish(self) -> Segment:
        """End of the forward: hand the segment to the frame as its replay strategy."""
        if self.refresh:
            self._refresh()
        if self.dist_log is not None:
            self.dist_log.settle()
        self.recent = []
        self._keep_what_the_replay_reads()
        self.frame.rerun = self.seg.replay
        # Replayed block inputs cost no memory of their own (for recompute_session_stats).
        self.frame.shared = frozenset(pos for pos, (slot, _) in self.seg.targets.items()
                                      if self.root[slot] >= 0)
        return self.seg

    def _keep_what_the_replay_reads(self) -> None:
        """Rule 2b (JAX's partial evaluation): a value the policy lets keep is kept when the
        replay of a recomputed value reads it, not only when autograd saved it itself (torch's
        relu saves its output, so the matmul before it is read only by the replay; a matmul
        reached through ``matmul``'s reshape is saved as ``_unsafe_view`` of it)."""
        held, self.held = self.held, {}
        seg = self.seg
        if not held or not seg.replayable:
            return
        holders = self.frame.holders
        stack = [sv for pos, sv in seg.targets.items() if holders[pos]() is not None]
        seen: set[tuple[int, int]] = set()
        while stack:
            sv = stack.pop()
            if sv in seen:
                continue
            seen.add(sv)
            ref = seg.kept.get(sv)
            if ref is not None and ref() is not None:
                continue
            h = held.get(sv)
            slot, version = sv
            if (h is not None and h[0]._version == h[1]
                    and seg.version(slot) == version):  # not rewritten since: still that value
                t, _, decision = h
                t = t.detach()  # outside the mode: shares the version counter _Kept checks
                if isinstance(decision, Offload):
                    packed: Any = _Offloaded(t, self.pinned and decision.dst == "pinned_host")
                    self._note("offloaded", t, slot, version)
                else:
                    packed = _Kept(t)
                    self._note("saved", t, slot, version)
                (seg.single_use if decision is True else seg.extra).append(packed)
                seg.kept[sv] = weakref.ref(packed)
                continue
            ops = [seg.producer[slot]]
            if version:
                ops.append(seg.writers[seg.base[slot]][version - 1])
            for i in ops:
                if i >= 0:
                    stack.extend((s, v) for _, s, v in seg.ops[i].inputs)
