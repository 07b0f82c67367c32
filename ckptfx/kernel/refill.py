"""``ckptfx.refill_outputs``: a checkpointed block's output that a later op saves for its own
backward is not held between the forward and the backward; the block's replay refills it.
Megatron's ``CheckpointWithoutOutput`` does this by hand, for one module at a time; here the
kernel does it for every ``checkpoint`` and ``remat`` block of a forward.

Rules

1. The context is a pair of saved-tensor hooks around the forward. A block pushes its own
   hooks innermost, so the context sees only what ops *outside* blocks save. It is active
   only where it is entered with no saved-tensor hooks on top: entered inside a checkpointed
   block's forward or replay, inside torch's checkpoint, ``save_on_cpu`` or another
   ``refill_outputs``, it pushes nothing and changes nothing (what is outside it decides).
   Under a ``torch.func`` transform, which refuses saved-tensor hooks, it is inert too.

2. At the end of a forward under the context (its hooks on top), a ``checkpoint`` or
   ``remat`` frame registers its tensor outputs in the context's map, by identity, with the
   version each has when the block returns. Registered are plain strided tensors that the
   block made (not a parameter, not sharing storage with one of the block's inputs), of a
   frame that holds at least one saved tensor: a frame that holds nothing is never kept
   alive for its outputs (it would keep its inputs alive instead). The map holds tensors
   and frames weakly and is emptied when the context exits: nothing outlives it.

   2b. What "the block made" means depends on what the replay can vouch for. A recorded
   remat frame knows it (the output's value was made by a recorded op), and its replay
   checks every outside tensor it reads. A frame whose replay re-runs the Python function
   (``ckptfx.checkpoint``, remat's unrecorded calls) reads outside tensors when it runs:
   its output is registered only if autograd shows the block made its storage (the base's
   node is newer than the block's start). An output that is, or views, a buffer, a global
   or a parameter, or that autograd does not track (a no-grad result of a buffer), is
   saved as it is, so changing that tensor before the backward gives what plain autograd
   gives. What remains is the contract torch's checkpoint puts on its saved tensors, now
   on the refilled outputs too: a re-run block must not read a tensor or Python state that
   changes between its forward and its backward (remat's recorded calls check tensors).

   2c. Random numbers are the exception the kernel takes care of: a re-run frame's forward
   under the context runs under ``NoteExplicitDraws``, which has the frame's replay
   environment note each explicit ``torch.Generator`` the block draws from (its state before
   the first draw), as remat's recorder does. The replay then starts those generators where
   the forward did, so a refilled output that depends on them is the forward's, bitwise.
   (Without the context the output itself is saved, and only the block's own backward reads
   the replay: there torch's contract, which restores only the default generators, holds.)

3. A pack of a registered output at the version it had when the block returned, or of a
   view of it with its dtype (``linear`` on a 3-d input saves ``x.view(-1, d)``), becomes a
   ``_Handle``: the frame, the output's position, the view's geometry, weak references to
   the tensor and its base, and the version. Everything else packed becomes a ``_Plain``: a
   detached alias (an op that saves its own output would otherwise hold its node through
   the packed tensor, a cycle gc cannot see) and the version, checked at unpack, since
   saved-tensor hooks turn autograd's own check off. A new frame's inputs are saved as
   ``_Plain`` (``plain_saves``): refilled inputs would make the first block's replay replay
   every block below it at once, holding all their tensors.

4. Unpacking a handle whose tensor (or base) is still alive hands it out as is, after the
   version check autograd makes: nothing was saved, so nothing is replayed. Otherwise the
   frame replays under the key its own holders use (session, GraphExecGroup, GraphTask; a
   one-off replay outside backward) and caches the replay there, so the block's own backward
   reads the same one: one replay per block and backward, with or without the context. A
   replay made while a handle needs it runs to the block's outputs (no early stop; frame.py
   Rule 7b), and each replayed output must have the forward's shape, dtype, device, strides,
   offset and storage size, or it is a ``CheckpointError``.

5. A handle gets its tensor once per key, as a holder does, or keeps it for later backward
   calls of a session opened with ``retain_on_unpack=True``. A handle read twice under one
   GraphTask (a custom Function reading ``ctx.saved_tensors`` twice, which autograd allows)
   gets a replay of its own; under a session, a read after the last consumer took it raises
   as a holder's does.

6. In-place writes: an output written before an op saved it is saved as it is (Rule 3); one
   written after the save and still alive at the backward raises at unpack, as autograd
   does. One written after the save and dropped before the backward cannot be seen (its
   version counter died with it): the replay hands back the values the op read in the
   forward, so the gradient is that of the forward, where plain autograd would refuse.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterator, Sequence

import optree
import torch

from ckptfx import _compat
from ckptfx._ops import op_info
from ckptfx.kernel.frame import CheckpointError, Frame, Replay

__all__ = ["refill_outputs"]

Meta = tuple[Any, ...]  # shape, dtype, device, stride, storage offset, storage bytes


def _meta(t: torch.Tensor) -> Meta:
    return (t.shape, t.dtype, t.device, t.stride(), t.storage_offset(),
            t.untyped_storage().nbytes())


def _modified(t: torch.Tensor, expected: int) -> CheckpointError:
    return CheckpointError(
        "one of the variables needed for gradient computation has been modified by an "
        f"inplace operation: [{t.type()} {list(t.shape)}] is at version {t._version}; "
        f"expected version {expected} instead (saved under ckptfx.refill_outputs(), which "
        "checks versions as autograd does). Clone the tensor before modifying it in place, "
        "or modify it after the backward."
    )


class _Plain:
    """A saved tensor kept as it is (Rule 3): an alias without the graph, and its version."""

    __slots__ = ("tensor", "version")

    def __init__(self, x: torch.Tensor) -> None:
        # Unrecorded for plain tensors: a dispatch mode the user counts ops with sees the
        # forward's ops only. (An alias still shares the version counter.)
        self.tensor = _compat.detach_unrecorded(x) if type(x) is torch.Tensor else x.detach()
        self.version = x._version

    def get(self) -> torch.Tensor:
        t = self.tensor
        if t._version != self.version:
            raise _modified(t, self.version)
        return t


class _RefillReplay(list):
    """A frame's replay that also carries, per handle, the refilled output it hands out."""

    __slots__ = ("outs",)

    def __init__(self, n: int, handles: int) -> None:
        super().__init__([None] * n)
        self.outs: list[Any] = [None] * handles


