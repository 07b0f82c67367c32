"""Benchmark: vjp_split and the zero-bubble pipeline stage against fused and torch's split.

(a) split step: forward + dx + dw of a stack of checkpointed transformer blocks.
    - ``fused``        ckptfx.checkpoint blocks, one ``autograd.grad`` for x and all params
    - ``vjp_split``    ckptfx.vjp_split: prefire + dx, then its weight pass (per group)
    - ``torch_split``  torch.utils.checkpoint blocks, dx then torch's per-group weight pass
                       (stage_backward_input / stage_backward_weight): 1 + groups replays
(b) a ScheduleZBVZeroBubble step on one process (gloo, two stages) with ckptfx's stage and
    torch's stage, both over checkpointed blocks, plus torch's stage under
    ScheduleInterleaved1F1B as the no-split reference; block runs counted.
(c) memory between dx and dw: per micro-batch bytes the session holds after prefire, after dx
    and after dw (``ckptfx.recompute_session_stats()``), trimmed vs all retained; and the peak
    resident memory (VmHWM) of an F F B B W W sequence, trimmed vs all retained.

Times are medians of alternated rounds, one thread, reported as ratios measured in the same
run. Peak memory needs MALLOC_MMAP_THRESHOLD_=65536 (the script re-execs itself with it).

    python benchmarks/bench_split.py            # full shapes
    python benchmarks/bench_split.py --quick    # small shapes, a few seconds
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Callable

import torch
import torch.nn as nn
import torch.utils.checkpoint as tcp

import ckptfx
import ckptfx.split.passes as split_passes
from ckptfx.bench.blocks import Block, count_runs
from ckptfx.bench.figures import medians, rounds_of
from ckptfx.bench.memory import peak_above_start, reexec_with_small_mmap_threshold


class Stack(nn.Module):
    """``n`` pre-norm transformer blocks with dropout, each under ``variant``'s checkpoint."""

    def __init__(self, d: int, n: int, variant: str) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, dropout=0.1, attention="matmul") for _ in range(n))
        self.variant = variant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = (ckptfx.checkpoint(b, x) if self.variant == "ckptfx"
                 else tcp.checkpoint(b, x, use_reentrant=False))
        return x


def median_times(fns: dict[str, Callable[[], None]], rounds: int) -> dict[str, float]:
    """Median seconds per call, the variants alternated (wall clock: as README's figures)."""
    return medians(rounds_of(fns, rounds, clock=time.perf_counter))


# -- (a) ------------------------------------------------------------------------------------


def bench_split_step(d: int, n: int, batch: int, seq: int, rounds: int) -> None:
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    torch.manual_seed(0)
    ck = Stack(d, n, "ckptfx")
    tc = Stack(d, n, "torch")
    tc.load_state_dict(ck.state_dict())
    x, g = torch.randn(batch, seq, d), torch.randn(batch, seq, d)
    params = list(ck.parameters())

    def fused() -> None:
        xr = x.detach().requires_grad_()
        out = ck(xr)
        torch.autograd.grad(out, [xr, *params], g)

    def split() -> None:
        out, dx_fn, dw_fn = ckptfx.vjp_split(ck, x, params=params)
        dx_fn(g)
        dw_fn()

    def torch_split() -> None:
        xr = x.detach().requires_grad_()
        out = tc(xr)
        _, groups = stage_backward_input([out], [g], [xr], tc.parameters())
        stage_backward_weight(tc.parameters(), groups)

    runs = {}
    for name, fn, stack in (("fused", fused, ck), ("vjp_split", split, ck),
                            ("torch_split", torch_split, tc)):
        runs[name] = count_runs(stack.blocks, fn) / n
    for p in [*ck.parameters(), *tc.parameters()]:
        p.grad = None
    t = median_times({"fused": fused, "vjp_split": split, "torch_split": torch_split}, rounds)
    print(f"(a) split step, {n} checkpointed transformer blocks d={d} batch={batch} seq={seq}:")
    for k in t:
        print(f"    {k:12s} {t[k] * 1e3:8.2f} ms  {t[k] / t['fused']:.3f}x fused   "
              f"block runs/step {runs[k]:.1f}")


# -- (b) ------------------------------------------------------------------------------------


