"""Scheduled recomputation: the control plane over the frames (the handles a forward's frames
are listed by, for a scheduler to prefire, are ``ckptfx.kernel.handles``'s).

Rules

1. A *session* is a key the scheduler chooses (any hashable but None), typically one per
   micro-batch and stage. Under a session every frame is replayed at most once, however many
   backward calls (dx, one dw per parameter group) read it; the replay is cached on the frame
   under the session until the last consumer takes it or the session is cleared.

2. A frame is *registered* to at most one session at a time (``frame.session``): by a prefire
   (``recompute_handle``), or when a backward started inside ``recompute_session_ctx`` first
   unpacks it (lazy discovery), on the caller's thread or on one of autograd's device threads:
   the context puts its activation in ``frame.tls`` for this thread and in the state autograd
   carries into a backward's threads (``_compat.carry``) for the others. A thread of the
   user's own that runs a backward sees neither: prefire or register the handles for it. A
   second session on the same frame is an error until the first is cleared.

3. ``recompute_session_ctx`` *binds* an ``Activation`` (session + retain flag) to every frame of
   the session (``frame.active``) and unbinds on exit. The unpack hook reads only that
   attribute, so the backward finds the session on any thread, including autograd's device
   threads that never saw the caller's context. Frames discovered lazily are bound when found.
   A replay made for a session is kept on the frame here (``_keep_replay``), under the
   lock, and only while the frame is still registered to that session. Whenever a frame's
   binding or its session replay changes, ``_sync_reads`` brings the frame's ``reads`` dict
   (frame.py Rule 4b) in line: the replay's tensors while the bound activation retains and
   logs nothing, empty otherwise.

4. Register, bind, unbind and clear happen under one ``RLock``; the unpack hook never takes it.

5. Nothing here keeps memory alive on its own. The registry holds sessions weakly; a frame holds
   its session. A session never cleared disappears with its frames (when their graph is freed);
   ``clear_recompute_session`` drops every cached tensor, binding and registration at once, is
   idempotent, and ignores unknown ids.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref
from typing import Any, Callable, Hashable

import torch

from ckptfx import _compat
from ckptfx.kernel.frame import SESSION_KEY, CheckpointError, Frame, tls
from ckptfx.kernel.fsdp import before_prefire
from ckptfx.kernel.handles import (
    RecomputeHandle,
    recompute_handle_collector_ctx,
    used_twice,
)

__all__ = [
    "RecomputeHandle",
    "SessionStats",
    "clear_recompute_session",
    "recompute_handle",
    "recompute_handle_collector_ctx",
    "recompute_session_ctx",
    "recompute_session_stats",
]

_lock = threading.RLock()
_registry: "weakref.WeakValueDictionary[Hashable, Session]" = weakref.WeakValueDictionary()
# Called with the id at every clear_recompute_session, whether the id has frames or not
# (``on_clear``).
_clear_listeners: list[Callable[[Hashable], None]] = []


class Session:
    """The frames of one session id (held weakly) and whether it has been cleared."""

    __slots__ = ("id", "frames", "cleared", "act", "contexts", "__weakref__")

    def __init__(self, session_id: Hashable) -> None:
        self.id = session_id
        self.frames: weakref.WeakSet[Frame] = weakref.WeakSet()
        self.cleared = False
        # The activation of the recompute_session_ctx open for this session now, if any, so
        # that a frame prefired inside the context is bound at once (Rule 3): worker threads
        # cannot discover it lazily.
        self.act: "Activation | None" = None
        # How many recompute_session_ctx are open on it (any thread): the last to close drops
        # the session if it got no frames, so nothing empty stays listed (Rule 5).
        self.contexts = 0

    def __repr__(self) -> str:
        return f"<ckptfx Session {self.id!r}: {len(self.frames)} frames>"


class Activation:
    """What ``recompute_session_ctx`` binds to a frame: the session and the retain flag."""

    __slots__ = ("session", "retain", "log", "drop_unless")

    def __init__(self, session: Session, retain: bool) -> None:
        self.session = session
        self.retain = retain
        # Set by the split transforms during a dx pass (retain only): the unpack hook appends
        # (holder, autograd node) so the weight pass can keep just what it reads.
        self.log: list | None = None
        # With the log, optionally the nodes the weight pass will execute: a replayed tensor
        # that a torch node outside them reads is dropped at that read, not when dx ends,
        # so dx frees it as a fused backward would (``ckptfx.split.passes`` Rule 4).
        self.drop_unless: set | None = None

    def record(self, log: list, drop_unless: set | None = None) -> None:
        """Log the reads of this (retaining) activation from now on: the split's dx pass.
        The frames it binds leave the dict fast path (frame.py Rule 4b), which logs nothing."""
        with _lock:
            self.log, self.drop_unless = log, drop_unless
            for frame in _frames_of(self.session):
                if frame.active is self:
                    _sync_reads(frame)  # empties it: this activation logs now

    def keep(self, frame: Frame, replay: list) -> list:
        """A frame bound to this activation was just replayed for its session: keep the
        replay (``_keep_replay``) and return the one the session reads."""
        return _keep_replay(frame, self.session, replay)

    def adopt(self, frame: Frame) -> "Activation | None":
        """Lazy discovery (Rule 2): register and bind a frame first unpacked in this context."""
        with _lock:
            # A stale copy (thread state copied by torch.jit.fork, say, read after the context
            # closed) registers nothing.
            if self.session.cleared or self.session.act is not self:
                return None
            _register(frame, self.session)
            _bind(frame, self)
        return self


@dataclasses.dataclass(frozen=True)
class SessionStats:
    """What one live session holds: ``frames`` registered, ``replayed`` of them replayed,
    ``tensors`` cached replayed tensors and their ``nbytes`` (shared storages counted once).

    Example::

        stats = ckptfx.recompute_session_stats()[("stage0", 3)]
        print(stats.replayed, "of", stats.frames, "blocks replayed,", stats.nbytes, "bytes")
    """

    session_id: Hashable
    frames: int
    replayed: int
    tensors: int
    nbytes: int


# -- sessions -------------------------------------------------------------------------------


def check_session_id(session_id: Any, what: str = "session_id") -> None:
    """A ``ValueError`` naming ``what`` unless ``session_id`` can key a recompute session:
    hashable, not None, and holding no tensor (a tensor hashes by its identity, so two
    ``torch.tensor(0)`` would name two sessions, and a later clear could not name either)."""
    if type(session_id) is int or type(session_id) is str:  # the common keys, at once
        return
    expected = f"{what} must be a hashable key (an int, str or tuple)"
    if session_id is None:
        raise ValueError(f"{expected}, got None")
    if _holds_tensor(session_id):
        got = "a tensor" if isinstance(session_id, torch.Tensor) else "a tuple holding a tensor"
        raise ValueError(
            f"{expected}, got {got}: a tensor hashes by identity, so two equal tensors name "
            "two sessions; pass int(t) (or t.item()) instead"
        )
    try:
        hash(session_id)
    except TypeError:
        raise ValueError(f"{expected}, got {_unhashable_part(session_id)}") from None


def _holds_tensor(key: Any) -> bool:
    if isinstance(key, torch.Tensor):
        return True
    return isinstance(key, tuple) and any(_holds_tensor(k) for k in key)


def _unhashable_part(key: Any) -> str:
    """``an unhashable list``, or for a tuple the element that is: ``a tuple holding an
    unhashable list``."""
    if isinstance(key, tuple):
        for k in key:
            try:
                hash(k)
            except TypeError:
                return f"a tuple holding {_unhashable_part(k)}"
    return f"an unhashable {type(key).__name__}"


def _session(session_id: Hashable) -> Session:
    session = _registry.get(session_id)
    if session is None:
        session = Session(session_id)
        _registry[session_id] = session
    return session


def _register(frame: Frame, session: Session) -> None:
    current = frame.session
    if current is session:
        return
    if current is not None:
        raise CheckpointError(
            f"ckptfx: {frame!r} is registered to recompute session {current.id!r} and cannot "
            f"be used by session {session.id!r} at the same time. Call "
            f"ckptfx.clear_recompute_session({current.id!r}) when its backward is done."
        )
    frame.session = session
    session.frames.add(frame)


def _frames_of(session: Session) -> list[Frame]:
    """``list(session.frames)``, from a snapshot of the WeakSet's references (copying a set
    runs no Python code, so no frame can die halfway), at a fifth of its iterator's cost:
    each backward call of a split step binds and unbinds every frame of its session."""
    frames = []
    # WeakSet keeps its references in .data (CPython's weakref module, every version)
    refs: set[weakref.ref[Frame]] = session.frames.data  # type: ignore[attr-defined]
    for ref in list(refs):
        frame = ref()
        if frame is not None:
            frames.append(frame)
    return frames


def _bind(frame: Frame, act: Activation) -> None:
    current = frame.active
    if current is not None and current.session is not act.session:
        raise CheckpointError(
            f"ckptfx: {frame!r} is bound to recompute session {current.session.id!r} and "
            f"session {act.session.id!r} tried to bind it at the same time. One frame serves "
            "one session at a time: finish (and clear) the first before opening the second."
        )
    frame.active = act
    _sync_reads(frame)


def _keep_replay(frame: Frame, session: Session, replay: list) -> list:
    """Cache ``replay`` as ``frame``'s session replay if the frame is still registered to
    ``session`` (a clear may have come while it replayed: then nothing keeps it, and it
    serves the read at hand only), and bring ``reads`` in line. Returns the replay the
    session reads: the first one kept, if two threads replayed the frame at once."""
    with _lock:
        if frame.session is session:
            if frame.session_replay is None:
                frame.session_replay = replay
            else:
                replay = frame.session_replay
            _sync_reads(frame)
    return replay


def _sync_reads(frame: Frame) -> None:
    """Rule 3: the frame's ``reads`` (frame.py Rule 4b) after its binding or replay changed.
    Called under ``_lock``."""
    act = frame.active
    if act is not None and act.retain and act.log is None and frame.session_replay is not None:
        frame.fill_reads()
    elif frame.reads:
        frame.reads.clear()


def recompute_session_ctx(session_id: Hashable,
                          retain_on_unpack: bool = False) -> _SessionContext:
    """Run backward calls of one session: every frame they read is replayed once for it.

    Inside the block, backward calls that unpack tensors of the session's frames use the
    session's cache: frames prefired with ``recompute_handle`` hand out their replay; frames
    not prefired are replayed at their first unpack and registered to the session (this lazy
    discovery happens on this thread and autograd's worker threads; to run the backward from
    another thread of your own, prefire or register the handles first).

    Args:
        session_id: any hashable key but None or a tensor (which hashes by identity), e.g.
            ``(stage, microbatch)`` of ints.
        retain_on_unpack: keep each replayed tensor after handing it out, for later backward
            calls of the same session (dx, and every dw group but the last). False (default)
            hands it out and drops it: use it for the last consumer.

    Sessions do not nest on one thread, nor inside the backward of a session on the device
    thread that runs it (a hook, a custom backward): opening one inside another raises
    ``CheckpointError`` and leaves neither behind. A context that ends with no frame
    registered to its session (its body raised first, or read no checkpointed block) leaves
    no session behind either. Always finish with ``clear_recompute_session`` in a
    ``finally``.

    Example (zero-bubble split of one micro-batch)::

        with ckptfx.recompute_handle_collector_ctx() as handles:
            out = stage(x)
        try:
            for h in handles:
                ckptfx.recompute_handle(h, sid)              # prefire: replay now
            with ckptfx.recompute_session_ctx(sid, retain_on_unpack=True):
                dx = torch.autograd.grad(out, x, g, retain_graph=True)
            with ckptfx.recompute_session_ctx(sid, retain_on_unpack=False):
                dw = torch.autograd.grad(out, params, g)
        finally:
            ckptfx.clear_recompute_session(sid)
    """
    return _SessionContext(session_id, retain_on_unpack)


class _SessionContext(contextlib.ContextDecorator):
    """``recompute_session_ctx``'s context manager (a class: one per backward call of a split
    step, where a generator-based one costs more than the rest of it). Single use; as a
    decorator, a new one per call. The arguments are checked on entry."""

    __slots__ = ("session_id", "retain", "entered", "session", "act")

    def __init__(self, session_id: Hashable, retain_on_unpack: bool) -> None:
        self.session_id = session_id
        self.retain = retain_on_unpack
        self.entered = False

    def _recreate_cm(self) -> _SessionContext:
        return _SessionContext(self.session_id, self.retain)

    def __enter__(self) -> None:
        if self.entered:
            raise used_twice("recompute_session_ctx")
        self.entered = True
        session_id, retain_on_unpack = self.session_id, self.retain
        check_session_id(session_id)
        if not isinstance(retain_on_unpack, bool):
            raise ValueError(
                f"retain_on_unpack must be a bool, got {type(retain_on_unpack).__name__}"
            )
        # This thread's own context, or the one whose backward it runs (a hook or a custom
        # Function's backward on a device thread): either way a session is open here.
        outer = tls.activation or _compat.carried(SESSION_KEY)
        if outer is not None:
            raise CheckpointError(
                f"ckptfx: recompute_session_ctx({session_id!r}) opened inside "
                f"recompute_session_ctx({outer.session.id!r}) on the same thread; session "
                "contexts do not nest. Close the first before opening the next."
            )
        with _lock:
            session = _session(session_id)
            act = Activation(session, retain_on_unpack)
            try:
                for frame in _frames_of(session):
                    _bind(frame, act)
                _compat.carry(SESSION_KEY, act)  # for autograd's device threads (Rule 2)
            except BaseException:
                _unbind(session, act)
                _drop_if_empty(session)
                raise
            session.act = act
            session.contexts += 1
        self.session, self.act = session, act
        tls.activation = act

    def __exit__(self, *exc: Any) -> None:
        session, act = self.session, self.act
        tls.activation = None
        _compat.uncarry(SESSION_KEY)
        with _lock:
            if session.act is act:
                session.act = None
            _unbind(session, act)
            session.contexts -= 1
            _drop_if_empty(session)


def _drop_if_empty(session: Session) -> None:
    """Forget a session that no open context uses and that has no frames: a context whose
    body raised before any backward (a nested context, a torch.func call) or ran a backward
    through no checkpointed block leaves nothing in ``recompute_session_stats()``, even while
    the exception's traceback still references the session. Marked cleared, so a stale
    activation cannot register frames into it."""
    if session.contexts == 0 and not session.frames and _registry.get(session.id) is session:
        del _registry[session.id]
        session.cleared = True


def _unbind(session: Session, act: Activation) -> None:
    for frame in _frames_of(session):
        if frame.active is act:
            frame.active = None
            _sync_reads(frame)


def recompute_handle(handle: RecomputeHandle, session_id: Hashable) -> None:
    """Prefire: register the handle's frame to ``session_id`` and replay it now.

    The replay runs on the calling thread, in the forward's RNG and autocast state (the
    caller's RNG is left where it was), and is cached on the frame for the session, to be
    read by the session's backward calls inside ``recompute_session_ctx``. A frame already
    replayed for this session is not replayed again; a handle whose graph was freed does
    nothing. If the replay raises, the session can be cleared (or the prefire retried).

    Example::

        with ckptfx.recompute_handle_collector_ctx() as handles:
            out = ckptfx.checkpoint(block, x)
        for h in handles:
            ckptfx.recompute_handle(h, "mb0")      # replay now, e.g. while a send is in flight
        with ckptfx.recompute_session_ctx("mb0", retain_on_unpack=True):
            dx = torch.autograd.grad(out, x, g, retain_graph=True)   # reads the prefired replay
    """
    registered = _register_handle(handle, session_id)
    if registered is not None:
        frame, session = registered
        if frame.session_replay is None:  # the frame is registered to session now
            if _compat.distributed_initialized():
                before_prefire(frame)  # FSDP2: the replay reads unsharded parameters
            _keep_replay(frame, session, frame.replay(session, store=False, scheduled=True))


def register_handle(handle: RecomputeHandle, session_id: Hashable) -> None:
    """``recompute_handle`` without the replay: register (and, inside the session's open
    context, bind) the handle's frame, which then replays at its first unpack under the
    session, on whatever thread unpacks it (Rule 3), as a prefired frame would have."""
    _register_handle(handle, session_id)


def _register_handle(handle: RecomputeHandle, session_id: Hashable
                     ) -> tuple[Frame, Session] | None:
    if not isinstance(handle, RecomputeHandle):
        raise ValueError(
            "handle must be a RecomputeHandle from ckptfx.recompute_handle_collector_ctx(), "
            f"got {type(handle).__name__}"
        )
    check_session_id(session_id)
    ref = getattr(handle, "_frame", None)
    if ref is None:
        raise ValueError(
            "handle is a RecomputeHandle that was not made by "
            "ckptfx.recompute_handle_collector_ctx() (it refers to no checkpointed call); "
            "use the handles that collector yields"
        )
    frame = ref()  # handle.frame, without the property's call
    if frame is None:
        return None
    with _lock:
        existing = _registry.get(session_id)
        session = existing if existing is not None else _session(session_id)
        try:
            active = frame.active
            if active is not None and active.session is not session:
                raise CheckpointError(
                    f"ckptfx: cannot prefire {frame!r} for session {session_id!r}: it is bound "
                    f"to session {active.session.id!r} right now."
                )
            _register(frame, session)
            if session.act is not None:  # prefired inside the session's open context
                _bind(frame, session.act)
        except BaseException:
            if existing is None:  # a rejected prefire leaves no session behind
                _registry.pop(session_id, None)
            raise
    return frame, session


def on_clear(listener: Callable[[Hashable], None]) -> None:
    """Have ``listener(session_id)`` called at every ``clear_recompute_session``, also for an
    id no frame is registered to: a transform that holds a session key before any of its
    frames joins it (a ``vjp_split`` made, its dx not run) learns that the user abandoned
    it. The listener runs outside the session lock and must not raise."""
    _clear_listeners.append(listener)


def clear_recompute_session(session_id: Hashable) -> None:
    """Drop everything the session holds: cached replays, registrations and bindings.

    Idempotent; an unknown id is a no-op. Call it in a ``finally`` after the session's last
    backward (or when abandoning a micro-batch); afterwards the frames work natively again and
    may join a new session.

    Example::

        try:
            with ckptfx.recompute_session_ctx("mb0", retain_on_unpack=True):
                dx = torch.autograd.grad(out, x, g, retain_graph=True)
            with ckptfx.recompute_session_ctx("mb0", retain_on_unpack=False):
                dw = torch.autograd.grad(out, weights, g)
        finally:
            ckptfx.clear_recompute_session("mb0")
    """
    check_session_id(session_id)
    for listener in _clear_listeners:
        listener(session_id)
    with _lock:
        session = _registry.pop(session_id, None)
        if session is None:
            return
        session.cleared = True
        for frame in _frames_of(session):
            if frame.session is session:
                frame.session = None
                frame.session_replay = None
            if frame.active is not None and frame.active.session is session:
                frame.active = None
            _sync_reads(frame)
        session.frames.clear()


def recompute_session_stats() -> dict[Hashable, SessionStats]:
    """Per live session: its frames and the replayed tensors (and bytes) it holds now.

    A scheduler reads this to see what a retained replay costs between dx and dw.

    Example::

        for session_id, stats in ckptfx.recompute_session_stats().items():
            print(session_id, stats.tensors, "tensors,", stats.nbytes, "bytes retained")
    """
    out: dict[Hashable, SessionStats] = {}
    with _lock:
        for session_id, session in list(_registry.items()):
            frames = _frames_of(session)
            storages: dict[int, int] = {}
            tensors = replayed = 0
            for frame in frames:
                replay = frame.session_replay if frame.session is session else None
                if replay is None:
                    continue
                replayed += 1
                shared = frame.shared or ()
                for i, t in enumerate(replay):
                    if t is not None and i not in shared:
                        tensors += 1
                        st = t.untyped_storage()
                        storages[st.data_ptr()] = st.nbytes()
                # A refill replay (frame.py Rule 7b) also holds the block's outputs.
                for t in getattr(replay, "outs", ()):
                    if hasattr(t, "untyped_storage"):
                        tensors += 1
                        st = t.untyped_storage()
                        storages[st.data_ptr()] = st.nbytes()
            out[session_id] = SessionStats(
                session_id, len(frames), replayed, tensors, sum(storages.values())
            )
    return out
