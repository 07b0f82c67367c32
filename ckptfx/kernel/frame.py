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
   session key the activation decides: ``retain`` keeps it for later consumers. A frame
   serves one session at a time (``frame.session``), so the session's replay has a slot of
   its own (``session_replay``), and the hot path reads it without a key lookup; session.py
   stores it there, under its lock, only while the frame is still registered to that
   session (a clear may come during the replay). The GraphTask and GraphExecGroup replays
   are kept by key (``replays``).

4. The unpack hook is the hot path. It reads attributes and one or two of torch's thread
   state getters; it takes no lock and reads no ContextVar or registry. Everything else
   (discovering a session, replaying, errors) is on the slow path, once per frame and key.

4b. Most reads of a split step are of a session replay that every consumer keeps (dx and
   every dw group but the last). For those no Python needs to run: while a frame is bound
   to a retaining activation that logs nothing, its ``reads`` dict maps each live holder to
   its replayed tensor, and a forward that hands its frame to a scheduler (a handle
   collector is open) pushes ``reads.__getitem__`` as the unpack hook: a hit is a lookup in
   C; a miss (no replay yet, another activation, a native backward) falls through
   ``__missing__`` to ``unpack_hook``, so both hooks hand out the same tensors. session.py
   fills the dict and empties it, under its lock, whenever the binding or the replay
   changes (``fill_reads``); a handle-less forward keeps the plain hook, whose native path
   has no dict miss to pay. While filled, the dict holds the holders (and so the frame): a
   graph freed inside such a context frees its frames when the context exits.

5. A replay runs as the forward ran (``ReplayEnv``: RNG, autocast, device context), starts as
   if no checkpoint were active (a nested checkpoint met during replay makes a new frame,
   as in torch), and is checked against the forward: the same number of saved tensors, and
   by default the same shape, dtype and device for each. A mismatch is a ``CheckpointError``;
   a replay never hands out a tensor it cannot vouch for.

6. Early stop ends the replay once the last saved tensor exists, at a point the program
   fixes, never a clock: what a replay runs, keeps and raises must not depend on how long
   anything took. The stop is torch's: the replay's pack hook raises in the pack of the last
   saved tensor, so the replay runs exactly the ops torch's would. One exception keeps ckptfx
   exact where torch is not: an op may save a buffer and fill it afterwards
   (``rrelu_with_noise`` packs its ``noise`` before writing it), so the op that packed the
   last tensors may have to finish first. Which op that is comes from the forward: autograd
   numbers the nodes it makes, and every pack of one op reads the same next number, so the
   frame knows where the packs of its last saving op start (``last_op_first``) and how many
   nodes were made since the saving op before it. The replay pushes a dispatch mode
   (``_LastOpWatch``, in ``function_replay.py``) at that boundary, before the last op
   dispatches (a mode pushed later would miss it), and knows the last op when it reaches the
   watch by the nodes made so far.
   If the last op ran before its last pack (the last tensors are its outputs), the pack hook
   stops as torch does; if the last tensors are its inputs, the op reaches the watch next,
   which runs it only when it writes one of them, then stops. The watch sees only the ops
   between the last two saving ops, and torch.compile ignores it.

6b. The watch costs a dispatch mode for a few ops of every replay, so a frame whose last
   saving op provably writes none of its arguments goes without it (``watch_last_op``): the
   pack hook's stop is then exactly what the watch would do (stop before the op runs). The
   proof comes at the end of the forward, from the outputs' autograd graph: the node the
   last packs were made for (sequence number ``op_seq - 1``) is found by a short walk from
   the outputs, shown to be the one that saved the last holder (autograd hands out the
   packed object of a saved variable), and its op is named from the node's class
   (``last_op.py``).
   Anything short of a proof keeps the watch: the node not found within the walk, a node of
   a custom Function or of compiled code, a name that does not map back to an ATen op, an op
   with a writable argument, or a frame created inside this one's forward (its inputs are
   packed outside any op, so the last pack need not belong to that node).
7. How a frame replays is a strategy (``Frame.rerun``, given by the frame's maker):
   re-running the Python function (``function_replay.py``), a recorded segment in
   ``remat``. Strategies fill the same list; keys, caching, handing out
   and checks are the frame's.

7b. A frame whose outputs a ``ckptfx.refill_outputs`` context handed out as handles
   (``frame.refill``, set by refill.py) makes each replay that a live handle needs a refill
   replay (a list subclass that also carries the outputs): it runs to the block's outputs (no
   early stop) and hands them to ``frame.refill``. Strategies fill both; the frame caches
   them under one key, so a block's outputs and its saved tensors come from one replay.

