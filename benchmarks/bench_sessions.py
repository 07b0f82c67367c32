"""Benchmark: a zero-bubble split step over checkpointed blocks, ckptfx sessions vs torch.

One step = forward of a stack of checkpointed MLP blocks, then dx
(``autograd.grad(out, x, retain_graph=True)``), then one ``autograd.grad`` per parameter
(dw split per parameter group, as torch.distributed.pipelining does). Variants, all timed in
the same run, alternated, medians reported as ratios to no checkpointing:

- ``none``    no checkpointing (the baseline)
- ``torch``   torch.utils.checkpoint(use_reentrant=False): one replay per backward call
- ``ckptfx``  ckptfx.checkpoint with a recompute session: collector, prefire, dx under
              retain_on_unpack=True, dw under retain=True (last group: False), clear
- ``ckptfx-lazy``  the same without the collector and prefire (dx replays)
- ``vjp_split``    ckptfx.checkpoint blocks under ckptfx.vjp_split: prefire, dx_fn, then its
              own weight pass dw_fn (weight-gradient ops only, all parameters at once)
- ``fused``   no checkpointing, one ``autograd.grad`` for x and every parameter: the floor
              any split backward is measured against (not a split step)

Block runs are counted by a counter inside the block and reported per block per step.
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
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as tcp

import ckptfx
from ckptfx.bench.overhead_split import split_backward


class MLPBlock(nn.Module):
    """x + fc2(gelu(fc1(x))); ``calls[0]`` counts forward calls (forward and replays)."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, hidden), nn.Linear(hidden, d)
        # a list, not an int attribute: nn.Module.__setattr__ costs ~5 us per call
        self.calls = [0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls[0] += 1
        return x + self.fc2(F.gelu(self.fc1(x)))


def make_step(variant: str, blocks: list[MLPBlock], x: torch.Tensor,
              g: torch.Tensor) -> Callable[[], None]:
    params = [p for b in blocks for p in b.parameters()]

    def step_none() -> None:
        h = x
        for b in blocks:
            h = b(h)
        split_backward(h, x, params, g, None)

    def step_torch() -> None:
        h = x
        for b in blocks:
            h = tcp.checkpoint(b, h, use_reentrant=False)
        split_backward(h, x, params, g, None)

    def stack(h: torch.Tensor) -> torch.Tensor:
        for b in blocks:
            h = ckptfx.checkpoint(b, h)
        return h

    def step_ckptfx() -> None:
        with ckptfx.recompute_handle_collector_ctx() as handles:
            h = stack(x)
        try:
            for hd in handles:
                ckptfx.recompute_handle(hd, "mb")
            split_backward(h, x, params, g, "mb")
        finally:
            ckptfx.clear_recompute_session("mb")

    def step_ckptfx_lazy() -> None:
        h = stack(x)
        try:
            split_backward(h, x, params, g, "mb")
        finally:
            ckptfx.clear_recompute_session("mb")

    def step_vjp_split() -> None:
        _, dx_fn, dw_fn = ckptfx.vjp_split(stack, x, params=params, session="mb")
        dx_fn.prefire()
        dx_fn(g)
        dw_fn()
        for p in params:  # dw_fn accumulates into .grad; start each step from None
            p.grad = None

    def step_fused() -> None:
        h = x
        for b in blocks:
            h = b(h)
        torch.autograd.grad(h, [x, *params], g)

    return {"none": step_none, "torch": step_torch, "ckptfx": step_ckptfx,
            "ckptfx-lazy": step_ckptfx_lazy, "vjp_split": step_vjp_split,
            "fused": step_fused}[variant]


VARIANTS = ("none", "torch", "ckptfx", "ckptfx-lazy", "vjp_split", "fused")


def bench_split(d: int, hidden: int, batch: int, nblocks: int, rounds: int,
                inner: int) -> dict[str, tuple[float, float]]:
    """Median seconds per step and block runs per block per step, for each variant."""
    torch.manual_seed(0)
    blocks = [MLPBlock(d, hidden) for _ in range(nblocks)]
    x = torch.randn(batch, d, requires_grad=True)
    g = torch.randn(batch, d)
    steps = {v: make_step(v, blocks, x, g) for v in VARIANTS}
    runs: dict[str, float] = {}
    for v, step in steps.items():  # warm up, and count runs on one step
        step()
        for b in blocks:
            b.calls[0] = 0
        step()
        runs[v] = sum(b.calls[0] for b in blocks) / nblocks
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(rounds):
        order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]  # alternate
        for v in order:
            step = steps[v]
            t0 = time.perf_counter()
            for _ in range(inner):
                step()
            times[v].append((time.perf_counter() - t0) / inner)
    return {v: (statistics.median(times[v]), runs[v]) for v in VARIANTS}


def bench_phases(d: int, hidden: int, batch: int, nblocks: int, rounds: int) -> dict[str, float]:
    """Median ms of each phase of the step: no checkpoint (forward, backward) against ckptfx
    (forward, prefire, backward under the session) - where the split step's overhead goes."""
    torch.manual_seed(0)
    blocks = [MLPBlock(d, hidden) for _ in range(nblocks)]
    x = torch.randn(batch, d, requires_grad=True)
    g = torch.randn(batch, d)
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
    ckptfx remat (its calls after the first run unrecorded: ckptfx.rerun) and remat with
    ``always_record=True`` (which records the block's ops: one op here)."""
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
    times: dict[str, list[float]] = {k: [] for k in calls}
    for fn in calls.values():
        for _ in range(inner):
            fn()
    for r in range(rounds):
        order = list(calls) if r % 2 == 0 else list(calls)[::-1]
        for k in order:
            fn = calls[k]
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            times[k].append((time.perf_counter() - t0) / inner * 1e6)
    return {k: statistics.median(v) for k, v in times.items()}


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
        print(f"  {'variant':12s} {'ms/step':>9s} {'vs none':>8s} {'runs/block':>11s}")
        for v in VARIANTS:
            t, runs = res[v]
            print(f"  {v:12s} {t * 1e3:9.3f} {t / base:7.3f}x {runs:11.1f}")

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