_TAKEN = object()  # in ``outs``: handed out and dropped


class FrameOutputs:
    """``frame.refill``: the frame's registered outputs and the handles made for them."""

    __slots__ = ("leaves", "metas", "targets", "handles")

    def __init__(self, leaves: list[int], metas: list[Meta],
                 targets: list[tuple[int, int]] | None) -> None:
        self.leaves = leaves    # per output: its position among the result's leaves
        self.metas = metas      # per output: its geometry when the block returned
        self.targets = targets  # remat: per output, its (slot, version) in the recording
        self.handles: list[Callable[[], "_Handle | None"]] = []  # weakrefs

    def new_replay(self, n: int) -> Replay:
        """The list a replay fills: a refill replay if a live handle lost its tensor."""
        for ref in self.handles:
            h = ref()
            if h is not None and not h.alive():
                return _RefillReplay(n, len(self.handles))
        return [None] * n

    def fill_from_result(self, replay: _RefillReplay, out: Any) -> None:
        """Re-running the block's function returned ``out``: take the outputs from it."""
        leaves = optree.tree_leaves(out, none_is_leaf=True)
        self.fill(replay, [leaves[i] if i < len(leaves) else None for i in self.leaves])

    def fill(self, replay: _RefillReplay, values: Sequence[Any]) -> None:
        """Check the replayed outputs (Rule 4) and give each handle that needs one its own."""
        outputs = []
        for j, (t, meta) in enumerate(zip(values, self.metas)):
            if not isinstance(t, torch.Tensor) or _meta(t) != meta:
                got = _meta(t)[:5] if isinstance(t, torch.Tensor) else type(t).__name__
                raise CheckpointError(
                    f"ckptfx.refill_outputs: output {j} of the replayed block differs from the "
                    f"forward's (forward: shape={tuple(meta[0])} dtype={meta[1]} "
                    f"device={meta[2]} stride={meta[3]} offset={meta[4]}; replay: {got}), so "
                    "it cannot stand in for the tensor the next op saved. The block must "
                    "return the same outputs when replayed; or run this forward outside "
                    "ckptfx.refill_outputs()."
                )
            outputs.append(t.detach() if t.requires_grad else t)
        outs = replay.outs
        for s in range(min(len(outs), len(self.handles))):
            h = self.handles[s]()
            if h is None or h.alive():
                continue  # freed, or hands out its own tensor
            t = outputs[h.output]
            outs[s] = t if h.view is None else t.as_strided(*h.view)


