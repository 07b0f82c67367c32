"""remat's unrecorded calls: a block whose policy keeps nothing is recorded on its first call,
and later calls that look the same run as a plain kernel frame, replayed by re-running the
block's Python function.

A recording costs Python per ATen op in the forward (a dispatch mode: at d=64 more than the
whole of torch's checkpoint forward). A policy that keeps nothing gains nothing from it but
exactness where a Python re-run would not be exact, and the first call's recording shows
whether the block is such a block. So:

Rules

1. Which calls. ``nothing_saveable`` (remat's default) and ``memory_budget(0.0)``, the
   policies that keep nothing but what the kernel keeps anyway (the inputs), under plain
   autograd: not under ``saved_residuals`` (it reports the recording), not nested in another
   block's recording, not where a collective can run (these policies keep collectives,
   which needs the recording), and not with ``remat(..., always_record=True)``.
2. The first call of the function with a new signature (``recording/signature.py``) is recorded as
   always, and its recording decides for later calls with that signature: they may run
   unrecorded if the recording is replayable (tracer.py Rule 4: no writes to inputs or after
   a save, no tensor subclass, no autograd inside, ...), drew no random number that a re-run
   would draw differently (from an explicit ``torch.Generator``, or on a device whose
   generator the frame does not capture), ran no collective, created no nested frame (a
   re-run would create it again, which a recompute session refuses), and ran no op before
   its last save that the recorded replay would skip (bar views, which compute nothing): a
   re-run runs every op up to its stop, so it then computes exactly what the recorded
   replay computes (the same FLOPs; ops counted by name differ in views only). That last
   condition also keeps recorded a block whose Python branches on a value it reads through
   an op (``.item()``, ``bool(t)``): no saved tensor needs that read. Last, every tensor it
   read from outside its arguments must live in a module the block belongs to (a
   parameter, a buffer or a tensor attribute of the module it is a method of, or of a
   module its closure holds), at one place only (not a tied weight, not a cast made
   before the block, such as autocast's cached cast, which nothing could check later): a
   re-run reads it where it finds it when it runs, so a later call notes what
   is there (Rule 4a). A closure's or a global's tensor cannot be found so. Otherwise
   every call with that signature is recorded (the signature includes the training flag of
   the module the block is a method of).
3. An unrecorded call is a frame as ``ckptfx.checkpoint`` makes one: the forward runs under
   the saved-tensor hooks only, with no dispatch mode; the replay re-runs the function
   under the kernel's deterministic early stop and its checks (frame.py Rules 5 and 6), with
   the forward's RNG and autocast state.
4. What a later call may do differently is caught in its replay, never passed on:
   a. a later call notes, when it starts, the tensor at each place the first call read one
      from (what its forward reads) and its version, or is recorded, and its recording
      decides anew, if a place is gone. The replay checks that none was modified in place
      since, as a recorded replay does (``segment.check_outside``), and puts back any that
      is no longer in its place for the re-run's duration: ``torch.func.functional_call``
      swaps tensors in for the forward only, and a re-run in the backward would read the
      module's own (torch's checkpoint does: wrong gradients). The module's attribute is
      restored when the re-run ends; another thread reading it meanwhile sees the
      forward's tensor, as it would during the forward under ``functional_call``;
   b. the re-run runs under a dispatch mode (``_DrawWatch``) that raises ``CheckpointError``
      at a draw from an explicit generator, or on a device whose generator state the frame
      did not capture: the forward drew from a state nobody kept, so the replay cannot draw
      the same numbers (a data-dependent branch the first call did not take);
   c. a call that created a nested frame is a valid checkpoint frame (nesting as in torch);
      later calls with its signature are recorded again;
   d. a tensor only a later call reads (a branch the first call did not take, on Python
      state the signature does not hold) is not at a place of 4a. So a later call also
      notes, when it starts, the tensor and its version at each place the first call
      could see holding one that it did not read (``watched_places``, places.py): the
      other parameters, buffers and tensor attributes of the block's modules (with modules
      among its arguments) and of the modules it read from (not their submodules), those of
      all their other submodules where these hold at most ``_MAX_WATCHED`` (places.py) in
      all, and the tensors in the block function's closure cells and among the globals its
      code names.
      Each costs a later call a lookup and a version read (well under a microsecond); a
      layer's forward reads all its tensors and notes none. The re-run's ``_DrawWatch`` checks each noted tensor
      at its first read: one modified in place since the call started (by the block's
      own forward too, whose write the re-run would repeat), or one put at a place since
      in place of the tensor noted there (the forward found the other one), raises
      ``CheckpointError`` naming the place, before the replay hands out anything. The
      check is a dict lookup per tensor argument of an op, in the backward only, and only
      for a call that noted something.
5. What users see: the replay of an unrecorded call runs the block's Python once per
   replay, as torch's checkpoint does (a counter inside the block goes up), where a recorded
   replay runs the recorded ATen ops only. Gradients are the same, bit for bit. What the
   re-run reads, it reads when it runs, as torch's checkpoint's does: Python state of the
   block (a scale read from a config object) must not change between forward and backward,
   which remat asks of every block and nothing can check. A tensor only a later call reads
   is checked as 4d says; one 4d cannot see is not, and must not change either: a tensor
   reached through another object (``self.cfg.table``, a global of another Python module,
   a tensor in a list in a closure), one of a submodule the first call read nothing from
   where such submodules hold more than ``_MAX_WATCHED`` tensors (a method of a whole
   model), a place made after the first call, a tensor read through ``.data`` or inside
   compiled code. ``always_record=True`` keeps every call recorded, and every outside
   read checked.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

import torch

from ckptfx import _compat
from ckptfx._ops import OP_INFO, op_info
from ckptfx.kernel import collectives
from ckptfx.kernel.frame import CheckpointError, Frame, Replay, tls
from ckptfx.kernel.function_replay import rerun_function
from ckptfx.policies.budget_policy import MemoryBudget
from ckptfx.policies.tracer_stack import tracer_stack
from ckptfx.recording.places import (
    Outside,
    Unrecorded,
    Watched,
    modules_near,
    owners_of,
    places_of,
    reads_to_check,
    watched_places,
)
from ckptfx.recording.segment import check_outside, describe_value
from ckptfx.recording.signature import flat_signature, per_function, signature

__all__ = ["Plan", "keeps_nothing", "plan_for"]  # for remat.py

# Caches of what first calls learnt (Rule 2): fun -> {signature: entry}, kept with the
# function, or with the module a bound method or partial belongs to (signature.py Rule 2).
_by_function: "weakref.WeakKeyDictionary[Any, dict[Any, Any]]" = weakref.WeakKeyDictionary()
_by_owner: "weakref.WeakKeyDictionary[Any, dict[Any, dict[Any, Any]]]" = (
    weakref.WeakKeyDictionary())
_MAX_SIGNATURES = 256  # per function; a cache that grows past it starts again

_RECORD = "record"  # entry: every call with this signature is recorded


def keeps_nothing(policy: Any) -> bool:
    """True for the policies of Rule 1 (``None`` is ``nothing_saveable``, as remat has it;
    a budget of nothing that may offload keeps something)."""
    return policy is None or (isinstance(policy, MemoryBudget) and policy.fraction == 0.0
                              and not policy.offload)


class Plan:
    """What one remat call does under Rules 1-2: ``unrecorded`` or record (and, for the
    first call of a signature, learn)."""

    __slots__ = ("cache", "key", "entry", "fun", "owners", "outside", "frames",
                 "ops_at_last_pack", "args", "kwargs")

    def __init__(self, cache: dict[Any, Any], key: Any, fun: Callable[..., Any],
                 owners: list[torch.nn.Module], args: tuple = (),
                 kwargs: dict[str, Any] | None = None) -> None:
        if key not in cache and len(cache) >= _MAX_SIGNATURES:
            cache.clear()
        self.cache = cache
        self.key = key
        self.fun = fun
        self.owners = owners  # modules the block is part of (where its outside tensors live)
        self.args = args  # the call's arguments: a first call watches their modules (4d)
        self.kwargs = kwargs
        self.entry = entry = cache.get(key)
        self.outside: tuple[Outside, Watched] | None = None
        if entry.__class__ is Unrecorded:
            self.outside = entry.current()
            if self.outside is None:  # Rule 4a: a place the first call read from is gone
                self.entry = None  # recorded, and what it shows replaces the entry
        self.frames = 0
        self.ops_at_last_pack = 0  # ops recorded when the last tensor was packed (Rule 2)

    @property
    def unrecorded(self) -> bool:
        return self.entry.__class__ is Unrecorded

    def start(self, frame: Frame) -> None:
        """The frame is made, the forward is about to run."""
        self.frames = tls.frames_made
        if self.entry.__class__ is Unrecorded:
            frame.rerun = _Rerun(*(self.outside or ([], [])))

    def recording_pack(self, tracer: Any) -> Callable[[torch.Tensor], Any]:
        """The pack hook of a recorded call: the tracer's, which a first call wraps to note
        how many ops a re-run would have run when it stops (Rule 2)."""
        inner = tracer.pack
        if self.entry is not None:
            return inner
        ops = tracer.seg.ops

        def pack(x: torch.Tensor) -> Any:
            packed = inner(x)
            self.ops_at_last_pack = len(ops)
            return packed
        return pack

    def finish(self, frame: Frame, tracer: Any) -> None:
        """The forward completed; ``tracer`` is its recorder (None if unrecorded)."""
        nested = tls.frames_made != self.frames
        if tracer is None:
            if nested:  # Rule 4c
                self.cache[self.key] = _RECORD
            return
        if self.entry is None:
            self.cache[self.key] = (_RECORD if nested else _learn(
                tracer, frame, self.ops_at_last_pack, modules_near(self.owners, self.fun),
                self.fun, (*self.args, *(self.kwargs or {}).values())))


def plan_for(fun: Callable[..., Any], policy: Any, always_record: bool, flat_fn: Any,
             tensors: Sequence[torch.Tensor], args: tuple, kwargs: dict,
             cache: dict[Any, Any] | None) -> Plan | None:
    """The plan of one remat call of ``fun``, or None where Rule 1 records it (without
    learning). ``flat_fn is fun`` for a call whose arguments are ``tensors``, positional;
    ``cache`` is the remat'd function's own (None: the one ``fun`` is found to have)."""
    if always_record or not keeps_nothing(policy):
        return None
    if tracer_stack.tracers or tracer_stack.report is not None or collectives.watch_needed():
        return None
    if cache is None:
        cache = per_function(fun, _by_function, _by_owner)
    key = flat_signature(tensors) if flat_fn is fun else signature(args, kwargs, tensors)
    owners = owners_of(fun, args)
    if owners:
        # A module's training flag often picks a branch (dropout, a generator of its own):
        # that of the module the block is, or is a method of, is part of the signature.
        key = (owners[0].training, key)
    return Plan(cache, key, fun, owners, args, kwargs)


def _learn(tracer: Any, frame: Frame, ops_at_last_pack: int,
           modules: list[torch.nn.Module], fun: Callable[..., Any],
           arguments: Sequence[Any] = ()) -> Any:
    """Rule 2: the entry a first call's recording earns its signature."""
    seg = tracer.seg
    if (not seg.replayable or seg.subclass or seg.collectives or tracer.dist is not None
            or frame.env.generators):
        return _RECORD
    # A re-run runs every op before its stop (all of them without early stop); the recorded
    # replay only those the saved tensors need: unrecorded only where the re-run computes no
    # more than that (bar views, which compute nothing: the weight's ``t`` a kept argument
    # needs is run again).
    holders = frame.holders
    wanted = [sv for pos, sv in seg.targets.items() if holders[pos]() is not None]
    needed = set(seg._plan(wanted, {}))
    ran = ops_at_last_pack if frame.early_stop else len(seg.ops)
    for i in range(ran):
        if i not in needed:
            info = op_info(seg.ops[i].func)
            if not info.view or info.writes or info.seeded:
                return _RECORD
    env = frame.env
    for keys in tracer.draws.draw_keys.values():
        for key in keys:
            if not (isinstance(key, tuple) and _restored(env, torch.device(key[1], key[2]))):
                return _RECORD
    # Rule 4a: a re-run reads outside tensors where it finds them when it runs; each must be
    # found somewhere a later call can check (closures and globals cannot be).
    places = places_of([t for t, _ in seg.outside.values()], modules)
    if places is None:
        return _RECORD
    # Rule 4d: modules among the arguments are the call's too (the signature holds them by
    # identity, so a later call with this entry has the same ones).
    watch = modules + [a for a in arguments if isinstance(a, torch.nn.Module)
                       and not any(a is m for m in modules)]
    return Unrecorded(places, watched_places(fun, watch, places))


