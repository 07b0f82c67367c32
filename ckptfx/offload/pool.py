"""Host buffers for offloaded residuals, reused across steps (``ckptfx.offload``, Rule 4).

One pool per device, kind of host memory and stream: its buffers are only ever written and
read by copies on that stream (the device's side stream), in issue order, so a buffer handed
back while a copy out of it is still queued can be handed out again at once: the next copy
into it is queued after that one.

Sizes are rounded up to classes (eight per power of two: at most 1/8 more than asked), so
steps whose shapes vary reuse buffers, and the cached bytes never exceed twice the most the
pool's residuals ever held at once: a buffer handed back past that is freed instead.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import torch

from ckptfx.kernel.frame import CheckpointError

__all__ = ["HostPool", "OffloadPoolStats", "empty_offload_pool", "offload_pool_stats", "pool_for",
           "size_class"]


class OffloadPoolStats(NamedTuple):
    """What the offload pools hold now, over every device.

    ``in_use_bytes``: host bytes holding residuals of live graphs; ``cached_bytes``: free
    buffers kept for later steps; ``allocations``: host buffers allocated since the process
    started (a step that finds its buffers in the pool allocates none).

    Example::

        stats = ckptfx.offload_pool_stats()
        print(f"{stats.in_use_bytes / 2**20:.1f} MiB of residuals in host memory")
    """

    in_use_bytes: int
    cached_bytes: int
    allocations: int


def size_class(nbytes: int) -> int:
    """``nbytes`` rounded up to its class: a multiple of 4 KiB, and of 1/8 of its power of
    two above that."""
    step = max(4096, 1 << max(0, nbytes.bit_length() - 4))
    return -(-nbytes // step) * step


class HostPool:
    """Free host buffers (1-D uint8) of one device, one kind of memory and one stream, by
    size class."""

    def __init__(self, device: torch.device, pinned: bool) -> None:
        self.device = device
        self.pinned = pinned
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.in_use = 0
        self.cached = 0
        self.most_in_use = 0  # twice this caps the cached bytes
        self.allocations = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """A host buffer of at least ``nbytes`` bytes (its size class): a free one, else a
        new one."""
        nbytes = size_class(nbytes)
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                self.cached -= nbytes
                self._use(nbytes)
                return free.pop()
        try:
            buf = self._allocate(nbytes)
        except RuntimeError as err:
            kind = "pinned " if self.pinned else ""
            raise CheckpointError(
                f"ckptfx offload: could not allocate {nbytes} bytes of {kind}host memory for a "
                f"residual of {self.device} ({err}). Free host memory "
                "(ckptfx.empty_offload_pool() releases the buffers kept for later steps), "
                "offload less (a smaller offload budget, fewer names, a larger "
                "Offload(min_bytes=...))" + (", or offload to pageable memory "
                                             "(offload_dst='cpu'; its copies do not overlap "
                                             "the computation)" if self.pinned else "")
            ) from err
        with self._lock:
            self._use(nbytes)
            self.allocations += 1
        return buf

    def _use(self, nbytes: int) -> None:
        self.in_use += nbytes
        self.most_in_use = max(self.most_in_use, self.in_use)

    def _allocate(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=self.pinned)

    def give(self, buf: torch.Tensor) -> None:
        """Hand ``buf`` back for a later ``take`` (any copy out of it is already queued)."""
        nbytes = buf.numel()
        with self._lock:
            self.in_use -= nbytes
            if self.cached + nbytes > 2 * self.most_in_use:
                return  # over the cap: freed (torch's host allocator waits for its copies)
            self.cached += nbytes
            self._free.setdefault(nbytes, []).append(buf)

    def empty(self) -> None:
        with self._lock:
            self._free.clear()
            self.cached = 0
            self.most_in_use = self.in_use


_pools: dict[tuple[torch.device, bool, int], HostPool] = {}
_pools_lock = threading.Lock()


def pool_for(device: torch.device, pinned: bool, stream: torch.Stream) -> HostPool:
    """The pool of host buffers for residuals of ``device`` (pinned or pageable) copied on
    ``stream``."""
    key = (device, pinned, stream.stream_id)
    pool = _pools.get(key)
    if pool is None:
        with _pools_lock:
            pool = _pools.setdefault(key, HostPool(device, pinned))
    return pool


def offload_pool_stats() -> OffloadPoolStats:
    """Host memory of offloaded residuals: in use by live graphs, cached for later steps,
    and how many buffers were ever allocated.

    Example::

        loss.backward()
        assert ckptfx.offload_pool_stats().in_use_bytes == 0   # nothing held past the step
    """
    with _pools_lock:
        pools = list(_pools.values())
    return OffloadPoolStats(sum(p.in_use for p in pools), sum(p.cached for p in pools),
                     sum(p.allocations for p in pools))


def empty_offload_pool() -> None:
    """Free the host buffers the offload pools keep for later steps (buffers holding
    residuals of live graphs stay). As ``torch.cuda.empty_cache`` is for device memory.

    Example::

        train(model)                  # offloading policies filled the pool
        ckptfx.empty_offload_pool()   # give the pinned host memory back before evaluating
    """
    with _pools_lock:
        pools = list(_pools.values())
    for pool in pools:
        pool.empty()
