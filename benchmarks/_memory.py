"""Peak resident memory for the scripts in benchmarks/: ``ckptfx.bench.memory`` (where the
readings and their conditions are described), plus the re-exec these scripts do at start.
"""

from __future__ import annotations

import os
import sys

from ckptfx.bench.memory import (MMAP_ENV, MMAP_VALUE, peak_above_start, reset_hwm,
                                 small_mmap_threshold, vm_hwm, vm_rss)

__all__ = ["MMAP_ENV", "MMAP_VALUE", "peak_above_start", "reexec_with_small_mmap_threshold",
           "reset_hwm", "small_mmap_threshold", "vm_hwm", "vm_rss"]


def reexec_with_small_mmap_threshold() -> None:
    """Re-run this script with the threshold set (returns only when it already is): glibc
    reads it at start, so setting it later changes nothing."""
    if not small_mmap_threshold():
        os.environ[MMAP_ENV] = MMAP_VALUE
        os.execv(sys.executable, [sys.executable, *sys.argv])
