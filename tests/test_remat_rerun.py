"""remat's unrecorded calls (ckptfx.recording.unrecorded): a block whose policy keeps nothing is recorded on
its first call per signature; later calls run as a plain kernel frame (no dispatch mode in the
forward) and replay by re-running the block's Python, exactly; what a re-run cannot vouch for
raises ``CheckpointError``, never a wrong gradient."""

from __future__ import annotations

import gc
import types
import weakref

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tcp
from torch import nn

import ckptfx
from ckptfx import checkpoint_policies as cp
from ckptfx.recording.unrecorded import _restored
from conftest import OpCounter, assert_bitwise, maybe_autocast

pytestmark = pytest.mark.usefixtures("no_hooks_left_behind")


def _modes() -> int:
    return torch._C._len_torch_dispatch_stack()


class ModeNotingBlock(nn.Module):
    """Counts its runs and notes how many dispatch modes its forward ran under (a recorded
    call runs under remat's tracer)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin1, self.lin2 = nn.Linear(8, 16), nn.Linear(16, 8)
        self.calls = 0
        self.modes: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.modes.append(_modes())
        h = F.dropout(F.gelu(self.lin1(x)), 0.25, self.training)
        return torch.tanh(self.lin2(h))


def _step(fn, block: ModeNotingBlock, x: torch.Tensor, seed: int) -> tuple[list, int, bool]:
    """(output and gradients, block runs in the backward, whether the forward was recorded)."""
    torch.manual_seed(seed)
    for p in block.parameters():
        p.grad = None
    xs = x.detach().requires_grad_()
    out = fn(xs)
    recorded = block.modes[-1] > 0
    before = block.calls
    out.sum().backward()
    return ([out.detach(), xs.grad, *(p.grad for p in block.parameters())],
            block.calls - before, recorded)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("policy", ["default", "nothing", "budget0"])
def test_later_calls_run_unrecorded_and_match_plain_and_torch(policy: str, bf16: bool) -> None:
    """Differential: the first call is recorded (its replay runs no Python), later calls
    replay by re-running the block once per backward, as torch's checkpoint does; every
    output and gradient bitwise the plain block's, dropout included."""
    pol = {"default": None, "nothing": cp.nothing_saveable,
           "budget0": cp.memory_budget(0.0)}[policy]
    block = ModeNotingBlock()
    rematted = ckptfx.remat(block.forward, policy=pol)
    torch_ckpt = lambda x: tcp.checkpoint(block, x, use_reentrant=False)  # noqa: E731
    x = torch.randn(4, 8)
    for call in range(3):
        # One autocast region per step, as a training loop has: a region shared with the
        # plain step would hand the block autocast's cached casts (a cast made outside the
        # block keeps it recorded: test_a_block_reading_a_cast_made_before_it_stays_recorded).
        with maybe_autocast(bf16):
            ref, plain_runs, _ = _step(block, block, x, call)
        with maybe_autocast(bf16):
            got, runs, recorded = _step(rematted, block, x, call)
        with maybe_autocast(bf16):
            theirs, torch_runs, _ = _step(torch_ckpt, block, x, call)
            assert_bitwise(got, ref)
            assert_bitwise(theirs, ref)
            assert plain_runs == 0 and torch_runs == 1
            assert (recorded, runs) == ((True, 0) if call == 0 else (False, 1))


