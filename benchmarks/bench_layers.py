"""Benchmark: remat over n repeated layers, memory and time against n.

Variants, for a stack of n ``ckptfx.bench.blocks.Block``s (pre-norm transformer, dropout
0.1):

- ``none``: no checkpoint;
- ``every1``: ``ckptfx.checkpoint_layers(layers, x, every=1)``, one checkpoint per layer;
- ``sqrt``: ``ckptfx.checkpoint_layers(layers, x, every=round(sqrt(n)))``;
- ``auto``: ``ckptfx.checkpoint_layers(layers, x)``, the group size from the first layer's
  measured saved bytes A and input bytes I: round(sqrt((n - 1) I / A));
- ``torch_seq`` / ``ckptfx_seq``: ``checkpoint_sequential(layers, round(sqrt(n)), x)``,
  torch's and ckptfx's (all segments but the last checkpointed).

Each (n, variant) runs in a fresh subprocess (``MALLOC_MMAP_THRESHOLD_=65536``, one
thread): a warm-up step, then measured steps: peak resident memory above the step's start
over forward + backward (``VmHWM``; weight gradients stay allocated from the warm-up, so
the peak is activations and replays) and step time; medians.

Usage::

    python benchmarks/bench_layers.py                 # n = 4, 9, 16, 36; d=64 seq 128 batch 8
    python benchmarks/bench_layers.py --quick         # n = 4, 9
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

from ckptfx.bench.memory import MMAP_ENV, MMAP_VALUE, child_env
from ckptfx.bench.child import answer, run_json, script_parser

VARIANTS = ("none", "every1", "sqrt", "auto", "torch_seq", "ckptfx_seq")
MIB = 2**20


def _child(cfg: dict) -> dict:
    import math

    import torch
    import torch.utils.checkpoint as tcp

    import ckptfx
    from ckptfx.bench.blocks import Block
    from ckptfx.bench.memory import measured_steps, small_mmap_threshold

    assert small_mmap_threshold()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    n, d = cfg["n"], cfg["d"]
    layers = torch.nn.ModuleList(Block(d, dropout=0.1, attention="matmul") for _ in range(n))
    segments = max(1, round(math.sqrt(n)))
    x = torch.randn(cfg["batch"], cfg["seq"], d, requires_grad=True)
    variant = cfg["variant"]

    def forward() -> torch.Tensor:
        if variant == "none":
            h = x
            for layer in layers:
                h = layer(h)
            return h
        if variant == "every1":
            return ckptfx.checkpoint_layers(layers, x, every=1)
        if variant == "sqrt":
            return ckptfx.checkpoint_layers(layers, x, every=segments)
        if variant == "auto":
            return ckptfx.checkpoint_layers(layers, x)
        if variant == "torch_seq":
            return tcp.checkpoint_sequential(layers, segments, x, use_reentrant=False)
        return ckptfx.checkpoint_sequential(layers, segments, x)

    def step() -> None:
        forward().sum().backward()
        # gradients stay allocated (zeroed, not freed): the peak above the step's start is
        # then activations and replays alone, not n layers of weight gradients
        layers.zero_grad(set_to_none=False)
        x.grad.zero_()

    step()
    peaks, times = measured_steps(step, cfg["steps"])
    return {"peak": statistics.median(peaks), "time": statistics.median(times)}


def _run_child(cfg: dict) -> dict:
    return run_json([sys.executable, os.path.abspath(__file__), "--child", json.dumps(cfg)],
                    child_env(1), f"subprocess for {cfg}")


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__, d=64, seq=128, batch=8, steps=3)
    parser.add_argument("--ns", default="4,9,16,36")
    args = parser.parse_args(argv)
    if args.child is not None:
        return answer(_child, args.child)
    ns = [4, 9] if args.quick else [int(s) for s in args.ns.split(",")]
    t0 = time.perf_counter()
    print(f"{MMAP_ENV}={MMAP_VALUE}, 1 thread, fresh subprocess per (n, variant); "
          f"d={args.d} seq={args.seq} batch={args.batch}; medians of {args.steps} steps")
    print(f"  {'n':>3s} " + "".join(f" {v + ' MiB':>14s}" for v in VARIANTS)
          + "".join(f" {v + ' s':>12s}" for v in VARIANTS))
    for i, n in enumerate(ns):
        res = {}
        for v in VARIANTS if i % 2 == 0 else VARIANTS[::-1]:
            res[v] = _run_child(dict(n=n, d=args.d, seq=args.seq, batch=args.batch,
                                     steps=args.steps, variant=v))
        print(f"  {n:3d} " + "".join(f" {res[v]['peak'] / MIB:14.1f}" for v in VARIANTS)
              + "".join(f" {res[v]['time']:12.3f}" for v in VARIANTS))
    print(f"{time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
