"""memory_budget(fraction, offload=...): a plan that keeps some values in host memory.

Measured on a transformer block on the CPU (where an offloaded value is kept as it is) and on
the fake accelerator (where it is copied to a host tensor and its device memory freed):
gradients bitwise, device bytes within ``fraction`` and host bytes within ``offload`` (and
as the plan says), never more FLOPs than the budget without offload, ``offload=0.0`` exactly
the budget without it, the model-level spread, the report, bad input and old pickles.
"""

from __future__ import annotations

import gc
import pickle
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import ckptfx
from ckptfx import budget
from ckptfx import checkpoint_policies as cp
from ckptfx.budget.place import MIN_OFFLOAD_BYTES, Placement, place
from ckptfx.budget.planner import _plans, placement_of
from ckptfx.policies.budget_policy import MemoryBudget
from ckptfx.policies.tracer_stack import tracer_stack

from conftest import assert_bitwise, grads, maybe_autocast, settle_device_threads
from models import TransformerBlock

pytestmark = pytest.mark.usefixtures("no_hooks_left_behind")

# (fraction, offload): device only, host only, both, more than everything, half and half.
CASES = [(0.2, 0.0), (0.0, 0.3), (0.1, 0.2), (0.2, 0.3), (0.3, 0.9), (0.5, 0.5)]


def backward(fn: Callable[..., Any], x: torch.Tensor, params: list[torch.Tensor], amp: bool,
             seed: int = 7) -> list:
    for t in (x, *params):
        t.grad = None
    torch.manual_seed(seed)
    with maybe_autocast(amp, x.device):
        out = fn(x)
    out.float().sum().backward()
    return grads([x, *params])


def kept(fn: Callable[..., Any], x: torch.Tensor, amp: bool) -> tuple[int, int]:
    """Measured (device bytes, host bytes) a call keeps beyond its arguments, from the residual
    report by storage. An offloaded tensor under MIN_OFFLOAD_BYTES stays on the device (the
    eager side's rule; on the CPU the report calls every Offload answer offloaded)."""
    report: list[Any] = []
    outer, tracer_stack.report = tracer_stack.report, report
    try:
        with maybe_autocast(amp, x.device):
            fn(x)
    finally:
        tracer_stack.report = outer
    device: dict[int, int] = {}
    host: dict[int, int] = {}
    for _, kind, t, _, _ in report:
        storage = t.untyped_storage()
        small = t.numel() * t.element_size() < MIN_OFFLOAD_BYTES
        if kind == "saved" or kind == "offloaded" and small:
            device[storage._cdata] = storage.nbytes()
        elif kind == "offloaded":
            host[storage._cdata] = storage.nbytes()
    return sum(device.values()), sum(host.values())


def allocated_between(fn: Callable[..., Any], x: torch.Tensor, amp: bool) -> int:
    """Accelerator memory held between forward and backward beyond the output (measured by
    the device's allocator: an offloaded value's device memory is gone)."""
    settle_device_threads()  # an earlier backward's graph is freed now, not while measuring
    gc.collect()
    gc.disable()  # nor is other garbage
    try:
        before = torch.accelerator.memory_allocated()
        torch.manual_seed(7)
        with maybe_autocast(amp, x.device):
            out = fn(x)
        held = torch.accelerator.memory_allocated() - before - out.untyped_storage().nbytes()
    finally:
        gc.enable()
    out.float().sum().backward()
    return held


def frontier_of(block: Any) -> budget.Frontier:
    (frontier,) = _plans[block].values()
    return frontier


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
def test_offload_is_bitwise_and_within_both_budgets(device: torch.device, amp: bool) -> None:
    """Each (fraction, offload): the planning call and a planned one give the plain
    gradients bitwise; the planned call keeps at most ``fraction`` on the device and
    ``offload`` in host memory, exactly the bytes its placement says (on the accelerator,
    measured by its allocator too)."""
    block = TransformerBlock(device)
    x = torch.randn(2, 64, 128, device=device, requires_grad=True)
    ref = backward(block, x, block.params, amp)
    offloaded = 0
    for fraction, offload in CASES:
        policy = cp.memory_budget(fraction, offload=offload)
        fn = ckptfx.remat(block, policy=policy)
        for _ in range(2):  # plans (first case only), then a planned call
            assert_bitwise(backward(fn, x, block.params, amp), ref,
                           f"gradient at {policy.label()}")
        frontier = frontier_of(block)
        placement = placement_of(policy, frontier)
        torch.manual_seed(7)
        dev, host = kept(fn, x, amp)
        assert dev <= frontier.budget_bytes(fraction), (policy, dev)
        assert host <= frontier.budget_bytes(offload), (policy, host)
        assert (dev, host) == (placement.device, placement.host), policy
        if device.type != "cpu":
            assert allocated_between(fn, x, amp) == placement.device, policy
        offloaded += host > 0
    assert offloaded >= 3  # the split is exercised, not only the device-only choice


