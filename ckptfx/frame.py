"""Frames and holders: the checkpoint kernel.

Rules (the invariants the code below keeps; read these before changing it)

1. A ``Frame`` is one forward call of a checkpointed block. Every tensor autograd saves
   inside the block is packed into a ``Holder`` (frame + position); the tensor itself is
   dropped. The frame keeps the block's inputs (as saved tensors, so an inner checkpoint's
   inputs are saved tensors of its parent), the replay environment and a weak reference
   to each holder. Holders keep the frame alive; nothing keeps a holder alive but the graph,
   so a freed graph frees the frame and everything it cached.

2. Unpacking a holder looks up the frame's replay for a *key* and hands out the tensor at
   the holder's position. The key is the session of the activation the control plane bound
   to the frame (``frame.active``), else torch's GraphExecGroup, else the GraphTask id.
   Outside backward (id -1) the replay is made for that one unpack and dropped.

3. A replay is made at most once per key: the first unpack under a key replays the block and
   fills a list with every tensor whose holder is still alive. Under a GraphTask key each
   tensor is handed out once and dropped (a second unpack is an error, as in torch). Under a
   session key the activation decides: ``retain`` keeps it for later consumers.

4. The unpack hook is the hot path. It reads attributes and one or two of torch's thread
   state getters; it takes no lock and reads no ContextVar or registry. Everything else
   (discovering a session, replaying, errors) is on the slow path, once per frame and key.

5. A replay runs as the forward ran (``ReplayEnv``: RNG, autocast, device context), starts as
   if no checkpoint were active (a nested checkpoint met during replay makes a new frame,
   as in torch), and is checked against the forward: the same number of saved tensors, and
   by default the same shape, dtype and device for each. A mismatch is a ``CheckpointError``;
   a replay never hands out a tensor it cannot vouch for.

6. Early stop ends the replay once the last saved tensor exists, but never before an op
   that saved it has finished writing it: an op may save a buffer and fill it afterwards
   (``rrelu_with_noise`` does). Two ways, both exact:
   - blocks whose forward took at least ``PRECISE_STOP_SECONDS`` replay under a dispatch mode
     that sees each op after autograd packed its inputs: once everything is packed, an op
     that writes none of its arguments is skipped (as torch stops), one that writes runs
     first;
   - smaller blocks, where a dispatch mode's per-op cost would outweigh the op it saves, arm
     a torch-function mode at the last pack that fires at the block's next torch call,
     necessarily after the op that packed returned;
   - blocks whose forward ran for less than ``EARLY_STOP_MIN_TAIL_SECONDS`` after the last
     pack do not stop early: stopping would cost more than the tail it skips.

7. How a frame replays is a strategy (``Frame.rerun``): re-running the Python function here,
   a recorded segment in ``remat``. Strategies fill the same list; keys, caching, handing out
   and checks are the frame's.

8. The generator state a replay restores is process-global, so replays that restore it run
   one at a time (``_rng_lock``, re-entrant for nested replays on one thread). Two threads
   replaying dropout blocks at once would otherwise draw each other's random numbers. (A
   block that runs a backward inside itself on an accelerator may wait on an autograd device
   thread that needs this lock: pass ``preserve_rng_state=False`` for such a block.)
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from typing import Any, Callable, Hashable

import torch
import torch.utils.checkpoint as _torch_checkpoint
from torch.overrides import TorchFunctionMode

from . import _compat
from ._env import ReplayEnv
from ._ops import op_info

__all__ = ["CheckpointError", "Frame", "Holder", "unpack_hook", "tls"]


class CheckpointError(_torch_checkpoint.CheckpointError):
    """A checkpointed block could not be replayed faithfully, or was used in a way ckptfx
    cannot support. Subclass of ``torch.utils.checkpoint.CheckpointError``."""


DEBUG_TIP = (
    "Tip: pass debug=True to ckptfx.checkpoint to see the ops of the forward and of the "
    "replay side by side."
)

# Thread state read on the slow path only:
#   activation        the session context opened on this thread (see session.py)
#   scheduled_replay  True while this thread replays a frame for a session
class _ThreadState(threading.local):
    activation: Any = None
    scheduled_replay: bool = False


tls = _ThreadState()


def refuse_new_frame_in_scheduled_replay(what: str) -> None:
    """A frame created while a block is replayed for a session is not supported (yet)."""
    if tls.scheduled_replay:
        raise CheckpointError(
            f"ckptfx: {what} was created while a block was being replayed for a recompute "
            "session (prefire or session backward). Nested blocks replayed by re-running "
            "their function are not supported under scheduled recomputation in this version: "
            "checkpoint the outer block only (a remat'd outer block replays its recorded ops "
            "and has no such limit), or run this backward without a session."
        )


class _Stop(Exception):
    """Raised inside the block to end a replay early (Rule 6)."""


class _StopAtNextCall(TorchFunctionMode):
    # Pushed at the last pack; the next torch call the block makes ends the replay. Calls
    # made inside an op by a dispatch mode's handler (which runs with that mode popped) are
    # part of the op still running and pass through.
    def __init__(self) -> None:
        super().__init__()
        self.depth = _compat.dispatch_mode_depth()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # Attribute access computes nothing and passes too: an in-place op whose saved
        # inputs were just packed (mul_ by a tensor saves self first) sets _backward_hooks
        # through the Python setter from C++, where a raise becomes a SystemError.
        if (_compat.dispatch_mode_depth() < self.depth
                or getattr(func, "__name__", None) in _ATTRIBUTE_ACCESS):
            return func(*args, **(kwargs or {}))
        raise _Stop


_ATTRIBUTE_ACCESS = frozenset({"__get__", "__set__", "__delete__"})


class _StopBeforeOp(_compat.TorchDispatchMode):
    # Active during a whole replay of a large block (Rule 6): once every saved tensor is
    # packed, end the replay before the op at hand, or right after it if it writes in place.
    def __init__(self, rec: "_Recorder") -> None:
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        rec = self.rec
        if rec.count < rec.stop_at:
            return func(*args, **(kwargs or {}))
        if op_info(func).writes:
            func(*args, **(kwargs or {}))
        raise _Stop


# Forward time above which a replay uses the precise stop (Rule 6); a dispatch mode costs a
# few microseconds per op, the op it skips costs about a block's forward over its op count.
PRECISE_STOP_SECONDS = 2e-3
# Stopping early costs ~10 us (a mode, an exception through the block); when the forward ran
# for less than this after its last saved tensor, the replay runs to the end instead.
EARLY_STOP_MIN_TAIL_SECONDS = 15e-6


class Holder:
    """What autograd stores in place of a saved tensor: its frame and its position."""

    __slots__ = ("frame", "index", "__weakref__")

    def __init__(self, frame: "Frame", index: int) -> None:
        self.frame = frame
        self.index = index


_rng_lock = threading.RLock()  # Rule 8

Replay = list  # position -> replayed tensor, None once handed out (or if its holder died)


class Frame:
    """One forward call of a checkpointed block (see the Rules above)."""

    __slots__ = (
        "fn", "inputs", "kwargs", "env", "rerun", "holders", "metas", "early_stop",
        "recompute_ctx", "debug", "replays", "active", "session",
        "forward_done", "ignore_count", "shared", "forward_seconds", "tail_seconds",
        "last_pack", "__weakref__",
    )

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        preserve_rng_state: bool = True,
        determinism_check: str = "default",
        early_stop: bool = True,
        recompute_ctx: Any = None,
        debug: Any = None,
    ) -> None:
        self.fn = fn
        # Saved under the hooks active now: the parent frame's, when nested.
        self.inputs = [
            _compat.make_saved_tensor(a, is_output=False) if isinstance(a, torch.Tensor) else a
            for a in args
        ]
        self.kwargs = kwargs
        self.env = ReplayEnv(
            (*args, *kwargs.values()) if kwargs else args, preserve_rng_state
        )
        self.rerun: Callable[[Frame, Replay], None] = rerun_function
        self.holders: list[weakref.ref[Holder]] = []
        self.metas: list[tuple[Any, ...]] | None = [] if determinism_check == "default" else None
        self.early_stop = early_stop
        self.recompute_ctx = recompute_ctx
        self.debug = debug
        self.replays: dict[Hashable, Replay | None] = {}
        self.active: Any = None  # bound by session.py; read by unpack_hook
        self.session: Any = None  # the one session registered on this frame, if any
        self.forward_done = False
        self.forward_seconds = 0.0  # set by the caller after the forward (Rule 6)
        self.last_pack = 0.0  # perf_counter() at the last pack of the forward
        self.tail_seconds = float("inf")  # forward time after the last pack (Rule 6)
        self.ignore_count = False
        # Positions whose replayed tensor aliases an input or a parameter (costs no memory),
        # found by the first function replay (None until then); read by session stats.
        self.shared: frozenset[int] | None = None

    # -- forward ---------------------------------------------------------------------------

    def pack(self, x: torch.Tensor) -> Holder:
        holder = Holder(self, len(self.holders))
        self.holders.append(weakref.ref(holder))
        if self.metas is not None:
            self.metas.append((x.shape, x.dtype, x.device))
        self.last_pack = time.perf_counter()
        return holder

    def forward_finished(self, start: float) -> None:
        """Record the forward's duration and its tail after the last pack (Rule 6)."""
        end = time.perf_counter()
        self.forward_seconds = end - start
        if self.last_pack:
            self.tail_seconds = end - self.last_pack
        self.forward_done = True

    def saved_inputs(self) -> list[Any]:
        return [a.unpack() if isinstance(a, _compat.SavedTensor) else a for a in self.inputs]

    # -- backward --------------------------------------------------------------------------

    def replay(self, key: Hashable, *, store: bool = True, scheduled: bool = False) -> Replay:
        """Replay the block for ``key`` and return its tensors (Rules 3 and 5)."""
        tensors: Replay = [None] * len(self.holders)
        outer = tls.scheduled_replay
        tls.scheduled_replay = scheduled
        env = self.env
        lock = _rng_lock if env.cpu_rng is not None or env.device_rng or env.generators else None
        try:
            if lock is None:
                self.rerun(self, tensors)
            else:
                with lock:
                    self.rerun(self, tensors)
        except CheckpointError as err:
            if self.debug is not None:
                self.debug.raise_with_logs(err)
            raise
        finally:
            tls.scheduled_replay = outer
        if store:
            self.replays[key] = tensors
        return tensors

    def unpack_slow(self, holder: Holder) -> torch.Tensor:
        """Everything the hot path does not do: session discovery, replay, errors."""
        act = self.active
        if act is None and tls.activation is not None:
            act = tls.activation.adopt(self)
        if act is not None:
            replay = self.replays.get(act.session)
            if replay is None:
                replay = self.replay(act.session, scheduled=True)
            t = _take(replay, holder.index, act.retain, act)
            if act.retain and act.log is not None:
                act.log.append((holder, _compat.current_autograd_node()))
            return t
        key = _compat.get_graph_exec_group()
        if key is None:
            key = _compat.current_graph_task_id()
            if key == -1:  # outside backward: a replay for this one unpack
                return self.replay(None, store=False)[holder.index]
        replay = self.replays.get(key)
        if replay is None:
            replay = self.replay(key)
        return _take(replay, holder.index, False, None)

    def __repr__(self) -> str:
        name = getattr(self.fn, "__qualname__", None) or type(self.fn).__name__
        return f"<ckptfx Frame of {name}: {len(self.holders)} saved tensors>"