class _Handle:
    """What a saved block output is packed into (Rule 3)."""

    __slots__ = ("frame", "output", "index", "ref", "base", "version", "view", "__weakref__")

    def __init__(self, frame: Frame, output: int, x: torch.Tensor,
                 base: torch.Tensor | None) -> None:
        state = frame.refill
        self.frame = frame
        self.output = output
        self.index = len(state.handles)
        state.handles.append(weakref.ref(self))
        self.ref = weakref.ref(x)
        self.version = x._version
        if base is None:
            self.base = None
            self.view: tuple[Any, ...] | None = None
        else:
            self.base = weakref.ref(base)
            self.view = (x.size(), x.stride(), x.storage_offset())

    def alive(self) -> bool:
        return self.ref() is not None or (self.base is not None and self.base() is not None)

    def original(self) -> torch.Tensor | None:
        """The packed tensor if it is still alive (version-checked), else None."""
        t = self.ref()
        if t is None and self.base is not None:
            base = self.base()
            if base is not None:
                assert self.view is not None
                t = base.detach().as_strided(*self.view)
        if t is not None and t._version != self.version:
            raise _modified(t, self.version)
        return t

    def unpack(self) -> torch.Tensor:
        t = self.original()
        if t is not None:
            return t
        replay, act = self.frame.current_replay()
        if replay is None:  # outside backward: a replay for this one unpack
            return self._own_replay(None)
        return self._take(replay, act is not None and act.retain, act)

    def _take(self, replay: Replay, retain: bool, act: Any) -> torch.Tensor:
        outs = getattr(replay, "outs", None)
        t = outs[self.index] if outs is not None and self.index < len(outs) else None
        if t is _TAKEN and act is not None:
            raise CheckpointError(
                f"ckptfx.refill_outputs: a block output saved by an op after the block was "
                f"already handed out and dropped by recompute session {act.session.id!r} (a "
                "consumer ran with retain_on_unpack=False). Use retain_on_unpack=True for "
                "every backward call except the last one of the session."
            )
        if t is None or t is _TAKEN:
            # Replayed before this handle needed it, or read twice in one backward (Rule 5).
            return self._own_replay(act)
        if not retain:
            assert outs is not None
            outs[self.index] = _TAKEN
        return t

    def _own_replay(self, act: Any) -> torch.Tensor:
        replay = self.frame.replay(None, store=False, scheduled=act is not None)
        outs = getattr(replay, "outs", None)
        t = outs[self.index] if outs is not None and self.index < len(outs) else None
        if t is None:
            raise CheckpointError(
                "ckptfx.refill_outputs: the replay of a block did not produce the output an op "
                "after it saved. This is a bug in ckptfx; run this forward outside "
                "ckptfx.refill_outputs() meanwhile."
            )
        return t


def _unpack(packed: Any) -> torch.Tensor:
    if packed.__class__ is _Handle:
        return packed.unpack()
    return packed.get()


Entry = tuple[Callable[[], Any], Callable[[], Any], int, int]  # tensor, frame, output, version


