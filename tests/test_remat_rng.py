"""remat's random ops replay the forward's numbers while storing no more generator states
than torch's checkpoint (segment.py, Rule 3b): the first CPU draw starts from the block's
start state, later draws continue from the random op before them.

The blocks run on the CPU and on the accelerator under test (``device``), where the random
ops draw from the device's generator (and an explicit generator is one on the device)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ckptfx
from ckptfx import checkpoint_name, checkpoint_policies as cp
from conftest import assert_bitwise, maybe_autocast

POLICIES = {
    "nothing": cp.nothing_saveable,
    "everything": cp.everything_saveable,
    "dots": cp.dots_saveable,
    "names": cp.save_only_these_names("mid"),
}


def _block(gen: torch.Generator | None):
    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # rand_like's output is read only by an add, which saves nothing: a replay needs it
        # only because the dropout after it continues from where it left the generator.
        h = (x @ w) + 0.1 * torch.rand_like(x)
        h = F.dropout(h.tanh(), 0.3, True)
        if gen is not None:  # another generator between two draws from the default one
            h = h + torch.randn(h.shape, generator=gen, device=h.device)
        h = checkpoint_name(F.dropout((h @ w).sin(), 0.2, True), "mid")
        return F.dropout(h @ w, 0.4, True).exp()
    return block


def _grads(fn, x, w, seed: int, gen: torch.Generator | None):
    torch.manual_seed(seed)
    if gen is not None:
        gen.manual_seed(seed)
    xs, ws = x.detach().requires_grad_(), w.detach().requires_grad_()
    out = fn(xs, ws)
    return [out, *torch.autograd.grad(out.sum(), [xs, ws])]


@pytest.mark.parametrize("explicit", [False, True], ids=["default", "default+generator"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_random_ops_replay_the_forward_numbers(policy: str, explicit: bool,
                                               device: torch.device) -> None:
    gen = torch.Generator(device=device).manual_seed(0) if explicit else None
    x, w = torch.randn(4, 6, device=device), torch.randn(6, 6, device=device)
    block = _block(gen)
    rematted = ckptfx.remat(block, policy=POLICIES[policy])
    for seed in range(3):
        assert_bitwise(_grads(rematted, x, w, seed, gen), _grads(block, x, w, seed, gen))


def test_no_generator_state_stored_for_draws_from_the_default_generator(
        device: torch.device) -> None:
    """Four random ops in a block: none stores a 5 KiB generator state (torch's checkpoint
    keeps the one state the frame holds too). On a device the first draw starts from the
    device state the frame captured, as the CPU's first draw starts from the CPU state."""
    x = torch.randn(4, 6, device=device, requires_grad=True)
    w = torch.randn(6, 6, device=device, requires_grad=True)
    with ckptfx.recompute_handle_collector_ctx() as handles:
        out = ckptfx.remat(_block(None))(x, w)
    seg = handles[0].frame.rerun.__self__
    seeded = [op for op in seg.ops if torch.Tag.nondeterministic_seeded in op.func.tags]
    assert len(seeded) >= 4
    assert not any(op.rng is not None and isinstance(op.rng[0], torch.Tensor) for op in seeded)
    out.sum().backward()


class _OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_a_replay_that_needs_a_later_random_op_runs_the_ones_before_it(
        device: torch.device) -> None:
    """``a`` is kept, so no replay needs rand_like's numbers; the dropout after it is
    replayed, and continues from where rand_like left the generator: the replay runs
    rand_like first (its state is not stored), and the gradients stay bitwise."""
    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        a = checkpoint_name(x @ w + torch.rand_like(x), "a")
        return F.dropout(a.tanh(), 0.5, True).exp()

    x, w = torch.randn(4, 6, device=device), torch.randn(6, 6, device=device)
    rematted = ckptfx.remat(block, policy=cp.save_only_these_names("a"))
    for seed in range(3):
        torch.manual_seed(seed)
        xs, ws = x.detach().requires_grad_(), w.detach().requires_grad_()
        out = rematted(xs, ws)
        with _OpCounter() as ops:
            got = torch.autograd.grad(out.sum(), [xs, ws])
        assert ops.ops.count("aten.rand_like") == 1  # run for the generator, not its values
        assert_bitwise([out, *got], _grads(block, x, w, seed, None))


