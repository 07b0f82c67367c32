"""Peak resident memory of a CPU run, for the benchmarks (Linux).

glibc keeps freed blocks below its mmap threshold in the heap, where the resident size never
shrinks, so a peak read from ``VmHWM`` says little unless the process started with
``MALLOC_MMAP_THRESHOLD_=65536`` (freed tensors then go back to the OS at once). The
allocator reads the variable at start: ``reexec_with_small_mmap_threshold`` re-runs the script
with it before torch is imported.
"""

from __future__ import annotations

import os
import sys
from typing import Callable

MMAP_ENV = "MALLOC_MMAP_THRESHOLD_"
MMAP_VALUE = "65536"


def small_mmap_threshold() -> bool:
    """True when this process started with the threshold the peak readings need."""
    return os.environ.get(MMAP_ENV) == MMAP_VALUE


def reexec_with_small_mmap_threshold() -> None:
    """Re-run this script with the threshold set (returns only when it already is)."""
    if not small_mmap_threshold():
        os.environ[MMAP_ENV] = MMAP_VALUE
        os.execv(sys.executable, [sys.executable, *sys.argv])


def vm_hwm() -> int:
    """The process's peak resident memory since the last ``reset_hwm``, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmHWM not in /proc/self/status")


def reset_hwm() -> None:
    """Reset the peak to the current resident memory."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_above_start(fn: Callable[[], object]) -> int:
    """Bytes of resident memory ``fn()`` needed above what was resident when it started."""
    reset_hwm()
    start = vm_hwm()
    fn()
    return vm_hwm() - start
