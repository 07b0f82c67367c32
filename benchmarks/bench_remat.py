"""remat vs torch.utils.checkpoint on a transformer block: replay time, ops replayed, forward.

    python benchmarks/bench_remat.py [--quick] [--repeats N]

For each size and policy (nothing_saveable vs plain torch checkpoint, twice: as it runs, its
calls after the first unrecorded and replayed by re-running the block (ckptfx.recording.unrecorded), and
"recorded", every call recorded (always_record=True); dots_saveable vs torch SAC saving
mm/addmm/bmm/baddbmm), in one run, alternating the variants, medians of:
  replay alone = one whole replay timed by itself (a saved tensor read outside backward);
  bwd - plain bwd = backward time minus the no-checkpoint backward time (noisier: includes
                 allocator effects of the rebuilt tensors);
  fwd    = forward time; ops = ATen ops the replay ran (ckptfx: Segment.last_plan);
  replay peak = resident memory one whole replay needs above what was resident before it
                 (measured in a child process started with MALLOC_MMAP_THRESHOLD_=65536,
                 see ckptfx/bench/memory.py; the timings run without it).
Targets: replay <= 0.8x torch's, forward <= 1.1x torch's checkpoint forward.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

import torch
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

import ckptfx
from ckptfx import checkpoint_policies as cp
from ckptfx.bench.blocks import Block  # the pre-norm transformer block, no dropout
from ckptfx.bench.memory import (MMAP_ENV, MMAP_VALUE, child_env, peak_above_start,
                                 small_mmap_threshold)
from ckptfx.bench.overhead import MATMULS  # what torch SAC saves: the matrix products
from ckptfx.bench.variants import sac_policy

sac_dots = sac_policy(MATMULS)


def variants(block: Block) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    return {
        "plain": block,
        "torch:nothing": lambda x: checkpoint(block, x, use_reentrant=False),
        "ckptfx:nothing": ckptfx.remat(block.forward, policy=cp.nothing_saveable),
        "ckptfx:recorded": ckptfx.remat(block.forward, policy=cp.nothing_saveable,
                                        always_record=True),
        "torch:dots": lambda x: checkpoint(
            block, x, use_reentrant=False,
            context_fn=lambda: create_selective_checkpoint_contexts(sac_dots)),
        "ckptfx:dots": ckptfx.remat(block.forward, policy=cp.dots_saveable),
    }


class OpCount(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def replay_ops(fn: Callable, block: Block, x: torch.Tensor) -> int:
    """ATen ops a backward runs beyond the plain backward's (the replay)."""
    counts = []
    for f in (block, fn):
        out = f(x)
        with OpCount() as c:
            out.sum().backward()
        counts.append(c.n)
    return counts[1] - counts[0]


def _node(out: torch.Tensor, name: str) -> Any:
    seen, stack = set(), [out.grad_fn]
    while stack:
        n = stack.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        if type(n).__name__ == name:
            return n
        stack.extend(f for f, _ in n.next_functions)
    raise LookupError(name)


def direct_replay(fns: dict[str, Callable], x: torch.Tensor, repeats: int) -> dict[str, float]:
    """Median time of one whole replay, measured alone: reading the softmax's saved output
    outside backward makes torch and ckptfx each rebuild every recomputed tensor once."""
    times: dict[str, list[float]] = {k: [] for k in fns if k != "plain"}
    for r in range(repeats + 1):
        order = list(times) if r % 2 == 0 else list(reversed(times))
        for name in order:
            out = fns[name](x)  # a fresh forward each time: torch's SAC cache is single-use
            node = _node(out, "SoftmaxBackward0")  # `out` stays alive: the whole graph needs
            t0 = time.perf_counter()              # its tensors, as in a real backward
            node._saved_result
            if r:
                times[name].append(time.perf_counter() - t0)
            del out, node
    return {k: statistics.median(v) for k, v in times.items()}


def replay_peaks(fns: dict[str, Callable], x: torch.Tensor, repeats: int) -> dict[str, float]:
    """Median resident bytes one whole replay (as in ``direct_replay``) needs above the start."""
    assert small_mmap_threshold(), f"run with {MMAP_ENV}={MMAP_VALUE}"
    peaks: dict[str, list[int]] = {k: [] for k in fns if k != "plain"}
    for r in range(repeats + 1):
        for name in peaks:
            out = fns[name](x)
            node = _node(out, "SoftmaxBackward0")
            gc.collect()
            peak = peak_above_start(lambda n=node: n._saved_result)
            if r:
                peaks[name].append(peak)
            del out, node
    return {k: statistics.median(v) for k, v in peaks.items()}


class _DotBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes of every dot output in a forward: what torch's SAC with ``sac_dots`` caches."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in MATMULS:
            self.nbytes += out.numel() * out.element_size()
        return out