8. The generator state a replay restores is process-global, so replays that restore it run
   one at a time (``_rng_lock``, re-entrant for nested replays on one thread). Two threads
   replaying dropout blocks at once would otherwise draw each other's random numbers. (A
   block that runs a backward inside itself on an accelerator may wait on an autograd device
   thread that needs this lock: pass ``preserve_rng_state=False`` for such a block.)
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Callable, Hashable

import torch
import torch.utils.checkpoint as _torch_checkpoint

from ckptfx import _compat
from ckptfx.kernel.last_op import last_op_writes_nothing
from ckptfx.kernel.replay_env import ReplayEnv

__all__ = ["CheckpointError", "Frame", "Holder", "Reads", "SESSION_KEY", "unpack_hook", "tls"]

_next_sequence_nr = _compat.next_sequence_nr
_SavedTensor = _compat.SavedTensor
# One reusable do-nothing context: what a replay or forward enters when nothing is to enter.
NULL_CONTEXT = contextlib.nullcontext()


class CheckpointError(_torch_checkpoint.CheckpointError):
    """A checkpointed block could not be replayed faithfully, or was used in a way ckptfx
    cannot support. Subclass of ``torch.utils.checkpoint.CheckpointError``.

    Example::

        try:
            loss.backward()
        except ckptfx.CheckpointError as err:   # also caught as torch's CheckpointError
            print(err)                          # what differed, and what to try next
    """


# The last line of a replay-mismatch error raised with debug off; kernel/debug.py takes it
# off again (and says why the op lists are there) when debug is on.
DEBUG_TIP = (
    "Tip: pass debug=True to ckptfx.checkpoint (or run the forward inside "
    "torch.utils.checkpoint.set_checkpoint_debug_enabled(True)) to see the ops of the forward "
    "and of the replay side by side."
)

# Thread state read on the slow path only:
#   activation        the session context opened on this thread (see session.py)
#   scheduled_replay  True while this thread replays a frame for a session
#   frames_made       frames created on this thread so far (Rule 6b and unrecorded.py ask whether
#                     a block's forward created one: a nested frame)
class _ThreadState(threading.local):
    activation: Any = None
    scheduled_replay: bool = False
    frames_made: int = 0


tls = _ThreadState()

# Under this key the session context also puts its activation in the state autograd carries
# into the threads of a backward (``_compat.carry``): autograd's device threads never see
# ``tls``, and lazy discovery (session.py Rule 2) must work there too.
SESSION_KEY = "ckptfx.recompute_session"
_carried = _compat.carried


def refuse_new_frame_in_scheduled_replay(what: str) -> None:
    """A frame created while a block is replayed for a session is not supported (yet)."""
    if tls.scheduled_replay:
        raise CheckpointError(
            f"ckptfx: {what} was created while a block was being replayed for a recompute "
            "session (prefire or session backward): the outer block is replayed by re-running "
            "its Python function (a ckptfx.checkpoint block, or a remat'd block whose "
            "recording cannot be replayed), and nested blocks re-created there are not "
            "supported under scheduled recomputation in this version. Checkpoint the outer "
            "block only, make it a remat'd block whose recording replays (no tensor "
            "subclasses, no in-place writes to its inputs or to values after autograd saved "
            "them, no buffers filled outside the dispatcher, no autograd inside), or run this "
            "backward without a session."
        )


class Holder:
    """What autograd stores in place of a saved tensor: its frame and its position."""

    __slots__ = ("frame", "index", "__weakref__")

    def __init__(self, frame: "Frame", index: int) -> None:
        self.frame = frame
        self.index = index


# A Holder without running its Python __init__ (Frame.pack, once per saved tensor)
_new_holder: Callable[[type[Holder]], Holder] = object.__new__


_rng_lock = threading.RLock()  # Rule 8

Replay = list  # position -> replayed tensor, None once handed out (or if its holder died)


class Reads(dict):
    """holder -> replayed tensor: the C fast path of Rule 4b. A miss is ``unpack_hook``'s."""

    __slots__ = ()

    def __missing__(self, holder: "Holder") -> torch.Tensor:
        return unpack_hook(holder)


