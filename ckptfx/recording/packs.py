"""What a remat'd block keeps for its backward: the residual holders, the saved-tensor pack
hook of ``tracer.Tracer`` and, at the forward's end, the values kept for the replay.

Rules (numbered with tracer.py's, which records the ops these packs refer to: 1 and 4 there,
3 and 3b in segment.py)

1b. Some ops have autograd save an input they then fill (``rrelu_with_noise`` packs its
   ``noise`` buffer, then writes it): the backward reads the value the op left. The packs
   since the last op are settled when the next op dispatches: a pack of a tensor this op
   writes, made at this op's autograd sequence number (every pack of one op reads the
   number of the node autograd made for it; an op without a node reads its predecessor's),
   is the op's own input, and refers to the version the op leaves. Any other pack of a value
   later written in place is a write after a save (tracer.py Rule 4).

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

2c. A residual report's list (``saved_residuals``) holds the reported call's tensors, so
   its graph, whose saved-tensor hooks hold the tracer: the tracer lets go of the list when
   its forward ends (``Tracer.finish``), or the cycle, which gc cannot see through
   autograd's graph, would keep the call (and its offloaded host buffers) alive.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch

from ckptfx import _compat
from ckptfx.kernel.frame import CheckpointError, Frame, Holder
from ckptfx.offload.groups import HostGroup, HostResidual, can_offload, group_for
from ckptfx.policies.protocol import Offload
from ckptfx.recording.segment import Segment, describe_value

__all__ = ["residual_unpack_hook"]


# -- residual holders (what a kept saved tensor is packed into) ------------------------------


def _check_version(t: torch.Tensor, version: int) -> torch.Tensor:
    # Saved-tensor hooks turn off autograd's own version check, so a kept tensor modified in
    # place after it was kept (e.g. a block output the caller rewrote) is caught here: a
    # stale residual must raise, never reach a gradient.
    if t._version != version:
        raise CheckpointError(
            f"ckptfx.remat: a tensor kept for the backward ({describe_value(t)}) was modified in "
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

    value = get  # what the replay reads (``HostResidual.value``: not an autograd read)

    def fresh(self) -> bool:
        """Still the value it was when kept (a single-use value rewritten is recomputed)."""
        return self.tensor._version == self.version


def residual_unpack_hook(packed: Any) -> torch.Tensor:
    """Unpack hook of remat frames: kernel holders replay, kept residuals are handed out."""
    if packed.__class__ is Holder:
        from ckptfx.kernel.frame import unpack_hook

        return unpack_hook(packed)
    return packed.get()


class _DeadRef:
    """Stands in ``frame.holders`` for a pack that is kept, not recomputed."""

    __slots__ = ()

    def __call__(self) -> None:
        return None


_DEAD = _DeadRef()


# -- the autograd side of the tracer ---------------------------------------------------------


class PackSide:
    """The autograd side of ``tracer.Tracer`` (its base class): the pack hook, what each pack
    keeps, and the values kept because the replay reads them (Rules 1b-2b)."""

    # Set by ``Tracer.__init__`` (tracer.py).
    frame: Frame
    seg: Segment
    attr: str
    ids: dict[int, int]
    decision: list[Any]
    root: list[int]
    packed_bases: set[int]
    recent: list[tuple[int, int, int, torch.Tensor, int, Any]]
    dispatch_seq: int
    refresh: list[Any]
    report: list[tuple[Any, ...]] | None
    held: dict[tuple[int, int], tuple[torch.Tensor, int, Any]]
    pinned: bool
    hosts: dict[tuple[torch.device, bool], HostGroup]
    _slot: Callable[[torch.Tensor], int]

    def _hold(self, slot: int, t: torch.Tensor, decision: Any, written: bool = False) -> None:
        if self.root[slot] >= 0:  # a view of an input or outside tensor: an argument
            return
        if t.is_inference():
            # Made under torch.inference_mode: autograd never saves it and it has no version
            # counter to check a kept copy by, so the replay recomputes it.
            self.decision[slot] = False
            return
        # The tensor itself, not a detach made here: below autograd a detach gets its own
        # version counter and would hide later in-place writes. It is detached in ``finish``
        # (held only during the forward, so no reference cycle). An in-place op's output is
        # bumped once more by autograd after this op returns.
        self.held[(slot, self.seg.version(slot))] = (t, t._version + written, decision)

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
        packed = self._packed(_compat.detach_unrecorded(x), x, decision, slot, version)
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
            if packed.__class__ is HostResidual:
                packed.group.refresh(x)  # copied to the host before the op filled it
            else:
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

    def _packed(self, kept: torch.Tensor, x: torch.Tensor, decision: Any, slot: int,
                version: int) -> _Kept | HostResidual:
        """``kept`` (a detached alias of ``x``) packed as ``decision`` says: copied to the host
        for an ``Offload`` (``ckptfx.offload``), else held as it is; noted for the residual
        report under ``x``."""
        if isinstance(decision, Offload):
            device = kept.device
            if device.type == "cpu":
                # Host memory already: kept as it is, and reported as the policy answered
                # (as JAX lists it), whatever its size.
                self._note("offloaded", x, slot, version)
                return _Kept(kept)
            if kept.numel() * kept.element_size() >= decision.min_bytes and can_offload(kept):
                pinned = self.pinned and decision.dst == "pinned_host"
                key = (device, pinned)
                group = group_for(self.hosts.get(key), device, pinned, self.frame,
                                  decision.prefetch)
                self.hosts[key] = group
                self._note("offloaded", x, slot, version)
                return group.offload(kept)
        self._note("saved", x, slot, version)
        return _Kept(kept)

    def _before_write(self, v: Any) -> None:
        """An op is about to write ``v`` (a tensor or a list of them) in place: copies of its
        storage to the host finish first (ckptfx.offload Rule 3)."""
        for t in (v if isinstance(v, (list, tuple)) else (v,)):
            if isinstance(t, torch.Tensor):
                for group in self.hosts.values():
                    group.before_write(t)

    def _note(self, kind: str, x: torch.Tensor, slot: int, version: int) -> None:
        if self.report is not None:
            self.report.append((self, kind, x, slot, version))

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
                packed = self._packed(t, t, decision, slot, version)
                if packed.__class__ is HostResidual:
                    packed.replay_only = True  # its read by the replay is its last
                (seg.single_use if decision is True else seg.extra).append(packed)
                seg.kept[sv] = weakref.ref(packed)
                continue
            for i in seg.makers(slot, version):
                if i >= 0:
                    stack.extend((s, v) for _, s, v in seg.ops[i].inputs)
