"""Benchmark: a zero-bubble split step over checkpointed blocks, ckptfx sessions vs torch.

One step = forward of a stack of checkpointed MLP blocks, then dx
(``autograd.grad(out, x, retain_graph=True)``), then one ``autograd.grad`` per parameter
(dw split per parameter group, as torch.distributed.pipelining does). Variants, all timed in
the same run, alternated, medians reported as ratios to no checkpointing. The steps are
``ckptfx.bench.overhead_split.split_steps`` (``ckptfx bench --overhead --only split`` times
them at the small size, with their floors):

- ``none``    no checkpointing (the baseline)
- ``torch checkpoint``  torch.utils.checkpoint(use_reentrant=False): one replay per
              backward call
- ``ckptfx sessions``  ckptfx.checkpoint with a recompute session: collector, prefire, dx
              under retain_on_unpack=True, dw under retain=True (last group: False), clear
- ``ckptfx sessions, no prefire``  the same without the collector and prefire (dx replays)
- ``vjp_split``    ckptfx.checkpoint blocks under ckptfx.vjp_split: prefire, dx_fn, then its
              own weight pass dw_fn (weight-gradient ops only, all parameters at once)
- ``fused``   no checkpointing, one ``autograd.grad`` for x and every parameter: the floor
              any split backward is measured against (not a split step)

Block runs are counted on one step of each variant (``ckptfx.bench.blocks.count_runs``,
outside the timed steps) and reported per block per step.
It also times the forward overhead of one checkpoint call (ckptfx.checkpoint and remat vs
torch) on a tiny block.

Usage::

    python benchmarks/bench_sessions.py            # full
    python benchmarks/bench_sessions.py --quick    # a few seconds
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.utils.checkpoint as tcp

import ckptfx
from ckptfx.bench.blocks import count_runs
from ckptfx.bench.figures import medians, rounds_of
from ckptfx.bench.overhead_split import split_backward, split_inputs, split_steps


def bench_split(d: int, hidden: int, batch: int, nblocks: int, rounds: int,
                inner: int) -> dict[str, tuple[float, float]]:
    """Median seconds per step and block runs per block per step, for each variant."""
    blocks, x, g = split_inputs(d, hidden, batch, nblocks)
    steps = split_steps(blocks, x, g)
    runs: dict[str, float] = {}
    for v, step in steps.items():  # warm up, and count runs on one step
        step()
        runs[v] = count_runs(blocks, step) / nblocks
    times = medians(rounds_of(steps, rounds, inner, clock=time.perf_counter))
    return {v: (times[v], runs[v]) for v in steps}


def bench_phases(d: int, hidden: int, batch: int, nblocks: int, rounds: int) -> dict[str, float]:
    """Median ms of each phase of the step: no checkpoint (forward, backward) against ckptfx
    (forward, prefire, backward under the session) - where the split step's overhead goes."""
    blocks, x, g = split_inputs(d, hidden, batch, nblocks)
    params = [p for b in blocks for p in b.parameters()]
    times: dict[str, list[float]] = {k: [] for k in
                                     ("none fwd", "none bwd", "ckptfx fwd", "prefire", "ckptfx bwd")}
    for r in range(rounds + 1):  # the first round warms up
        t0 = time.perf_counter()
        h = x
        for b in blocks:
            h = b(h)
        t1 = time.perf_counter()
        split_backward(h, x, params, g, None)
        t2 = time.perf_counter()
        with ckptfx.recompute_handle_collector_ctx() as handles:
            h = x
            for b in blocks:
                h = ckptfx.checkpoint(b, h)
        t3 = time.perf_counter()
        try:
            for hd in handles:
                ckptfx.recompute_handle(hd, "mb")
            t4 = time.perf_counter()
            split_backward(h, x, params, g, "mb")
            t5 = time.perf_counter()
        finally:
            ckptfx.clear_recompute_session("mb")
        if r:
            for k, v in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
                times[k].append(v)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def _tiny(t: torch.Tensor) -> torch.Tensor:
    return t.sin()


def bench_forward_overhead(rounds: int, inner: int) -> dict[str, float]:
    """Median microseconds per forward call: plain, torch checkpoint, ckptfx checkpoint,
    ckptfx remat (its calls after the first run unrecorded: ckptfx.recording.unrecorded) and
    remat with ``always_record=True`` (which records the block's ops: one op here)."""
    x = torch.randn(4, requires_grad=True)
    remat_tiny = ckptfx.remat(_tiny)
    recorded_tiny = ckptfx.remat(_tiny, always_record=True)
    calls: dict[str, Callable[[], object]] = {
        "plain": lambda: _tiny(x),
        "torch": lambda: tcp.checkpoint(_tiny, x, use_reentrant=False),
        "ckptfx": lambda: ckptfx.checkpoint(_tiny, x),
        "remat": lambda: remat_tiny(x),
        "recorded": lambda: recorded_tiny(x),
    }
    times = medians(rounds_of(calls, rounds, inner, clock=time.perf_counter))
    return {k: t * 1e6 for k, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few rounds (smoke run)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per variant")
    parser.add_argument("--phases", action="store_true",
                        help="only the phase breakdown of the large split step")
    args = parser.parse_args()
    torch.set_num_threads(1)
    quick = args.quick
    print(f"torch {torch.__version__}, ckptfx {ckptfx.__version__}, 1 thread"
          + (", --quick" if quick else ""))

    configs = [
        ("small", dict(d=64, hidden=256, batch=8), 30 if not quick else 5, 20 if not quick else 5),
        ("large", dict(d=512, hidden=2048, batch=64), 15 if not quick else 3, 2 if not quick else 1),
    ]
    nblocks = 6
    if args.phases:
        ph = bench_phases(nblocks=nblocks, rounds=args.rounds or 12, **configs[1][1])
        plain = ph["none fwd"] + ph["none bwd"]
        print(f"\nphases of the large split step, ms (medians): {ph}")
        print(f"  plain step {plain:.1f} ms; ckptfx adds forward "
              f"{ph['ckptfx fwd'] - ph['none fwd']:+.1f}, prefire {ph['prefire']:+.1f} "
              f"({ph['prefire'] / plain:.1%}), backward {ph['ckptfx bwd'] - ph['none bwd']:+.1f} ms")
        return
    for name, shape, rounds, inner in configs:
        rounds = args.rounds or rounds
        res = bench_split(nblocks=nblocks, rounds=rounds, inner=inner, **shape)
        base = res["none"][0]
        print(f"\nsplit step, {nblocks} MLP blocks {name} {shape}, dx + one dw call per "
              f"parameter ({4 * nblocks}); median of {rounds}x{inner} steps")
        print(f"  {'variant':28s} {'ms/step':>9s} {'vs none':>8s} {'runs/block':>11s}")
        for v, (t, runs) in res.items():
            print(f"  {v:28s} {t * 1e3:9.3f} {t / base:7.3f}x {runs:11.1f}")

    rounds, inner = (5, 200) if quick else (31, 2000)
    ov = bench_forward_overhead(rounds, inner)
    print(f"\nforward of one checkpoint call on a tiny block (sin of 4 floats), median of "
          f"{rounds}x{inner} calls")
    for k, us in ov.items():
        extra = "" if k == "plain" else f"   overhead {us - ov['plain']:6.1f} us"
        print(f"  {k:8s} {us:7.1f} us/call{extra}")
    for k in ("ckptfx", "remat", "recorded"):
        print(f"  {k} overhead / torch overhead: "
              f"{(ov[k] - ov['plain']) / (ov['torch'] - ov['plain']):.2f}")


if __name__ == "__main__":
    main()
