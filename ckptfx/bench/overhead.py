"""Per-call overhead where blocks are small: remat's forward, the split step, vjp_split.

    ckptfx bench --overhead [--quick] [--only remat|split|vjp256] [--rounds N]
    python benchmarks/bench_overhead.py [--quick] [--only remat|split|vjp256] [--rounds N]

All variants of a part run in one process, alternated (A B C ... then C B A ...), one
thread; each figure is the median of the per-round ratios to its alternative in the same
run (a round times both next to each other, so the machine's drifting speed cancels), with
their interquartile range (the spread) and the ratio of the two medians. Times are the
benchmarking thread's CPU time (``time.thread_time``): on a machine shared with other work
the wall clock also counts the time the other processes held the cores. Parts:

remat   forward of a transformer block (d=64 / d=256): ``remat(nothing_saveable)`` vs
        torch's checkpoint, ``remat(dots_saveable)`` vs torch's selective checkpoint (SAC)
        saving the dots. Floor: torch's checkpoint forward under an empty
        TorchDispatchMode, the least any recorder of ATen ops costs (Python per op).
        Targets: nothing <= 1.1x, dots <= 1.0x. nothing_saveable's calls after the first
        run unrecorded (ckptfx.recording.unrecorded); ``always_record=True`` is the
        recorded forward, for comparison. Then a whole step (forward + backward) of the
        same variants: an unrecorded call's replay re-runs the block under a dispatch mode
        (the explicit generator watch), so the recording's cost moves to the backward
        rather than going.
split   a split step over 6 small MLP blocks (d=64, hidden 256, batch 8): ckptfx sessions
        (prefire + dx + one dw call per parameter) vs no checkpointing (target <= 1.3x),
        and its floor: every saved tensor through a Python saved-tensor hook plus one more
        forward of each block to its last pack, what any hook-based checkpoint pays;
        ``vjp_split`` (prefire + dx + its weight pass) vs one fused backward without
        checkpointing (target <= 1.5x). Floors: torch's own split (stage_backward_input /
        stage_backward_weight) over the same blocks without checkpointing, the autograd
        calls a per-group weight pass makes at the least; a fused step plus one more
        forward, the compute that any step replaying each block once adds; the split
        floor: the hook floor's forward and replays plus vjp_split's two engine calls at
        this size (dx, then one weight backward from the outputs), what any checkpointed
        split replaying each block once through saved-tensor hooks pays. Also: ckptfx's
        checkpoint with prefire and one fused backward, vjp_split against it, and
        vjp_split forced to its per-group weight pass (what the rule's choice saves), and
        what a checkpoint's own machinery costs per block over the hook floor in a fused
        step (forward + one backward), ckptfx's checkpoint against torch's.
vjp256  dx + dw of ``vjp_split`` vs one fused backward over 6 checkpointed transformer
        blocks (d=256, batch 8, seq 128; target <= 1.05x). Floor: torch's split against a
        fused backward, both without checkpointing (dw reads each activation a second time,
        after dx, out of cache). Also: dx dropping the tensors only it reads when it ends
        instead of at their read (what the drop at the read saves), and the minor page faults
        of each step: a split holds what dw reads from dx to dw, so its peak is higher, and
        on the CPU glibc hands that memory back after each step and faults it in again
        (zeroed) in the next. So the part runs twice: here, and in a new process whose glibc
        keeps freed memory (``MALLOC_MMAP_THRESHOLD_``/``MALLOC_TRIM_THRESHOLD_``, as a
        caching allocator on an accelerator keeps it); the verdict judges both.

At the end a verdict: one line per target whose part ran, named by what it measures, met or
not, with the floor measured for it in the same run (``figures.verdict``; a floor above its
target says the target is below what that step costs before any of ckptfx's own work).

``main()`` returns every figure as a flat dict (for ``ckptfx bench``).
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

import ckptfx
from ckptfx import checkpoint_policies as cp
from ckptfx.bench.blocks import Block, MLPBlock
from ckptfx.bench.figures import (
    TARGETS,
    fmt,
    medians,
    ratio,
    rounds_of,
    target_note,
    verdict,
)
from ckptfx.bench.overhead_split import (
    KEEP_FREED_MEMORY,
    bench_split,
    bench_vjp256,
    bench_vjp256_keeping_freed_memory,
    split_variants,
)
from ckptfx.bench.variants import sac_policy

__all__ = ["KEEP_FREED_MEMORY", "MATMULS", "PARTS", "TARGETS", "Block", "MLPBlock",
           "bench_remat", "bench_split", "bench_vjp256", "bench_vjp256_keeping_freed_memory",
           "main", "ratio", "rounds_of", "run", "split_variants", "verdict"]

aten = torch.ops.aten
# What torch SAC saves against remat(dots_saveable): the transformer block's matrix products.
MATMULS = (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default)
_sac_dots = sac_policy(MATMULS)


class _Empty(TorchDispatchMode):
    """A dispatch mode that only calls the op: the least any recorder of ATen ops costs."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        return func(*args, **(kwargs or {}))


