"""A 2-stage x 2-way FSDP2 zero-bubble pipeline on CPU (gloo), 4 processes.

A 2-D DeviceMesh ("pp", "dp") of 4 ranks. The model is 4 chunks of 2 MLP blocks; each rank
of a pipeline row holds two chunks (ScheduleZBVZeroBubble: a V, InterleavedZeroBubble: a
loop), and every block and chunk is ``fully_shard``-ed over the "dp" dimension. Each data-
parallel rank feeds its own batch. For each schedule the same steps run three ways:

- torch's PipelineStage without checkpointing (the reference losses and gradients),
- torch's PipelineStage with torch.utils.checkpoint blocks,
- ckptfx.pipelining.PipelineStage with ckptfx.checkpoint_wrapper blocks,

and each rank prints whether ckptfx's losses and sharded gradients are bitwise equal to the
reference, how many times each block ran per micro-batch (a counter inside the block), and
the median step time of ckptfx's stage over torch's stage with torch's checkpoint.

    torchrun --nproc-per-node 4 examples/fsdp_pipeline.py        # or
    python examples/fsdp_pipeline.py                              # spawns the 4 processes
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.utils.checkpoint as tcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage as TorchStage
from torch.distributed.pipelining import ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble

import ckptfx
from ckptfx.pipelining import PipelineStage

D = int(os.environ.get("CKPTFX_PP_DIM", "64"))  # the tests run it at 16
MICROBATCHES, PP, DP, STAGES, BLOCKS = 4, 2, 2, 4, 2
# torch 2.13's own PipelineStage under ScheduleZBVZeroBubble leaves the last stage's gradients
# None when its FSDP2 modules reshard after forward (gloo, CPU): the reference run needs
# reshard_after_forward=False. RESHARD=1 runs ckptfx's stage with resharding anyway.
RESHARD = os.environ.get("RESHARD", "0") == "1"
SCHEDULES = (ScheduleZBVZeroBubble, ScheduleInterleavedZeroBubble)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.runs = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.runs += 1
        return x + self.fc2(torch.tanh(self.fc1(self.ln(x))))


class TorchCheckpointed(nn.Module):
    def __init__(self, block: Block) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tcp.checkpoint(self.block, x, use_reentrant=False)


def stage_indices(schedule: type, pp_rank: int) -> list[int]:
    if schedule is ScheduleInterleavedZeroBubble:  # looped: rank, rank + PP
        return [pp_rank, pp_rank + PP]
    return [pp_rank, STAGES - 1 - pp_rank]  # V-shape


def build(schedule: type, variant: str, mesh: object) -> tuple[object, list, list[Block]]:
    pp_rank = mesh["pp"].get_local_rank()
    dp_mesh = mesh["dp"]
    stages, blocks = [], []
    for idx in stage_indices(schedule, pp_rank):
        torch.manual_seed(idx)  # the same initial weights for every variant
        chunk_blocks = [Block() for _ in range(BLOCKS)]
        blocks += chunk_blocks
        layers: list[nn.Module] = []
        for b in chunk_blocks:
            if variant == "ckptfx":
                ckptfx.checkpoint_wrapper(b)
                layers.append(b)
            elif variant == "torch":
                layers.append(TorchCheckpointed(b))
            else:
                layers.append(b)
        chunk = nn.Sequential(*layers)
        for layer in layers:
            fully_shard(layer, mesh=dp_mesh, reshard_after_forward=RESHARD)
        fully_shard(chunk, mesh=dp_mesh, reshard_after_forward=RESHARD)
        stage_cls = PipelineStage if variant == "ckptfx" else TorchStage
        stages.append(stage_cls(chunk, idx, STAGES, torch.device("cpu"),
                                group=mesh["pp"].get_group()))
    sched = schedule(stages, n_microbatches=MICROBATCHES,
                     loss_fn=lambda o, t: (o - t).square().mean())
    return sched, stages, blocks


def run(schedule: type, variants: list[str], mesh: object, steps: int) -> dict:
    """``steps`` steps of each variant's pipeline, the variants alternating step by step (so
    a change in the machine's load shifts them alike); per variant its losses, final
    gradients, step times and block runs."""
    built = {v: build(schedule, v, mesh) for v in variants}
    dp_rank = mesh["dp"].get_local_rank()
    g = torch.Generator().manual_seed(100 + dp_rank)  # each data-parallel rank its own batch
    x = torch.randn(2 * MICROBATCHES, D, generator=g)
    t = torch.randn(2 * MICROBATCHES, D, generator=g)
    out = {v: {"losses": [], "times": [], "runs": []} for v in variants}
    for _ in range(steps):
        for v in variants:
            sched, stages, blocks = built[v]
            for s in stages:
                s.submod.zero_grad(set_to_none=True)
            for b in blocks:
                b.runs = 0
            step_losses: list = []
            has_first = any(s.is_first for s in stages)
            has_last = any(s.is_last for s in stages)
            dist.barrier()
            start = time.perf_counter()
            sched.step(*((x,) if has_first else ()), target=t if has_last else None,
                       losses=step_losses if has_last else None)
            out[v]["times"].append(time.perf_counter() - start)
            out[v]["losses"].append([loss.detach().clone() for loss in step_losses])
            out[v]["runs"].append([b.runs for b in blocks])
    for v in variants:
        stages = built[v][1]
        out[v]["grads"] = [None if p.grad is None else p.grad.to_local().clone()
                           for s in stages for p in s.submod.parameters()]
    return out


def bitwise(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        x is not None and y is not None and torch.equal(x, y) for x, y in zip(a, b))


def main(steps: int = 6, with_torch_checkpoint: bool = True) -> dict:
    """Run every schedule; per schedule (bitwise, runs per block per micro-batch after the
    first step, the first step's, torch checkpoint's, step-time ratio)."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    report = {}
    for schedule in SCHEDULES:
        variants = ["plain", "torch", "ckptfx"] if with_torch_checkpoint else ["plain", "ckptfx"]
        results = run(schedule, variants, mesh, steps)
        ref, ours, torch_ckpt = results["plain"], results["ckptfx"], results.get("torch")
        same = (all(bitwise(a, b) for a, b in zip(ours["losses"], ref["losses"]))
                and bitwise(ours["grads"], ref["grads"]))
        first = sorted({r / MICROBATCHES for r in ours["runs"][0]})
        per_mb = sorted({r / MICROBATCHES for step in ours["runs"][1:] for r in step})
        torch_per_mb: list = []
        ratio = float("nan")
        if torch_ckpt is not None:
            torch_per_mb = sorted({r / MICROBATCHES for step in torch_ckpt["runs"][1:] for r in step})
            ratio = (statistics.median(ours["times"][1:])
                     / statistics.median(torch_ckpt["times"][1:]))
        report[schedule.__name__] = (same, per_mb, first, torch_per_mb, ratio)
        print(f"rank {rank} {schedule.__name__}: bitwise vs no checkpoint: {same}; runs per block "
              f"per micro-batch: ckptfx {per_mb} (first step {first}), torch checkpoint "
              f"{torch_per_mb}; median step time ckptfx / torch checkpoint: {ratio:.2f}",
              flush=True)
    return report


def _spawned(rank: int, path: str, queue: object) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(path, PP * DP), rank=rank,
                            world_size=PP * DP)
    try:
        report = main()
        queue.put((rank, report))  # type: ignore[attr-defined]
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group("gloo")
        try:
            main()
        finally:
            dist.destroy_process_group()
    else:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        path = tempfile.mktemp(prefix="ckptfx_fsdp_pp_")
        procs = [ctx.Process(target=_spawned, args=(r, path, q)) for r in range(PP * DP)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)
        sys.exit(max(p.exitcode or 0 for p in procs))
