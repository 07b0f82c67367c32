"""Peak memory of one training step, measured: the host's resident set on CPU, the device
allocator's peak on an accelerator.

On CPU (Linux) the peak is ``VmHWM`` from ``/proc/self/status``, reset by writing ``5`` to
``/proc/self/clear_refs``. glibc keeps freed blocks below its mmap threshold in the heap,
where the resident size never shrinks, so the reading says little unless the process started
with ``MALLOC_MMAP_THRESHOLD_=65536`` (freed tensors then go back to the OS at once); the
allocator reads the variable at start, so the benchmarks run each measurement in a fresh
subprocess started with it (``child_env``), or re-run themselves with it
(``reexec_with_small_mmap_threshold``, the scripts in ``benchmarks/``). On CUDA/NPU/XPU the
peak is the device allocator's ``max_memory_allocated`` (``torch.accelerator`` when torch
has it).
"""

from __future__ import annotations

import gc
import os
import sys
import time
from typing import Any, Callable

import torch

__all__ = ["MMAP_ENV", "MMAP_VALUE", "Meter", "child_env", "measured_steps",
           "peak_above_start", "reexec_with_small_mmap_threshold", "reset_hwm",
           "small_mmap_threshold", "vm_hwm", "vm_rss"]

MMAP_ENV = "MALLOC_MMAP_THRESHOLD_"
MMAP_VALUE = "65536"


def small_mmap_threshold() -> bool:
    """True when this process started with the threshold the CPU peak readings need."""
    return os.environ.get(MMAP_ENV) == MMAP_VALUE


def child_env(threads: int) -> dict[str, str]:
    """The environment of a measuring subprocess: small mmap threshold, ``threads`` threads."""
    env = dict(os.environ)
    env[MMAP_ENV] = MMAP_VALUE
    env["OMP_NUM_THREADS"] = str(threads)
    return env


def reexec_with_small_mmap_threshold() -> None:
    """Re-run this script with the small mmap threshold set (returns only when it already
    is): glibc reads it at start, so setting it later changes nothing."""
    if not small_mmap_threshold():
        os.environ[MMAP_ENV] = MMAP_VALUE
        os.execv(sys.executable, [sys.executable, *sys.argv])


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status (the CPU readings need Linux)")


def vm_hwm() -> int:
    """The process's peak resident memory since the last ``reset_hwm``, in bytes."""
    return _status("VmHWM:")


def vm_rss() -> int:
    """The process's resident memory now, in bytes."""
    return _status("VmRSS:")


def reset_hwm() -> None:
    """Reset the peak to the current resident memory."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_above_start(fn: Callable[[], object], device: torch.device | str = "cpu") -> int:
    """Bytes of memory ``fn()`` needed above what was in use when it started, on ``device``
    (CPU: the resident set; see ``Meter``)."""
    meter = Meter(torch.device(device))
    meter.start()
    fn()
    return meter.peak()


def measured_steps(step: Callable[[], object], steps: int) -> tuple[list[int], list[float]]:
    """``steps`` calls of ``step`` on the CPU, each from a collected heap: the peak resident
    bytes of each above its start, and its seconds (wall clock: the peak reading's own
    system calls stay outside)."""
    peaks, times = [], []
    meter = Meter(torch.device("cpu"))
    for _ in range(steps):
        gc.collect()
        meter.start()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
        peaks.append(meter.peak())
    return peaks, times


class Meter:
    """Peak and current memory above a start point, on ``device`` (CPU: resident set)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cpu = device.type == "cpu"
        self._start = 0

    def start(self) -> None:
        """Make now the zero of ``peak`` and ``now``."""
        if self.cpu:
            reset_hwm()
            self._start = vm_hwm()
        else:
            acc = _accelerator_memory()
            acc.reset_peak_memory_stats(self.device)
            self._start = acc.memory_allocated(self.device)

    def peak(self) -> int:
        """Peak bytes above the start since ``start()``."""
        if self.cpu:
            return vm_hwm() - self._start
        return _accelerator_memory().max_memory_allocated(self.device) - self._start

    def now(self) -> int:
        """Bytes held above the start now."""
        if self.cpu:
            return vm_rss() - self._start
        return _accelerator_memory().memory_allocated(self.device) - self._start


def _accelerator_memory() -> Any:
    """``torch.accelerator`` (torch >= 2.8 has the memory functions there), else torch.cuda."""
    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "max_memory_allocated"):
        return acc
    return torch.cuda
