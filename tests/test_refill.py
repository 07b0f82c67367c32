"""ckptfx.refill_outputs: a checkpointed block's output that the next op saves is not held
between forward and backward; the block's one replay refills it.

Differential: one transformer-ish stack (checkpointed norms with dropout, attention core and
activation; the linears after them save their outputs) run plain, under torch's checkpoint,
under ckptfx's, and under ckptfx's inside the context (checkpoint and remat): gradients
bitwise, replays counted inside the blocks (or as ATen ops for remat), and the bytes the
forward leaves allocated measured by the device's allocator (on the CPU, the profiler's
accounting). Every test runs on the CPU and on the accelerator under test (``device``)."""

from __future__ import annotations

import contextlib
import gc
import threading
import weakref
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tcp
from torch import nn
from torch.profiler import profile

import ckptfx
from ckptfx import checkpoint_policies as cp
from conftest import OpCounter, assert_bitwise, grads, maybe_autocast

pytestmark = pytest.mark.usefixtures("no_hooks_left_behind")

B, S, D, HEADS, LAYERS = 2, 4, 8, 2, 2


class Counted(nn.Module):
    """A block that counts its runs (forward and each replay)."""

    def __init__(self, fn: Callable[..., Any], *params: nn.Parameter) -> None:
        super().__init__()
        self.fn = fn
        self.params = nn.ParameterList(params)
        self.calls = 0

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.fn(*args, *self.params)