def _restored(env: Any, device: torch.device) -> bool:
    """True if a replay of the frame with ``env`` restores the default generator of
    ``device`` (the CPU's, and the accelerator devices of the block's tensor arguments)."""
    if device.type in ("cpu", "meta"):
        return env.cpu_rng is not None
    return (device.type == env.device_type and device.index is not None
            and any(i == device.index for i, _ in env.device_rng))


class _Rerun:
    """The replay strategy of an unrecorded call (``Frame.rerun``; Rules 4a, 4b and 4d)."""

    __slots__ = ("outside", "watched")

    def __init__(self, outside: Outside, watched: Watched) -> None:
        self.outside = outside
        self.watched = watched

    def __call__(self, frame: Frame, tensors: Replay) -> None:
        swapped: list[tuple[dict[str, Any], str, Any]] = []
        try:
            for where, name, t, version in self.outside:
                check_outside(t, version)
                now = where.get(name, _ABSENT)
                if now is not t:  # the forward ran inside torch.func.functional_call, say:
                    swapped.append((where, name, now))  # the re-run reads what it read
                    where[name] = t
            with _DrawWatch(frame, reads_to_check(self.watched)):
                rerun_function(frame, tensors)
        finally:
            for where, name, now in reversed(swapped):
                if now is _ABSENT:
                    del where[name]
                else:
                    where[name] = now


