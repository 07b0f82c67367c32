"""Benchmark: ``ckptfx.checkpoint`` against ``torch.utils.checkpoint`` and no checkpoint.

Two measurements, each reported as ratios between variants measured in the same run:

1. A stack of checkpointed transformer blocks: forward+backward time (median over repeats,
   the variants alternated) and peak memory over one step (CPU: the rise of ``VmHWM`` from
   ``/proc/self/status`` after resetting it through ``/proc/self/clear_refs``; CUDA:
   ``max_memory_allocated``).
2. Per-call forward overhead of one checkpoint call on tiny tensors, in microseconds, and
   the same for a forward+backward.

The target: ckptfx's step time within 1.05x of torch's checkpoint and its peak memory at most
torch's (the verdict judges both). ``bench_memory.py`` measures peaks in fresh processes.

Usage::

    python benchmarks/bench_checkpoint.py            # 6 blocks, d=256, seq 128, batch 8
    python benchmarks/bench_checkpoint.py --quick    # a smaller, faster run

The script re-executes itself with ``MALLOC_MMAP_THRESHOLD_=65536`` so that freed tensors go
back to the OS and the peak memory reading means something.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from typing import Callable

from ckptfx.bench.memory import MMAP_ENV, reexec_with_small_mmap_threshold

if __name__ == "__main__":
    reexec_with_small_mmap_threshold()

import torch  # noqa: E402  (after the re-exec: the allocator reads the variable at start)
import torch.utils.checkpoint as torch_checkpoint  # noqa: E402
from torch import nn  # noqa: E402

import ckptfx  # noqa: E402
from ckptfx.bench.blocks import encoder_stack  # noqa: E402
from ckptfx.bench.child import add_shape_options  # noqa: E402
from ckptfx.bench.figures import medians, rounds_of, verdict  # noqa: E402
from ckptfx.bench.memory import peak_above_start  # noqa: E402

VARIANTS = ("none", "torch", "ckptfx")
TARGETS = (
    ("time", 1.05, "ckptfx.checkpoint step time / torch's checkpoint", None),
    # the target is stated as a ratio to two decimals (<= 1.00); pages are 4 KiB
    ("memory", 1.0, "ckptfx.checkpoint step peak memory / torch's checkpoint, two decimals",
     None),
)


def checkpoint_call(variant: str) -> Callable[..., torch.Tensor]:
    """``call(fn, x)`` for a variant: run ``fn(x)`` plainly or under a checkpoint."""
    if variant == "none":
        return lambda fn, x: fn(x)
    if variant == "torch":
        return lambda fn, x: torch_checkpoint.checkpoint(fn, x, use_reentrant=False)
    return lambda fn, x: ckptfx.checkpoint(fn, x)


def step(stack: nn.ModuleList, x: torch.Tensor, variant: str) -> None:
    call = checkpoint_call(variant)
    h = x
    for block in stack:
        h = call(block, h)
    h.sum().backward()
    for p in stack.parameters():
        p.grad = None
    x.grad = None


def sync(device: str) -> None:
    if device != "cpu":
        torch.get_device_module(device).synchronize()


def time_steps(stack, x, repeats: int, device: str) -> dict[str, list[float]]:
    """Seconds per step of each variant, alternated (figures.rounds_of), wall clock: on an
    accelerator the work is not on this thread; each step ends synchronized."""
    def timed(variant: str) -> Callable[[], None]:
        def run() -> None:
            step(stack, x, variant)
            sync(device)
        return run

    return rounds_of({v: timed(v) for v in VARIANTS}, repeats, clock=time.perf_counter)


def peak_bytes(stack, x, variant: str, device: str) -> int:
    """Memory the step needs above what was allocated before it (peak minus baseline)."""
    gc.collect()
    sync(device)

    def run() -> None:
        step(stack, x, variant)
        sync(device)

    return peak_above_start(run, device)


def per_call_overhead(calls: int, repeats: int) -> dict[str, dict[str, float]]:
    """Microseconds per checkpoint call on a tiny tensor: forward only, and forward+backward."""
    x = torch.randn(4, requires_grad=True)
    fn = torch.sin  # saves its input: one holder per call

    def forward(call: Callable[..., torch.Tensor]) -> Callable[[], object]:
        return lambda: call(fn, x)

    def forward_backward(call: Callable[..., torch.Tensor]) -> Callable[[], None]:
        return lambda: call(fn, x).sum().backward()

    fns = {}
    for v in VARIANTS:
        fns[f"{v} forward"] = forward(checkpoint_call(v))
        fns[f"{v} forward+backward"] = forward_backward(checkpoint_call(v))
    med = medians(rounds_of(fns, repeats, calls, clock=time.perf_counter))
    return {v: {kind: med[f"{v} {kind}"] * 1e6 for kind in ("forward", "forward+backward")}
            for v in VARIANTS}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    parser.add_argument("--blocks", type=int, default=6)
    add_shape_options(parser, d=256, seq=128, batch=8)
    parser.add_argument("--repeats", type=int, default=15, help="timed steps per variant")
    parser.add_argument("--calls", type=int, default=2000, help="calls per overhead sample")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if args.quick:
        args.blocks, args.d, args.seq, args.batch = 3, 64, 32, 4
        args.repeats, args.calls = 5, 300
    torch.set_num_threads(args.threads)

    print(f"torch {torch.__version__}, ckptfx {ckptfx.__version__}, device {args.device}, "
          f"{torch.get_num_threads()} thread(s), {MMAP_ENV}={os.environ.get(MMAP_ENV)}")
    print(f"stack: {args.blocks} TransformerEncoderLayer blocks, d={args.d}, seq={args.seq}, "
          f"batch={args.batch}, dropout 0.1; {args.repeats} alternated repeats")

    stack = encoder_stack(args.blocks, args.d, args.device)
    x = torch.randn(args.batch, args.seq, args.d, device=args.device, requires_grad=True)
    for variant in VARIANTS:  # warm-up (allocator, lazy init)
        step(stack, x, variant)

    times = time_steps(stack, x, args.repeats, args.device)
    med = medians(times)
    peaks: dict[str, list[int]] = {v: [] for v in VARIANTS}
    for r in range(3):
        for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            peaks[variant].append(peak_bytes(stack, x, variant, args.device))
    peak = {v: statistics.median(p) for v, p in peaks.items()}

    print("\nforward+backward of the stack")
    print(f"  {'variant':8s} {'median ms':>10s} {'min ms':>8s} {'peak MiB':>9s}")
    for v in VARIANTS:
        print(f"  {v:8s} {med[v] * 1e3:10.2f} {min(times[v]) * 1e3:8.2f} "
              f"{peak[v] / 2**20:9.1f}")
    print(f"  time   ckptfx/torch = {med['ckptfx'] / med['torch']:.3f}   "
          f"ckptfx/none = {med['ckptfx'] / med['none']:.3f}   "
          f"torch/none = {med['torch'] / med['none']:.3f}")
    print(f"  memory ckptfx/torch = {peak['ckptfx'] / max(peak['torch'], 1):.3f}   "
          f"ckptfx/none = {peak['ckptfx'] / max(peak['none'], 1):.3f}   "
          f"torch/none = {peak['torch'] / max(peak['none'], 1):.3f}")
    figures = {"time": med["ckptfx"] / med["torch"],
               "memory": round(peak["ckptfx"] / max(peak["torch"], 1), 2)}
    print("  verdict:")
    for line in verdict(figures, TARGETS):
        print("    " + line)

    overhead = per_call_overhead(args.calls, args.repeats)
    print(f"\nper-call overhead, torch.sin on a 4-element tensor ({args.calls} calls x "
          f"{args.repeats} alternated repeats, median us per call)")
    print(f"  {'variant':8s} {'forward':>9s} {'fwd+bwd':>9s}")
    for v in VARIANTS:
        print(f"  {v:8s} {overhead[v]['forward']:9.2f} {overhead[v]['forward+backward']:9.2f}")
    for kind in ("forward", "forward+backward"):
        ck, ref, plain = (overhead[v][kind] for v in ("ckptfx", "torch", "none"))
        # The second ratio leaves out the cost of the op itself: checkpointing cost only.
        print(f"  {kind:16s} ckptfx/torch = {ck / ref:.3f}   "
              f"checkpoint cost ckptfx/torch = {(ck - plain) / (ref - plain):.3f}")


if __name__ == "__main__":
    main()
