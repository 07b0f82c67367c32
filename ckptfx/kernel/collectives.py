"""Collectives inside a checkpointed or remat'd block: kept, never replayed by default.

A replay that re-runs a collective (an all-reduce, an all-to-all) is a second collective
call on this rank only, unless every rank replays the same blocks in the same order: ranks
desynchronise or deadlock (VeOmni #979). So ckptfx keeps a collective's outputs from the
forward and hands them to the replay.

Rules

1. A *collective* is an op of the ``c10d``, ``_c10d_functional`` or ``c10d_functional``
   namespaces but ``_c10d_functional._wrap_tensor_autograd`` (a local op: it wraps a tensor
   into an ``AsyncCollectiveTensor``, and the replay runs it on the replayed tensor), or an
   op passed to ``ckptfx.register_collective``. (``_c10d_functional_autograd``'s ops reach
   the modes as the ``_c10d_functional`` ops they call.) FSDP2's own ops (those run
   inside FSDP's ``record_function("FSDP::...")`` scopes: its all-gathers, copies and views
   of unsharded parameters) are not the block's: they are run, never recorded or kept, and
   the unsharded parameters they fill are read by the block like any parameter.

2. remat: a collective's outputs are ``MUST_SAVE`` unless the policy answers
   ``CheckpointPolicy.MUST_RECOMPUTE`` for it. A replay plan that would run a kept collective
   (its kept value was rewritten in place after the forward) raises ``CheckpointError``.

3. checkpoint (and remat's fallback that re-runs the Python function): the forward runs under
   ``Recorder``, which logs each collective's outputs (references, their versions settled at
   the next op); the re-run runs under ``Replayer``, which answers each collective with the
   logged outputs (copying them into the buffers an in-place collective writes) instead of
   calling it. A replay that meets another collective than the forward did, or a logged
   output modified in place since, raises ``CheckpointError``. With ``torch.distributed`` not
   initialized and no op registered, no mode is pushed: single-process code pays nothing.

4. Collectives run inside a tensor subclass's own dispatch (DTensor's redistributions) are
   below any mode and are not seen: such blocks are replayed as torch would.
"""

from __future__ import annotations

import weakref
from typing import Any

import optree
import torch
from torch.utils.checkpoint import CheckpointPolicy

from ckptfx import _compat
from ckptfx._ops import op_info
from ckptfx.kernel.frame import NULL_CONTEXT as NULL
from ckptfx.kernel.frame import CheckpointError

__all__ = ["Recorder", "Replayer", "Watch", "is_collective", "register_collective",
           "replay_context", "watch_needed"]

_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional"})
_LOCAL = frozenset({"_wrap_tensor_autograd"})  # op names in those namespaces: no collective
_registered: set[Any] = set()
_KIND: dict[Any, bool] = {}
_RF_ENTER = getattr(getattr(torch.ops.profiler, "_record_function_enter_new", None), "default",
                    None)
_RF_EXIT = getattr(getattr(torch.ops.profiler, "_record_function_exit", None), "_RecordFunction",
                   None)
# frame -> its Log (frames have __slots__; a weak map keeps the kernel untouched)
_logs: "weakref.WeakKeyDictionary[Any, Log]" = weakref.WeakKeyDictionary()
# The map's own dict (a WeakKeyDictionary keeps the one it made), empty while no frame has a
# log: a replay tests it before calling replay_context (len() of the map runs Python)
logged: dict[Any, Any] = _logs.data  # type: ignore[attr-defined]


def register_collective(op: Any) -> None:
    """Treat ``op`` (an ``OpOverload`` or ``OpOverloadPacket``) as a collective: kept from the
    forward, never replayed by ``checkpoint`` or ``remat`` unless a policy says
    ``MUST_RECOMPUTE``.

    Example::

        ckptfx.register_collective(torch.ops.mylib.all_to_all)
    """
    if isinstance(op, torch._ops.OpOverloadPacket):
        for name in op.overloads():
            register_collective(getattr(op, name))
        return
    if not isinstance(op, torch._ops.OpOverload):
        raise TypeError(
            "register_collective: op must be a torch.ops OpOverload or OpOverloadPacket "
            f"(e.g. torch.ops.mylib.my_all_to_all), got {type(op).__name__}"
        )
    _registered.add(op)
    _KIND.pop(op, None)


