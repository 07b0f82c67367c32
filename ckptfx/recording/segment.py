"""The recorded segment of a remat'd block and its replay: the plan of the ops a recomputed
value needs, run under the forward's generator states.

Rules (numbered with tracer.py's, which records the segment: 1 and 4 there, 1b, 2 and 2b in
packs.py)

3. In-place writes are versioned per base storage (a view shares its base's). An op reads a
   value at a version; a pack keeps a value at a version. The replay of a recomputed value
   runs only the ops it transitively needs, reading kept values where a kept (slot, version)
   is still alive instead of recomputing it, and lets go of each value after the last op
   that reads it (the forward's memory profile, not every intermediate at once). Seeded
   random ops replay from the generator states they drew from in the forward (the global
   generators' and any explicit ``generator=``'s; Rule 3b), so skipping ops never shifts a
   dropout mask; the caller's generators are put back after the replay (the current
   device's and every device whose generator the replay sets: a prefire of a block on
   another device runs on the caller's thread).

   3b. A generator state is stored only where the replay cannot know it otherwise (a CPU
   generator state is 5 KiB; one per dropout would make remat hold more than torch's
   checkpoint, which keeps one per block). The block's first draw from the CPU generator,
   or from the default generator of a device the frame captured (the devices of its
   inputs), starts from the state the frame captured when the block began, if the
   generator still holds it. A random op whose previous draw on the same generators was one
   random op drawing from exactly those, and which finds them where that op left them,
   continues from there: any replay that runs it runs that op first (``Segment.rng_prev``;
   usually it is needed anyway, as every dropout mask is). Any other draw stores its states:
   a generator reseeded or set inside the block (tracer.py Rule 5) costs one state per draw
   after the change, never a wrong mask.

   3c. The replay runs as the forward's ops ran: under the forward's default dtype (ATen
   reads it inside ``linspace`` or ``randn``), and with grad mode on, below autograd, so
   nothing is recorded while kernels that return more under grad mode (the oneDNN LSTM
   layer's workspace) return it.
"""

from __future__ import annotations

from typing import Any, Callable

import optree
import torch

from ckptfx import _compat
from ckptfx._ops import op_info as _op_info
from ckptfx.kernel.frame import CheckpointError, Frame, Replay
from ckptfx.kernel.function_replay import rerun_function
from ckptfx.kernel.replay_env import DefaultDtype
from ckptfx.offload.groups import HostResidual

__all__ = ["Segment", "check_outside", "outside_version"]


# -- the recorded segment -------------------------------------------------------------------