def saved_bytes(block: Block, x: torch.Tensor) -> tuple[int, int]:
    """(torch SAC's cached dot outputs, ckptfx dots_saveable's kept residuals), in bytes."""
    with _DotBytes() as counter:
        block(x)
    kept = ckptfx.saved_residuals(ckptfx.remat(block.forward, policy=cp.dots_saveable), x)
    return counter.nbytes, sum(r.nbytes for r in kept if r.kind != "argument")


def measure(b: int, t: int, d: int, repeats: int) -> None:
    torch.manual_seed(0)
    block = Block(d)
    x = torch.randn(b, t, d, requires_grad=True)
    fns = variants(block)
    fwd: dict[str, list[float]] = {k: [] for k in fns}
    bwd: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(repeats + 1):  # first round is warm-up
        order = list(fns) if r % 2 == 0 else list(reversed(fns))
        for name in order:
            t0 = time.perf_counter()
            out = fns[name](x)
            t1 = time.perf_counter()
            out.sum().backward()
            t2 = time.perf_counter()
            if r:
                fwd[name].append(t1 - t0)
                bwd[name].append(t2 - t1)
    med = {k: (statistics.median(fwd[k]), statistics.median(bwd[k])) for k in fns}
    base_bwd = med["plain"][1]
    print(f"\n== batch {b}, seq {t}, d {d} (plain fwd {med['plain'][0]*1e3:.2f} ms, "
          f"bwd {base_bwd*1e3:.2f} ms, {repeats} repeats)")
    direct = direct_replay(fns, x, repeats)
    torch_bytes, ckptfx_bytes = saved_bytes(block, x)
    print(f"dots     saved beyond the inputs: torch SAC {torch_bytes / 2**20:.2f} MiB, ckptfx "
          f"{ckptfx_bytes / 2**20:.2f} MiB (only the dot outputs the backward reads)")
    for pol in ("nothing", "recorded", "dots"):
        tn, cn = f"torch:{'nothing' if pol == 'recorded' else pol}", f"ckptfx:{pol}"
        print(f"{pol:8s} replay alone: torch {direct[tn]*1e3:7.2f} ms  ckptfx "
              f"{direct[cn]*1e3:7.2f} ms  ratio {direct[cn] / direct[tn]:5.2f}x  (target <= 0.8)")
        t_rep = med[tn][1] - base_bwd
        c_rep = med[cn][1] - base_bwd
        ops_t = replay_ops(fns[tn], block, x)
        ops_c = replay_ops(fns[cn], block, x)
        print(f"{pol:8s} bwd - plain bwd: torch {t_rep*1e3:7.2f} ms ({ops_t} ops)  ckptfx "
              f"{c_rep*1e3:7.2f} ms ({ops_c} ops)  ratio {c_rep / t_rep:5.2f}x")
        print(f"{pol:8s} fwd:    torch {med[tn][0]*1e3:7.2f} ms  ckptfx {med[cn][0]*1e3:7.2f} ms"
              f"  ratio {med[cn][0] / med[tn][0]:5.2f}x  (target <= 1.1)")


def print_replay_peaks(b: int, t: int, d: int, repeats: int) -> None:
    torch.manual_seed(0)
    block = Block(d)
    x = torch.randn(b, t, d, requires_grad=True)
    peaks = replay_peaks(variants(block), x, repeats)
    mib = 1 / 2**20
    for pol in ("nothing", "dots"):
        tp, cp_ = peaks[f"torch:{pol}"], peaks[f"ckptfx:{pol}"]
        if max(tp, cp_) < 2**20:  # tensors this small stay in the heap: RSS cannot see them
            print(f"{pol:8s} replay peak:  below what the resident size resolves at this size")
            continue
        print(f"{pol:8s} replay peak:  torch {tp * mib:7.2f} MiB  ckptfx {cp_ * mib:7.2f} MiB  "
              f"ratio {cp_ / tp:5.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small size, few repeats")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--replay-peak-of", type=int, nargs=3, metavar=("B", "T", "D"),
                        help=argparse.SUPPRESS)  # the child process of the memory part
    args = parser.parse_args()
    torch.set_num_threads(1)
    sizes = [(2, 32, 64)] if args.quick else [(2, 32, 64), (8, 128, 256)]
    repeats = args.repeats or (5 if args.quick else 15)
    if args.replay_peak_of:
        print_replay_peaks(*args.replay_peak_of, repeats=min(repeats, 5))
        return
    print(f"torch {torch.__version__}, 1 thread")
    for b, t, d in sizes:
        measure(b, t, d, repeats)
        sys.stdout.flush()
        subprocess.run([sys.executable, __file__, "--replay-peak-of", str(b), str(t), str(d)],
                       env=child_env(1), check=True)


if __name__ == "__main__":
    main()