class _Scope:
    """One active ``refill_outputs`` context: its pack hook and its map of block outputs."""

    __slots__ = ("outputs", "plain", "__weakref__")

    def __init__(self) -> None:
        self.outputs: dict[int, Entry] = {}
        self.plain = 0  # > 0 while a new frame saves its inputs (Rule 3)

    def pack(self, x: torch.Tensor) -> Any:
        outputs = self.outputs
        if not outputs or self.plain:
            return _Plain(x)
        entry = outputs.get(id(x))
        base = None
        if entry is None or entry[0]() is not x:
            base = x._base
            if base is None:
                return _Plain(x)
            entry = outputs.get(id(base))
            if (entry is None or entry[0]() is not base or type(x) is not torch.Tensor
                    or x.dtype != base.dtype or x.layout != torch.strided
                    or x.is_conj() != base.is_conj() or x.is_neg() != base.is_neg()):
                return _Plain(x)
        _, frame_ref, output, version = entry
        frame = frame_ref()
        if frame is None or x._version != version:  # written since the block returned
            return _Plain(x)
        return _Handle(frame, output, x, base)

    def register(self, frame: Frame, out: Any, inputs: Sequence[Any],
                 tracer: Any = None, first_node: int | None = None) -> None:
        """Rule 2, at the end of ``frame``'s forward (``tracer``: a remat frame's;
        ``first_node``: ``first_node()`` when the block's forward began)."""
        if frame.refill is not None or not any(ref() is not None for ref in frame.holders):
            return
        storages = {a.untyped_storage().data_ptr() for a in inputs
                    if isinstance(a, torch.Tensor)}
        leaves: list[int] = []
        metas: list[Meta] = []
        targets: list[tuple[int, int]] = []
        chosen: list[torch.Tensor] = []
        for i, y in enumerate(optree.tree_leaves(out, none_is_leaf=True)):
            if (type(y) is not torch.Tensor or y.layout != torch.strided or not y.numel()
                    or (y.grad_fn is None and y.requires_grad) or y.is_conj() or y.is_neg()
                    or y.untyped_storage().data_ptr() in storages):
                continue
            if tracer is not None:
                slot = y.__dict__.get(tracer.attr)
                if slot is None or tracer.root[slot] >= 0:  # not made by the block's ops
                    continue
                targets.append((slot, tracer.seg.version(slot)))
            elif not _made_in_block(y, first_node):
                continue
            leaves.append(i)
            metas.append(_meta(y))
            chosen.append(y)
        if not chosen:
            return
        frame.refill = FrameOutputs(leaves, metas, targets if tracer is not None else None)
        frame_ref = weakref.ref(frame)
        outputs = self.outputs
        for j, y in enumerate(chosen):
            key = id(y)
            outputs[key] = (weakref.ref(y, _forget(outputs, key)), frame_ref, j, y._version)


class NoteExplicitDraws(_compat.TorchDispatchMode):
    """Rule 2c: the frame's environment notes every explicit generator the forward draws
    from, before its first draw."""

    def __init__(self, frame: Frame) -> None:
        super().__init__()
        self.env = frame.env

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # compiled code the block calls runs compiled, as without the context

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if op_info(func).seeded:
            self.env.note_generators_of(args, kwargs)
        return func(*args, **kwargs)


def first_node() -> int:
    """The sequence number the next autograd node made on this thread gets: taken when a
    block's forward begins, it tells which outputs' storages the block made (Rule 2)."""
    return int(torch._C._autograd._get_sequence_nr())


def _made_in_block(y: torch.Tensor, first: int | None) -> bool:
    # An unrecorded frame (ckptfx.checkpoint, remat's unrecorded calls) knows nothing of
    # the tensors its function read from outside: its replay reads them when it runs. Its
    # output is refilled only if autograd shows the block made its storage (the base's node
    # is the block's), so an output that is, or views, a tensor from outside (a buffer, a
    # global, a parameter), or that autograd does not track, is saved as it is.
    base = y._base if y._base is not None else y
    node = base.grad_fn
    return first is not None and node is not None and node._sequence_nr() >= first


def _forget(outputs: dict[int, Entry], key: int) -> Callable[[Any], None]:
    def forget(ref: Any) -> None:  # the output died: its id may be reused
        entry = outputs.get(key)
        if entry is not None and entry[0] is ref:
            del outputs[key]
    return forget


class _PlainSaves:
    __slots__ = ("scope",)

    def __init__(self, scope: _Scope | None) -> None:
        self.scope = scope

    def __enter__(self) -> None:
        if self.scope is not None:
            self.scope.plain += 1

    def __exit__(self, *exc: Any) -> None:
        if self.scope is not None:
            self.scope.plain -= 1


