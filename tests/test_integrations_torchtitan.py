"""ckptfx.integrations.torchtitan on torchtitan's own llama3 ``debugmodel``, on the CPU.

Training steps (AdamW) with ckptfx's checkpointing chosen as torchtitan chooses its own
(``CkptfxAC.Config(...).build(dump_folder=...).apply(model)``, what torchtitan's
``parallelize_fn`` calls) give the gradients of every step and the parameters after the
steps of the same model without checkpointing, bit for bit. So do the steps of the ZBV
zero-bubble pipeline that ckptfx's ``pipeline_llm`` (torchtitan's, with ckptfx's stages)
builds, where each block is replayed once per micro-batch, while torchtitan's ``FullAC`` on
torch's stages replays a block of the last stage once for the input step and once per
parameter in the weight step.

Test-only attention swap: torchtitan's language models attend with FlexAttention or varlen
attention, and torch has no CPU backward for FlexAttention, so every block's
``attention.inner_attention`` is torchtitan's ``ScaledDotProductAttention`` (causal) here.
The debug model has no dropout, so no random op is replayed. The tests run with one torch
thread: on two shared cores two threads per process are several times slower.

Skipped only when torchtitan is not installed (``pip install --no-deps torchtitan`` beside
a torch release, then ``pip install tyro spmd_types triton``: the llama3 model's modules
import triton, which the adapter itself does not need).
"""

from __future__ import annotations

import copy
import subprocess
import sys
import warnings
from types import SimpleNamespace
from typing import Any, Iterator

import pytest
import torch
import torch.distributed.pipelining
import torch.nn.functional as F
from torch import nn

import ckptfx
import ckptfx.pipelining
from ckptfx import checkpoint_policies as cp

from conftest import OpCounter, assert_bitwise

VOCAB = 2048  # the debug model's
MB = 4  # pipeline micro-batches


# -- the model ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tt() -> Iterator[SimpleNamespace]:
    """torchtitan's modules, and the debug model (built once; each test takes a copy), with
    one torch thread for the module's tests."""
    pytest.importorskip("torchtitan", reason="torchtitan is not installed (see the module "
                                             "docstring for the install lines)")
    from torchtitan.distributed import pipeline_parallel
    from torchtitan.distributed.activation_checkpoint import FullAC
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import llama3_configs

    from ckptfx.integrations import torchtitan as adapter

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = llama3_configs["debugmodel"](attn_backend="flex")
    model = config.build()
    model.init_states()
    for block in model.layers.values():  # the test-only swap (module docstring)
        block.attention.inner_attention = ScaledDotProductAttention(
            ScaledDotProductAttention.Config())
    try:
        yield SimpleNamespace(model=model, config=config, FullAC=FullAC, pp=pipeline_parallel,
                              ac=adapter)
    finally:
        torch.set_num_threads(threads)


def _inner(block: nn.Module) -> nn.Module:
    """The block itself under ckptfx's wrapper (in place), the wrapped one under torch's."""
    return getattr(block, "_checkpoint_wrapped_module", block)


def _count_runs(model: nn.Module) -> None:
    """A counter in each block: the Python runs of its feed-forward (the block's forward and
    every replay that re-runs it), in ``feed_forward.runs``."""
    for block in model.layers.values():
        ff = _inner(block).feed_forward
        ff.runs = 0
        ff.register_forward_pre_hook(lambda m, args: setattr(m, "runs", m.runs + 1))


def _runs(model: nn.Module) -> list[int]:
    return [_inner(b).feed_forward.runs for b in model.layers.values()]


def _batches(n: int, batch: int, seq: int = 32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (batch, seq), generator=g),
             torch.randint(0, VOCAB, (batch, seq), generator=g)) for _ in range(n)]


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def _apply(tt: SimpleNamespace, model: nn.Module, variant: str) -> None:
    """Checkpoint ``model`` as ``variant`` says, the way torchtitan's parallelize_fn does."""
    config: Any = {
        "plain": None,
        "torchtitan_full": tt.FullAC.Config(),
        "full": tt.ac.CkptfxAC.Config(),
        "dots_saveable": tt.ac.CkptfxAC.Config(policy="dots_saveable"),
        "memory_budget": tt.ac.CkptfxAC.Config(memory_budget=0.3),
        "budget_offload": tt.ac.CkptfxAC.Config(memory_budget=0.1, offload=0.4),
        "offload_policy_name": tt.ac.CkptfxAC.Config(policy="offload_dot_with_no_batch_dims"),
    }.get(variant, variant)
    if config == "function":  # the function path, with a policy object
        tt.ac.apply_ac(model, policy=cp.dots_with_no_batch_dims_saveable)
    elif config == "function_offload":
        tt.ac.apply_ac(model, memory_budget=0.1, offload=0.4)
    elif config is not None:
        config.build(dump_folder="").apply(model)