def unpack_hook(holder: Holder) -> torch.Tensor:
    """The saved-tensor unpack hook of every frame: the hot path (Rule 4)."""
    frame = holder.frame
    act = frame.active
    if act is not None:
        replay = frame.replays.get(act.session)
        if replay is not None:
            t = replay[holder.index]
            if t is not None:
                if not act.retain:
                    replay[holder.index] = None
                elif act.log is not None:
                    act.log.append((holder, _compat.current_autograd_node()))
                return t
    else:
        key = _compat.get_graph_exec_group()
        replay = frame.replays.get(_compat.current_graph_task_id() if key is None else key)
        if replay is not None:
            t = replay[holder.index]
            if t is not None:
                replay[holder.index] = None
                return t
    return frame.unpack_slow(holder)


def _take(replay: Replay, index: int, retain: bool, act: Any) -> torch.Tensor:
    t = replay[index]
    if t is None:
        if act is None:
            raise CheckpointError(
                "ckptfx.checkpoint: a saved tensor is being unpacked a second time in the same "
                "backward call. Each replayed tensor is handed out once per backward; if a custom "
                "autograd.Function reads ctx.saved_tensors twice, read it once."
            )
        raise CheckpointError(
            f"ckptfx: saved tensor {index} of this block was already handed out and dropped by "
            f"recompute session {act.session.id!r} (a consumer ran with retain_on_unpack=False). "
            "Use retain_on_unpack=True for every backward call except the last one of the session."
        )
    if not retain:
        replay[index] = None
    return t


