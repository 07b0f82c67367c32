"""The replay is decided by the program, never by the clock (frame.py, Rule 6).

What a replay runs, keeps and raises must not depend on how long anything took. These tests
repeat one backward many times beside a busy process and count what the replay did (FLOPs
and ATen ops, with torch's own counters), compare a short and a long tail, run the stop
under torch-function modes and selective-checkpoint contexts, and compare with torch's
checkpoint, which stops in the pack of the last saved tensor. An in-place op that packs its
saved inputs before it runs ends a block as well: the deferred stop waits for it.
"""

from __future__ import annotations

import functools
import subprocess
import sys
import time
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.flop_counter import FlopCounterMode

import ckptfx
from conftest import assert_bitwise, input_grads, run_variant

pytestmark = pytest.mark.usefixtures("no_hooks_left_behind")

aten = torch.ops.aten


@pytest.fixture
def busy_core() -> Iterator[None]:
    """Another process keeps a core busy for the duration of the test. torch runs on one
    thread meanwhile: an OpenMP region waiting for a descheduled thread makes a small op
    take milliseconds, which would only slow the test down."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        proc.kill()
        proc.wait(timeout=30)


class OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ATen ops that run (the pack hooks' own detaches left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is not aten.detach.default:
            name = str(func.overloadpacket)
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _stack(d: int, hidden: int, n: int) -> list[nn.Module]:
    torch.manual_seed(0)
    # Each block ends with a Linear: its addmm saves only inputs, so a replay that runs past
    # the last saved tensor does a whole extra matmul that FLOP counting sees.
    return [nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Dropout(0.1),
                          nn.Linear(hidden, d)) for _ in range(n)]


def _backward_work(blocks: list[nn.Module], x: torch.Tensor, variant: str,
                   counter: Callable[[], Any]) -> Any:
    h = x
    for b in blocks:
        h = run_variant(variant, b, h)
    with counter() as c:
        h.sum().backward()
    return c


@pytest.mark.parametrize("size", ["tiny", "large"])
def test_replay_work_identical_over_200_backwards_on_a_loaded_machine(
        size: str, busy_core: None) -> None:
    d, hidden, batch = (8, 16, 2) if size == "tiny" else (64, 256, 32)
    blocks = _stack(d, hidden, 3)
    x = torch.randn(batch, d, requires_grad=True)
    flops, ops = set(), set()
    for _ in range(200):
        c = _backward_work(blocks, x, "ckptfx", lambda: FlopCounterMode(display=False))
        flops.add(c.get_total_flops())
    for _ in range(20):
        c = _backward_work(blocks, x, "ckptfx", OpCounter)
        ops.add(tuple(sorted(c.counts.items())))
    assert len(flops) == 1 and len(ops) == 1  # the same work every time
    # ... and the same as torch's checkpoint does (it stops in the last saved tensor's pack)
    torch_flops = _backward_work(blocks, x, "torch",
                                 lambda: FlopCounterMode(display=False)).get_total_flops()
    torch_ops = _backward_work(blocks, x, "torch", OpCounter).counts
    assert flops == {torch_flops}
    assert ops == {tuple(sorted(torch_ops.items()))}


@pytest.mark.parametrize("tail", [0, 400])
def test_long_and_short_tails_stop_at_the_same_op(tail: int) -> None:
    """Ops after the last saved tensor never run in the replay, however many there are
    or however long they took in the forward."""
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    tail_runs = [0]

    def block(x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(lin(x))  # tanh saves its output: the last saved tensor
        for _ in range(tail):
            h = h * 1.0001  # multiplying by a number saves nothing
            tail_runs[0] += 1
        return h + 1

    x = torch.randn(3, 8, requires_grad=True)
    g_plain = torch.autograd.grad(block(x).sum(), [x, *lin.parameters()])
    replayed = {}
    for variant in ("ckptfx", "torch"):
        tail_runs[0] = 0
        out = run_variant(variant, block, x)
        assert tail_runs[0] == tail  # the forward
        with OpCounter() as ops:
            g = torch.autograd.grad(out.sum(), [x, *lin.parameters()])
        assert tail_runs[0] == tail  # the replay reached none of it
        assert_bitwise(g, g_plain)
        replayed[variant] = ops.counts
    assert replayed["ckptfx"] == replayed["torch"]  # the replay ran torch's ops, no more


@pytest.mark.parametrize("tail", [0, 400])
@pytest.mark.parametrize("early_stop", [True, False])
def test_replay_that_saves_more_same_outcome_for_any_tail(tail: int, early_stop: bool) -> None:
    """A replay that would save more than the forward: accepted with early stop (the replay
    ends at the forward's last saved tensor), refused without, whatever the tail."""
    runs = [0]

    def block(x: torch.Tensor) -> torch.Tensor:
        runs[0] += 1
        h = x.sin()
        if runs[0] > 1:
            h = h.exp()  # the replay saves one tensor more
        for _ in range(tail):
            h = h * 1.0001
        return h

    x = torch.randn(4, requires_grad=True)
    g_plain = torch.autograd.grad(block(x).sum(), x)
    for variant in ("ckptfx", "torch"):
        runs[0] = 0
        out = run_variant(variant, block, x, ckpt_early_stop=early_stop)
        if early_stop:
            assert_bitwise(torch.autograd.grad(out.sum(), x), g_plain)
        else:
            with pytest.raises(torch_checkpoint.CheckpointError,
                               match="trying to save more tensors during recomputation"):
                out.sum().backward()


class Passthrough(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode", ["device", "user"])
def test_early_stop_under_torch_function_modes(mode: str) -> None:
    """torch.device(...) and user modes are torch-function modes active during the replay;
    the stop fires under them as torch's does."""
    torch.manual_seed(0)
    lin1, lin2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def block(x: torch.Tensor) -> torch.Tensor:
        return lin2(torch.tanh(lin1(x)))  # the final addmm saves inputs only: skipped

    x = torch.randn(3, 8, requires_grad=True)
    g_plain = torch.autograd.grad(block(x).sum(), [x, *lin1.parameters()])
    replayed = {}
    for variant in ("ckptfx", "torch"):
        with torch.device("cpu") if mode == "device" else Passthrough():
            out = run_variant(variant, block, x)
            with OpCounter() as ops:
                g = torch.autograd.grad(out.sum(), [x, *lin1.parameters()])
        assert_bitwise(g, g_plain)
        replayed[variant] = ops.counts
    assert replayed["ckptfx"] == replayed["torch"]
    assert replayed["ckptfx"]["aten.addmm"] == 1  # lin1's, replayed; lin2's never


def _must_save_mm(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op is aten.mm.default else \
        CheckpointPolicy.PREFER_RECOMPUTE


@pytest.mark.parametrize("ctx", ["device", "autocast", "none"])
def test_sac_replay_sees_the_ops_torch_shows_it_and_writes_nothing(ctx: str) -> None:
    """A selective-checkpoint context sees exactly the replay torch's would show it: the
    in-place add after the cached matmul never runs again (it would add 0.5 to the forward's
    output, which shares the cached matmul's storage)."""
    torch.manual_seed(0)
    h0, w0 = torch.randn(4, 8), torch.randn(8, 8)

    def block(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (h @ w).add_(0.5)

    results = {}
    for variant in ("plain", "torch", "ckptfx"):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        opts = {} if variant == "plain" else {
            "ckpt_context_fn": functools.partial(create_selective_checkpoint_contexts,
                                                 _must_save_mm)}
        scope = {"device": torch.device("cpu"),
                 "autocast": torch.autocast("cpu", dtype=torch.bfloat16),
                 "none": Passthrough()}[ctx]
        with scope:
            out = run_variant(variant, block, h, w, **opts)
            before = out.detach().clone()
            out.float().pow(2).sum().backward()
        assert torch.equal(out.detach(), before)  # the backward left the output alone
        results[variant] = (out.detach(), h.grad, w.grad)
    for variant in ("torch", "ckptfx"):
        assert_bitwise(list(results[variant]), list(results["plain"]))


def test_no_clock_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """checkpoint, remat, sessions and the split backward run with every clock of the time
    module made to raise: no decision can read one."""
    def no_clock(*_: Any) -> float:
        raise AssertionError("ckptfx read a clock")

    torch.manual_seed(0)
    blocks = _stack(8, 16, 2)
    x = torch.randn(2, 8, requires_grad=True)
    block_fn = ckptfx.remat(lambda t: F.gelu(t).sin())
    for name in ("perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns", "time",
                 "time_ns", "process_time", "thread_time"):
        monkeypatch.setattr(time, name, no_clock)
    out = block_fn(ckptfx.checkpoint(blocks[1], ckptfx.checkpoint(blocks[0], x)))
    out.sum().backward()
    with ckptfx.recompute_handle_collector_ctx() as handles:
        out = ckptfx.checkpoint(blocks[1], block_fn(x))
    try:
        for handle in handles:
            ckptfx.recompute_handle(handle, "clockless")
        with ckptfx.recompute_session_ctx("clockless", retain_on_unpack=True):
            torch.autograd.grad(out.sum(), x, retain_graph=True)
        with ckptfx.recompute_session_ctx("clockless"):
            torch.autograd.grad(out.sum(), list(blocks[1].parameters()))
    finally:
        ckptfx.clear_recompute_session("clockless")
    monkeypatch.undo()


def test_handles_listed_in_the_order_forwards_started() -> None:
    """An outer block's handle comes before those of the blocks nested in it, so a scheduler
    that prefires in list order replays the outer block first."""
    order = []

    def leaf(t: torch.Tensor) -> torch.Tensor:
        order.append("leaf")
        return t.sin()

    def middle(t: torch.Tensor) -> torch.Tensor:
        order.append("middle")
        return ckptfx.remat(leaf)(t.cos()).exp()

    def outer(t: torch.Tensor) -> torch.Tensor:
        order.append("outer")
        return ckptfx.checkpoint(middle, t * 2).tanh()

    x = torch.randn(4, requires_grad=True)
    with ckptfx.recompute_handle_collector_ctx() as handles:
        first = ckptfx.checkpoint(outer, x)
        outs = [first, ckptfx.checkpoint(leaf, first)]  # the graphs keep the frames alive
    assert order == ["outer", "middle", "leaf", "leaf"]
    fns = [h.frame.fn for h in handles]
    assert fns[0] is outer and fns[1] is middle and fns[3] is leaf
    assert getattr(fns[2], "__qualname__", "").endswith("leaf")  # remat's flat wrapper
    assert len(handles) == 4
    del outs
    # a forward that raises takes its handle back
    def failing(t: torch.Tensor) -> torch.Tensor:
        t.sin()
        raise ZeroDivisionError

    with ckptfx.recompute_handle_collector_ctx() as handles:
        with pytest.raises(ZeroDivisionError):
            ckptfx.checkpoint(failing, x)
        with pytest.raises(ZeroDivisionError):
            ckptfx.remat(failing)(x)
        kept = ckptfx.checkpoint(leaf, x)
    assert [h.frame.fn for h in handles] == [leaf]
    del kept


@pytest.mark.parametrize("last", [True, False], ids=["compiled-last", "compiled-then-sin"])
def test_compiled_function_inside_a_checkpoint_replays_exactly(last: bool) -> None:
    """A block that calls a compiled function (whose first forward, counting its compile,
    is long) replays the compiled code, bitwise; the stop never runs it under a mode that
    makes dynamo fall back to eager."""
    torch.manual_seed(0)
    lin = nn.Linear(16, 16)
    compiled = torch.compile(lambda t: torch.tanh(lin(t)) * 2, backend="aot_eager")

    def block(x: torch.Tensor) -> torch.Tensor:
        y = compiled(x)
        return y if last else y.sin()

    x = torch.randn(4, 16, requires_grad=True)
    g_plain = torch.autograd.grad(block(x).sum(), [x, *lin.parameters()])
    for early_stop in (True, False):
        out = ckptfx.checkpoint(block, x, early_stop=early_stop)
        assert_bitwise(torch.autograd.grad(out.sum(), [x, *lin.parameters()]), g_plain)


def test_stop_in_the_pack_of_an_output_even_when_the_last_op_saves_several() -> None:
    """The last saving op packs an input, runs, then packs its output (sigmoid saves its
    result after x was packed by...): the stop is in the output's pack, as torch's, so no
    Python code of the block after that op runs in the replay."""
    after = [0]

    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = torch.addcmul(x, x, w)  # saves x and w (inputs), its output is not saved
        y = torch.sigmoid(h * w)    # mul saves h and w; sigmoid saves its output
        after[0] += 1
        return y * 3

    x = torch.randn(4, requires_grad=True)
    w = torch.randn(4, requires_grad=True)
    g_plain = torch.autograd.grad(block(x, w).sum(), [x, w])
    for variant in ("ckptfx", "torch"):
        after[0] = 0
        out = run_variant(variant, block, x, w)
        assert_bitwise(torch.autograd.grad(out.sum(), [x, w]), g_plain)
        assert after[0] == 1, variant  # the forward only


# An in-place op that packs its saved inputs before it runs: the deferred stop must wait for it.
X2 = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
W = torch.randn(6, 6, generator=torch.Generator().manual_seed(2))


# Found in review of the deferred early stop (was test_review_regressions_2.py).
def test_early_stop_inplace_mul_by_tensor_as_last_op() -> None:
    # mul_ by a tensor that requires grad saves a copy of self, then runs; torch's C++ sets
    # _backward_hooks through the Python setter afterwards (an earlier deferred stop saw that
    # as "the next torch call" and raised a SystemError).
    calls = []

    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return (x @ w).mul_(w[0])

    ref = input_grads(block, [X2, W])
    calls.clear()
    got = input_grads(lambda x, w: ckptfx.checkpoint(block, x, w), [X2, W])
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert len(calls) == 2  # forward + one replay


# Found in review of the deferred early stop (was test_review_regressions_2.py).
def test_early_stop_inplace_mul_under_user_function_mode() -> None:
    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x @ w).div_(w[0].abs() + 1)

    with Passthrough():
        ref = input_grads(block, [X2, W])
        got = input_grads(lambda x, w: ckptfx.checkpoint(block, x, w), [X2, W])
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