def bench_remat(d: int, rounds: int, inner: int) -> dict[str, float]:
    """The remat part at width ``d`` (docstring above): ``rounds`` rounds of ``inner`` calls;
    prints its figures and returns them, keyed ``remat{d}_...``."""
    b, t = (2, 32) if d <= 64 else (8, 128)
    torch.manual_seed(0)
    block = Block(d)
    x = torch.randn(b, t, d, requires_grad=True)
    nothing = ckptfx.remat(block.forward, policy=cp.nothing_saveable)
    recorded = ckptfx.remat(block.forward, policy=cp.nothing_saveable, always_record=True)
    dots = ckptfx.remat(block.forward, policy=cp.dots_saveable)

    def floor() -> Any:
        with _Empty():
            return checkpoint(block, x, use_reentrant=False)

    fns = {
        "plain": lambda: block(x),
        "torch": lambda: checkpoint(block, x, use_reentrant=False),
        "floor": floor,
        "remat nothing": lambda: nothing(x),
        "remat nothing recorded": lambda: recorded(x),
        "torch SAC dots": lambda: checkpoint(
            block, x, use_reentrant=False,
            context_fn=lambda: create_selective_checkpoint_contexts(_sac_dots)),
        "remat dots": lambda: dots(x),
    }
    times = rounds_of(fns, rounds, inner)
    r_nothing, r_dots, r_floor, r_recorded = (ratio(times, a, b) for a, b in (
        ("remat nothing", "torch"), ("remat dots", "torch SAC dots"), ("floor", "torch"),
        ("remat nothing recorded", "torch")))
    med = medians(times)
    print(f"remat forward, transformer block d={d} batch={b} seq={t} ({rounds}x{inner} calls): "
          + ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in med.items()))
    print(f"  nothing_saveable / torch checkpoint: {fmt(r_nothing)}"
          + target_note(f"remat{d}_nothing_vs_torch"))
    print(f"  nothing_saveable, always_record=True / torch checkpoint: {fmt(r_recorded)}")
    print(f"  dots_saveable / torch SAC:           {fmt(r_dots)}"
          + target_note(f"remat{d}_dots_vs_sac"))
    print(f"  floor: torch checkpoint under an empty dispatch mode / torch checkpoint: "
          f"{fmt(r_floor)}")
    steps = rounds_of({k: _fwd_bwd(fns[k]) for k in
                       ("torch", "remat nothing", "remat nothing recorded")}, rounds, inner)
    s_nothing = ratio(steps, "remat nothing", "torch")
    s_recorded = ratio(steps, "remat nothing recorded", "torch")
    print(f"  step (forward + backward), nothing_saveable / torch checkpoint: {fmt(s_nothing)}")
    print(f"  step, nothing_saveable, always_record=True / torch checkpoint: {fmt(s_recorded)}")
    return {f"remat{d}_nothing_vs_torch": r_nothing[0], f"remat{d}_dots_vs_sac": r_dots[0],
            f"remat{d}_dispatch_floor_vs_torch": r_floor[0],
            f"remat{d}_recorded_nothing_vs_torch": r_recorded[0],
            f"remat{d}_step_nothing_vs_torch": s_nothing[0],
            f"remat{d}_step_recorded_nothing_vs_torch": s_recorded[0]}


def _fwd_bwd(fn: Callable[[], Any]) -> Callable[[], None]:
    """``fn``'s forward, then a backward of its sum: a whole step."""
    def step() -> None:
        fn().sum().backward()
    return step


PARTS = ("remat", "split", "vjp256")


def run(only: str | None = None, quick: bool = False, rounds: int | None = None
        ) -> dict[str, float]:
    """Run the parts (``only`` one of ``PARTS``, or all), print each figure, return them all.

    Example::

        figures = run("remat", quick=True, rounds=1)   # a smoke run: seconds
    """
    if only is not None and only not in PARTS:
        raise ValueError(f"only must be one of {', '.join(PARTS)} or None, got {only!r}")
    if rounds is not None and rounds < 1:
        raise ValueError(f"rounds must be a positive integer, got {rounds!r}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        q = quick
        print(f"torch {torch.__version__}, ckptfx {ckptfx.__version__}, 1 thread")
        figures: dict[str, float] = {}
        if only in (None, "remat"):
            figures.update(bench_remat(64, rounds or (5 if q else 41), 5 if q else 20))
            figures.update(bench_remat(256, rounds or (3 if q else 21), 1))
        if only in (None, "split"):
            figures.update(bench_split(rounds or (5 if q else 101), 2 if q else 4))
        if only in (None, "vjp256"):
            figures.update(bench_vjp256(rounds or (3 if q else 15)))
            figures.update(bench_vjp256_keeping_freed_memory(rounds or (3 if q else 15)))
        print("verdict on the per-call overhead targets (this run):")
        for line in verdict(figures):
            print("  " + line)
        return figures
    finally:
        torch.set_num_threads(threads)


def main(argv: list[str] | None = None) -> dict[str, float]:
    """``python benchmarks/bench_overhead.py``'s entry (``ckptfx bench --overhead``'s twin)."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="few rounds (a smoke run)")
    ap.add_argument("--only", choices=PARTS)
    ap.add_argument("--rounds", type=int, default=None)
    args = ap.parse_args(argv)
    return run(args.only, args.quick, args.rounds)


if __name__ == "__main__":
    main()