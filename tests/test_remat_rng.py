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
from conftest import assert_bitwise

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