def bench_pipeline(d: int, n: int, batch: int, seq: int, mbs: int, rounds: int) -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage as TorchStage
    from torch.distributed.pipelining import ScheduleInterleaved1F1B, ScheduleZBVZeroBubble

    from ckptfx.pipelining import PipelineStage

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0,
                                world_size=1)
    torch.manual_seed(0)
    x, tgt = torch.randn(batch * mbs, seq, d), torch.randn(batch * mbs, seq, d)
    loss = lambda o, t: (o - t).square().mean()  # noqa: E731

    def make(schedule: type, stage_cls: type, variant: str):
        torch.manual_seed(0)
        chunks = [Stack(d, n, variant) for _ in range(2)]
        stages = [stage_cls(c, i, 2, torch.device("cpu")) for i, c in enumerate(chunks)]
        sched = schedule(stages, n_microbatches=mbs, loss_fn=loss)
        sched.step(x, target=tgt)  # metadata inference

        def step() -> None:
            sched.step(x, target=tgt)
        return step, chunks

    variants = {
        "ckptfx ZBV": make(ScheduleZBVZeroBubble, PipelineStage, "ckptfx"),
        "torch ZBV": make(ScheduleZBVZeroBubble, TorchStage, "torch"),
        "torch 1F1B": make(ScheduleInterleaved1F1B, TorchStage, "torch"),
    }
    runs = {}
    for k, (step, chunks) in variants.items():
        blocks = [b for c in chunks for b in c.blocks]
        runs[k] = count_runs(blocks, step) / (2 * n * mbs)
    t = median_times({k: v[0] for k, v in variants.items()}, rounds)
    print(f"(b) pipeline step, one process, 2 stages x {n} checkpointed blocks, {mbs} "
          f"micro-batches of {batch}x{seq}x{d}:")
    for k in t:
        print(f"    {k:12s} {t[k] * 1e3:8.2f} ms  {t[k] / t['torch ZBV']:.3f}x torch ZBV  "
              f"{t[k] / t['torch 1F1B']:.3f}x torch 1F1B  block runs per block per "
              f"micro-batch {runs[k]:.2f}")


# -- (c) ------------------------------------------------------------------------------------


def bench_memory(d: int, n: int, batch: int, seq: int, rounds: int) -> None:
    torch.manual_seed(0)
    stack = Stack(d, n, "ckptfx")
    params = list(stack.parameters())
    xs = [torch.randn(batch, seq, d) for _ in range(2)]
    g = torch.randn(batch, seq, d)
    mib = 1 / 2**20

    print(f"(c) memory, {n} checkpointed transformer blocks d={d} batch={batch} seq={seq}:")
    for trim in (True, False):
        split_passes.trim_enabled = trim
        out, dx_fn, dw_fn = ckptfx.vjp_split(stack, xs[0], params=params)
        sid = dx_fn.session
        dx_fn.prefire()
        a = ckptfx.recompute_session_stats()[sid].nbytes
        dx_fn(g)
        b = ckptfx.recompute_session_stats()[sid].nbytes
        dw_fn()
        c = ckptfx.recompute_session_stats().get(sid)
        print(f"    {'trimmed' if trim else 'all retained':12s} per micro-batch held: after "
              f"prefire {a * mib:7.2f} MiB, after dx {b * mib:7.2f} MiB, after dw "
              f"{(c.nbytes if c else 0) * mib:.2f} MiB")

    def ffbbww() -> None:
        splits = [ckptfx.vjp_split(stack, x, params=params) for x in xs]  # F F
        for _, dx_fn, _ in splits:  # B B
            dx_fn(g)
        for _, _, dw_fn in splits:  # W W
            dw_fn()

    peaks: dict[bool, list[int]] = {True: [], False: []}
    ffbbww()
    for _ in range(rounds):
        for trim in (True, False):
            split_passes.trim_enabled = trim
            for p in params:
                p.grad = None
            peaks[trim].append(peak_above_start(ffbbww))
    split_passes.trim_enabled = True
    pt, pa = statistics.median(peaks[True]), statistics.median(peaks[False])
    print(f"    F F B B W W peak RSS above start: trimmed {pt * mib:.1f} MiB, all retained "
          f"{pa * mib:.1f} MiB ({pt / max(pa, 1):.3f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small shapes, few rounds")
    ap.add_argument("--only", choices=["a", "b", "c"], help="run one part")
    args = ap.parse_args()
    reexec_with_small_mmap_threshold()
    torch.set_num_threads(1)
    if args.quick:
        d, n, batch, seq, rounds, mbs = 64, 2, 2, 32, 5, 4
    else:
        d, n, batch, seq, rounds, mbs = 256, 6, 8, 128, 9, 4
    print(f"torch {torch.__version__}, 1 thread, medians of {rounds} alternated rounds")
    if args.only in (None, "a"):
        bench_split_step(d, n, batch, seq, rounds)
    if args.only in (None, "b"):
        bench_pipeline(d, max(1, n // 2), max(1, batch // 2), seq, mbs, rounds)
    if args.only in (None, "c"):
        bench_memory(d, n, batch, seq, max(3, rounds // 2))


if __name__ == "__main__":
    main()
