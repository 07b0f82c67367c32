"""Distributed: collectives kept inside blocks, the split backward under DDP and FSDP2, remat
around an FSDP2 module call, and a 2 x 2 pipeline x FSDP2 run.

The single-process tests use a custom op registered with ``ckptfx.register_collective`` (a
counter inside it counts its runs), and check that the cached "is torch.distributed
initialized" test follows the c10d state torch has in place. The multi-process tests spawn gloo ranks once per world
size (``_distributed_workers``), run every check there, and assert on what each rank
returned; the workers destroy their process groups in a ``finally`` and the parent waits
with a timeout.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.utils.checkpoint as tcp
from torch.utils.checkpoint import CheckpointPolicy

import ckptfx

import _distributed_workers as workers

# -- a collective in one process: a registered custom op ---------------------------------------

_calls = [0]


@torch.library.custom_op("ckptfx_test::fake_all_reduce", mutates_args=())
def _fake_all_reduce(x: torch.Tensor) -> torch.Tensor:
    _calls[0] += 1
    return x * 2


_fake_all_reduce.register_autograd(lambda ctx, g: g * 2)
FAKE = torch.ops.ckptfx_test.fake_all_reduce.default


def _block(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(torch.ops.ckptfx_test.fake_all_reduce(torch.sin(x)) * x)


def _recompute_the_collective(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_RECOMPUTE if op is FAKE else CheckpointPolicy.PREFER_RECOMPUTE


VARIANTS = {
    "checkpoint": lambda x: ckptfx.checkpoint(_block, x),
    "remat": ckptfx.remat(_block),
    "remat_dots": ckptfx.remat(_block, policy=ckptfx.checkpoint_policies.dots_saveable),
    "vjp_split": None,  # below
}


def _runs_and_grad(name: str) -> tuple[int, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(5, requires_grad=True)
    _calls[0] = 0
    if name == "vjp_split":
        out, dx_fn, dw_fn = ckptfx.vjp_split(lambda x: ckptfx.checkpoint(_block, x), x)
        dx = dx_fn(torch.ones_like(out))
        dw_fn()
        return _calls[0], dx
    fn = {"plain": _block, "torch": lambda x: tcp.checkpoint(_block, x, use_reentrant=False),
          "remat_recompute": ckptfx.remat(_block, policy=_recompute_the_collective),
          **VARIANTS}[name]
    fn(x).sum().backward()
    return _calls[0], x.grad


@pytest.fixture
def registered() -> Any:
    ckptfx.register_collective(FAKE)
    yield
    from ckptfx.kernel import collectives
    collectives._registered.discard(FAKE)
    collectives._KIND.pop(FAKE, None)


def test_a_registered_collective_is_kept_not_replayed(registered: None) -> None:
    plain_runs, plain_grad = _runs_and_grad("plain")
    assert plain_runs == 1
    torch_runs, torch_grad = _runs_and_grad("torch")
    assert torch_runs == 2  # torch's checkpoint replays it
    assert torch.equal(torch_grad, plain_grad)
    for name in VARIANTS:
        runs, grad = _runs_and_grad(name)
        assert runs == 1, name
        assert torch.equal(grad, plain_grad), name


def test_a_policy_may_ask_to_recompute_a_collective(registered: None) -> None:
    runs, grad = _runs_and_grad("remat_recompute")
    assert runs == 2
    assert torch.equal(grad, _runs_and_grad("plain")[1])


def test_an_unregistered_op_is_replayed_as_torch_does() -> None:
    assert _runs_and_grad("checkpoint")[0] == 2
    assert _runs_and_grad("remat")[0] == 2


def test_a_replay_calling_other_collectives_raises(registered: None) -> None:
    times = [1]

    def block(x: torch.Tensor) -> torch.Tensor:
        for _ in range(times[0]):
            x = torch.ops.ckptfx_test.fake_all_reduce(x)
        return torch.sin(x)

    x = torch.randn(3, requires_grad=True)
    y = ckptfx.checkpoint(block, x)
    times[0] = 2  # the replay would call one more than the forward did
    with pytest.raises(ckptfx.CheckpointError, match="collective"):
        y.sum().backward()


def test_a_collective_returning_a_tensor_subclass_is_refused_in_the_forward() -> None:
    # Its output cannot be kept as a plain alias (a wrapper subclass has no data of its own):
    # the forward says so, rather than the replay handing out an empty tensor.
    from torch.testing._internal.two_tensor import TwoTensor

    from ckptfx.kernel import collectives
    op = torch.ops.aten.sin.default
    ckptfx.register_collective(op)
    try:
        x = TwoTensor(torch.randn(3), torch.randn(3)).requires_grad_()
        with pytest.raises(ckptfx.CheckpointError, match="returned a tensor subclass"):
            ckptfx.checkpoint(lambda t: torch.sin(t) * 2, x)
    finally:
        collectives._registered.discard(op)
        collectives._KIND.pop(op, None)
    assert not collectives.is_collective(op)


def test_register_collective_names_what_it_expects() -> None:
    with pytest.raises(TypeError, match="register_collective: op must be"):
        ckptfx.register_collective("c10d.allreduce_")


# Found in review of the cached torch.distributed check (was test_review_regressions_3.py).
def test_distributed_check_follows_a_replaced_c10d_world(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    # torch may replace c10d's state object at run time (its threaded test harness does):
    # the check reads the one in place now, as torch.distributed.is_initialized does.
    from ckptfx import _compat
    from ckptfx.kernel import collectives

    c10d = torch.distributed.distributed_c10d

    class World:
        default_pg = object()

    assert _compat.distributed_initialized() is torch.distributed.is_initialized()
    monkeypatch.setattr(c10d, "_world", World())
    assert torch.distributed.is_initialized() is True
    assert _compat.distributed_initialized() is True
    assert collectives.watch_needed() is True


# -- two gloo ranks ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_ranks() -> dict:
    results = workers.spawn_ranks(workers.two_ranks, 2, timeout=180)
    for rank, r in results.items():
        assert "error" not in r, f"rank {rank}:\n{r.get('error')}"
    return results


def test_real_all_reduce_inside_a_block_is_not_replayed(two_ranks: dict) -> None:
    for r in two_ranks.values():
        c = r["collectives"]
        assert c["plain"] == (1, 0)
        assert c["torch"] == (2, 1)  # torch replays the all_reduce in the backward
        assert c["checkpoint"] == (2, 0)  # Python re-run, the all_reduce answered from the log
        assert c["remat"] == c["remat_dots"] == (1, 0)
        assert all(c["bitwise"].values()), c["bitwise"]


def test_functional_all_reduce_inside_a_block_is_not_replayed(two_ranks: dict) -> None:
    # fc.all_reduce returns an AsyncCollectiveTensor (made by a local wrapping op, which the
    # replay runs): the replay answers the all_reduce from the log; the one all_reduce left
    # in each backward is the gradient's, as in the plain backward.
    for r in two_ranks.values():
        c = r["collectives"]["functional"]
        assert c["plain"] == (1, 1)
        assert c["torch"] == (2, 2)  # torch replays the all_reduce in the backward
        assert c["checkpoint"] == (2, 1)
        assert c["remat"][1] == 1
        assert all(c["bitwise"].values()), c["bitwise"]


def test_autograd_functional_collectives_inside_a_block_are_not_replayed(two_ranks: dict
                                                                          ) -> None:
    # all_gather_tensor_autograd then reduce_scatter_tensor_autograd: the one all_gather in
    # each backward is reduce_scatter's gradient, as in the plain backward.
    for r in two_ranks.values():
        c = r["collectives"]["functional_autograd"]
        assert c["plain"] == (1, 1)
        assert c["torch"] == (2, 2)  # torch replays the forward's all_gather too
        assert c["checkpoint"] == (2, 1)
        assert c["remat"][1] == 1
        assert all(c["bitwise"].values()), c["bitwise"]


def test_ddp_vjp_split_all_reduces_like_ddp_backward(two_ranks: dict) -> None:
    for r in two_ranks.values():
        d = r["ddp"]
        assert d[False] == [("split", True, True)] * 3
        assert d["replicas_False"] and d["replicas_True"]


def test_ddp_static_graph_first_step_is_refused_before_any_gradient(two_ranks: dict) -> None:
    for r in two_ranks.values():
        d = r["ddp"][True]
        assert d[0] == ("refused", True, True)  # no .grad written, message names DDP
        assert d[1:] == [("split", True, True)] * 2


def test_ddp_find_unused_and_fsdp2_mixed_precision_splits(two_ranks: dict) -> None:
    for r in two_ranks.values():
        assert r["variants"] == {"ddp_find_unused": [True, True], "fsdp_bf16": [True, True]}


@pytest.mark.parametrize(("wrap", "how"), workers.FSDP_CASES)
def test_fsdp2_split_is_bitwise_and_reshards(two_ranks: dict, wrap: str, how: str) -> None:
    runs = 4 if wrap == "checkpoint_wrapper" else 2  # 2 blocks: forward + one replay each
    for r in two_ranks.values():
        # (output, dx, sharded grads) bitwise vs FSDP2's plain backward; resharded after dw
        assert r["fsdp"][(wrap, how)] == [(True, True, True, True, runs)] * 2


@pytest.mark.parametrize("how", [h for h in workers.SESSION_PREFIRES
                                 if h != "remat_through_a_global"])
def test_fsdp2_scheduler_prefire_unshards_the_blocks_modules(two_ranks: dict, how: str
                                                            ) -> None:
    """recompute_handle before the session backward: wrapped blocks, remat on the forward
    inside the FSDP call, remat around the call (the module a default argument), and a lazy
    session replay; the sharded gradients are bitwise FSDP's plain backward's."""
    for r in two_ranks.values():
        assert r["fsdp"][("sessions", how)] == ("", True, False)


def test_fsdp2_prefire_of_a_block_whose_module_it_cannot_see_is_refused(two_ranks: dict
                                                                       ) -> None:
    """A remat'd function that reaches its FSDP block only through a global: the prefire
    cannot unshard it, and the replay refuses the resharded parameters before any gradient
    is written, saying what works instead."""
    for r in two_ranks.values():
        error, _, no_grads = r["fsdp"][("sessions", "remat_through_a_global")]
        assert "FSDP resharded it after the forward" in error
        assert "vjp_split" in error
        assert no_grads


def test_fsdp2_abandoned_split_reduces_nothing_and_reshards(two_ranks: dict) -> None:
    for r in two_ranks.values():
        assert r["fsdp"]["abandoned"] == (True, True, True)


def test_remat_around_an_fsdp2_call_keeps_fsdp_collectives_outside(two_ranks: dict) -> None:
    for r in two_ranks.values():
        rf = r["remat_fsdp_call"]
        # no Python re-run (0 block runs in the backward), the policy decides: without one the
        # replay recomputes fc1's addmm in each block, dots_saveable keeps it
        assert rf["none"] == [(0, 2, True)] * 2
        assert rf["dots"] == [(0, 0, True)] * 2


# -- four gloo ranks: 2-stage x 2-way FSDP2 pipeline ---------------------------------------------


def test_pipeline_x_fsdp2_2x2_zero_bubble() -> None:
    results = workers.spawn_ranks(workers.pipeline_2x2, 4, timeout=240)
    for rank, r in results.items():
        assert "error" not in r, f"rank {rank}:\n{r.get('error')}"
        for schedule in ("ScheduleZBVZeroBubble", "ScheduleInterleavedZeroBubble"):
            same, per_mb, first, _, _ = r[schedule]
            assert same, (rank, schedule)
            assert per_mb == [2.0], (rank, schedule, per_mb)
            assert first == [2.25], (rank, schedule, first)  # + torch's inference forward