# -- the default replay strategy: run the Python function again --------------------------


class _Recorder:
    """Pack hook of a replay: files each saved tensor at its position and checks it."""

    __slots__ = ("frame", "tensors", "count", "stop_at", "fn_modes", "stopper", "probe",
                 "input_ids", "precise")

    def __init__(self, frame: Frame, tensors: Replay, inputs: list[Any]) -> None:
        self.frame = frame
        self.tensors = tensors
        self.count = 0
        n = len(tensors)
        self.stop_at = (n if frame.early_stop and n
                        and frame.tail_seconds >= EARLY_STOP_MIN_TAIL_SECONDS else -1)
        self.precise = self.stop_at > 0 and frame.forward_seconds >= PRECISE_STOP_SECONDS
        self.fn_modes = 0
        self.stopper: _StopAtNextCall | None = None
        # First session replay of the frame: note which saved tensors alias inputs or
        # parameters (for recompute_session_stats; native replays need not know).
        self.probe: list[int] | None = (
            [] if frame.shared is None and tls.scheduled_replay else None)
        self.input_ids = {id(a) for a in inputs} if self.probe is not None else set()

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        frame = self.frame
        i = self.count
        probe = self.probe
        if probe is not None and _aliases_input_or_leaf(x, self.input_ids):
            probe.append(i)
        if x.requires_grad:
            x = x.detach()  # before the count moves on: the precise stop sees this detach
        self.count = i + 1
        if i >= len(self.tensors):
            if not frame.forward_done:
                # Backward inside the block during its own forward: the replay may see more
                # than the forward had saved when it was triggered (torch's Rule 6).
                frame.ignore_count = True
                return x
            raise CheckpointError(
                "ckptfx.checkpoint: the replay saved more tensors than the original forward "
                f"({len(frame.holders)}). The block must run the same ops when replayed.\n"
                + DEBUG_TIP
            )
        if frame.holders[i]() is not None:
            self.tensors[i] = x
        metas = frame.metas
        if metas is not None:
            shape, dtype, device = metas[i]
            if x.dtype != dtype or x.shape != shape or x.device != device:
                raise CheckpointError(
                    "ckptfx.checkpoint: the replay saved a tensor with different metadata than "
                    f"the original forward.\ntensor at position {i}:\n"
                    f"  forward:  shape={tuple(metas[i][0])} dtype={metas[i][1]} "
                    f"device={metas[i][2]}\n"
                    f"  replay:   shape={tuple(x.shape)} dtype={x.dtype} device={x.device}\n"
                    + DEBUG_TIP
                )
        if (self.count == self.stop_at and not self.precise
                and _compat.torch_function_depth() == self.fn_modes):
            self.stopper = _StopAtNextCall()
            self.stopper.__enter__()
        return x

    def disarm(self) -> None:
        stopper, self.stopper = self.stopper, None
        if stopper is not None and _compat.torch_function_depth() == self.fn_modes + 1:
            stopper.__exit__(None, None, None)