def test_an_op_that_fills_the_buffer_it_saved_replays_exactly_when_unrecorded() -> None:
    """rrelu saves its noise before drawing it: an unrecorded call's re-run lets it finish
    (the kernel's early stop, frame.py Rule 6), where torch 2.13's stops before it."""
    lin = nn.Linear(6, 6)
    calls = {"n": 0}

    def block(x: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        return F.rrelu(lin(x), training=True)

    rematted = ckptfx.remat(block)
    for seed in range(3):
        x = torch.randn(4, 6, requires_grad=True)
        torch.manual_seed(seed)
        ref = torch.autograd.grad(block(x).sum(), [x, lin.weight])
        torch.manual_seed(seed)
        out = rematted(x)
        before = calls["n"]
        assert_bitwise(torch.autograd.grad(out.sum(), [x, lin.weight]), ref)
        assert calls["n"] - before == (0 if seed == 0 else 1)


def test_policies_that_keep_something_are_always_recorded() -> None:
    block = ModeNotingBlock()
    rematted = ckptfx.remat(block.forward, policy=cp.dots_saveable)
    for call in range(3):
        _, runs, recorded = _step(rematted, block, torch.randn(4, 8), call)
        assert (recorded, runs) == (True, 0)


def test_always_record_keeps_every_call_recorded() -> None:
    block = ModeNotingBlock()
    rematted = ckptfx.remat(block.forward, always_record=True)
    for call in range(3):
        _, runs, recorded = _step(rematted, block, torch.randn(4, 8), call)
        assert (recorded, runs) == (True, 0)
    with pytest.raises(TypeError, match="always_record must be a bool"):
        ckptfx.remat(block.forward, always_record="yes")


def test_a_new_signature_or_training_flag_is_recorded_first() -> None:
    block = ModeNotingBlock()
    rematted = ckptfx.remat(block.forward)
    seen = []
    for shape, training in [((4, 8), True), ((4, 8), True), ((2, 8), True), ((2, 8), True),
                            ((2, 8), False), ((2, 8), False)]:
        block.train(training)
        seen.append(_step(rematted, block, torch.randn(shape), 0)[2])
    assert seen == [True, False, True, False, True, False]


def _noisy(gen: torch.Generator, when: str):
    lin = nn.Linear(6, 6, bias=False)
    w = lin.weight

    def block(x: torch.Tensor) -> torch.Tensor:
        h = lin(x)
        # data-dependent: only a call whose input's first entry is positive draws. bool()
        # reads the value through an op (no saved tensor needs it: the block stays
        # recorded); tolist() reads it outside the dispatcher, unseen by any recording.
        if (when == "always" or (when == "item" and bool(x[0, 0] > 0))
                or (when == "tolist" and x.tolist()[0][0] > 0)):
            h = h + torch.randn(h.shape, generator=gen)
        return h.tanh()
    return block, w


def _gen_grads(fn, x: torch.Tensor, w: torch.Tensor, gen: torch.Generator, seed: int) -> list:
    torch.manual_seed(seed)
    gen.manual_seed(seed)
    xs = x.detach().requires_grad_()
    out = fn(xs)
    return [out.detach(), *torch.autograd.grad(out.sum(), [xs, w])]


def test_a_first_call_drawing_from_an_explicit_generator_keeps_recording() -> None:
    """torch's checkpoint draws new numbers in its replay; remat records such a block on
    every call and replays its draws."""
    gen = torch.Generator()
    block, w = _noisy(gen, "always")
    calls = {"n": 0}

    def counted(x: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        return block(x)

    rematted = ckptfx.remat(counted)
    for seed in range(3):
        x = torch.randn(4, 6)
        ref = _gen_grads(block, x, w, gen, seed)
        before = calls["n"]
        assert_bitwise(_gen_grads(rematted, x, w, gen, seed), ref)
        assert calls["n"] - before == 1  # the forward only: every replay is a recorded one
    theirs = _gen_grads(lambda x: tcp.checkpoint(block, x, use_reentrant=False), x, w, gen, 0)
    assert not torch.equal(theirs[1], _gen_grads(block, x, w, gen, 0)[1])


def test_a_branch_on_a_value_read_by_an_op_keeps_the_block_recorded() -> None:
    gen = torch.Generator()
    block, w = _noisy(gen, "item")
    rematted = ckptfx.remat(block)
    for x in (torch.full((4, 6), -1.0), torch.ones(4, 6), torch.ones(4, 6)):
        assert_bitwise(_gen_grads(rematted, x, w, gen, 1), _gen_grads(block, x, w, gen, 1))


def test_a_later_call_that_draws_from_an_explicit_generator_raises_in_its_replay() -> None:
    """The first call did not take the branch (on a value read outside the dispatcher), so
    the second ran unrecorded: its replay cannot know the generator's state at the forward,
    and says so before drawing (the user's generator and the CPU's are untouched);
    always_record=True is exact."""
    gen = torch.Generator()
    block, w = _noisy(gen, "tolist")
    quiet = torch.full((4, 6), -1.0)
    loud = torch.ones(4, 6)
    rematted = ckptfx.remat(block)
    _gen_grads(rematted, quiet, w, gen, 0)  # recorded: learns the block re-runs exactly
    torch.manual_seed(0)
    out = rematted(loud.requires_grad_())
    gen_state, cpu_state = gen.get_state(), torch.get_rng_state()
    with pytest.raises(ckptfx.CheckpointError, match="explicit torch.Generator.*always_record"):
        out.sum().backward()
    assert torch.equal(gen.get_state(), gen_state)
    assert torch.equal(torch.get_rng_state(), cpu_state)
    assert _modes() == 0

    recorded = ckptfx.remat(block, always_record=True)
    for x in (quiet, loud, loud):
        assert_bitwise(_gen_grads(recorded, x, w, gen, 1), _gen_grads(block, x, w, gen, 1))


def test_an_outside_tensor_modified_before_the_backward_raises_as_when_recorded() -> None:
    w = torch.randn(6, 6, requires_grad=True)
    rematted = ckptfx.remat(lambda x: (x @ w).sin())
    x = torch.randn(4, 6, requires_grad=True)
    for unrecorded in (False, True):
        out = rematted(x)
        with torch.no_grad():
            w.add_(1.0)
        with pytest.raises(ckptfx.CheckpointError, match="modified in place between"):
            out.sum().backward()


def test_dead_ops_before_the_last_save_keep_the_block_recorded() -> None:
    """A re-run would run the matmul no saved tensor needs; the recorded replay skips it, so
    the block stays recorded and its replays' op counts do not change."""
    w = torch.randn(6, 6)
    calls = {"n": 0}

    def block(x: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        a = x.sin()
        unused = a @ w  # noqa: F841 - dead: no saved tensor and no output needs it
        return (a * 2).exp()

    rematted = ckptfx.remat(block)
    x = torch.randn(4, 6, requires_grad=True)
    for _ in range(3):
        out = rematted(x)
        before = calls["n"]
        with OpCounter() as ops:
            out.sum().backward()
        assert calls["n"] == before and "mm" not in ops.counts


def test_a_nested_frame_keeps_the_block_recorded_from_then_on() -> None:
    """A first call that creates a nested checkpoint is recorded every time; a later call
    that creates one (a branch the first did not take) is a valid checkpoint frame, exact,
    and the calls after it are recorded (a session replay of it refuses the nested frame,
    as for ckptfx.checkpoint)."""
    flag = {"nest": False}
    modes: list[int] = []

    def block(x: torch.Tensor) -> torch.Tensor:
        modes.append(_modes())
        h = x.sin()
        if flag["nest"]:
            h = ckptfx.checkpoint(torch.cos, h)
        return h.exp()

    rematted = ckptfx.remat(block)
    x = torch.randn(4, 6, requires_grad=True)
    ref = torch.autograd.grad(block(x).sum(), x)
    recorded = []
    for nest in (False, False, True, False):
        flag["nest"] = nest
        want = ref if not nest else torch.autograd.grad(block(x).sum(), x)
        out = rematted(x)
        recorded.append(modes[-1] > 0)
        assert_bitwise(torch.autograd.grad(out.sum(), x), want)
    assert recorded == [True, False, False, True]
    flag["nest"] = True
    nested_first = ckptfx.remat(block)
    recorded = []
    for _ in range(2):
        out = nested_first(x)
        recorded.append(modes[-1] > 0)
        out.sum().backward()
    assert recorded == [True, True]
    # An unrecorded call that nests, replayed for a session: refused, not wrong.
    flag["nest"] = False
    fresh = ckptfx.remat(block)
    fresh(x).sum().backward()
    flag["nest"] = True
    with ckptfx.recompute_handle_collector_ctx() as handles:
        out = fresh(x)
    try:
        with pytest.raises(ckptfx.CheckpointError, match="created while a block was being"):
            ckptfx.recompute_handle(handles[0], "s")
    finally:
        ckptfx.clear_recompute_session("s")
    del out


def test_sessions_replay_an_unrecorded_call_once() -> None:
    """Prefire + dx + dw over an unrecorded call: one re-run for the whole split backward,
    gradients bitwise the plain ones."""
    block = ModeNotingBlock()
    rematted = ckptfx.remat(block.forward)
    x = torch.randn(4, 8)
    _step(rematted, block, x, 0)  # the recorded first call
    ref, _, _ = _step(block, block, x, 1)
    torch.manual_seed(1)
    params = list(block.parameters())
    xs = x.clone().requires_grad_()
    with ckptfx.recompute_handle_collector_ctx() as handles:
        out = rematted(xs)
    assert block.modes[-1] == 0
    before = block.calls
    try:
        ckptfx.recompute_handle(handles[0], "split")
        with ckptfx.recompute_session_ctx("split", retain_on_unpack=True):
            dx = torch.autograd.grad(out.sum(), xs, retain_graph=True)
        with ckptfx.recompute_session_ctx("split", retain_on_unpack=False):
            dw = torch.autograd.grad(out.sum(), params)
    finally:
        ckptfx.clear_recompute_session("split")
    assert block.calls - before == 1
    assert_bitwise([out.detach(), *dx, *dw], ref)


def test_checkpoint_with_a_keep_nothing_policy_learns_per_module() -> None:
    """checkpoint_wrapper(policy=nothing_saveable) makes a new bound method per call: what
    the first call learnt lives with the module."""
    block = ckptfx.checkpoint_wrapper(ModeNotingBlock(), policy=cp.nothing_saveable)
    recorded = [_step(block, block, torch.randn(4, 8), s)[2] for s in range(3)]
    assert recorded == [True, False, False]


def test_saved_residuals_still_reports_the_recording() -> None:
    block = ModeNotingBlock()
    rematted = ckptfx.remat(block.forward)
    x = torch.randn(4, 8, requires_grad=True)
    first = [str(r) for r in ckptfx.saved_residuals(rematted, x)]
    for s in range(2):
        _step(rematted, block, x, s)
    assert [str(r) for r in ckptfx.saved_residuals(rematted, x)] == first


def test_unrecorded_calls_leave_nothing_alive() -> None:
    """The graph frees the frame; what the first call learnt holds its parameters weakly."""
    block = ModeNotingBlock()
    rematted = ckptfx.remat(block.forward)
    x = torch.randn(4, 8, requires_grad=True)
    rematted(x).sum().backward()
    with ckptfx.recompute_handle_collector_ctx() as handles:
        out = rematted(x)
    frame = weakref.ref(handles[0].frame)
    weight = weakref.ref(block.lin1.weight)
    del out, handles
    gc.collect()
    assert frame() is None
    del block, rematted
    gc.collect()
    assert weight() is None


def test_only_generators_a_replay_restores_count_as_restored() -> None:
    env = types.SimpleNamespace(cpu_rng=torch.get_rng_state(), device_type="cuda",
                                device_rng=[(0, None)])
    assert _restored(env, torch.device("cpu"))
    assert _restored(env, torch.device("cuda", 0))
    assert not _restored(env, torch.device("cuda", 1))
    assert not _restored(env, torch.device("cuda"))  # the current device: not known here
    assert not _restored(types.SimpleNamespace(cpu_rng=None, device_type=None, device_rng=[]),
                         torch.device("cpu"))


@pytest.mark.parametrize("fresh", [True, False], ids=["new-params", "same-params"])
def test_functional_call_stays_exact_when_unrecorded(fresh: bool) -> None:
    """Differential: under torch.func.functional_call a re-run in the backward would read the
    module's own parameters, not the ones passed in (torch's checkpoint gives wrong
    gradients here); an unrecorded call's replay puts the tensors its forward read back in
    their places for the re-run, with new tensors each call or the same ones."""

    class Blk(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return self.lin(x).sin()

    class Outer(nn.Module):
        def __init__(self, wrap) -> None:
            super().__init__()
            self.blk = blk
            self.wrap = wrap

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.wrap(self.blk, x)

    torch.manual_seed(0)
    blk = Blk()
    own = [p.detach().clone() for p in blk.parameters()]
    rematted = ckptfx.remat(blk.forward)
    x = torch.randn(3, 4, requires_grad=True)
    remat_outer = Outer(lambda b, x: rematted(x))
    torch_outer = Outer(lambda b, x: tcp.checkpoint(b, x, use_reentrant=False))
    params = {}
    for call in range(3):
        if fresh or not params:
            params = {f"blk.{k}": (v.detach() * (2 + call)).requires_grad_()
                      for k, v in blk.named_parameters()}
        leaves = [x, *params.values()]
        ref = torch.autograd.grad(torch.sin(F.linear(x, *params.values())).sum(), leaves)
        out = torch.func.functional_call(remat_outer, params, (x,))
        before = blk.calls
        assert_bitwise(torch.autograd.grad(out.sum(), leaves), ref)
        assert blk.calls - before == (0 if call == 0 else 1)  # later calls: unrecorded
        out = torch.func.functional_call(torch_outer, params, (x,))
        theirs = torch.autograd.grad(out.sum(), leaves)
        assert not all(torch.equal(a, b) for a, b in zip(theirs, ref))
    assert all(torch.equal(a, b) for a, b in zip(blk.parameters(), own))  # put back


def test_outside_tensors_that_no_module_holds_keep_the_block_recorded() -> None:
    """A closure's tensor can be rebound between forward and backward unseen; a module's
    parameter is checked where the first call found it (a closure over a module counts)."""
    w = torch.randn(6, 6, requires_grad=True)
    lin = nn.Linear(6, 6)
    modes: list[int] = []

    def closure_block(x: torch.Tensor) -> torch.Tensor:
        modes.append(_modes())
        return (x @ w).sin()

    def module_block(x: torch.Tensor) -> torch.Tensor:
        modes.append(_modes())
        return lin(x).sin()

    x = torch.randn(4, 6, requires_grad=True)
    for block, want in ((closure_block, [True, True, True]),
                        (module_block, [True, False, False])):
        rematted = ckptfx.remat(block)
        seen = []
        for _ in range(3):
            out = rematted(x)
            seen.append(modes[-1] > 0)
            out.sum().backward()
        assert seen == want, block.__name__


def test_a_block_reading_a_cast_made_before_it_stays_recorded() -> None:
    """A tensor the block reads that is a cast made before it (autocast's cached cast of a
    weight used earlier in the region, or a closure's ``.to()`` copy) is not the module's
    tensor, and nothing could check it later: every call stays recorded, and an in-place
    change of the copy between forward and backward is refused, as plain autograd refuses
    it."""
    lin = nn.Linear(4, 4)
    w64 = lin.weight.to(torch.float64)
    block = ckptfx.remat(lambda x: torch.tanh(x @ w64.t()))
    x = torch.randn(3, 4, dtype=torch.float64)
    for _ in range(2):
        block(x.clone().requires_grad_()).sum().backward()
    out = block(x.clone().requires_grad_())
    assert _modes() == 0
    with torch.no_grad():
        w64.mul_(2)
    with pytest.raises((RuntimeError, ckptfx.CheckpointError)):
        out.sum().backward()
    # autocast's cache: the weight was cast before the block in the same region.
    m = ModeNotingBlock()
    rematted = ckptfx.remat(m.forward)
    xb = torch.randn(4, 8)
    for call in range(3):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref, _, _ = _step(m, m, xb, call)
            got, runs, recorded = _step(rematted, m, xb, call)
        assert_bitwise(got, ref)
        assert (recorded, runs) == (True, 0)


def test_tied_weights_under_functional_call_stay_exact() -> None:
    """A weight at two places (tied) is read where the forward read each: such a block stays
    recorded, so ``functional_call`` swapping one of the places is exact."""
    from torch.func import functional_call

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)
            self.b.weight = self.a.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.b(torch.tanh(self.a(x))))

    torch.manual_seed(0)
    plain, m = Tied(), Tied()
    m.load_state_dict(plain.state_dict())
    m.forward = ckptfx.remat(m.forward)  # type: ignore[method-assign]
    x = torch.randn(3, 4)
    m(x.clone().requires_grad_()).sum().backward()  # the first call: recorded, learns
    w2 = torch.randn(4, 4, requires_grad=True)
    grads = []
    for mod in (plain, m):
        xs = x.clone().requires_grad_()
        w2.grad = None
        functional_call(mod, {"a.weight": w2}, (xs,)).sum().backward()
        grads.append((xs.grad, w2.grad))
    assert_bitwise(grads[1], grads[0])