def _train(tt: SimpleNamespace, variant: str, steps: int, autocast: bool = False
           ) -> tuple[list[list[torch.Tensor]], list[torch.Tensor], list[list[int]], list[dict]]:
    """``steps`` AdamW steps: each step's gradients, the parameters after them, each step's
    runs per block and ATen op counts."""
    model = copy.deepcopy(tt.model)
    _apply(tt, model, variant)
    _count_runs(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    grads, runs, ops = [], [], []
    for tokens, labels in _batches(steps, batch=2):
        for ff in (_inner(b).feed_forward for b in model.layers.values()):
            ff.runs = 0
        with OpCounter() as counter:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                logits = model(tokens)
            _loss(logits, labels).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        runs.append(_runs(model))
        ops.append(counter.counts)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return grads, [p.detach().clone() for p in model.parameters()], runs, ops


# -- import ------------------------------------------------------------------------------------


def test_torchtitan_is_imported_by_name_only_and_without_it_the_error_says_how_to_install(
) -> None:
    code = ("import sys, ckptfx, ckptfx.integrations\n"
            "assert 'ckptfx.integrations.torchtitan' not in sys.modules\n"
            "assert not any(m.split('.')[0] == 'torchtitan' for m in sys.modules)\n"
            "sys.modules['torchtitan'] = None  # as if it were not installed\n"
            "try:\n"
            "    ckptfx.integrations.torchtitan\n"
            "except ImportError as e:\n"
            "    print(e)\n"
            "else:\n"
            "    raise SystemExit('no ImportError')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pip install torchtitan" in out.stdout and "--no-deps" in out.stdout


# -- training steps ----------------------------------------------------------------------------

STEPS = 2


@pytest.fixture(scope="module")
def plain_run(tt: SimpleNamespace) -> tuple:
    return _train(tt, "plain", STEPS)


@pytest.mark.parametrize("variant", ["torchtitan_full", "full", "dots_saveable",
                                     "memory_budget", "function", "budget_offload",
                                     "offload_policy_name", "function_offload"])
def test_training_steps_are_bitwise_those_without_checkpointing(
        tt: SimpleNamespace, plain_run: tuple, variant: str) -> None:
    ref_grads, ref_params, ref_runs, ref_ops = plain_run
    grads, params, runs, ops = _train(tt, variant, STEPS)
    for step in range(STEPS):
        assert_bitwise(grads[step], ref_grads[step])
    assert_bitwise(params, ref_params, "parameter")
    assert ref_runs == [[1] * 6] * STEPS
    if variant in ("torchtitan_full", "full"):
        # the forward and one replay of each block per step, in Python
        assert runs == [[2] * 6] * STEPS
        assert all(o["silu"] == 2 * r["silu"] for o, r in zip(ops, ref_ops))
    elif variant == "dots_saveable":
        # the replay runs the blocks' other ops again (not in Python) and no matmul
        assert runs == ref_runs
        assert all(o["silu"] == 2 * r["silu"] and o["mm"] == r["mm"]
                   for o, r in zip(ops, ref_ops))


@pytest.fixture(scope="module")
def plain_bf16_run(tt: SimpleNamespace) -> tuple:
    return _train(tt, "plain", 1, autocast=True)


@pytest.mark.parametrize("variant", ["full", "dots_saveable"])
def test_bf16_autocast_step_is_bitwise_the_one_without_checkpointing(
        tt: SimpleNamespace, plain_bf16_run: tuple, variant: str) -> None:
    ref_grads, ref_params, _, _ = plain_bf16_run
    grads, params, _, _ = _train(tt, variant, 1, autocast=True)
    assert_bitwise(grads[0], ref_grads[0])
    assert_bitwise(params, ref_params, "parameter")


# -- the config path ---------------------------------------------------------------------------


def test_config_builds_ckptfx_ac_that_wraps_each_layer_in_place(tt: SimpleNamespace) -> None:
    model = copy.deepcopy(tt.model)
    blocks = dict(model.layers.named_children())
    names = [n for n, _ in model.named_parameters()]
    modules = [n for n, _ in model.named_modules()]
    ac = tt.ac.CkptfxAC.Config(policy="dots_saveable").build(dump_folder="/tmp/unused")
    assert type(ac) is tt.ac.CkptfxAC and ac.dump_folder == "/tmp/unused"
    ac.apply(model)
    assert dict(model.layers.named_children()) == blocks  # the same objects, in their slots
    assert [n for n, _ in model.named_parameters()] == names
    assert [n for n, _ in model.named_modules()] == modules  # no _checkpoint_wrapped_module
    block_class = type(tt.model.layers["0"])
    for block in blocks.values():  # wrapped in place: a subclass of its class, same object
        assert type(block) is not block_class and isinstance(block, block_class)
    # one block alone (torchtitan's _wrap_block), with a budget: that block's own fraction
    alone = copy.deepcopy(tt.model.layers["0"])
    assert tt.ac.CkptfxAC.Config(memory_budget=0.5).build()._wrap_block(alone) is alone
    assert type(alone) is not block_class and isinstance(alone, block_class)
    # torchtitan's own FullAC puts a wrapper module in each slot, a level in module paths
    other = copy.deepcopy(tt.model)
    tt.FullAC.Config().build(dump_folder="").apply(other)
    assert "layers.0._checkpoint_wrapped_module.attention" in dict(other.named_modules())


def test_torchtitans_command_line_selects_and_overrides_the_config(tt: SimpleNamespace) -> None:
    """Through tyro with torchtitan's registry (as its ConfigManager parses), a config
    default of ``CkptfxAC.Config`` stays one, and its fields take command-line values."""
    from dataclasses import field, make_dataclass

    import tyro
    from torchtitan.config.manager import custom_registry
    from torchtitan.distributed.activation_checkpoint import (
        ActivationCheckpointingConfig,
        SelectiveAC,
    )

    # the trainer config's field, with torchtitan's annotation (a real one, not a string)
    TrainerLike = make_dataclass("TrainerLike", [(
        "activation_checkpoint", ActivationCheckpointingConfig,
        field(default_factory=SelectiveAC.Config))], kw_only=True)

    default = TrainerLike(activation_checkpoint=tt.ac.CkptfxAC.Config(policy="dots_saveable"))
    with warnings.catch_warnings():
        # tyro notes that CkptfxAC.Config is not one of torchtitan's own AC configs
        warnings.simplefilter("ignore")
        kept = tyro.cli(TrainerLike, args=[], default=default, registry=custom_registry)
        changed = tyro.cli(TrainerLike, registry=custom_registry, default=default, args=[
            "activation-checkpoint:config", "--activation-checkpoint.policy", "nothing_saveable"])
    assert kept.activation_checkpoint == tt.ac.CkptfxAC.Config(policy="dots_saveable")
    assert changed.activation_checkpoint == tt.ac.CkptfxAC.Config(policy="nothing_saveable")


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, error, words", [
    ({"policy": "dots"}, ValueError, ["'dots'", "dots_saveable"]),
    ({"policy": "save_only_these_names"}, TypeError, ["factory", "save_only_these_names(...)"]),
    ({"policy": "dots_saveable", "memory_budget": 0.5}, ValueError, ["not both"]),
    ({"memory_budget": 1.5}, ValueError, ["1.5"]),
    ({"memory_budget": "half"}, TypeError, ["memory_budget"]),
    ({"early_stop": "yes"}, TypeError, ["early_stop"]),
    ({"determinism_check": "strict"}, ValueError, ["determinism_check"]),
    ({"offload": 0.2}, ValueError, ["offload", "memory_budget"]),
    ({"memory_budget": 0.2, "offload": 2.0}, ValueError, ["offload"]),
])
def test_bad_config_is_refused_when_made(tt: SimpleNamespace, kwargs: dict, error: type,
                                         words: list[str]) -> None:
    with pytest.raises(error) as info:
        tt.ac.CkptfxAC.Config(**kwargs)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_bad_model_or_policy_is_refused_before_anything_changes(tt: SimpleNamespace) -> None:
    with pytest.raises(TypeError, match="torch.nn.Module"):
        tt.ac.apply_ac("model")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="layers"):
        tt.ac.apply_ac(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="checkpoint function"):
        tt.ac.apply_ac(copy.deepcopy(tt.model), policy=ckptfx.checkpoint)
    # a model whose last block torchtitan's FullAC checkpoints already: no block changes
    model = copy.deepcopy(tt.model)
    last = model.layers["5"]
    model.layers.register_module("5", tt.FullAC.Config().build(dump_folder="")._wrap_block(last))
    classes = [type(b) for b in model.layers.values()]
    with pytest.raises(ValueError, match=r"layers\.5 is already checkpointed"):
        tt.ac.CkptfxAC.Config().build(dump_folder="").apply(model)
    assert [type(b) for b in model.layers.values()] == classes