@pytest.mark.parametrize("first", ["device_without_index", "default_generator_by_name"])
def test_a_draw_naming_the_default_generator_another_way_is_the_same_generator(
        device: torch.device, first: str) -> None:
    """``torch.rand(..., device="cuda")`` and an explicit ``generator=`` that is the default
    generator draw from the generator a dropout on ``cuda:0`` draws from: the dropout replays
    from where they left it, not from the block's start."""
    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if first == "device_without_index":
            n = torch.rand(4, 6, device=device.type)
        else:
            gen = (torch.default_generator if device.type == "cpu"
                   else torch.get_device_module(device.type).default_generators[device.index])
            n = torch.rand(4, 6, device=device, generator=gen)
        return F.dropout(((x @ w) * n).tanh(), 0.5, True).exp()

    x, w = torch.randn(4, 6).to(device), torch.randn(6, 6).to(device)
    for seed in range(3):
        assert_bitwise(_grads(ckptfx.remat(block), x, w, seed, None),
                       _grads(block, x, w, seed, None))


# -- generator state set inside the block (segment.py Rule 3b, tracer.py Rule 5) ---------------


def _rng_get(device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(device.type).get_rng_state()


def _rng_set(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:  # what Megatron-style RNG trackers do on a GPU
        torch.get_device_module(device.type).set_rng_state(state)


def _reseeding_block(kind: str, device: torch.device, gen: torch.Generator):
    """A block that changes a generator's state between two draws, outside the dispatcher."""
    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        start = _rng_get(device)
        gen_start = gen.get_state()
        h = F.dropout(x @ w, 0.3, True)
        h = h + torch.rand(h.shape, generator=gen, device=device)
        if kind == "manual_seed":
            torch.manual_seed(7)
        elif kind == "set_rng_state":
            _rng_set(device, start)  # the second mask repeats the first one's draw
        elif kind == "fork_rng":
            with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device],
                                       device_type=device.type):
                torch.manual_seed(11)
                h = F.dropout(h, 0.5, True)
        elif kind == "generator_manual_seed":
            gen.manual_seed(5)
        elif kind == "generator_set_state":
            gen.set_state(gen_start)
        h = F.dropout(h.tanh(), 0.5, True)
        h = h * torch.rand(h.shape, generator=gen, device=device)
        return F.dropout(h @ w, 0.2, True).sin()
    return block


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("policy", ["nothing", "dots", "everything"])
@pytest.mark.parametrize("kind", ["manual_seed", "set_rng_state", "fork_rng",
                                  "generator_manual_seed", "generator_set_state"])
def test_generator_state_set_inside_the_block_is_replayed(
        kind: str, policy: str, autocast: bool, device: torch.device) -> None:
    gen = torch.Generator(device=device)
    block = _reseeding_block(kind, device, gen)
    x, w = torch.randn(4, 6, device=device), torch.randn(6, 6, device=device)

    def run(fn):
        torch.manual_seed(3)
        gen.manual_seed(3)
        xs, ws = x.detach().requires_grad_(), w.detach().requires_grad_()
        with maybe_autocast(autocast, device):
            out = fn(xs, ws)
        result = [out, *torch.autograd.grad(out.float().sum(), [xs, ws])]
        return result + [_rng_get(device), gen.get_state()]  # the caller's RNG, untouched

    expected = run(block)
    rematted = ckptfx.remat(block, policy=POLICIES[policy])
    for _ in range(2):  # the first call is recorded; a later one may run unrecorded
        assert_bitwise(run(rematted), expected)


