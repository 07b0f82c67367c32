"""Benchmark: what keeping collectives costs a checkpoint forward once torch.distributed is up.

Where ``torch.distributed`` is initialized, ``ckptfx.checkpoint``'s forward runs under a
dispatch mode that logs the block's collectives (``ckptfx.kernel.collectives``), so its replay never
calls one again. This times the forward of one checkpoint call on a tiny block (sin of 4
floats: the per-call cost) and of a stack of 6 checkpointed MLP blocks (d=256, batch 64, a
forward and backward step), with a one-rank gloo process group initialized and destroyed in
turn (alternated, medians).

Usage::

    python benchmarks/bench_distributed.py
"""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

import ckptfx


def _per_call(fn: Callable[[], object], n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n


def main(rounds: int = 7) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    tiny = torch.randn(4, requires_grad=True)
    blocks = [nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
              for _ in range(6)]
    x = torch.randn(64, 256, requires_grad=True)

    def call() -> object:
        return ckptfx.checkpoint(torch.sin, tiny)

    def step() -> object:
        h = x
        for b in blocks:
            h = ckptfx.checkpoint(b, h)
        h.sum().backward()
        return None

    cases = {"one call (sin of 4 floats)": (call, 2000), "6 MLP blocks d=256 step": (step, 5)}
    for fn, n in cases.values():
        _per_call(fn, max(1, n // 10))  # warm up
    times: dict[str, dict[bool, list[float]]] = {k: {True: [], False: []} for k in cases}
    path = tempfile.mktemp(prefix="ckptfx_bench_pg_")
    for r in range(rounds):
        for on in ((False, True) if r % 2 == 0 else (True, False)):  # no position bias
            if on:
                dist.init_process_group("gloo", store=dist.FileStore(f"{path}{r}", 1),
                                        rank=0, world_size=1)
            try:
                for name, (fn, n) in cases.items():
                    times[name][on].append(_per_call(fn, n))
            finally:
                if on:
                    dist.destroy_process_group()
    for name, t in times.items():
        on, off = statistics.median(t[True]), statistics.median(t[False])
        print(f"{name}: {on * 1e6:.1f} us with torch.distributed initialized, "
              f"{off * 1e6:.1f} us without ({on / off:.2f}x)")


if __name__ == "__main__":
    main()