# -- the ZBV zero-bubble pipeline --------------------------------------------------------------


def _pipeline(tt: SimpleNamespace, variant: str) -> tuple[list, list, list]:
    """torchtitan's ``pipeline_llm`` (ckptfx's for ``variant="ckptfx"``) with the ZBV
    schedule: two stages, both on this rank as ZBV places them with one pipeline rank, each
    checkpointed by the trainer config's ``ac_config`` through a ``parallelize_fn`` that
    applies it as torchtitan's does. Two steps: each step's gradients, losses and runs.

    torchtitan's ``ParallelDims`` refuses a pipeline degree of 1, so ``parallel_dims`` is a
    stand-in with what ``pipeline_llm`` reads of it: the degree and the ``pp`` mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("pp",))
    dims = SimpleNamespace(pp=1, get_mesh=lambda names: mesh)
    ac_config = {"plain": None, "torchtitan": tt.FullAC.Config(),
                 "ckptfx": tt.ac.CkptfxAC.Config()}[variant]

    def parallelize_fn(model: nn.Module, *, ac_config: Any, dump_folder: str,
                       **others: Any) -> nn.Module:
        if ac_config is not None:  # what torchtitan's parallelize_llama does with it
            ac_config.build(dump_folder=dump_folder).apply(model)
        return model

    pipeline_llm = tt.ac.pipeline_llm if variant == "ckptfx" else tt.pp.pipeline_llm
    schedule, parts, _, _ = pipeline_llm(
        tt.model, parallel_dims=dims, training=TrainingConfig(local_batch_size=MB),
        parallelism=ParallelismConfig(pipeline_parallel_schedule="ZBVZeroBubble",
                                      pipeline_parallel_microbatch_size=1),
        compile_config=CompileConfig(), ac_config=ac_config, dump_folder="",
        device=torch.device("cpu"), model_config=tt.config, parallelize_fn=parallelize_fn,
        loss_fn=lambda logits, labels: (_loss(logits, labels), None))
    assert type(schedule).__name__ == "ScheduleZBVZeroBubble" and len(parts) == 2
    stage_class = ckptfx.pipelining.PipelineStage if variant == "ckptfx" else (
        torch.distributed.pipelining.PipelineStage)
    assert all(type(s) is stage_class for s in schedule._stages)
    for part in parts:
        _count_runs(part)
    grads, losses, runs = [], [], []
    for tokens, labels in _batches(2, batch=MB):
        for part in parts:
            part.zero_grad(set_to_none=True)
            for ff in (_inner(b).feed_forward for b in part.layers.values()):
                ff.runs = 0
        step_losses: list[torch.Tensor] = []
        schedule.step(tokens, target=labels, losses=step_losses)
        grads.append([p.grad.clone() for part in parts for p in part.parameters()])
        losses.append(step_losses)
        runs.append([_runs(part) for part in parts])
    return grads, losses, runs


@pytest.mark.usefixtures("gloo_world_of_one")
def test_zbv_pipeline_is_bitwise_and_ckptfx_replays_each_block_once_per_microbatch(
        tt: SimpleNamespace) -> None:
    ref_grads, ref_losses, plain_runs = _pipeline(tt, "plain")
    # torch's metadata inference runs each stage once more on the first step
    assert plain_runs == [[[MB + 1] * 3] * 2, [[MB] * 3] * 2]
    for variant in ("torchtitan", "ckptfx"):
        grads, losses, runs = _pipeline(tt, variant)
        for step in range(2):
            assert_bitwise(grads[step], ref_grads[step])
            assert_bitwise(losses[step], ref_losses[step], "loss")
        if variant == "ckptfx":
            # per micro-batch the forward and one replay; the inference forward (first
            # step) is not replayed
            assert runs == [[[2 * MB + 1] * 3] * 2, [[2 * MB] * 3] * 2]
        else:
            # The first stage's weight step is a full backward: one replay. The last stage
            # replays each block for its input step and once per parameter (each a group of
            # torch's weight step), 7 in a llama3 block; on the first step it also replays
            # the inference forward for its gradient metadata.
            params = len(list(_inner(tt.model.layers["0"]).parameters()))
            assert runs == [[[2 * MB + 1] * 3, [(2 + params) * MB + 2] * 3],
                            [[2 * MB] * 3, [(2 + params) * MB] * 3]]
    assert not ckptfx.recompute_session_stats()  # every micro-batch's session cleared


def test_ckptfx_pipelining_rebinds_torchtitans_stage_class_for_the_call_only(
        tt: SimpleNamespace) -> None:
    torch_stage = torch.distributed.pipelining.PipelineStage
    seen = []

    def pipelining_fn(fail: bool) -> str:
        seen.append(tt.pp.PipelineStage)
        if fail:
            raise RuntimeError("stage build failed")
        return "built"

    wrapped = tt.ac.ckptfx_pipelining(pipelining_fn)
    assert wrapped(False) == "built"
    with pytest.raises(RuntimeError, match="stage build failed"):
        wrapped(True)
    assert seen == [ckptfx.pipelining.PipelineStage] * 2
    assert tt.pp.PipelineStage is torch_stage  # restored, also after the error
    assert tt.ac.pipeline_llm.__wrapped__ is tt.pp.pipeline_llm
    with pytest.raises(TypeError, match="pipelining_fn must be a callable"):
        tt.ac.ckptfx_pipelining("pipeline_llm")  # type: ignore[arg-type]