_ABSENT = object()


class _DrawWatch(_compat.TorchDispatchMode):
    """Rule 4b: the re-run of an unrecorded call draws only what the frame restores. Rule
    4d: it reads no watched tensor that changed since the call's forward."""

    def __init__(self, frame: Frame,
                 reads: dict[int, tuple[torch.Tensor, int, str]] | None = None) -> None:
        super().__init__()
        self.frame = frame
        self.reads = reads  # by id; each entry is checked at its first read, then dropped

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # compiled code the block calls runs compiled, as in the forward

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if kwargs is None:
            kwargs = {}
        reads = self.reads
        if reads:
            # A watched tensor is alive (``reads`` holds it), so no other object has its id.
            for a in args:
                if id(a) in reads:
                    self._check_read(a)
                elif a.__class__ is list or a.__class__ is tuple:  # cat's, stack's tensors
                    for b in a:
                        if id(b) in reads:
                            self._check_read(b)
            if kwargs:
                for a in kwargs.values():
                    if id(a) in reads:
                        self._check_read(a)
        info = OP_INFO.get(func) or op_info(func)
        if info.seeded:
            self._check(func, args, kwargs)
        return func(*args, **kwargs)

    def _check_read(self, t: torch.Tensor) -> None:
        """Rule 4d, at the re-run's first read of a watched tensor."""
        assert self.reads is not None
        watched, version, label = self.reads.pop(id(t))
        if watched is not t or version == -1 or (version >= 0 and t._version == version):
            return
        name = getattr(self.frame.fn, "__qualname__", None) or type(self.frame.fn).__name__
        what = (f"was modified in place after this call's forward began (version {version} "
                f"then, {t._version} now: by code run before the backward, or by the block "
                "itself, whose write the re-run would repeat), so the re-run would read the "
                "new values" if version >= 0 else
                "was put there after this call's forward, in place of the tensor the "
                "forward found there (an assignment, or a torch.func.functional_call that "
                "has ended), so the re-run would read another tensor")
        raise CheckpointError(
            f"ckptfx.remat: the replay of {name} re-runs the block, which read {label} "
            f"({describe_value(t)}) from outside its arguments; that tensor {what}. The "
            "first call of this block with these argument shapes did not read it (a branch "
            "it did not take), so this call ran unrecorded and nothing kept what it read. "
            "Run the backward before changing the tensor (or change a clone), pass it to "
            "the block as an argument, or pass always_record=True to ckptfx.remat."
        )

    def _check(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        name = getattr(self.frame.fn, "__qualname__", None) or type(self.frame.fn).__name__
        if kwargs.get("generator") is not None or any(
                isinstance(a, torch.Generator) for a in args):
            raise CheckpointError(
                f"ckptfx.remat: the replay of {name} drew random numbers from an explicit "
                f"torch.Generator ({func}), which the first call of this block with these "
                "argument shapes did not. A block whose policy keeps nothing is recorded on "
                "its first call only; later calls run unrecorded and replay by re-running "
                "the function, and the generator's state at this call's forward was not "
                "kept, so the replay cannot draw the same numbers. Pass always_record=True "
                "to ckptfx.remat (use remat instead of checkpoint(policy=...)), or let the "
                "block's first call draw from that generator too."
            )
        device = kwargs.get("device")
        if device is None:
            device = next((a.device for a in args if isinstance(a, torch.Tensor)), "cpu")
        device = torch.device(device)
        if not _restored(self.frame.env, device):
            raise CheckpointError(
                f"ckptfx.remat: the replay of {name} drew random numbers on {device} "
                f"({func}), whose generator the frame does not restore (it restores the "
                "CPU's and those of the devices of the block's tensor arguments), and the "
                "first call of this block with these argument shapes drew none there: the "
                "replay cannot draw the same numbers. Pass always_record=True to "
                "ckptfx.remat, or pass a tensor on that device to the block."
            )