def is_collective(func: Any) -> bool:
    kind = _KIND.get(func)
    if kind is None:
        kind = _KIND[func] = func in _registered or (
            getattr(func, "namespace", None) in _NAMESPACES
            and getattr(func, "_opname", None) not in _LOCAL)
    return kind


def watch_needed() -> bool:
    """Rule 3: a mode only where a collective can run."""
    return bool(_registered) or _compat.distributed_initialized()


def collective_decision(policy: Any, ctx: Any, func: Any, args: tuple, kwargs: dict) -> Any:
    """Rule 2: MUST_SAVE, unless the policy insists on recomputing."""
    if policy is not None:
        answer = policy(ctx, func, *args, **kwargs)
        if answer is CheckpointPolicy.MUST_RECOMPUTE:
            return False
    return CheckpointPolicy.MUST_SAVE


class Watch:
    """Tells FSDP's own ops apart (Rule 1) by the ``FSDP::`` record_function scopes."""

    __slots__ = ("scopes",)

    def __init__(self) -> None:
        self.scopes: list[Any] = []

    def outside(self, func: Any, args: tuple) -> bool:
        """True for an op the block must run but not record: FSDP's, or its scope marks."""
        if func is _RF_ENTER:
            name = args[0] if args else ""
            return bool(self.scopes) or (isinstance(name, str) and name.startswith("FSDP::"))
        if func is _RF_EXIT:
            return bool(self.scopes)
        return bool(self.scopes)

    def ran(self, func: Any, args: tuple, out: Any) -> None:
        """After an ``outside`` op ran: open or close an FSDP scope."""
        # Scopes nest: inside an FSDP scope every enter opens one and every exit closes one
        # (the exit's handle is a new Python wrapper, so it is not matched by identity).
        if func is _RF_ENTER:
            self.scopes.append(out)
        elif func is _RF_EXIT and self.scopes:
            self.scopes.pop()

    def run(self, func: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
        """Run an ``outside`` op, unrecorded, and track the scope it opens or closes."""
        out = func(*args, **kwargs)
        self.ran(func, args, out)
        return out


class _Own:
    """In a logged output: the op's k-th written buffer (the replay's own is returned)."""

    __slots__ = ("k",)

    def __init__(self, k: int) -> None:
        self.k = k


class _Entry:
    __slots__ = ("func", "out", "written", "positions", "versions")

    def __init__(self, func: Any, out: Any, written: list[torch.Tensor],
                 positions: list[int]) -> None:
        self.func = func
        self.out = out
        self.written = written
        self.positions = positions
        self.versions: list[int] | None = None


class Log:
    """The collectives one frame's forward ran, in order, with their outputs (Rule 3)."""

    __slots__ = ("entries", "pending")

    def __init__(self) -> None:
        self.entries: list[_Entry] = []
        self.pending: list[_Entry] = []

    def record(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        leaves, spec = optree.tree_flatten(out, none_is_leaf=True)
        positions = _written_positions(func, args, kwargs, leaves)
        arg_leaves = _arg_leaves(args, kwargs)
        written = [arg_leaves[i] for i in positions]
        kept = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                for k, w in enumerate(written):
                    if leaf is w:
                        leaf = _Own(k)  # the replay hands back its own buffer, refilled
                        break
                else:
                    leaf = _kept(leaf, func)
            kept.append(leaf)
        entry = _Entry(func, (spec, kept), [_kept(w, func) for w in written], positions)
        self.entries.append(entry)
        self.pending.append(entry)

    def settle(self) -> None:
        """Versions of what was logged, once the ops that wrote it have returned."""
        for entry in self.pending:
            entry.versions = [t._version for t in _tensors(entry)]
        self.pending = []


def _kept(t: torch.Tensor, func: Any) -> torch.Tensor:
    """What the log keeps of a tensor a collective returned or wrote: an unrecorded detach.
    That detach bypasses Python dispatch, so a tensor subclass with a ``__torch_dispatch__``
    of its own (a wrapper: ``AsyncCollectiveTensor``, DTensor) would come out without its
    data; such a tensor is refused in the forward instead."""
    if type(t).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__:
        raise CheckpointError(
            f"ckptfx: the collective {func} returned a tensor subclass ({type(t).__name__}), "
            "or wrote into one, which ckptfx cannot keep for the replay. Move the collective "
            "out of the checkpointed block, or checkpoint the code around it"
        )
    return _compat.detach_unrecorded(t)


def _tensors(entry: _Entry) -> list[torch.Tensor]:
    return [*entry.written, *(t for t in entry.out[1] if isinstance(t, torch.Tensor))]


def _arg_leaves(args: tuple, kwargs: dict) -> list[Any]:
    return optree.tree_leaves((args, kwargs), none_is_leaf=True)


def _written_positions(func: Any, args: tuple, kwargs: dict, out_leaves: list[Any]) -> list[int]:
    """Where, among the flattened arguments, the tensors the op writes are: those its schema
    marks written, and those it returns (c10d's in-place ops return their buffers; their
    list arguments carry no alias annotation)."""
    ids = {id(t) for t in out_leaves if isinstance(t, torch.Tensor)}
    for i, name in op_info(func).writes:
        v = args[i] if i < len(args) else kwargs.get(name)
        for t in (v if isinstance(v, (list, tuple)) else (v,)):
            if isinstance(t, torch.Tensor):
                ids.add(id(t))
    return [i for i, a in enumerate(_arg_leaves(args, kwargs))
            if isinstance(a, torch.Tensor) and id(a) in ids]


def log_for(frame: Any) -> Log:
    log = _logs.get(frame)
    if log is None:
        log = _logs[frame] = Log()
    return log


class Recorder(_compat.TorchDispatchMode):
    """A checkpoint forward's mode: log the block's collectives (Rule 3)."""

    def __init__(self, frame: Any) -> None:
        super().__init__()
        self.frame = frame
        self.watch = Watch()
        self.log: Log | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        log = self.log
        if log is not None and log.pending:
            log.settle()
        watch = self.watch
        if watch.outside(func, args):
            return watch.run(func, args, kwargs)
        out = func(*args, **kwargs)
        if is_collective(func):
            if log is None:
                log = self.log = log_for(self.frame)
            log.record(func, args, kwargs, out)
        return out

    def __exit__(self, *exc: Any) -> None:
        if self.log is not None:
            self.log.settle()
        return super().__exit__(*exc)


class Replayer(_compat.TorchDispatchMode):
    """A re-run's mode: answer each collective from the log (Rule 3)."""

    def __init__(self, log: Log, frame: Any) -> None:
        super().__init__()
        self.log = log
        self.next = 0
        self.watch = Watch()
        self.frame = frame

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        watch = self.watch
        if watch.outside(func, args):
            return watch.run(func, args, kwargs)
        if not is_collective(func):
            return func(*args, **kwargs)
        entries = self.log.entries
        k = self.next
        if k >= len(entries) or entries[k].func is not func:
            ran = entries[k].func if k < len(entries) else "nothing more"
            raise CheckpointError(
                f"ckptfx: the replay of {self.frame!r} called the collective {func} where the "
                f"forward called {ran} (collective #{k}); a block must call the same "
                "collectives on every run. Make the block's collectives unconditional, or "
                "move them out of the checkpointed block"
            )
        entry = entries[k]
        self.next = k + 1
        if entry.versions is not None and [t._version for t in _tensors(entry)] != entry.versions:
            raise CheckpointError(
                f"ckptfx: the output of the collective {func} in {self.frame!r} was modified "
                "in place after the forward; the replay cannot hand it out. Clone the "
                "collective's output before modifying it"
            )
        arg_leaves = _arg_leaves(args, kwargs)
        now = [arg_leaves[i] for i in entry.positions]
        for dst, src in zip(now, entry.written):
            dst.copy_(src)
        spec, kept = entry.out
        leaves = [now[v.k] if isinstance(v, _Own) else v for v in kept]
        return optree.tree_unflatten(spec, leaves)


def forward_context(frame: Any) -> Any:
    """A checkpoint forward: record its collectives where one can run (Rule 3)."""
    return Recorder(frame) if watch_needed() else NULL


def replay_context(frame: Any) -> Any:
    """A re-run of ``frame``'s function: the forward's collectives answered from its log."""
    log = _logs.get(frame) if logged else None
    if log is None or not log.entries:
        return NULL
    return Replayer(log, frame)


