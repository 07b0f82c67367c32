"""The offloaded residuals of one block call (a ``HostGroup``): their host copies, the reload
that brings them back, and the ``HostResidual`` each saved tensor is packed into. The Rules
are ``ckptfx.offload``'s.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Hashable

import torch

from ckptfx.kernel import session as _session
from ckptfx.kernel.frame import CheckpointError
from ckptfx.offload.pool import HostPool, pool_for
from ckptfx.offload.streams import current_stream, side_stream

__all__ = ["HostGroup", "HostResidual", "can_offload", "group_for"]


class _Buffers:
    """What a group's finalizer settles, without a reference back to the group: per copied
    storage, its host buffer and size, the event of its copy out, and the device copy a
    reload made (strong, or weak once read: Rule 6) with the stream it was allocated on."""

    __slots__ = ("device", "pool", "side", "host", "nbytes", "d2h", "dev", "dev_weak",
                 "dev_stream", "h2d", "read_by", "left")

    def __init__(self, device: torch.device, pool: HostPool, side: torch.Stream) -> None:
        self.device = device
        self.pool = pool
        self.side = side
        self.host: list[torch.Tensor] = []
        self.nbytes: list[int] = []
        self.d2h: list[torch.Event] = []
        self.dev: list[torch.Tensor | None] = []
        self.dev_weak: list[Callable[[], torch.Tensor | None] | None] = []
        self.dev_stream: list[torch.Stream | None] = []
        self.h2d: list[torch.Event | None] = []
        self.read_by: list[set[int]] = []  # ids of the residuals read since the reload
        self.left: list[int] = []          # residuals alive per buffer

    def copy_out(self, source: torch.Tensor, index: int | None = None) -> int:
        """Queue the copy of ``source`` (1-D uint8 over a whole device storage) into a host
        buffer, on the side stream after the current stream's work (Rule 3)."""
        side = self.side
        side.wait_stream(current_stream(self.device))  # the value has been computed
        if index is None:
            index = len(self.host)
            self.host.append(self.pool.take(source.numel()))
            self.nbytes.append(source.numel())
            self.d2h.append(torch.Event(device=self.device))
            self.dev.append(None)
            self.dev_weak.append(None)
            self.dev_stream.append(None)
            self.h2d.append(None)
            self.read_by.append(set())
            self.left.append(0)
        with side:
            self.host[index][:self.nbytes[index]].copy_(source, non_blocking=self.pool.pinned)
        self.d2h[index].record(side)
        # The allocator keeps the source's memory from new work until the side stream's work
        # queued when it is freed has run: the copy may still be reading it.
        source.record_stream(side)
        return index

    def wait_copied(self, index: int) -> None:
        """Have the current stream wait for buffer ``index``'s copy out (device-side): what
        it runs next may write the source."""
        current_stream(self.device).wait_event(self.d2h[index])

    def reload(self, indices: list[int]) -> None:
        """Queue the copies of ``indices`` back to the device (Rule 5)."""
        side = self.side
        stream = current_stream(self.device)
        bufs = [torch.empty(self.nbytes[i], dtype=torch.uint8, device=self.device)
                for i in indices]  # allocated on the current stream, the one that reads them
        side.wait_stream(stream)  # the memory's earlier users on that stream are done
        event = torch.Event(device=self.device)
        with side:
            for i, buf in zip(indices, bufs):
                buf.copy_(self.host[i][:self.nbytes[i]], non_blocking=self.pool.pinned)
        event.record(side)
        for i, buf in zip(indices, bufs):
            # Freed unread (a prefetch the backward never reached, a cleared session), its
            # memory waits for the copy into it.
            buf.record_stream(side)
            self.dev[i] = buf
            self.dev_weak[i] = weakref.ref(buf)
            self.dev_stream[i] = stream
            self.h2d[i] = event
            self.read_by[i] = set()

    def device_copy(self, index: int) -> torch.Tensor | None:
        buf = self.dev[index]
        if buf is None:
            ref = self.dev_weak[index]
            buf = ref() if ref is not None else None
        return buf

    def close(self) -> None:
        """The group died (its graph was freed): Rule 7. Its host buffers go back to the
        pool; a copy still queued in or out of one runs before any later copy that reuses it
        (the pool's stream). Device memory was handed to the allocator with its streams."""
        for host in self.host:
            self.pool.give(host)
        self.host = []
        self.dev = []
        self.dev_weak = []


