"""ckptfx.pipelining.PipelineStage under torch's zero-bubble schedules, on one process.

gloo, world size 1, two stages on the rank. Each schedule runs two steps, each counted (a
counter inside each block) and its gradients compared bit for bit with the same schedule on
torch's stage without checkpointing, with dropout in the blocks. The first step includes
torch's metadata inference (one forward of each stage, with or without checkpointing).

Every test takes the ``device`` fixture: the stages, their modules and the batches are on the
CPU or on the accelerator, where autograd runs I and W on its device threads. Both stages are
on the one rank, so torch's schedules hand activations and gradients from stage to stage
locally (``set_local_fwd_input``/``set_local_bwd_input``): no tensor goes through gloo, and
the group only has to exist.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as tcp
from torch.distributed.pipelining import PipelineStage as TorchStage
from torch.distributed.pipelining import (
    ScheduleDualPipeV,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

import ckptfx
from ckptfx.pipelining import PipelineStage

from conftest import assert_bitwise
from models import D, Block

MB = 4  # micro-batches; D is models.Block's width


pytestmark = pytest.mark.usefixtures("gloo_world_of_one")


class Chunk(nn.Module):
    def __init__(self, variant: str) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(act=torch.tanh, p=0.2) for _ in range(2)])
        self.variant = variant
        if variant == "wrap":  # ckptfx.checkpoint_wrapper on each block
            for b in self.blocks:
                ckptfx.checkpoint_wrapper(b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            if self.variant == "ckptfx":
                x = ckptfx.checkpoint(b, x)
            elif self.variant == "torch":
                x = tcp.checkpoint(b, x, use_reentrant=False)
            else:
                x = b(x)
        return x


SCHEDULES = [
    ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV
]


def run(
    schedule: type, variant: str, stage_cls: type, device: torch.device, static: bool = False,
    detail: bool = False,
) -> tuple[list[list[list[int]]], list[list]]:
    """Two steps; per step the runs of each block ([stage][block]) and the gradients.

    ``static``: stages built with ``input_args``/``output_args`` (no metadata inference).
    ``detail``: the stages validate every runtime tensor (as under TORCH_DISTRIBUTED_DEBUG=DETAIL).
    """
    torch.manual_seed(0)
    chunks = [Chunk(variant).to(device) for _ in range(2)]
    stages = []
    for i, c in enumerate(chunks):
        meta = {}
        if static:
            meta = dict(input_args=torch.empty(2, D, device=device, requires_grad=i > 0),
                        output_args=torch.empty(2, D, device=device, requires_grad=True))
        stages.append(stage_cls(c, i, 2, device, **meta))
        if detail:
            stages[-1]._runtime_validate = True
    sched = schedule(stages, n_microbatches=MB, loss_fn=lambda o, t: (o - t).square().mean())
    x, t = torch.randn(2 * MB, D).to(device), torch.randn(2 * MB, D).to(device)
    runs, grads = [], []
    for step in range(2):
        for c in chunks:
            c.zero_grad(set_to_none=True)
            for b in c.blocks:
                b.runs = 0
        torch.manual_seed(5 + step)
        sched.step(x, target=t)
        runs.append([[b.runs for b in c.blocks] for c in chunks])
        grads.append([p.grad for c in chunks for p in c.parameters()])
    return runs, grads


def every_block(n: int) -> list[list[int]]:
    return [[n, n], [n, n]]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_one_replay_per_microbatch_and_bitwise_grads(schedule: type,
                                                     device: torch.device) -> None:
    plain_runs, ref = run(schedule, "plain", TorchStage, device)
    # torch's metadata inference runs each stage once on the first step, checkpointed or not
    assert plain_runs == [every_block(MB + 1), every_block(MB)]
    runs, got = run(schedule, "ckptfx", PipelineStage, device)
    # forward + one replay per micro-batch; the inference forward is never replayed
    assert runs == [every_block(2 * MB + 1), every_block(2 * MB)]
    for g, r in zip(got, ref):
        assert_bitwise(g, r)
    assert not ckptfx.recompute_session_stats()  # every session cleared after its W

    torch_runs, torch_grads = run(schedule, "torch", TorchStage, device)
    for g, r in zip(torch_grads, ref):
        assert_bitwise(g, r)
    # torch's stage replays the last stage's inference forward for its gradient metadata:
    # on the first step that stage runs the inference forward and its replay on top
    assert torch_runs[0][0] == [2 * MB + 1] * 2
    assert torch_runs[0][1] == [r + 2 for r in torch_runs[1][1]]
    if schedule in (ScheduleInterleaved1F1B, ScheduleDualPipeV):
        # 1F1B: full backward only. On one rank DualPipeV splits I/W only for the first stage's
        # last micro-batch, where torch's I step is a no-op: nothing to save there.
        assert torch_runs[1] == runs[1]
    else:
        # torch's own stage: 1 replay for I plus one per parameter group (4 per block) in W.
        assert torch_runs[1][0] == [2 * MB, 2 * MB]
        assert all(r > 2 * MB for r in torch_runs[1][1]), torch_runs


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_static_metadata_runs_each_block_twice_per_microbatch_from_the_first_step(
    schedule: type, device: torch.device,
) -> None:
    plain_runs, ref = run(schedule, "plain", TorchStage, device, static=True)
    assert plain_runs == [every_block(MB)] * 2  # no metadata inference
    runs, got = run(schedule, "wrap", PipelineStage, device, static=True)
    assert runs == [every_block(2 * MB)] * 2
    for g, r in zip(got, ref):
        assert_bitwise(g, r)
    assert not ckptfx.recompute_session_stats()


def test_skipped_inference_backward_infers_torchs_metadata(device: torch.device) -> None:
    """The gradient metadata the stage infers without the inference backward is the one
    torch's stage infers with it (same for the forward metadata)."""
    metas = []
    for variant, cls in (("plain", TorchStage), ("ckptfx", TorchStage), ("ckptfx", PipelineStage)):
        torch.manual_seed(0)
        stages = [cls(Chunk(variant).to(device), i, 2, device) for i in range(2)]
        sched = ScheduleZBVZeroBubble(stages, n_microbatches=MB,
                                      loss_fn=lambda o, t: (o - t).square().mean())
        sched.step(torch.randn(2 * MB, D).to(device), target=torch.randn(2 * MB, D).to(device))
        metas.append([(s._stage_meta.inputs, s._stage_meta.outputs, s._stage_meta.input_grads,
                       s._stage_meta.output_grads) for s in stages])
    assert metas[0] == metas[1] == metas[2]
    assert metas[2][1][2][0] is not None  # the last stage's input gradient was inferred


