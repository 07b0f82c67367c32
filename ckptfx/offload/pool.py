"""Host buffers for offloaded residuals, reused across steps (``ckptfx.offload``, Rule 4).

One pool per device (and per kind of host memory): its buffers are only ever written and read
by copies on that device's side stream, in issue order, so a buffer handed back while a copy
out of it is still queued can be handed out again at once: the next copy into it is queued
after that one.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import torch

from ckptfx.kernel.frame import CheckpointError

__all__ = ["HostPool", "OffloadPoolStats", "empty_offload_pool", "offload_pool_stats", "pool_for"]


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


class HostPool:
    """Free host buffers (1-D uint8) of one device and one kind of memory, by byte size."""

    def __init__(self, device: torch.device, pinned: bool) -> None:
        self.device = device
        self.pinned = pinned
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.in_use = 0
        self.cached = 0
        self.allocations = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """A host buffer of exactly ``nbytes`` bytes: a free one, else a new one."""
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                self.cached -= nbytes
                self.in_use += nbytes
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
                                             "(offload_dst='cpu')" if self.pinned else "")
            ) from err
        with self._lock:
            self.in_use += nbytes
            self.allocations += 1
        return buf

    def _allocate(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=self.pinned)

    def give(self, buf: torch.Tensor) -> None:
        """Hand ``buf`` back for a later ``take`` (any copy out of it is already queued)."""
        nbytes = buf.numel()
        with self._lock:
            self.in_use -= nbytes
            self.cached += nbytes
            self._free.setdefault(nbytes, []).append(buf)

    def empty(self) -> None:
        with self._lock:
            self._free.clear()
            self.cached = 0


_pools: dict[tuple[torch.device, bool], HostPool] = {}
_pools_lock = threading.Lock()


def pool_for(device: torch.device, pinned: bool) -> HostPool:
    """The pool of host buffers for residuals of ``device`` (pinned or pageable)."""
    key = (device, pinned)
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