class RecordedOp:
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
        self.ops: list[RecordedOp] = []
        self.producer: list[int] = []        # slot -> op that created the object (-1: none)
        self.base: list[int] = []            # slot -> slot of its base storage
        self.writers: dict[int, list[int]] = {}  # base slot -> ops that wrote it, in order
        self.input_slots: list[int] = []
        self.outside: dict[int, tuple[torch.Tensor, int]] = {}  # slot -> (tensor, version)
        self.targets: dict[int, tuple[int, int]] = {}  # holder position -> (slot, version)
        self.kept: dict[tuple[int, int], Callable[[], Any]] = {}  # (slot, version) -> weakref
        self.replayable = True
        self.why_not: str | None = None
        # (op, tensor) of the first in-place write to an argument or outside tensor that an
        # earlier op read: the block cannot be re-run (tracer.py Rule 4b).
        self.reread: tuple[Any, torch.Tensor] | None = None
        # Random op -> the random op before it on the same generators, for ops recorded
        # without generator states (Rule 3b): a replay that runs one runs the other first.
        self.rng_prev: dict[int, int] = {}
        # Device indices whose generator a replay sets (random ops recorded with states), so
        # the replay can put each back: the caller's current device is not always one of them
        # (a prefire on the caller's thread of a block on another device).
        self.rng_devices: set[int] = set()
        self.subclass = False  # a tensor subclass reached the recorder
        self.last_plan: int = 0
        # Values the policy keeps because the replay (not autograd) reads them (packs.py Rule
        # 2b): single-use ones (the policy permitted the keep) and, for the graph's life, those
        # it insisted on (MUST_SAVE) or moved to the host.
        self.single_use: list[Any] = []
        self.hosts: tuple[Any, ...] = ()  # the block's offload HostGroups (ckptfx.offload)
        self.extra: list[Any] = []
        # Ops that are collectives the policy did not ask to recompute: never replayed
        # (ckptfx.kernel.collectives Rule 2).
        self.collectives: set[int] = set()

    def not_replayable(self, why: str) -> None:
        if self.replayable:
            self.replayable = False
            self.why_not = why

    def version(self, slot: int) -> int:
        w = self.writers.get(self.base[slot])
        return 0 if w is None else len(w)

    def makers(self, slot: int, version: int) -> list[int]:
        """The ops that made ``slot`` at ``version``: its producer (-1 for an argument) and,
        for a rewritten version, the in-place op that wrote it."""
        ops = [self.producer[slot]]
        if version:
            ops.append(self.writers[self.base[slot]][version - 1])
        return ops

    # The replay strategy (frame.rerun) -------------------------------------------------

    def replay(self, frame: Frame, tensors: Replay) -> None:
        # A refill replay (frame.py Rule 7b) also rebuilds the block's outputs, at the
        # (slot, version) each had when the block returned.
        outputs = None if type(tensors) is list else frame.refill.targets
        if not self.replayable and (outputs is not None or self._needs_python(frame)):
            if self.reread is not None:
                self._refuse_rerun(frame)
            rerun_function(frame, tensors)
            return
        for group in self.hosts:  # the block's offloaded values come back now (ckptfx.offload)
            group.reload_ahead()
        targets = [(pos, sv) for pos, sv in self.targets.items()
                   if frame.holders[pos]() is not None]
        if outputs is not None:
            targets += [(-1, sv) for sv in outputs]  # position -1: not a holder's
        if not targets:
            return
        # A single-use value rewritten in place since the forward is recomputed (packs.py Rule
        # 2b), and so is an offloaded one (not a collective's: those are kept, never rerun).
        stale = {id(k) for k in self.single_use if not k.fresh()}
        stale.update(id(k) for k in self.extra if k.__class__ is HostResidual and not k.fresh())
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
            check_outside(t, version)
            if t.untyped_storage().nbytes() == 0 and t.numel():
                raise CheckpointError(
                    f"ckptfx.remat: a parameter the block read ({describe_value(t)}) has no data "
                    "now: FSDP resharded it after the forward. A replay needs it unsharded: "
                    "run the replay inside the FSDP module's backward (remat around the "
                    "module call, whose output FSDP's pre-backward hook watches, or a lazy "
                    "session replay), through vjp_split / ckptfx.pipelining, which unshard "
                    "before prefire, or, for a recompute_handle prefire, let the block refer "
                    "to its FSDP module (a bound method, the module itself, a module argument "
                    "or closure: ckptfx.kernel.fsdp Rule 1) or call its unshard() first"
                )
            vals[slot] = t
        # Values kept only because the replay reads them are single-use (packs.py Rule 2b): this
        # replay takes them over and lets go of each after its last read.
        self.single_use.clear()
        release = self._release_after(plan, targets, available)
        with _ReplayGuard(frame.env.device_type, frame.env.generators,
                          {*(i for i, _ in frame.env.device_rng), *self.rng_devices},
                          frame.env.default_dtype):
            for k, i in enumerate(plan):
                op = self.ops[i]
                leaves = list(op.leaves)
                for j, slot, version in op.inputs:
                    kept = available.get((slot, version))
                    leaves[j] = vals[slot] if kept is None else kept.value()
                args, kwargs = _unflatten(op.spec, leaves)
                rng = op.rng
                if rng is not None:
                    if rng is BLOCK_START:
                        assert frame.env.cpu_rng is not None  # remat frames always capture it
                        torch.set_rng_state(frame.env.cpu_rng)
                    elif rng[0] is DEVICE_BLOCK_START:
                        _set_device_block_start(frame.env, rng[1])
                    else:
                        _set_rng(rng)
                out = op.func(*args, **kwargs)
                if op.outs:
                    out_leaves = output_leaves(out)
                    for j, slot in op.outs:
                        vals[slot] = out_leaves[j]
                drop = release[k]
                if drop is not None:
                    for r in drop:  # a slot (int) or a kept value's (slot, version)
                        if r.__class__ is int:
                            vals[r] = None
                        else:
                            del available[r]
        values = []
        for pos, sv in targets:
            kept = available.get(sv)
            t = vals[sv[0]] if kept is None else kept.value()
            if pos >= 0:
                tensors[pos] = t
            else:
                values.append(t)
        if outputs is not None:
            frame.refill.fill(tensors, values)

    def _refuse_rerun(self, frame: Frame) -> None:
        func, t = self.reread  # type: ignore[misc]
        name = getattr(frame.fn, "__qualname__", None) or type(frame.fn).__name__
        raise CheckpointError(
            f"ckptfx.remat: {name} reads a tensor from outside its arguments "
            f"({describe_value(t)}) that it also writes in place ({func}); its recomputation "
            "would read the value the forward (or the recomputation itself) left there, not "
            "the one the forward read, and compute other gradients. (A parametrization that updates its state in the forward, such "
            "as spectral_norm's power iteration, does this.) Keep everything this block "
            "saves (policy=everything_saveable), make the state change before the block "
            "and pass the result in, or do not checkpoint it."
        )

    def _needs_python(self, frame: Frame) -> bool:
        """tracer.py Rule 4: a block that is not replayable must re-run its Python function,
        unless every live holder stands for a block input as it came in, or a view of one (all
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
            for i in self.makers(*sv):
                # a random op recorded without its generator states needs the one before it
                while i >= 0 and i not in needed:
                    needed.add(i)
                    stack.extend((s, v) for _, s, v in self.ops[i].inputs)
                    i = self.rng_prev.get(i, -1)
        return sorted(needed)


def flatten_tree(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], Any]:
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


def output_leaves(out: Any) -> Any:
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


def describe_value(t: torch.Tensor) -> str:
    return f"{t.dtype} {list(t.shape)}"


def outside_version(t: torch.Tensor) -> int:
    """``t._version``, or -1 for an inference tensor, which has no version counter (and can
    be written in place only inside torch.inference_mode, where nothing records)."""
    return -1 if t.is_inference() else t._version


def check_outside(t: torch.Tensor, version: int) -> None:
    """Before a replay: a tensor the block read from outside its arguments, at ``version``
    in the forward, must not have been modified in place since (the replay would read the
    new values)."""
    if version >= 0 and t._version != version:
        raise CheckpointError(
            f"ckptfx.remat: a tensor the block read from outside its arguments "
            f"({describe_value(t)}, e.g. a parameter or a closure) was modified in place "
            "between the forward and the backward; the replay would read the new "
            "values. Run the backward before updating it, or pass it as an argument."
        )


# The state the CPU generator had when the block started (``frame.env.cpu_rng``).
BLOCK_START = ("block start",)
CPU_DEFAULT = frozenset({("default", "cpu", None)})
# ``(DEVICE_BLOCK_START, index)``: the state device ``index``'s default generator had when the
# block started (``frame.env.device_rng``), for the block's first draw from it.
DEVICE_BLOCK_START = "device block start"


def _set_device_block_start(env: Any, index: int) -> None:
    mod = torch.get_device_module(env.device_type)
    for i, state in env.device_rng:
        if i == index:
            mod.set_rng_state(state, i)
            return
    raise AssertionError("the tracer stores DEVICE_BLOCK_START only for a captured device")


def rng_states(device: Any, generators: list[torch.Generator]) -> tuple[Any, ...]:
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
    """Nothing recorded by autograd, no autocast (ops were recorded after it), the forward's
    default dtype; the caller's RNG put back after: the global generators' and the explicit
    ``generators`` the block drew from. Entering changes nothing if it raises."""

    def __init__(self, device_type: str | None, generators: Any = (),
                 device_indices: Any = (), default_dtype: torch.dtype | None = None) -> None:
        self.device_type = device_type
        self.generators = generators
        self.device_indices = device_indices  # besides the current device
        self.default_dtype = default_dtype

    def __enter__(self) -> None:
        # What to put back, read before anything changes.
        self.grad = torch.is_grad_enabled()
        self.cpu_rng = torch.get_rng_state()
        self.gen_states = [(g, g.get_state()) for g in self.generators]
        self.dev_rng: list[tuple[Any, int, torch.Tensor]] = []
        if self.device_type is not None:
            mod = torch.get_device_module(self.device_type)
            if mod.is_initialized():
                indices = {mod.current_device(), *self.device_indices}
                self.dev_rng = [(mod, i, mod.get_rng_state(i)) for i in indices]
        self.autocast = [torch.autocast("cpu", enabled=False)]
        if self.device_type is not None and torch.amp.is_autocast_available(self.device_type):
            self.autocast.append(torch.autocast(self.device_type, enabled=False))
        # Grad mode on, as in the forward, but below autograd, so nothing is recorded: a few
        # kernels return more under grad mode (the oneDNN LSTM layer's workspace, which its
        # backward reads).
        self.entered: list[Any] = []
        try:
            self.below_autograd = _compat.below_autograd()
            self.below_autograd.__enter__()
            self.entered.append(self.below_autograd)
            torch.set_grad_enabled(True)
            if (self.default_dtype is not None
                    and self.default_dtype is not torch.get_default_dtype()):
                dtype = DefaultDtype(self.default_dtype)
                dtype.__enter__()
                self.entered.append(dtype)
            for a in self.autocast:
                a.__enter__()
                self.entered.append(a)
        except BaseException:
            self._put_back()
            raise

    def __exit__(self, *exc: Any) -> None:
        torch.set_rng_state(self.cpu_rng)
        for g, state in self.gen_states:
            g.set_state(state)
        for mod, i, state in self.dev_rng:
            mod.set_rng_state(state, i)
        self._put_back()

    def _put_back(self) -> None:
        for ctx in reversed(self.entered):
            ctx.__exit__(None, None, None)
        torch.set_grad_enabled(self.grad)