def test_offload_never_recomputes_more_than_the_budget_without_it() -> None:
    """At every (fraction, offload), no more FLOPs than memory_budget(fraction), fewer
    where host memory helps; the FLOPs a planned call recomputes, measured, are the plan's."""
    block = TransformerBlock(torch.device("cpu"))
    x = torch.randn(2, 64, 128, requires_grad=True)
    backward(ckptfx.remat(block, policy=cp.memory_budget(0.5)), x, block.params, False)
    frontier = frontier_of(block)
    fewer = 0
    for fraction in (0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8):
        alone = frontier.choose(fraction)
        for offload in (0.0, 0.1, 0.2, 0.4, 1.0):
            placement = place(frontier, fraction, offload)
            assert placement.point.flops <= alone.flops
            assert placement.device <= frontier.budget_bytes(fraction)
            assert placement.host <= frontier.budget_bytes(offload)
            fewer += placement.point.flops < alone.flops
    assert fewer
    every = _measured_flops(ckptfx.remat(block, policy=cp.everything_saveable), x, block)
    for fraction, offload in ((0.1, 0.2), (0.2, 0.3)):
        policy = cp.memory_budget(fraction, offload=offload)
        flops = _measured_flops(ckptfx.remat(block, policy=policy), x, block)
        assert flops - every == placement_of(policy, frontier).point.flops


def _measured_flops(fn: Callable[..., Any], x: torch.Tensor, block: TransformerBlock) -> int:
    backward(fn, x, block.params, False)  # a budget plans on its first call
    torch.manual_seed(7)
    out = fn(x)
    with FlopCounterMode(display=False) as counter:
        out.sum().backward()
    return counter.get_total_flops()


def test_offload_zero_is_the_budget_without_offload(capsys: pytest.CaptureFixture[str]
                                                   ) -> None:
    """``offload=0.0`` (the default) is today's budget: the same policy value, the same
    point, nothing offloaded, the same report word for word."""
    block = TransformerBlock(torch.device("cpu"))
    x = torch.randn(2, 64, 128)
    assert cp.memory_budget(0.3) == cp.memory_budget(0.3, offload=0.0)
    ckptfx.print_saved_residuals(ckptfx.remat(block, policy=cp.memory_budget(0.3)), x)
    capsys.readouterr()
    frontier = frontier_of(block)
    for fraction in (0.0, 0.1, 0.3, 0.6, 1.0):
        assert place(frontier, fraction, 0.0) == Placement.on_device(frontier.choose(fraction))
        texts = []
        for policy in (cp.memory_budget(fraction), cp.memory_budget(fraction, offload=0.0)):
            ckptfx.print_saved_residuals(ckptfx.remat(block, policy=policy), x)
            texts.append(capsys.readouterr().out)
        assert texts[0] == texts[1] and "offloaded" not in texts[0]


def test_the_report_lists_what_went_to_host(capsys: pytest.CaptureFixture[str]) -> None:
    block = TransformerBlock(torch.device("cpu"))
    x = torch.randn(2, 64, 128)
    fn = ckptfx.remat(block, policy=cp.memory_budget(0.2, offload=0.3))
    ckptfx.print_saved_residuals(fn, x)
    text = capsys.readouterr().out
    assert "memory_budget(0.2, offload=0.3): keeps" in text
    assert "in host memory (offloaded)" in text and "offloads op" in text
    assert "(offloaded to host)" in text  # the residual lines
    residuals = ckptfx.saved_residuals(fn, x)
    assert any(r.kind == "offloaded" for r in residuals)
    assert any(r.kind == "saved" for r in residuals)


def test_fraction_plus_offload_past_one_keeps_everything_split() -> None:
    block = TransformerBlock(torch.device("cpu"))
    x = torch.randn(2, 64, 128, requires_grad=True)
    fn = ckptfx.remat(block, policy=cp.memory_budget(0.4, offload=0.8))
    ref = backward(block, x, block.params, False)
    assert_bitwise(backward(fn, x, block.params, False), ref)
    frontier = frontier_of(block)
    placement = place(frontier, 0.4, 0.8)
    # no FLOPs recomputed, as under everything_saveable, split between the memories (of
    # the points recomputing none, the one copying fewest bytes: place.py Rule 5b)
    assert placement.point.flops == frontier.everything.flops == 0
    assert frontier.choose(0.4).flops > 0 and placement.host > 0
    assert placement.device <= frontier.budget_bytes(0.4)
    assert placement.host <= frontier.budget_bytes(0.8)
    assert kept(fn, x, False) == (placement.device, placement.host)
    # fraction 1.0 keeps everything on the device: nothing to offload
    assert place(frontier, 1.0, 0.5) == Placement.on_device(frontier.everything)


