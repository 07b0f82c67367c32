"""The default replay strategy (frame.py Rule 7): run the block's Python function again.

The replay runs as the forward ran (the frame's ``ReplayEnv``), under a pack hook, the
``_Recorder``, that files each saved tensor at its position and checks it against the
forward (Rule 5), and stops where torch's replay stops: in the pack of the last saved tensor
(Rule 6), or, where the frame could not prove its last saving op harmless (Rule 6b), once
``_LastOpWatch`` has seen that op, letting it finish when it fills a tensor it saved.
Nested checkpoints met by the replay make frames of their own, as in torch.
"""

from __future__ import annotations

from typing import Any

import torch

from ckptfx import _compat
from ckptfx._ops import op_info
from ckptfx.kernel import collectives
from ckptfx.kernel.frame import (
    DEBUG_TIP,
    NULL_CONTEXT,
    CheckpointError,
    Frame,
    Replay,
    tls,
)

__all__ = ["rerun_function"]


class _Stop(Exception):
    """Raised inside the block to end a replay early (Rule 6)."""


class _LastOpWatch(_compat.TorchDispatchMode):
    # Pushed by the replay's pack hook once the packs of every op before the forward's last
    # saving op are done (Rule 6), so the last op's own dispatch reaches it: autograd packs an
    # op's inputs before the op reaches a dispatch mode and its outputs after it returns.
    def __init__(self, rec: "_Recorder") -> None:
        super().__init__()
        self.rec = rec

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # A compiled function the block calls inside the watch's window runs its compiled
        # code, as in the forward: torch.compile would otherwise run it eagerly under this
        # mode, with other numerics and other saved tensors.
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        rec = self.rec
        kwargs = kwargs or {}
        if rec.last_op_ran is None:  # the pack hook's own detach
            return func(*args, **kwargs)
        if rec.count < rec.stop_at:
            if _compat.next_sequence_nr() == rec.last_op_seq:
                rec.last_op_ran = True  # the last op itself: its outputs pack next
            return func(*args, **kwargs)
        # Every tensor is packed and the op at hand is the one that packed the last ones.
        if _writes_one_of(func, args, kwargs, rec.last_op_packs):
            func(*args, **kwargs)  # it fills a tensor it saved (rrelu's noise): finish it
        raise _Stop


def _writes_one_of(func: Any, args: tuple, kwargs: dict, ids: set[int]) -> bool:
    """True if ``func`` writes in place one of the tensors whose ``id`` is in ``ids`` (they
    are alive: the op holds them)."""
    writes = op_info(func).writes
    if not writes:
        return False
    for i, name in writes:
        arg = args[i] if i < len(args) else kwargs.get(name)
        for t in arg if isinstance(arg, (list, tuple)) else (arg,):
            if id(t) in ids:
                return True
    return False


_NO_IDS: Any = frozenset()  # what a replay that neither probes nor watches looks ids up in