def test_detailed_validation_keeps_torchs_inference_backward(device: torch.device) -> None:
    """Under runtime validation (which compares every gradient's stride with the inferred
    one) the stage keeps torch's real inference backward: one replay more on the first step."""
    _, ref = run(ScheduleZBVZeroBubble, "plain", TorchStage, device)
    runs, got = run(ScheduleZBVZeroBubble, "ckptfx", PipelineStage, device, detail=True)
    assert runs == [[[2 * MB + 1] * 2, [2 * MB + 2] * 2], every_block(2 * MB)]
    for g, r in zip(got, ref):
        assert_bitwise(g, r)


def test_weight_step_memory_is_trimmed_between_i_and_w(device: torch.device) -> None:
    """Between I and W the session holds fewer replayed bytes than after prefire."""
    torch.manual_seed(0)
    chunks = [Chunk("ckptfx").to(device) for _ in range(2)]
    stages = [PipelineStage(c, i, 2, device) for i, c in enumerate(chunks)]
    seen: list[tuple[int, int]] = []
    stage = stages[1]
    orig_w = stage.backward_weight_one_chunk

    def spy_w(mb: int, last_backward: bool = False) -> None:
        stats = ckptfx.recompute_session_stats().get(stage.session_id(mb))
        if stats is not None:
            seen.append((stats.tensors, stats.nbytes))
        orig_w(mb, last_backward=last_backward)

    stage.backward_weight_one_chunk = spy_w  # type: ignore[method-assign]
    sched = ScheduleInterleavedZeroBubble(stages, n_microbatches=MB,
                                          loss_fn=lambda o, t: (o - t).square().mean())
    sched.step(torch.randn(2 * MB, D).to(device), target=torch.randn(2 * MB, D).to(device))
    assert len(seen) == MB
    # Per block after prefire: fc1 input+weight, tanh output, dropout mask, fc2 input+weight;
    # after I only the matmul inputs and weights are left, and of those only fc2's input costs
    # memory (fc1's input is the block input, weights are parameters): 1 per block, 2 blocks.
    assert all(tensors == 2 for tensors, _ in seen), seen
    assert not ckptfx.recompute_session_stats()