def test_a_block_that_cannot_be_replayed_splits_everything(device: torch.device) -> None:
    """A block whose recording cannot be replayed has two points, nothing and everything:
    with enough offload, everything is kept, split between the memories (the plan answers
    op by op, views included), and the gradients are the plain ones bitwise."""
    g = torch.Generator().manual_seed(0)
    w1 = (torch.randn(128, 512, generator=g) / 12).to(device).requires_grad_()
    w2 = (torch.randn(512, 128, generator=g) / 22).to(device).requires_grad_()

    def block(x: torch.Tensor) -> torch.Tensor:
        h = F.layer_norm(x @ w1, (512,))
        h.data_ptr()  # memory handed outside the dispatcher: the block re-runs instead
        return torch.tanh(F.gelu(h) @ w2)

    x = torch.randn(256, 128, device=device, requires_grad=True)
    ref = backward(block, x, [w1, w2], False)
    policy = cp.memory_budget(0.35, offload=0.8)
    fn = ckptfx.remat(block, policy=policy)
    for _ in range(2):
        assert_bitwise(backward(fn, x, [w1, w2], False), ref)
    frontier = frontier_of(block)
    assert not frontier.replayable
    placement = placement_of(policy, frontier)
    assert placement.point.keep == frontier.everything_keep and placement.host > 0
    assert placement.device <= frontier.budget_bytes(0.35)
    assert placement.host <= frontier.budget_bytes(0.8)
    torch.manual_seed(7)
    assert kept(fn, x, False) == (placement.device, placement.host)
    # 0.3 cannot split: the three large values are needed on the host, more than 0.8
    assert place(frontier, 0.3, 0.8) == Placement.on_device(frontier.nothing)


@pytest.mark.parametrize("fraction, offload", [(0.15, 0.4)])
def test_model_budget_spreads_offload_over_blocks(fraction: float, offload: float) -> None:
    """memory_budget_policies(blocks, fraction, offload=...): bitwise; the model's device
    bytes within ``fraction`` and host bytes within ``offload`` of everything_saveable's
    total, measured; no more FLOPs than each block's own memory_budget(fraction, offload)."""
    blocks = [TransformerBlock(torch.device("cpu"), seed=s, heads=h)
              for s, h in ((0, 4), (1, 2), (2, 8))]
    params = [p for b in blocks for p in b.params]
    x = torch.randn(2, 64, 128, requires_grad=True)

    def model(calls: list) -> Callable[[torch.Tensor], torch.Tensor]:
        def run(h: torch.Tensor) -> torch.Tensor:
            for c in calls:
                h = c(h)
            return h
        return run

    ref = backward(model(blocks), x, params, False)
    policies = ckptfx.memory_budget_policies(blocks, fraction, offload=offload)
    assert all(isinstance(p, budget.BlockShare) and p.offload == offload for p in policies)
    calls = [ckptfx.remat(b, policy=p) for b, p in zip(blocks, policies)]
    for _ in range(3):  # plan; register every block's frontier; the re-spread starts
        assert_bitwise(backward(model(calls), x, params, False), ref)
    frontiers = [frontier_of(b) for b in blocks]
    every = sum(f.everything.nbytes for f in frontiers)
    placements = [placement_of(p, f) for p, f in zip(policies, frontiers)]
    h, dev, host = x, 0, 0
    torch.manual_seed(7)
    for c, pl in zip(calls, placements):
        d, o = kept(c, h, False)
        assert (d, o) == (pl.device, pl.host)
        dev, host = dev + d, host + o
        h = c(h)
    assert dev <= fraction * every and host <= offload * every
    assert host > 0
    even = [place(f, fraction, offload) for f in frontiers]
    assert sum(p.point.flops for p in placements) <= sum(p.point.flops for p in even)
    alone = [f.choose(fraction) for f in frontiers]
    assert sum(p.point.flops for p in placements) <= sum(p.flops for p in alone)


@pytest.mark.parametrize("bad, error", [
    (1.5, ValueError), (-0.1, ValueError), (float("nan"), ValueError),
    ("0.5", TypeError), (True, TypeError), (None, TypeError),
])
def test_bad_offload(bad: Any, error: type) -> None:
    with pytest.raises(error, match="memory_budget: offload"):
        cp.memory_budget(0.5, offload=bad)
    with pytest.raises(error, match="memory_budget: offload"):
        budget.memory_budget_policies([lambda x: x], 0.5, offload=bad)
    with pytest.raises(error, match="memory_budget: offload"):
        MemoryBudget(0.5, bad)


def test_budgets_pickled_before_offload_load_with_none() -> None:
    """A budget pickled before ``offload`` existed has no such field: it loads with the
    default, equal to a budget made now; one with offload round-trips."""
    old = object.__new__(MemoryBudget)
    object.__setattr__(old, "fraction", 0.5)  # what an old pickle's state holds
    loaded = pickle.loads(pickle.dumps(old, protocol=2))
    assert loaded.offload == 0.0 and loaded == cp.memory_budget(0.5)
    assert hash(loaded) == hash(cp.memory_budget(0.5))
    new = cp.memory_budget(0.2, offload=0.3)
    assert pickle.loads(pickle.dumps(new)) == new
    shares = ckptfx.memory_budget_policies([None, None], 0.2, offload=0.3)
    assert [p.offload for p in pickle.loads(pickle.dumps(shares))] == [0.3, 0.3]