class _Recorder:
    """Pack hook of a replay: files each saved tensor at its position and checks it."""

    __slots__ = ("frame", "tensors", "count", "stop_at", "last_op_first", "last_op_seq",
                 "watch", "last_op_ran", "last_op_packs", "task", "probe", "input_ids",
                 "mismatched")

    def __init__(self, frame: Frame, tensors: Replay, inputs: list[Any]) -> None:
        self.frame = frame
        self.tensors = tensors
        self.count = 0
        n = len(tensors)
        # A refill replay (Rule 7b) runs to the block's outputs.
        self.stop_at = n if frame.early_stop and n and type(tensors) is list else -1
        # Rule 6: from the pack at this position on, _LastOpWatch sees the replay's ops.
        self.last_op_first = (frame.last_op_first if self.stop_at > 0 and frame.watch_last_op
                              else -1)
        self.last_op_seq = -1  # the sequence number the last op's packs see (set by arm)
        self.watch: _LastOpWatch | None = None
        self.last_op_ran: bool | None = False
        self.last_op_packs: set[int] = _NO_IDS  # the last op's packs, by id (made by arm)
        # A backward run inside the block restores its own thread state when it ends, a
        # mode pushed there would vanish: the watch is armed in the replay's own task only.
        self.task = _compat.current_graph_task_id() if self.last_op_first >= 0 else None
        # Metadata mismatches, reported together once the replay ended (as torch does).
        self.mismatched: list[tuple[int, tuple[Any, ...], tuple[Any, ...]]] = []
        # First session replay of the frame: note which saved tensors alias inputs or
        # parameters (for recompute_session_stats; native replays need not know).
        self.probe: list[int] | None = (
            [] if frame.shared is None and tls.scheduled_replay else None)
        self.input_ids = set(map(id, inputs)) if self.probe is not None else _NO_IDS

    def arm(self) -> None:
        if _compat.current_graph_task_id() == self.task:
            # The nodes the forward made from here to its last saving op: the last op is
            # the one dispatched once the replay has made as many.
            frame = self.frame
            self.last_op_seq = _compat.next_sequence_nr() + frame.op_seq - frame.prev_op_seq
            self.last_op_packs = set()
            self.watch = _LastOpWatch(self)
            self.watch.__enter__()

    def disarm(self) -> None:
        watch, self.watch = self.watch, None
        if watch is not None and _compat.top_dispatch_mode() is watch:
            watch.__exit__(None, None, None)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """The replay's pack hook: file ``x`` at its position, checked (Rule 5), and stop
        where the forward's last saved tensor was packed (Rule 6). One function, no helper
        calls on the common path: it runs for every saved tensor of every replay."""
        i = self.count
        self.count = i + 1
        probe = self.probe
        if probe is not None:  # does x alias an input or a leaf (a parameter)?
            ids = self.input_ids
            base = x._base
            if base is None:
                base = x
            # grad_fn, not is_leaf (which makes no Python node): dynamo, tracing this hook
            # inside a compiled block's replay, turns base.is_leaf into a graph op on a base
            # it lost
            if (id(x) in ids or id(base) in ids
                    or (base.requires_grad and base.grad_fn is None)):
                probe.append(i)
        watched = self.watch is not None
        if watched:  # a pack of the last op, its watch armed
            # The object the op will hold at the dispatcher, by id: a reference would be a
            # cycle gc cannot see (x's graph holds this hook through its saved variables).
            self.last_op_packs.add(id(x))
            if x.requires_grad:
                ran, self.last_op_ran = self.last_op_ran, None  # the watch lets this pass:
                x = x.detach()                                 # not an op of the block
                self.last_op_ran = ran
        elif x.requires_grad:
            x = x.detach()
        frame = self.frame
        tensors = self.tensors
        if i >= len(tensors):
            self._overflow(frame)
        elif frame.holders[i]() is not None:  # its holder lives: someone will read it
            tensors[i] = x
            metas = frame.metas
            if metas is not None:
                meta = metas[i]
                if x.dtype != meta[1] or x.shape != meta[0] or x.device != meta[2]:
                    self.mismatched.append((i, meta, (x.shape, x.dtype, x.device)))
        if watched:
            if i + 1 == self.stop_at and self.last_op_ran:
                raise _Stop  # the last op ran before this pack: its outputs are saved
            return x  # else an input of the last op, packed before it runs: the watch decides
        if i + 1 == self.stop_at:
            raise _Stop  # torch's stop, in the pack of the last saved tensor (Rule 6)
        if i + 1 == self.last_op_first:
            self.arm()  # the next pack is the last op's first
        return x

    @staticmethod
    def _overflow(frame: Frame) -> None:
        """A pack past the forward's count."""
        if not frame.forward_done:
            # Backward inside the block during its own forward: the replay may see more
            # than the forward had saved when it was triggered (torch's Rule 6).
            frame.ignore_count = True
            return
        raise CheckpointError(
            "ckptfx.checkpoint: trying to save more tensors during recomputation than "
            f"during the original forward pass ({len(frame.holders)}). The block must run "
            "the same ops when replayed.\n" + DEBUG_TIP
        )

    def check(self, frame: Frame) -> None:
        """After the replay: the count and metadata checks of Rule 5, in torch's words."""
        if not frame.ignore_count and frame.forward_done and self.count != len(self.tensors):
            raise CheckpointError(
                "ckptfx.checkpoint: A different number of tensors was saved during the "
                "original forward and recomputation.\n"
                f"Number of tensors saved during forward: {len(self.tensors)}\n"
                f"Number of tensors saved during recomputation: {self.count}.\n"
                "The block must run the same ops when replayed.\n" + DEBUG_TIP
            )
        if self.mismatched:
            lines = "".join(
                f"tensor at position {i}:\n"
                f"saved metadata: shape={tuple(m[0])} dtype={m[1]} device={m[2]}\n"
                f"recomputed metadata: shape={tuple(r[0])} dtype={r[1]} device={r[2]}\n"
                for i, m, r in self.mismatched
            )
            raise CheckpointError(
                "ckptfx.checkpoint: Recomputed values for the following tensors have "
                f"different metadata than during the forward pass.\n{lines}"
                "The block must compute the same shapes and dtypes when replayed.\n"
                + DEBUG_TIP
            )


def _identity(x: Any) -> Any:
    return x


def rerun_function(frame: Frame, tensors: Replay) -> None:
    """Replay strategy: run the block's Python function again under a recording hook."""
    args = frame.saved_inputs()
    rec = _Recorder(frame, tensors, args)
    ctx = frame.recompute_ctx
    log = collectives.replay_context(frame) if collectives.logged else NULL_CONTEXT
    grad_was = torch.is_grad_enabled()
    env = frame.env
    _compat.push_saved_tensors_hooks(rec.pack, _identity)
    try:
        torch._C._set_grad_enabled(True)  # torch.enable_grad(), without its wrapper object
        saved = env.enter()  # env.restored(), as two calls
        try:
            if ctx is None and log is NULL_CONTEXT:
                _run_to_stop(frame, rec, args, tensors)
            else:
                with (ctx if ctx is not None else NULL_CONTEXT), log:
                    _run_to_stop(frame, rec, args, tensors)
        except BaseException as err:
            env.leave(saved, type(err), err, err.__traceback__)
            raise
        env.leave(saved, None, None, None)
    finally:
        torch._C._set_grad_enabled(grad_was)
        _compat.pop_saved_tensors_hooks()
    if rec.probe is not None:
        frame.shared = frozenset(rec.probe)
    if rec.mismatched or rec.count != len(tensors):
        rec.check(frame)


def _run_to_stop(frame: Frame, rec: _Recorder, args: list[Any], tensors: Replay) -> None:
    try:
        if rec.last_op_first == 0:
            rec.arm()  # the block's first saving op is its last: watch from the start
        out = frame.fn(*args, **frame.kwargs)
        if type(tensors) is not list:  # a refill replay (Rule 7b)
            frame.refill.fill_from_result(tensors, out)
    except _Stop:
        pass
    finally:
        if rec.watch is not None:
            rec.disarm()