class Frame:
    """One forward call of a checkpointed block (see the Rules above)."""

    __slots__ = (
        "fn", "inputs", "kwargs", "env", "rerun", "holders", "metas", "early_stop",
        "recompute_ctx", "debug", "replays", "session_replay", "reads", "active", "session",
        "forward_done", "ignore_count", "shared", "op_seq", "prev_op_seq", "last_op_first",
        "watch_last_op", "frames_made", "refill", "__weakref__",
    )

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        rerun: Callable[["Frame", Replay], None],
        preserve_rng_state: bool = True,
        determinism_check: str = "default",
        early_stop: bool = True,
        recompute_ctx: Any = None,
        debug: Any = None,
    ) -> None:
        # Rule 6b: an enclosing frame's last pack may be one of ours (saved-tensor hooks are
        # per thread, so only frames made on this thread can pack into an enclosing one).
        made = tls.frames_made + 1
        tls.frames_made = self.frames_made = made
        self.fn = fn
        # Saved under the hooks active now: the parent frame's, when nested (not as outputs).
        inputs = list(args)  # a loop, not a comprehension: one Python frame less per call
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                inputs[i] = _compat.make_saved_tensor(a, False)
        self.inputs: list[Any] = inputs
        self.kwargs = kwargs
        self.env = ReplayEnv(
            (*args, *kwargs.values()) if kwargs else args, preserve_rng_state
        )
        self.rerun = rerun
        self.holders: list[Callable[[], Holder | None]] = []  # weakrefs, or a dead stand-in
        self.metas: list[tuple[Any, ...]] | None = [] if determinism_check == "default" else None
        self.early_stop = early_stop
        self.recompute_ctx = recompute_ctx
        self.debug = debug
        self.replays: dict[Hashable, Replay | None] = {}  # by GraphTask / GraphExecGroup
        self.active: Any = None  # bound by session.py; read by unpack_hook
        self.session: Any = None  # the one session registered on this frame, if any
        self.session_replay: Replay | None = None  # that session's replay (Rule 3)
        self.reads = Reads()  # Rule 4b: filled while bound to a retaining, unlogged session
        self.forward_done = False
        # Rule 6: the autograd sequence number the packs of the last saving op saw, the one
        # of the saving op before it (or the block's start), and the position of the last
        # saving op's first pack.
        self.op_seq = self.prev_op_seq = _next_sequence_nr()
        self.last_op_first = 0
        self.watch_last_op = True  # Rule 6b: cleared by forward_finished when not needed
        self.ignore_count = False
        # Positions whose replayed tensor aliases an input or a parameter (costs no memory),
        # found by the first function replay (None until then); read by session stats.
        self.shared: frozenset[int] | None = None
        self.refill: Any = None  # Rule 7b: the outputs refill_outputs() handed out as handles

    # -- forward ---------------------------------------------------------------------------

    def pack(self, x: torch.Tensor) -> Holder:
        """The forward's pack hook (Rule 1): called for every saved tensor, so it makes its
        holder without a Python ``__init__``."""
        holders = self.holders
        position = len(holders)
        holder = _new_holder(Holder)
        holder.frame = self
        holder.index = position
        holders.append(weakref.ref(holder))
        metas = self.metas
        if metas is not None:
            metas.append((x.shape, x.dtype, x.device))
        self.note_op(position)
        return holder

    def note_op(self, position: int) -> None:
        """At each pack of the forward: note where the packs of a new op start (Rule 6)."""
        seq = _next_sequence_nr()
        if seq != self.op_seq:
            self.prev_op_seq, self.op_seq = self.op_seq, seq
            self.last_op_first = position

    def forward_finished(self, outputs: Any = None) -> None:
        """End of the forward. Given the block's ``outputs``, the frame looks for the proof
        that its replay's early stop needs no watch (Rule 6b)."""
        self.forward_done = True
        if (outputs is not None and self.early_stop and self.holders
                and tls.frames_made == self.frames_made):
            last = self.holders[-1]()
            if last is not None and last_op_writes_nothing(outputs, self.op_seq - 1, last):
                self.watch_last_op = False

    def saved_inputs(self) -> list[Any]:
        inputs = list(self.inputs)
        for i, a in enumerate(inputs):
            if isinstance(a, _SavedTensor):
                inputs[i] = a.unpack()
        return inputs

    def fill_reads(self) -> None:
        """Rule 4b: ``reads`` becomes the session replay's live holders and tensors (called
        by session.py, under its lock, while a retaining, unlogged activation is bound)."""
        reads = self.reads
        reads.clear()
        replay = self.session_replay
        if replay is None:
            return
        for ref, t in zip(self.holders, replay):
            if t is not None:
                holder = ref()
                if holder is not None:
                    reads[holder] = t

    # -- backward --------------------------------------------------------------------------

    def replay(self, key: Hashable, *, store: bool = True, scheduled: bool = False) -> Replay:
        """Replay the block for ``key`` and return its tensors (Rules 3 and 5)."""
        refill = self.refill
        tensors: Replay = ([None] * len(self.holders) if refill is None
                           else refill.new_replay(len(self.holders)))  # Rule 7b
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
        if store:  # a session's replay is kept by session.py, under its lock (Rule 3)
            self.replays[key] = tensors
        return tensors

    def activation(self) -> Any:
        """The session activation this frame is read under now: the one bound to it, else the
        one a ``recompute_session_ctx`` opened on this thread (or carried into this device
        thread), adopted here (session.py Rule 2); None outside any session."""
        act = self.active
        if act is None:
            opened = tls.activation
            if opened is None:  # a device thread running the backward of a session's caller
                opened = _carried(SESSION_KEY)
            if opened is not None:
                act = opened.adopt(self)
        return act

    def current_replay(self) -> tuple[Replay | None, Any]:
        """The replay an unpack reads now, made if missing (Rule 3's keys: the session, the
        GraphExecGroup, the GraphTask), and the session activation it reads under (or
        None); ``(None, None)`` outside any backward."""
        act = self.activation()
        if act is not None:  # bound to a frame registered to act.session (session.py)
            replay = self.session_replay
            if replay is None:
                replay = act.keep(self, self.replay(act.session, store=False, scheduled=True))
            return replay, act
        key = _compat.get_graph_exec_group()
        if key is None:
            key = _compat.current_graph_task_id()
            if key == -1:
                return None, None
        replay = self.replays.get(key)
        if replay is None:
            replay = self.replay(key)
        return replay, None

    def unpack_slow(self, holder: Holder) -> torch.Tensor:
        """Everything the hot path does not do: session discovery, replay, errors."""
        replay, act = self.current_replay()
        if replay is None:  # outside backward: a replay for this one unpack
            return self.replay(None, store=False)[holder.index]
        if act is None:
            return _take(replay, holder.index, False, None)
        t = _take(replay, holder.index, act.retain, act)
        if act.retain and act.log is not None:
            _note_read(act, replay, holder)
        return t

    def __repr__(self) -> str:
        name = getattr(self.fn, "__qualname__", None) or type(self.fn).__name__
        return f"<ckptfx Frame of {name}: {len(self.holders)} saved tensors>"


