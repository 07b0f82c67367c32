"""ckptfx.pipelining.PipelineStage with torch.compile'd blocks under ScheduleZBVZeroBubble.

gloo, world size 1, two stages on the rank, as in test_pipelining.py, but each block is
compiled (aot_eager) and then checkpointed by ckptfx (the torchtitan order). Runs are
counted per block by an opaque op inside the compiled graph; gradients are compared bitwise
with torch's stage running the same compiled blocks without checkpointing.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage as TorchStage
from torch.distributed.pipelining import ScheduleZBVZeroBubble

import ckptfx
from ckptfx.pipelining import PipelineStage

from conftest import assert_bitwise
from models import D, Block

MB = 4  # micro-batches; D is models.Block's width
RUNS: dict[int, int] = {}


@torch.library.custom_op("ckptfx_test::count_run", mutates_args=())
def count_run(x: torch.Tensor, block: int) -> torch.Tensor:
    """A copy of ``x`` that counts the runs of block ``block``."""
    RUNS[block] = RUNS.get(block, 0) + 1
    return x.clone()


@count_run.register_fake
def _(x: torch.Tensor, block: int) -> torch.Tensor:
    return torch.empty_like(x)


count_run.register_autograd(lambda ctx, g: (g, None))


pytestmark = pytest.mark.usefixtures("gloo_world_of_one")


class OpCountedBlock(Block):
    """models.Block (tanh, dropout 0.2) whose input goes through ``count_run`` first: its
    runs are counted per block by that op, inside the compiled graph, not in Python."""

    def __init__(self, index: int) -> None:
        super().__init__(act=torch.tanh, p=0.2)
        self.index = index

    def note_run(self) -> None:
        pass  # ``count_run`` counts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(count_run(x, self.index))


class Chunk(nn.Module):
    def __init__(self, first: int, checkpointed: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([OpCountedBlock(first), OpCountedBlock(first + 1)])
        for b in self.blocks:
            b.compile(backend="aot_eager")
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = ckptfx.checkpoint(b, x) if self.checkpointed else b(x)
        return x


def run(stage_cls: type, checkpointed: bool) -> tuple[list[list[int]], list[list]]:
    torch.manual_seed(0)
    chunks = [Chunk(2 * i, checkpointed) for i in range(2)]
    stages = [stage_cls(c, i, 2, torch.device("cpu")) for i, c in enumerate(chunks)]
    sched = ScheduleZBVZeroBubble(stages, n_microbatches=MB,
                                  loss_fn=lambda o, t: (o - t).square().mean())
    x, t = torch.randn(2 * MB, D), torch.randn(2 * MB, D)
    runs, grads = [], []
    for step in range(2):
        for c in chunks:
            c.zero_grad(set_to_none=True)
        RUNS.clear()
        torch.manual_seed(5 + step)
        sched.step(x, target=t)
        runs.append([RUNS.get(i, 0) for i in range(4)])
        grads.append([p.grad for c in chunks for p in c.parameters()])
    return runs, grads


@torch._functorch.config.patch(donated_buffer=False)
def test_compiled_blocks_run_twice_per_microbatch_under_zero_bubble() -> None:
    # the I step runs each compiled block's backward with retain_graph=True (README); torch's
    # own patch, as monkeypatch's undo deletes the config key (pytest 9)
    torch._dynamo.reset()
    plain_runs, ref = run(TorchStage, checkpointed=False)
    # torch's metadata inference runs each stage once on the first step
    assert plain_runs == [[MB + 1] * 4, [MB] * 4]
    runs, got = run(PipelineStage, checkpointed=True)
    for g, r in zip(got, ref):
        assert_bitwise(g, r)
    assert runs == [[2 * MB + 1] * 4, [2 * MB] * 4]  # forward + one replay per micro-batch
    torch._dynamo.reset()