def rms_dropout(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    return F.dropout(h, 0.25, training=True)


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    def heads(t: torch.Tensor) -> torch.Tensor:
        return t.view(B, S, HEADS, D // HEADS).transpose(1, 2)

    a = torch.softmax(heads(q) @ heads(k).transpose(-1, -2) / 2.0, dim=-1) @ heads(v)
    return a.transpose(1, 2).reshape(B, S, D)  # a copy: the block's own output


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = Counted(rms_dropout, nn.Parameter(torch.rand(D) + 0.5))
        self.core = Counted(attention_core)
        self.norm2 = Counted(rms_dropout, nn.Parameter(torch.rand(D) + 0.5))
        self.act = Counted(F.gelu)
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor, ckpt: Callable[..., Any]) -> torch.Tensor:
        h = ckpt(self.norm1, x)  # saved (as views: 3-d input) by q, k and v
        x = x + self.o(ckpt(self.core, self.q(h), self.k(h), self.v(h)))
        h = ckpt(self.norm2, x)  # saved by fc1
        return x + self.fc2(ckpt(self.act, self.fc1(h)))  # the gelu output saved by fc2

    def blocks(self) -> list[Counted]:
        return [self.norm1, self.core, self.norm2, self.act]


def make_stack(device: torch.device) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(Layer() for _ in range(LAYERS)).to(device)


def _input(device: torch.device) -> torch.Tensor:
    """The stack's input, the same numbers on every device (drawn on the CPU, seed 1)."""
    torch.manual_seed(1)
    return torch.randn(B, S, D).to(device).requires_grad_()


def _remat(policy: Any) -> Callable[..., Any]:
    return lambda block, *args: ckptfx.remat(block.forward, policy=policy)(*args)


CKPT: dict[str, Callable[..., Any]] = {
    "plain": lambda block, *args: block(*args),
    "torch": lambda block, *args: tcp.checkpoint(block, *args, use_reentrant=False),
    "ckptfx": ckptfx.checkpoint,
    "refill": ckptfx.checkpoint,
    "remat": _remat(None),
    "remat_dots": _remat(cp.dots_saveable),
}
REFILLED = ("refill", "remat", "remat_dots")


def forward(stack: nn.ModuleList, x: torch.Tensor, variant: str, autocast: bool) -> torch.Tensor:
    ckpt = CKPT[variant]
    with maybe_autocast(autocast, x.device):
        if variant in REFILLED:
            with ckptfx.refill_outputs():
                for layer in stack:
                    x = layer(x, ckpt)
        else:
            for layer in stack:
                x = layer(x, ckpt)
    return x.float().square().sum()


def run(stack: nn.ModuleList, variant: str, autocast: bool, device: torch.device
        ) -> tuple[list[torch.Tensor | None], list[int], dict[str, int]]:
    """Gradients, block runs and the backward's ATen op counts of one step."""
    params = list(stack.parameters())
    for p in params:
        p.grad = None
    x = _input(device)  # seeds 1: the dropouts draw the same masks in every variant
    blocks = [b for layer in stack for b in layer.blocks()]
    for b in blocks:
        b.calls = 0
    loss = forward(stack, x, variant, autocast)
    with OpCounter() as ops:
        loss.backward()
    return grads([x, *params]), [b.calls for b in blocks], ops.counts


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_stack_bitwise_one_replay_per_block(autocast: bool, device: torch.device) -> None:
    stack = make_stack(device)
    expected, calls, _ = run(stack, "plain", autocast, device)
    assert calls == [1] * 4 * LAYERS
    norms = 2 * LAYERS  # rsqrt runs once per norm in the forward, once per replay
    for variant in CKPT:
        got, calls, ops = run(stack, variant, autocast, device)
        assert_bitwise(got, expected, f"{variant} gradient")
        if variant == "plain" or variant.startswith("remat"):  # remat replays recorded ops
            assert calls == [1] * 4 * LAYERS, variant
        else:
            assert calls == [2] * 4 * LAYERS, variant  # one replay per block, not two
        assert ops.get("rsqrt", 0) == (0 if variant == "plain" else norms), variant


def held_after_forward(stack: nn.ModuleList, variant: str, autocast: bool,
                       device: torch.device) -> int:
    """Net bytes one forward leaves allocated: the CPU allocator's accounting (the
    profiler's) on the CPU, the device allocator's (``memory_allocated``) on a device."""
    x = _input(device)
    forward(stack, x, variant, autocast).backward()  # warm up
    gc.collect()
    if device.type == "cpu":
        with profile(profile_memory=True) as prof:
            loss = forward(stack, x, variant, autocast)
        held = sum(e.self_cpu_memory_usage for e in prof.key_averages())
    else:
        mod = torch.get_device_module(device.type)
        before = mod.memory_allocated(device)
        loss = forward(stack, x, variant, autocast)
        held = mod.memory_allocated(device) - before
    loss.backward()
    return held


def allocated(nbytes: int, device: torch.device) -> int:
    """What the device's allocator counts for a tensor of ``nbytes``: CUDA's caching
    allocator rounds each block up to 512 bytes; the CPU and the fake device count bytes."""
    return -(-nbytes // 512) * 512 if device.type == "cuda" else nbytes


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_refill_saves_exactly_the_block_outputs(autocast: bool, device: torch.device) -> None:
    stack = make_stack(device)
    # (ckptfx's checkpoint holds what torch's holds, to the byte: test_block_output.py)
    held = {v: held_after_forward(stack, v, autocast, device)
            for v in ("ckptfx", "refill", "remat")}
    # Per layer, the outputs the next op saves as they are: both norms' (saved by q, k, v and
    # fc1), the attention core's (by o) and the gelu's (by fc2). Under bf16 autocast the
    # linears after a norm save a bf16 copy of its float32 output, as without the context:
    # only the core's and the gelu's bf16 outputs are the saved tensors themselves.
    if autocast:
        sizes = [B * S * D * 2, B * S * 4 * D * 2]
    else:
        sizes = [B * S * D * 4] * 3 + [B * S * 4 * D * 4]
    outputs = LAYERS * sum(allocated(n, device) for n in sizes)
    assert held["ckptfx"] - held["refill"] == outputs
    assert held["remat"] == held["refill"]


def _block_pair(calls: list[int], device: torch.device
                ) -> tuple[Callable[..., Any], nn.Linear]:
    torch.manual_seed(0)
    lin = nn.Linear(D, D).to(device)

    def block(x: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        return torch.tanh(x) * 2

    return block, lin


def test_output_written_before_the_save_is_saved_as_is(device: torch.device) -> None:
    calls = [0]
    block, lin = _block_pair(calls, device)
    x = torch.randn(S, D, device=device, requires_grad=True)
    results = []
    for refill in (False, True):
        lin.zero_grad()
        x.grad = None
        with ckptfx.refill_outputs() if refill else contextlib.nullcontext():
            y = ckptfx.checkpoint(block, x)
            y.mul_(3)  # before lin saves it: the saved tensor is the new value
            out = lin(y)
        del y
        out.sum().backward()
        results.append(grads([x, lin.weight]))
    assert_bitwise(results[1], results[0])


@pytest.mark.parametrize("variant", ["plain", "torch", "ckptfx", "refill"])
def test_output_written_after_the_save_raises_as_autograd(variant: str,
                                                          device: torch.device) -> None:
    calls = [0]
    block, lin = _block_pair(calls, device)
    x = torch.randn(S, D, device=device, requires_grad=True)
    with ckptfx.refill_outputs() if variant == "refill" else contextlib.nullcontext():
        y = CKPT[variant](block, x)
        out = lin(y)
    y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_other_saved_tensors_keep_the_version_check(device: torch.device) -> None:
    # Saved-tensor hooks switch autograd's check off; the context checks what it saves.
    for refill in (False, True):
        a = torch.randn(S, D, device=device, requires_grad=True) * 1
        with ckptfx.refill_outputs() if refill else contextlib.nullcontext():
            out = a.sin()
        a.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()


@pytest.mark.parametrize("variant", ["torch", "ckptfx", "refill"])
def test_retain_graph_replays_per_backward_as_torch(variant: str, device: torch.device) -> None:
    calls = [0]
    block, lin = _block_pair(calls, device)
    x = torch.randn(S, D, device=device, requires_grad=True)
    with ckptfx.refill_outputs() if variant == "refill" else contextlib.nullcontext():
        out = lin(CKPT[variant](block, x)).sum()
    out.backward(retain_graph=True)
    out.backward()
    assert calls[0] == 3  # forward, one replay per backward
    expected = torch.autograd.grad(lin(block(x)).sum(), x)[0] * 2
    assert torch.equal(x.grad, expected)


def test_an_output_still_held_is_handed_out_without_a_replay(device: torch.device) -> None:
    calls = [0]
    block, lin = _block_pair(calls, device)
    x = torch.randn(S, D, device=device, requires_grad=True)
    with ckptfx.refill_outputs():
        y = ckptfx.checkpoint(block, x)
        out = lin(y).sum()
    (dw,) = torch.autograd.grad(out, lin.weight, retain_graph=True)
    assert calls[0] == 1  # the block's backward did not run, and y was there
    del y
    (dw2,) = torch.autograd.grad(out, lin.weight)
    assert calls[0] == 2  # y was dropped: lin's backward needed the replay
    assert torch.equal(dw, dw2)


class _ReadsTwice(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(h, w)
        return h @ w

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, w = ctx.saved_tensors
        h2, _ = ctx.saved_tensors  # autograd allows a second read
        assert torch.equal(h, h2)
        return g @ w.t(), h2.t() @ g


def test_a_second_read_in_one_backward_gets_its_own_replay(device: torch.device) -> None:
    calls = [0]
    block, _ = _block_pair(calls, device)
    x = torch.randn(S, D, device=device, requires_grad=True)
    w = torch.randn(D, D, device=device, requires_grad=True)
    expected = torch.autograd.grad(_ReadsTwice.apply(block(x), w).sum(), (x, w))
    calls[0] = 0
    with ckptfx.refill_outputs():
        out = _ReadsTwice.apply(ckptfx.checkpoint(block, x), w).sum()
    assert_bitwise(torch.autograd.grad(out, (x, w)), expected)
    assert calls[0] == 3  # forward, the backward's replay, the second read's own


def test_sessions_and_vjp_split_replay_once(device: torch.device) -> None:
    stack = make_stack(device)
    expected, _, _ = run(stack, "plain", False, device)
    params = list(stack.parameters())
    blocks = [b for layer in stack for b in layer.blocks()]

    def stage(x: torch.Tensor) -> torch.Tensor:
        with ckptfx.refill_outputs():
            for layer in stack:
                x = layer(x, ckptfx.checkpoint)
        return x.float().square().sum()

    for mode in ("prefire", "vjp_split"):
        for p in params:
            p.grad = None
        for b in blocks:
            b.calls = 0
        x = _input(device)
        if mode == "vjp_split":
            out, dx_fn, dw_fn = ckptfx.vjp_split(stage, x, params=params, session="refill")
            dx = dx_fn(torch.ones_like(out))
            dw_fn()
        else:
            with ckptfx.recompute_handle_collector_ctx() as handles:
                out = stage(x)
            try:
                for h in handles:
                    ckptfx.recompute_handle(h, "refill")
                with ckptfx.recompute_session_ctx("refill", retain_on_unpack=True):
                    (dx,) = torch.autograd.grad(out, x, retain_graph=True)
                with ckptfx.recompute_session_ctx("refill", retain_on_unpack=False):
                    torch.autograd.backward(out, inputs=params)
            finally:
                ckptfx.clear_recompute_session("refill")
        assert [b.calls for b in blocks] == [2] * len(blocks), mode
        assert_bitwise([dx, *grads(params)], expected, f"{mode} gradient")


def test_backward_on_a_fresh_thread(device: torch.device) -> None:
    stack = make_stack(device)
    expected, _, _ = run(stack, "plain", False, device)
    x = _input(device)
    for p in stack.parameters():
        p.grad = None
    loss = forward(stack, x, "refill", False)
    errors: list[BaseException] = []

    def backward() -> None:
        try:
            loss.backward()
        except BaseException as err:  # reported below
            errors.append(err)

    t = threading.Thread(target=backward)
    t.start()
    t.join()
    assert not errors
    assert_bitwise(grads([x, *stack.parameters()]), expected)


def test_a_graph_freed_without_backward_leaks_nothing(device: torch.device) -> None:
    stack = make_stack(device)
    x = torch.randn(B, S, D, device=device, requires_grad=True)
    with ckptfx.recompute_handle_collector_ctx() as handles:
        loss = forward(stack, x, "refill", False)
    frames = [weakref.ref(h.frame) for h in handles]
    assert frames and all(f() is not None and f().refill is not None for f in frames)
    del handles, loss
    gc.collect()
    assert all(f() is None for f in frames)


def test_where_other_hooks_are_active_it_changes_nothing(device: torch.device) -> None:
    calls = [0]
    block, lin = _block_pair(calls, device)
    x = torch.randn(S, D, device=device, requires_grad=True)
    expected = torch.autograd.grad(lin(block(x)).sum(), x)

    def outer(x: torch.Tensor) -> torch.Tensor:
        with ckptfx.refill_outputs():  # inside a checkpointed block: inert
            return lin(ckptfx.checkpoint(block, x))

    calls[0] = 0
    assert_bitwise(torch.autograd.grad(ckptfx.checkpoint(outer, x).sum(), x), expected)
    assert calls[0] == 3  # outer's forward and replay each run the inner block once, + 1
    with torch.autograd.graph.save_on_cpu(), ckptfx.refill_outputs():
        with ckptfx.recompute_handle_collector_ctx() as handles:
            out = lin(ckptfx.checkpoint(block, x)).sum()
    assert handles[0].frame.refill is None
    assert_bitwise(torch.autograd.grad(out, x), expected)


def test_a_replay_with_other_outputs_is_refused(device: torch.device) -> None:
    sizes = iter([S, S - 1])
    _, lin = _block_pair([0], device)

    def block(x: torch.Tensor) -> torch.Tensor:
        return x.sin()[: next(sizes)]  # sin saves x: the replay's saved tensors match

    x = torch.randn(S, D, device=device, requires_grad=True)
    with ckptfx.refill_outputs():
        out = lin(ckptfx.checkpoint(block, x)).sum()
    with pytest.raises(ckptfx.CheckpointError, match="output 0 of the replayed block"):
        out.backward()


def test_remat_block_that_must_rerun_its_function(device: torch.device) -> None:
    calls = [0]
    _, lin = _block_pair(calls, device)

    def block(x: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        with torch.enable_grad():  # autograd inside: the recording is not replayed op by op
            t = x.detach().requires_grad_()
            (g,) = torch.autograd.grad(t.sin().sum(), t)
        return torch.tanh(x) * g

    x = torch.randn(S, D, device=device, requires_grad=True)
    expected = torch.autograd.grad(lin(block(x)).sum(), (x, lin.weight))
    runs = []
    for refill in (False, True):
        calls[0] = 0
        with ckptfx.refill_outputs() if refill else contextlib.nullcontext():
            with ckptfx.recompute_handle_collector_ctx() as handles:
                out = lin(ckptfx.remat(block)(x)).sum()
        assert (handles[0].frame.refill is not None) == refill
        assert_bitwise(torch.autograd.grad(out, (x, lin.weight)), expected)
        runs.append(calls[0])
    assert runs[1] == runs[0]  # one re-run in the backward, which also gave the output


def test_session_stats_count_the_refilled_outputs(device: torch.device) -> None:
    x = torch.randn(S, D, device=device, requires_grad=True)
    held = []
    for refill in (False, True):
        block, lin = _block_pair([0], device)
        with ckptfx.refill_outputs() if refill else contextlib.nullcontext():
            with ckptfx.recompute_handle_collector_ctx() as handles:
                out = lin(ckptfx.checkpoint(block, x)).sum()
        try:
            ckptfx.recompute_handle(handles[0], "stats")
            held.append(ckptfx.recompute_session_stats()["stats"].nbytes)
            with ckptfx.recompute_session_ctx("stats"):
                out.backward()
        finally:
            ckptfx.clear_recompute_session("stats")
    assert held[1] - held[0] == S * D * 4  # the block's output, refilled by the prefire


def test_a_transposed_view_of_the_output_is_refilled(device: torch.device) -> None:
    calls = [0]
    block, _ = _block_pair(calls, device)
    x = torch.randn(S, D, device=device, requires_grad=True)
    w = torch.randn(S, D, device=device, requires_grad=True)
    expected = torch.autograd.grad((block(x).t() @ w).sum(), (x, w))
    calls[0] = 0
    with ckptfx.refill_outputs():
        with ckptfx.recompute_handle_collector_ctx() as handles:
            out = (ckptfx.checkpoint(block, x).t() @ w).sum()  # mm saves the view y.t()
    state = handles[0].frame.refill
    assert [h().view is not None for h in state.handles] == [True]
    assert_bitwise(torch.autograd.grad(out, (x, w)), expected)
    assert calls[0] == 2


def test_a_forward_that_raises_leaves_nothing_pushed(device: torch.device) -> None:
    block, lin = _block_pair([0], device)
    x = torch.randn(S, D, device=device, requires_grad=True)
    with pytest.raises(ZeroDivisionError):
        with ckptfx.refill_outputs():
            lin(ckptfx.checkpoint(block, x))
            raise ZeroDivisionError
    # (the module's fixture checks the hooks stack); nested contexts are inert inside
    with ckptfx.refill_outputs(), ckptfx.refill_outputs():
        with ckptfx.recompute_handle_collector_ctx() as handles:
            out = lin(ckptfx.checkpoint(block, x)).sum()
    assert len(handles[0].frame.refill.handles) == 1
    out.backward()


def test_under_a_torch_func_transform_it_is_inert(device: torch.device) -> None:
    block, lin = _block_pair([0], device)
    x = torch.randn(S, D, device=device)

    def loss(x: torch.Tensor, refill: bool) -> torch.Tensor:
        with ckptfx.refill_outputs() if refill else contextlib.nullcontext():
            return lin(ckptfx.remat(block)(x)).sum()

    expected = torch.func.grad(loss)(x, False)
    assert torch.equal(torch.func.grad(loss)(x, True), expected)


@pytest.mark.parametrize("make", ["view", "untracked"])
def test_an_output_whose_storage_the_block_did_not_make_is_saved_as_is(
        make: str, device: torch.device) -> None:
    """A ``ckptfx.checkpoint`` block's replay reads outside tensors when it runs, so an output
    autograd does not show the block made (a view of a buffer, or a no-grad result of one)
    is not refilled: a later in-place change of the buffer gives what plain autograd gives
    (its error, or the forward's value), never a re-read."""
    buf = torch.randn(4, 4, device=device)
    w = torch.randn(4, 4, device=device, requires_grad=True)

    def blk(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(x), (buf[0:3] if make == "view" else buf[0:3] * 1.0)

    x0 = torch.randn(3, 4, device=device)
    results = []
    for variant in ("plain", "refill"):
        w.grad = None
        buf.copy_(torch.ones(4, 4, device=device))
        x = x0.clone().requires_grad_()
        if variant == "plain":
            h, m = blk(x)
            loss = ((h @ w) * m).sum()
        else:
            with ckptfx.refill_outputs():
                h, m = ckptfx.checkpoint(blk, x)
                loss = ((h @ w) * m).sum()
        del h, m
        buf.mul_(5.0)
        try:
            loss.backward()
            results.append(("ok", w.grad.clone()))
        except RuntimeError:  # CheckpointError is a RuntimeError
            results.append(("raised", None))
    assert results[1][0] == results[0][0]
    if results[0][0] == "ok":
        assert torch.equal(results[1][1], results[0][1])


@pytest.mark.parametrize("variant", ["ckptfx", "remat"])
def test_output_of_a_block_drawing_from_an_explicit_generator_is_refilled_bitwise(
        variant: str, device: torch.device) -> None:
    """Rule 2c: a refilled output that depends on an explicit generator's draws is the
    forward's: the replay starts the generator where the forward did (torch's checkpoint
    restores only the default generators; without refill it never replays the output)."""
    gen = torch.Generator(device=device)
    w = torch.randn(4, 4, device=device, requires_grad=True)
    v = torch.randn(4, 4, device=device, requires_grad=True)
    x = torch.randn(3, 4, device=device, requires_grad=True)

    def block(x: torch.Tensor) -> torch.Tensor:
        h = x @ w
        return h + torch.rand(h.shape, generator=gen, device=device)  # dx needs no noise

    wrap = {"plain": block, "ckptfx": lambda x: ckptfx.checkpoint(block, x),
            "remat": ckptfx.remat(block)}

    def run(name: str, refill: bool) -> list[torch.Tensor]:
        gen.manual_seed(3)
        with ckptfx.refill_outputs() if refill else contextlib.nullcontext():
            loss = (wrap[name](x) @ v).tanh().sum()  # the matmul saves the block's output
        return [*torch.autograd.grad(loss, [x, w, v]), gen.get_state()]

    assert_bitwise(run(variant, refill=True), run("plain", refill=False))