# A fused-dropout-style custom op: the kernel draws its own mask, which no schema declares.
@torch.library.custom_op("ckptfx_test::masked", mutates_args=())
def _masked(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mask = (torch.rand_like(x) > 0.5).to(x.dtype) * 2
    return x * mask, mask


_masked.register_fake(lambda x: (torch.empty_like(x), torch.empty_like(x)))
_masked.register_autograd(
    lambda ctx, grad, _: grad * ctx.saved_tensors[0],
    setup_context=lambda ctx, inputs, output: ctx.save_for_backward(output[1]))


@torch.library.custom_op("ckptfx_test::scaled", mutates_args=())
def _scaled(x: torch.Tensor) -> torch.Tensor:
    return x * 3


_scaled.register_fake(lambda x: torch.empty_like(x))
_scaled.register_autograd(lambda ctx, grad: grad * 3,
                         setup_context=lambda ctx, inputs, output: None)


@pytest.mark.parametrize("policy", ["nothing", "dots", "everything"])
def test_custom_op_that_draws_random_numbers_replays_the_forward_mask(
        policy: str, device: torch.device) -> None:
    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = _masked(torch.tanh(x @ w))[0]
        return F.dropout(_scaled(h) @ w, 0.3, True).sin()  # a draw after it continues

    x, w = torch.randn(4, 6, device=device), torch.randn(6, 6, device=device)
    rematted = ckptfx.remat(block, policy=POLICIES[policy])
    for seed in range(3):  # the first call is recorded; later ones may run unrecorded
        assert_bitwise(_grads(rematted, x, w, seed, None), _grads(block, x, w, seed, None))


def test_custom_op_that_draws_nothing_stores_no_generator_state() -> None:
    x, w = torch.randn(4, 6, requires_grad=True), torch.randn(6, 6)
    with ckptfx.recompute_handle_collector_ctx() as handles:
        out = ckptfx.remat(lambda x: _scaled(x @ w).sin())(x)  # holds the frame
    seg = handles[0].frame.rerun.__self__
    assert [op.rng for op in seg.ops if "scaled" in str(op.func)] == [None]


@pytest.mark.parametrize("policy", ["nothing", "dots"])
def test_checkpoint_around_a_remat_block_leaves_the_explicit_generator_as_plain_autograd(
        policy: str, device: torch.device) -> None:
    """tracer.py Rule 4c: the outer checkpoint's re-run stops early, inside the remat'd
    block; the explicit generator the block reseeds and draws from is noted in the outer
    frame too, which puts the caller's state back after its re-run."""
    gen = torch.Generator(device=device)
    x0 = torch.randn(4, 8, device=device)

    def block(x: torch.Tensor) -> torch.Tensor:
        gen.manual_seed(251)
        return F.log_softmax(x + 0.1 * torch.randn(4, 8, generator=gen, device=device), -1)

    def run(fn):
        x = x0.clone().requires_grad_()
        out = fn(x)
        out.sum().backward()
        return [out, x.grad, gen.get_state()]

    inner = ckptfx.remat(block, policy=POLICIES[policy])
    assert_bitwise(run(lambda x: ckptfx.checkpoint(inner, x)), run(block))


_LIB = torch.library.Library("ckptfx_test_gen", "DEF")
_LIB.define("noisy(Tensor x, Generator? g) -> Tensor")
_LIB.impl("noisy", lambda x, g: x * torch.rand(x.shape, generator=g, device=x.device),
          "CompositeExplicitAutograd")


@pytest.mark.parametrize("policy", ["nothing", "dots"])
def test_custom_op_given_a_generator_replays_its_draw(policy: str,
                                                      device: torch.device) -> None:
    """An op with a ``Generator?`` argument draws from it, whatever its tags say: it is
    recorded as a random op and the generator replayed, on every call."""
    gen = torch.Generator(device=device)
    x0 = torch.randn(3, 4, device=device)

    def block(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * torch.ops.ckptfx_test_gen.noisy(x.detach(), gen))

    def run(fn):
        gen.manual_seed(0)
        x = x0.clone().requires_grad_()
        out = fn(x)
        out.sum().backward()
        return [out, x.grad, gen.get_state()]

    rematted = ckptfx.remat(block, policy=POLICIES[policy])
    for _ in range(2):
        assert_bitwise(run(rematted), run(block))