class HostGroup:
    """The offloaded residuals of one block call (one frame), Rules 2-7."""

    __slots__ = ("buffers", "frame", "prev", "prefetch", "reloaded", "started", "storages",
                 "written", "outputs", "session", "lock", "__weakref__")

    def __init__(self, device: torch.device, pinned: bool, frame: Any, prefetch: int,
                 prev: "HostGroup | None") -> None:
        side = side_stream(device)
        self.buffers = _Buffers(device, pool_for(device, pinned, side), side)
        self.frame = weakref.ref(frame)
        self.prev = weakref.ref(prev) if prev is not None else None
        self.prefetch = prefetch
        self.reloaded = False  # a reload was issued (by its backward or a prefetch)
        self.started = False   # its backward began reading (which prefetches: Rule 5)
        # storage data pointer -> (weakref to the storage, version copied, buffer index):
        # views of one storage share a copy (Rule 2). Forward only.
        self.storages: dict[int, tuple[Any, int, int]] | None = {}
        # Buffers whose storage the block wrote after copying it, and the block's outputs
        # that share a copied storage (output, its version, buffer): a read of either raises
        # as autograd does for a saved tensor modified in place (Rule 8).
        self.written: set[int] = set()
        self.outputs: list[tuple[Any, int, int]] = []
        self.session: Any = None  # the session that retains the reload (Rule 6)
        self.lock = threading.Lock()
        weakref.finalize(self, self.buffers.close)

    # the forward ------------------------------------------------------------------------

    def offload(self, t: torch.Tensor) -> "HostResidual":
        """Pack ``t`` (a detached alias of a saved device tensor that ``can_offload``): queue
        its storage's copy to the host, unless one is already queued at this version."""
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        size = t.element_size()
        with torch._C._DisableTorchDispatch():  # not an op of the block (recording/tracer.py)
            buffers = self.buffers
            assert self.storages is not None, "offload after the block's forward ended"
            key = storage.data_ptr()
            seen = self.storages.get(key)
            if seen is not None and seen[0]() is storage and seen[1] == t._version:
                index = seen[2]
            else:
                whole = t.as_strided((nbytes // size,), (1,), 0).view(torch.uint8)
                index = buffers.copy_out(whole)
                self.storages[key] = (weakref.ref(storage), t._version, index)
        residual = HostResidual(self, index, t.dtype, t.shape, t.stride(), int(t.storage_offset()))
        buffers.left[index] += 1
        return residual

    def refresh(self, t: torch.Tensor) -> None:
        """``t``'s storage was just written by the op that saved it (packs.py Rule 1b): copy
        it again, so the host holds the value the op left."""
        seen = self.storages.get(t.untyped_storage().data_ptr()) if self.storages else None
        if seen is None:
            return
        self.written.discard(seen[2])  # the op's own write, not a write after the save
        with torch._C._DisableTorchDispatch():
            nbytes, size = t.untyped_storage().nbytes(), t.element_size()
            whole = t.as_strided((nbytes // size,), (1,), 0).view(torch.uint8)
            self.buffers.copy_out(whole, seen[2])

    def before_write(self, t: torch.Tensor) -> None:
        """The block is about to write ``t`` in place: its storage's copy out must be done
        first (Rule 3)."""
        storages = self.storages
        if storages:
            seen = storages.get(t.untyped_storage().data_ptr())
            if seen is not None and seen[1] == t._version:
                self.buffers.wait_copied(seen[2])
                self.written.add(seen[2])

    def finish(self, outputs: list[torch.Tensor]) -> None:
        """The block's forward ended: outputs whose storage is being copied make the current
        stream wait for the copy (the caller may write them)."""
        storages, self.storages = self.storages, None
        if storages:
            for t in outputs:
                seen = storages.get(t.untyped_storage().data_ptr())
                if seen is not None:
                    self.buffers.wait_copied(seen[2])
                    if seen[1] == t._version:
                        self.outputs.append((weakref.ref(t), t._version, seen[2]))

    # the backward -----------------------------------------------------------------------

    def read(self, residual: "HostResidual", counts: bool) -> torch.Tensor:
        """The device tensor of ``residual``: reloaded if needed, on the current stream after
        the reload's event (Rules 5 and 6)."""
        buffers = self.buffers
        index = residual.index
        if (self.written or self.outputs) and self.modified(index):
            raise CheckpointError(
                "ckptfx.remat: a tensor offloaded for the backward was modified in place after "
                "it was saved; the backward would read the value saved, where autograd "
                "raises (\"one of the variables needed for gradient computation has been "
                "modified by an inplace operation\"). Clone it before modifying it in place."
            )
        if self.outputs:  # still held, unmodified, by the caller: read there (Rule 9)
            held = self._held_output(index)
            if held is not None and held.dtype is residual.dtype:
                if not self.started:
                    self._start()
                with torch._C._DisableTorchDispatch():
                    return held.as_strided(residual.shape, residual.stride, residual.offset)
        with self.lock:
            self._note_session()
            buf = buffers.device_copy(index)
            if buf is None:
                self._reload([index] if self.reloaded else None)
                buf = buffers.dev[index]
            assert buf is not None
            event = buffers.h2d[index]
            read_by = buffers.read_by[index]
            if counts:
                read_by.add(id(residual))
            if self.session is None and len(read_by) >= buffers.left[index]:
                buffers.dev[index] = None  # read by all: kept weakly from now on (Rule 6)
        if not self.started:
            self._start()
        with torch._C._DisableTorchDispatch():
            stream = current_stream(buffers.device)
            if event is not None:
                stream.wait_event(event)
            if stream != buffers.dev_stream[index]:  # read on another stream than allocated
                buf.record_stream(stream)
            flat = buf if residual.dtype is torch.uint8 else buf.view(residual.dtype)
            return flat.as_strided(residual.shape, residual.stride, residual.offset)

    def modified(self, index: int) -> bool:
        """Rule 8: buffer ``index``'s storage was modified in place since it was copied."""
        if index in self.written:
            return True
        for ref, version, i in self.outputs:
            t = ref() if i == index else None
            if t is not None and t._version != version:
                return True
        return False

    def reload_ahead(self, start: bool = True) -> None:
        """Issue this group's reload now if it was never made: a replay or prefire is about
        to read the block's residuals (``start``: and the prefetch that brings, Rule 5), or
        a later block's backward prefetches it (not ``start``)."""
        if not self.reloaded:
            with self.lock:
                if not self.reloaded:
                    if start:  # a prefetch adopts nothing into this backward's session
                        self._note_session()
                    self._reload(None)
        if start and not self.started:
            self._start()

    def _held_output(self, index: int) -> torch.Tensor | None:
        """A block output over buffer ``index``'s storage that the caller still holds, not
        modified since the block returned, or None (Rule 9)."""
        for ref, version, i in self.outputs:
            if i == index:
                t = ref()
                if t is not None and t._version == version:
                    return t
        return None

    def _reload(self, indices: list[int] | None) -> None:
        buffers = self.buffers
        self.reloaded = True
        if indices is None:
            indices = [i for i in range(len(buffers.host))
                       if not self.outputs or self._held_output(i) is None]
        if indices:
            buffers.reload(indices)

    def _start(self) -> None:
        """This block's backward began: reload the blocks it reaches next (Rule 5), unless
        registered to another session than this one (another micro-batch's)."""
        self.started = True
        prev = self.prev
        for _ in range(self.prefetch):
            group = prev() if prev is not None else None
            if group is None or group.started:
                break
            frame = group.frame()
            session = frame.session if frame is not None else None
            if frame is None or (session is not None and session is not self.session):
                break
            group.reload_ahead(start=False)
            prev = group.prev

    def _note_session(self) -> None:
        """Rule 6: a frame registered to (or read under) a session keeps its reload for the
        session."""
        if self.session is not None:
            return
        frame = self.frame()
        if frame is None:
            return
        session = frame.session
        if session is None:
            act = frame.activation()
            session = act.session if act is not None else None
        if session is None or session.cleared:
            return
        self.session = session
        _retain(session.id, self)
        buffers = self.buffers
        for i, ref in enumerate(buffers.dev_weak):  # what is still alive is kept again
            if buffers.dev[i] is None and ref is not None:
                buffers.dev[i] = ref()

    def release(self) -> None:
        """The session that retained the reload was cleared."""
        with self.lock:
            self.session = None
            buffers = self.buffers
            for i in range(len(buffers.dev)):
                buffers.dev[i] = None


def can_offload(t: torch.Tensor) -> bool:
    """Whether ``t`` can be restored from a copy of its storage's bytes (Rule 2): a plain
    strided tensor, not lazily conjugated or negated, not quantized, over a storage of a
    whole number of its elements."""
    if (t.__class__ is not torch.Tensor or t.layout is not torch.strided
            or t.is_conj() or t.is_neg() or t.is_quantized):
        return False
    nbytes = t.untyped_storage().nbytes()
    return nbytes > 0 and nbytes % t.element_size() == 0


class HostResidual:
    """A saved tensor offloaded to host memory: which buffer of its group, and its layout."""

    __slots__ = ("group", "index", "dtype", "shape", "stride", "offset", "replay_only",
                 "__weakref__")

    def __init__(self, group: HostGroup, index: int, dtype: torch.dtype, shape: torch.Size,
                 stride: tuple[int, ...], offset: int) -> None:
        self.group = group
        self.index = index
        self.dtype = dtype
        self.shape = shape
        self.stride = stride
        self.offset = offset
        self.replay_only = False  # kept only because the replay reads it (packs.py Rule 2b)

    def get(self) -> torch.Tensor:
        """Autograd unpacks it: a read that counts toward letting the reload go (Rule 6)."""
        return self.group.read(self, counts=True)

    def value(self) -> torch.Tensor:
        """The replay reads it: its last read if only the replay reads it; else autograd's
        own unpack is still to come, and the reload stays for it (Rule 6)."""
        return self.group.read(self, counts=self.replay_only)

    def fresh(self) -> bool:
        """Not modified in place since it was saved. (The replay recomputes a value it would
        read that is not fresh: packs.py Rule 2b.)"""
        group = self.group
        return not (group.written or group.outputs) or not group.modified(self.index)

    def __del__(self) -> None:
        try:
            self.group.buffers.left[self.index] -= 1
        except (AttributeError, IndexError):  # the group closed first, at shutdown
            pass

    @property
    def host(self) -> torch.Tensor:
        """The host buffer holding this residual's storage (for tests and reports)."""
        return self.group.buffers.host[self.index]


# -- which group a pack goes to ------------------------------------------------------------

_forward = threading.local()  # the last group made on this thread (its forward order: Rule 5)


def group_for(current: HostGroup | None, device: torch.device, pinned: bool, frame: Any,
              prefetch: int) -> HostGroup:
    """The group of the block recording now for a residual of ``device``: ``current`` if it
    fits, else a new one linked after the last group made on this thread."""
    if current is not None and current.buffers.device == device and (
            current.buffers.pool.pinned == pinned):
        current.prefetch = max(current.prefetch, prefetch)
        return current
    last = getattr(_forward, "last", None)
    group = HostGroup(device, pinned, frame, prefetch, last() if last is not None else None)
    _forward.last = weakref.ref(group)
    return group


# -- sessions (Rule 6) -----------------------------------------------------------------------

_retained: dict[Hashable, "weakref.WeakSet[HostGroup]"] = {}
_retained_lock = threading.Lock()


def _retain(session_id: Hashable, group: HostGroup) -> None:
    with _retained_lock:
        _retained.setdefault(session_id, weakref.WeakSet()).add(group)


def _on_clear(session_id: Hashable) -> None:
    with _retained_lock:
        groups = _retained.pop(session_id, None)
    for group in list(groups or ()):
        group.release()


_session.on_clear(_on_clear)
