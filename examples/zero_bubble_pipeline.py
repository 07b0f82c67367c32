"""Zero-bubble pipelining with checkpointed blocks on two processes (gloo, 127.0.0.1).

Four stages, two per rank, each a chunk of checkpointed MLP blocks. For each zero-bubble
schedule the same step runs three ways on every rank:

- torch's PipelineStage without checkpointing (the reference gradients),
- torch's PipelineStage with torch.utils.checkpoint blocks,
- ckptfx.pipelining.PipelineStage with ckptfx.checkpoint blocks,

and each rank prints how often the blocks of its stages ran (a counter inside the block) and
whether the gradients are bitwise equal to the reference.

    pip install "ckptfx[examples]"     # numpy: torch's pipelining sends its metadata with it
    python examples/zero_bubble_pipeline.py
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as tcp
from torch.distributed.pipelining import PipelineStage as TorchStage
from torch.distributed.pipelining import (
    ScheduleDualPipeV,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

import ckptfx
from ckptfx.pipelining import PipelineStage

D, MICROBATCHES, WORLD, STAGES = 32, 4, 2, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.runs = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.runs += 1
        return x + self.fc2(F.dropout(F.gelu(self.fc1(self.ln(x))), 0.1, True))


class Chunk(nn.Module):
    def __init__(self, variant: str) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.variant = variant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            if self.variant == "ckptfx":
                x = ckptfx.checkpoint(b, x)
            elif self.variant == "torch":
                x = tcp.checkpoint(b, x, use_reentrant=False)
            else:
                x = b(x)
        return x


def stage_indices(schedule: type, rank: int) -> list[int]:
    if schedule is ScheduleInterleavedZeroBubble:  # looped: rank, rank + world, ...
        return [rank, rank + WORLD]
    return [rank, STAGES - 1 - rank]  # V-shape


def step(schedule: type, variant: str, stage_cls: type, rank: int) -> tuple[int, list]:
    chunks = {}
    for idx in range(STAGES):  # same initial weights on every rank and variant
        torch.manual_seed(idx)
        chunks[idx] = Chunk(variant)
    mine = stage_indices(schedule, rank)
    stages = [stage_cls(chunks[i], i, STAGES, torch.device("cpu")) for i in mine]
    sched = schedule(stages, n_microbatches=MICROBATCHES,
                     loss_fn=lambda o, t: (o - t).square().mean())
    torch.manual_seed(100)
    x, t = torch.randn(2 * MICROBATCHES, 16, D), torch.randn(2 * MICROBATCHES, 16, D)
    for run in range(2):  # the first step includes torch's metadata inference
        for i in mine:
            chunks[i].zero_grad(set_to_none=True)
            for b in chunks[i].blocks:
                b.runs = 0
        torch.manual_seed(1000 + rank)
        if rank == 0:
            sched.step(x, target=t)
        else:
            sched.step(target=t)
    runs = sum(b.runs for i in mine for b in chunks[i].blocks)
    return runs, [p.grad for i in mine for p in chunks[i].parameters()]


def worker(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    try:
        for schedule in (ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble,
                         ScheduleDualPipeV):
            _, ref = step(schedule, "plain", TorchStage, rank)
            t_runs, t_grads = step(schedule, "torch", TorchStage, rank)
            c_runs, c_grads = step(schedule, "ckptfx", PipelineStage, rank)
            same = lambda gs: all(torch.equal(a, b) for a, b in zip(gs, ref))  # noqa: E731
            blocks = 2 * len(stage_indices(schedule, rank)) * MICROBATCHES
            print(f"rank {rank} {schedule.__name__:30s} block runs per (block, micro-batch): "
                  f"torch stage {t_runs / blocks:.2f}, ckptfx stage {c_runs / blocks:.2f}; "
                  f"grads bitwise equal to no checkpoint: torch {same(t_grads)}, "
                  f"ckptfx {same(c_grads)}", flush=True)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def require_numpy() -> None:
    """Refuse to start without numpy, in the parent, with how to get it.

    torch.distributed's object send/receive (the pipeline schedules' metadata exchange) needs
    numpy; without it the receiving rank dies inside torch and the other sees only
    "Connection closed by peer"."""
    try:
        import numpy  # noqa: F401
    except ImportError:
        raise SystemExit("examples/zero_bubble_pipeline.py needs numpy (torch.distributed "
                         "sends the pipeline's metadata with it): pip install "
                         '"ckptfx[examples]"  (or: pip install numpy)') from None


def main() -> None:
    require_numpy()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(worker, args=(free_port(),), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main()
