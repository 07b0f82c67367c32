"""Benchmark: the memory-budget Pareto curve, measured: peak memory against step time.

A stack of ``ckptfx.bench.blocks.Block`` (pre-norm transformer, dropout 0.1), each block
``ckptfx.remat``'d under ``checkpoint_policies.memory_budget(f)`` for f = 0.0, 0.1, ..., 1.0,
beside the hand-picked policies (``nothing_saveable``, ``dots_saveable``,
``everything_saveable``), torch's checkpoint (``use_reentrant=False``) and no checkpoint.

Each variant runs in a fresh subprocess (``MALLOC_MMAP_THRESHOLD_=65536``, one thread): one
warm-up step (where a budget plans), then measured steps: the peak resident memory above the
step's start over forward + backward (``VmHWM``), the step time, and the backward's FLOPs
(``FlopCounterMode``, its recompute included). Medians over steps and repeats; the variants'
order alternates between repeats. Peaks are measured, not estimated: torch's compile-time
budget is known to give a peak that is not monotone in the budget (pytorch #197838).

It also times the planning of one block (``Frontier.from_recording``: scoring, the
min-cut hull and the branch and bound that proves the choice, ckptfx/budget/cut.py) and
prints what was proved: the median over fresh blocks, in this process.

Usage::

    python benchmarks/bench_budget.py            # d=256, seq 128, batch 8, 4 blocks
    python benchmarks/bench_budget.py --quick    # small shapes, one repeat

``run(quick=...)`` returns the rows, for ``ckptfx bench``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any

from ckptfx.bench.memory import MMAP_ENV, MMAP_VALUE, child_env
from ckptfx.bench.child import answer, run_json, script_parser

FRACTIONS = tuple(round(0.1 * i, 1) for i in range(11))
VARIANTS = ("none", "torch", "nothing", "dots", "everything",
            *(f"budget:{f}" for f in FRACTIONS))
MIB = 2**20


def _child(cfg: dict) -> dict:
    import torch
    import torch.utils.checkpoint as tcp
    from torch.utils.flop_counter import FlopCounterMode

    import ckptfx
    from ckptfx import checkpoint_policies as cp
    from ckptfx.bench.blocks import Block
    from ckptfx.bench.memory import measured_steps, small_mmap_threshold

    assert small_mmap_threshold()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    d, seq, batch, n = cfg["d"], cfg["seq"], cfg["batch"], cfg["blocks"]
    blocks = [Block(d, dropout=0.1, attention="matmul") for _ in range(n)]
    params = [p for b in blocks for p in b.parameters()]
    variant = cfg["variant"]
    if variant == "none":
        calls = list(blocks)
    elif variant == "torch":
        calls = [lambda h, b=b: tcp.checkpoint(b, h, use_reentrant=False) for b in blocks]
    else:
        if variant.startswith("budget:"):
            policies = ckptfx.memory_budget_policies(blocks, float(variant[7:]))
        else:
            policies = [getattr(cp, f"{variant}_saveable")] * n
        calls = [ckptfx.remat(b.forward, policy=p) for b, p in zip(blocks, policies)]
    x = torch.randn(batch, seq, d, requires_grad=True)

    def step(count: bool = False) -> int:
        h = x
        for c in calls:
            h = c(h)
        loss = h.sum()
        del h
        flops = 0
        if count:
            with FlopCounterMode(display=False) as fc:
                loss.backward()
            flops = fc.get_total_flops()
        else:
            loss.backward()
        for p in params:
            p.grad = None
        x.grad = None
        return flops

    step()  # warm-up: a budget plans here
    flops = step(count=True)
    peaks, times = measured_steps(step, cfg["steps"])
    return {"peak": peaks, "time": times, "flops": flops}


def _run_child(cfg: dict) -> dict:
    return run_json([sys.executable, os.path.abspath(__file__), "--child", json.dumps(cfg)],
                    child_env(1), f"subprocess for {cfg['variant']}")


def run(quick: bool = False, d: int = 256, seq: int = 128, batch: int = 8, blocks: int = 4,
        repeats: int = 2, steps: int = 3) -> list[dict[str, Any]]:
    """One row per variant: median peak (MiB), median step time (s), backward FLOPs."""
    if quick:
        d, seq, batch, blocks, repeats, steps = 128, 64, 4, 2, 1, 2
    base = dict(d=d, seq=seq, batch=batch, blocks=blocks, steps=steps)
    samples: dict[str, dict[str, list[float]]] = {v: {"peak": [], "time": []}
                                                   for v in VARIANTS}
    flops: dict[str, int] = {}
    for r in range(repeats):
        for v in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            res = _run_child({**base, "variant": v})
            samples[v]["peak"].extend(res["peak"])
            samples[v]["time"].extend(res["time"])
            flops[v] = res["flops"]
    return [{"variant": v, "peak_mib": statistics.median(samples[v]["peak"]) / MIB,
             "step_s": statistics.median(samples[v]["time"]), "backward_flops": flops[v]}
            for v in VARIANTS]


def planning(d: int, seq: int, batch: int, repeats: int = 5) -> dict[str, Any]:
    """Planning one ``Block``: median seconds of ``Frontier.from_recording`` over fresh
    blocks, and what it proved (candidate ops, cuts, whether every choice is exact)."""
    import torch

    import ckptfx
    from ckptfx import budget
    from ckptfx import checkpoint_policies as cp
    from ckptfx.bench.blocks import Block

    torch.set_num_threads(1)
    real = budget.Frontier.from_recording.__func__  # type: ignore[attr-defined]
    times: list[float] = []
    frontiers: list[Any] = []

    def timed(cls: Any, tracer: Any) -> Any:
        t0 = time.perf_counter()
        frontier = real(cls, tracer)
        times.append(time.perf_counter() - t0)
        frontiers.append(frontier)
        return frontier

    budget.Frontier.from_recording = classmethod(timed)  # type: ignore[method-assign]
    try:
        for _ in range(repeats):
            block = Block(d, dropout=0.1, attention="matmul")
            x = torch.randn(batch, seq, d, requires_grad=True)
            ckptfx.remat(block.forward, policy=cp.memory_budget(0.5))(x).sum().backward()
    finally:
        budget.Frontier.from_recording = classmethod(real)  # type: ignore[method-assign]
    f = frontiers[-1]
    return {"seconds": statistics.median(times), "units": f.units, "exact": f.exact,
            "cuts": f.proof.cuts if f.proof is not None else 0, "points": len(f.points),
            "repeats": repeats}


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__, d=256, seq=128, batch=8, steps=3)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    if args.child is not None:
        return answer(_child, args.child)
    t0 = time.perf_counter()
    rows = run(args.quick, args.d, args.seq, args.batch, args.blocks, args.repeats, args.steps)
    ref = {r["variant"]: r for r in rows}["torch"]
    print(f"{MMAP_ENV}={MMAP_VALUE}, 1 thread, fresh subprocess per variant; medians")
    print(f"  {'variant':12s} {'peak MiB':>9s} {'step s':>8s} {'bwd GFLOP':>10s} "
          f"{'peak/torch':>11s} {'time/torch':>11s}")
    for r in rows:
        print(f"  {r['variant']:12s} {r['peak_mib']:9.1f} {r['step_s']:8.3f} "
              f"{r['backward_flops'] / 1e9:10.3f} {r['peak_mib'] / ref['peak_mib']:11.2f} "
              f"{r['step_s'] / ref['step_s']:11.2f}")
    budget = [r for r in rows if r["variant"].startswith("budget:")]
    mono = all(a["backward_flops"] >= b["backward_flops"] for a, b in zip(budget, budget[1:]))
    print(f"\nbackward FLOPs non-increasing in the budget: {mono}")
    d, seq, batch = (128, 64, 4) if args.quick else (args.d, args.seq, args.batch)
    p = planning(d, seq, batch, repeats=1 if args.quick else 5)
    print(f"planning one block (d={d} seq {seq} batch {batch}): {p['units']} candidate ops, "
          f"{p['points']} frontier points, {p['cuts']} min cuts, every choice proven exact: "
          f"{p['exact']}; median {p['seconds']:.3f} s over {p['repeats']} fresh blocks; "
          f"{time.perf_counter() - t0:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