_NO_SCOPE = _PlainSaves(None)


def scope_on_top() -> _Scope | None:
    """The ``refill_outputs`` context whose hooks are on top now (a block about to start)."""
    owner = getattr(_compat.top_saved_tensors_pack_hook(), "__self__", None)
    return owner if owner.__class__ is _Scope else None


def plain_saves(scope: _Scope | None) -> _PlainSaves:
    """Around a new frame's construction: its inputs are saved as they are (Rule 3)."""
    return _NO_SCOPE if scope is None else _PlainSaves(scope)


@contextlib.contextmanager
def refill_outputs() -> Iterator[None]:
    """Hold no second copy of a checkpointed block's output: the replay refills it.

    Inside the ``with`` block, where an op after a ``ckptfx.checkpoint`` or ``ckptfx.remat``
    block saves the block's output for its own backward (the linears after a checkpointed
    norm, the projection after a checkpointed attention core), autograd keeps a small handle
    instead of the tensor: once the caller drops the output, its memory is free until the
    backward, where the block's replay (the one its own backward needs anyway) refills it
    just before that op's backward reads it. Between forward and backward a checkpointed
    block then costs only its inputs. This is Megatron's ``CheckpointWithoutOutput``, for any
    block and without hand-written discard and recompute calls.

    - Exact: the refilled output is the replay's, bitwise the forward's (RNG and autocast
      restored); its shape, dtype, strides and storage are checked against the forward, and
      a mismatch is a ``ckptfx.CheckpointError``.
    - One replay: the replay is cached under the backward's key (GraphTask, GraphExecGroup
      or recompute session), so the block is still replayed once per backward, and once per
      session for ``vjp_split`` / ``grad_split`` and prefire. An output the caller still
      holds at the backward is handed out as is, without a replay. The replay does run where
      the first op that saved the output needs it, even in a backward that does not reach
      the block itself (``autograd.grad`` for that op's weight only).
    - In-place writes: an output modified before the op saved it is saved as is; modified
      after the save and still alive, the backward raises what autograd raises. Saved-tensor
      hooks switch autograd's version check off, so the context checks every tensor saved
      under it the same way.
    - What is refilled: outputs the block made, and views of them with their dtype (a
      ``Linear`` on a 3-d input saves a reshaped view). Under autocast an op may save a cast
      copy instead (a ``Linear`` after a float32 norm): that copy is an ordinary saved tensor,
      as it is without the context. Outputs that alias the block's inputs, and outputs of a
      block that saved nothing, stay as they are. A ``ckptfx.checkpoint`` block's replay
      re-runs its function, reading outside tensors when it runs: its outputs are refilled
      only where autograd shows the block made them (not a view of a buffer or global, not
      an untracked result), and, as with torch's checkpoint, what the block reads must not
      change between forward and backward; a recorded ``remat`` block checks that itself.
    - Where it does nothing: entered while other saved-tensor hooks are active (inside a
      checkpointed block, ``torch.autograd.graph.save_on_cpu``, another ``refill_outputs``),
      it leaves them in charge; under a ``torch.func`` transform (which refuses
      saved-tensor hooks) it does nothing either. A ``torch.func`` transform called inside
      it refuses its hooks, as it refuses any (``remat`` blocks that use one are fine).

    Example::

        import ckptfx

        def attention(x):
            h = ckptfx.checkpoint(norm, x)        # h is saved by q, k and v below
            return x + proj(sdpa(q(h), k(h), v(h)))

        with ckptfx.refill_outputs():
            loss = model(x).sum()                 # no norm output held from here ...
        loss.backward()                           # ... until its replay refills it
    """
    if _compat.top_saved_tensors_pack_hook() is not None or _compat.functorch_level():
        # Rule 1: other hooks decide here; torch.func transforms refuse saved-tensor hooks
        yield
        return
    scope = _Scope()
    _compat.push_saved_tensors_hooks(scope.pack, _unpack)
    try:
        yield
    finally:
        _compat.pop_saved_tensors_hooks()
        scope.outputs.clear()