def _identity(x: Any) -> Any:
    return x


def _aliases_input_or_leaf(x: torch.Tensor, input_ids: set[int]) -> bool:
    if id(x) in input_ids:
        return True
    base = x._base
    if base is None:
        return x.requires_grad and x.grad_fn is None
    return id(base) in input_ids or (base.requires_grad and base.grad_fn is None)


def rerun_function(frame: Frame, tensors: Replay) -> None:
    """Replay strategy: run the block's Python function again under a recording hook."""
    args = frame.saved_inputs()
    rec = _Recorder(frame, tensors, args)
    ctx = frame.recompute_ctx if frame.recompute_ctx is not None else contextlib.nullcontext()
    _compat.push_saved_tensors_hooks(rec.pack, _identity)
    try:
        with torch.enable_grad(), frame.env.restored(), ctx:
            rec.fn_modes = _compat.torch_function_depth()
            try:
                if rec.precise:
                    with _StopBeforeOp(rec):
                        frame.fn(*args, **frame.kwargs)
                else:
                    frame.fn(*args, **frame.kwargs)
            except _Stop:
                pass
            finally:
                rec.disarm()
    finally:
        _compat.pop_saved_tensors_hooks()
    if rec.probe is not None:
        frame.shared = frozenset(rec.probe)
    if not frame.ignore_count and frame.forward_done and rec.count != len(tensors):
        raise CheckpointError(
            "ckptfx.checkpoint: a different number of tensors was saved during the original "
            f"forward ({len(tensors)}) and the replay ({rec.count}). The block must run the "
            "same ops when replayed.\n" + DEBUG_TIP
        )