class _ReadsOnce(dict):
    """node class -> whether its nodes unpack each saved tensor once per call: torch's own
    (C++) nodes do; a custom Function's backward may read ``ctx.saved_tensors`` twice.
    Filled on first sight, so the hot path pays a dict lookup."""

    def __missing__(self, cls: type) -> bool:
        once = cls is not type(None) and not issubclass(
            cls, torch.autograd.function.BackwardCFunction)
        self[cls] = once
        return once


_reads_once = _ReadsOnce()


def _note_read(act: Any, replay: Replay, holder: Holder) -> None:
    """A retaining dx pass read ``holder``'s tensor: log the reading node for the split's
    trim, or, when that node is one the weight pass will not execute (``act.drop_unless``)
    and reads it only this once, drop the tensor now, as a fused backward frees it."""
    node = _compat.current_autograd_node()
    keep = act.drop_unless
    if keep is not None and node not in keep and _reads_once[node.__class__]:
        replay[holder.index] = None
    else:
        act.log.append((holder, node))


def unpack_hook(holder: Holder) -> torch.Tensor:
    """The saved-tensor unpack hook of every frame: the hot path (Rule 4)."""
    frame = holder.frame
    act = frame.active
    if act is not None:
        replay = frame.session_replay
        if replay is not None:
            t = replay[holder.index]
            if t is not None:
                if not act.retain:
                    replay[holder.index] = None
                elif act.log is not None:
                    _note_read(act, replay, holder)
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
            overlap = ""
            if _compat.get_graph_exec_group() is not None:
                overlap = (
                    "Performing two backward calls that overlap (i.e. require the same saved "
                    "activation in order to compute gradients) is not allowed while under the "
                    "torch.utils.checkpoint.GraphExecGroup context. To let several backward "
                    "calls read one replay, run them in ckptfx.recompute_session_ctx instead. "
                )
            raise CheckpointError(
                "ckptfx.checkpoint: Unpack is being triggered for a tensor that was already "
                f"unpacked once. {overlap}If you are calling ctx.saved_tensors in backward, "
                "make sure to do so only once (ckptfx hands each replayed tensor out once per "
                "backward call)."
            )
        raise CheckpointError(
            f"ckptfx: saved tensor {index} of this block was already handed out and dropped by "
            f"recompute session {act.session.id!r} (a consumer ran with retain_on_unpack=False). "
            "Use retain_on_unpack=True for every backward call except the last one of the session."
        )
    if not retain:
        replay[index] = None
    return t
