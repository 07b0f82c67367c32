"""What a CPU backward cannot show, on the accelerator under test (``conftest.ACCELERATOR``).

On every CI run that is the fake PrivateUse1 device (``tests/fake_device``); on a machine with
CUDA or an NPU, ``tests/device_check.py`` runs this file there. Either way autograd runs the
backward on its device threads, which see none of the caller's thread-local state; random ops
draw from the device's generator; autocast has the device's own dispatch key; and offloaded
residuals go to pinned host memory. Each test says which of these it is about.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint

import ckptfx
from ckptfx import checkpoint_policies as cp
from conftest import ACCELERATOR, OpCounter, needs_accelerator

pytestmark = [needs_accelerator, pytest.mark.usefixtures("no_sessions_left")]
D = 32


def _device() -> torch.device:
    assert ACCELERATOR is not None
    return torch.device(ACCELERATOR.type, 0)


def _params(device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {k: (torch.randn(D, D, generator=g) / 6).to(device).requires_grad_()
            for k in ("w1", "w2")}


def _input(device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, D, generator=g).to(device).requires_grad_()


def _block(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    h = F.dropout(F.gelu(x @ p["w1"]), 0.3, True)
    return F.dropout(h.sin() @ p["w2"], 0.2, True)


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.dropout(F.gelu(self.up(x)), 0.3, True).sin())


def _variant(name: str) -> Callable[..., torch.Tensor]:
    return {
        "plain": _block,
        "torch": lambda p, x: torch_checkpoint.checkpoint(_block, p, x, use_reentrant=False),
        "checkpoint": lambda p, x: ckptfx.checkpoint(_block, p, x),
        "remat": ckptfx.remat(_block),
        "remat_dots": ckptfx.remat(_block, policy=cp.dots_saveable),
    }[name]


def _amp_grads(fn: Callable[..., torch.Tensor], p: dict[str, torch.Tensor], x: torch.Tensor,
               amp: bool, seed: int = 1) -> list[torch.Tensor]:
    """The usual AMP step: the forward under device autocast, the backward outside it, so the
    replay must restore the device's autocast state itself."""
    torch.manual_seed(seed)
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=amp):
        out = fn(p, x)
    return [out, *torch.autograd.grad(out.float().square().sum(), [x, *p.values()])]


def test_the_backward_runs_on_autograd_device_threads() -> None:
    """The premise of this file: a hook of the backward runs on a thread other than the
    caller's (on the CPU it would run on the caller's)."""
    p, x = _params(_device()), _input(_device())
    out = ckptfx.checkpoint(_block, p, x)
    threads: list[int] = []
    out.register_hook(lambda g: threads.append(threading.get_ident()))
    out.sum().backward()
    assert threads and threads[0] != threading.get_ident()


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16_autocast"])
@pytest.mark.parametrize("variant", ["torch", "checkpoint", "remat", "remat_dots"])
def test_dropout_and_autocast_are_exact_with_the_backward_outside_autocast(
        variant: str, amp: bool) -> None:
    p, x = _params(_device()), _input(_device())
    ref = _amp_grads(_variant("plain"), p, x, amp)
    got = _amp_grads(_variant(variant), p, x, amp)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


@pytest.mark.parametrize("variant", ["torch", "checkpoint", "remat", "remat_dots"])
def test_the_replay_leaves_the_device_generator_where_the_forward_left_it(variant: str) -> None:
    p, x = _params(_device()), _input(_device())
    mod = torch.get_device_module(_device().type)
    torch.manual_seed(1)
    out = _variant(variant)(p, x)
    after_forward = mod.get_rng_state(0)
    out.square().sum().backward()
    assert torch.equal(after_forward, mod.get_rng_state(0))


@pytest.mark.parametrize("variant", ["checkpoint", "remat", "remat_dots"])
def test_a_prefire_of_a_block_on_another_device_leaves_that_device_generator_alone(
        variant: str) -> None:
    """A prefire replays on the caller's thread, whose current device is 0, a block that
    drew on device 1: device 1's generator is put back too (and the replay's masks are the
    forward's: the gradients stay exact)."""
    if torch.accelerator.device_count() < 2:
        pytest.skip("needs two devices")
    other = torch.device(_device().type, 1)
    p, x = _params(other), _input(other)
    mod = torch.get_device_module(other.type)
    ref = _amp_grads(_variant("plain"), p, x, amp=False)
    torch.manual_seed(1)
    with ckptfx.recompute_handle_collector_ctx() as handles:
        out = _variant(variant)(p, x)
    torch.rand(3, device=other)  # the caller draws on device 1 between forward and prefire
    before = mod.get_rng_state(1)
    try:
        for h in handles:
            ckptfx.recompute_handle(h, "other-device")
        assert torch.equal(mod.get_rng_state(1), before)
        with ckptfx.recompute_session_ctx("other-device"):
            got = torch.autograd.grad(out.float().square().sum(), [x, *p.values()])
    finally:
        ckptfx.clear_recompute_session("other-device")
    assert all(torch.equal(a, b) for a, b in zip(ref, [out, *got]))


def test_checkpoint_wrapper_module_is_exact_under_amp() -> None:
    torch.manual_seed(0)
    plain = _Mlp().to(_device())
    wrapped = ckptfx.checkpoint_wrapper(_Mlp().to(_device()))
    wrapped.load_state_dict(plain.state_dict())
    x = _input(_device())
    results = []
    for module in (plain, wrapped):
        torch.manual_seed(3)
        with torch.autocast(_device().type, dtype=torch.bfloat16):
            out = module(x)
        results.append([out, *torch.autograd.grad(out.float().sum(), [x, *module.parameters()])])
    assert all(torch.equal(a, b) for a, b in zip(*results))


# -- sessions: dx, then k dw calls, replay each block once on the device threads ----------


def _make(kind: str) -> tuple[Callable[..., torch.Tensor], list[torch.Tensor]]:
    """A two-block stage of ``kind`` and its parameters."""
    device = _device()
    if kind == "checkpoint_wrapper":
        torch.manual_seed(0)
        blocks = [ckptfx.checkpoint_wrapper(_Mlp().to(device)) for _ in range(2)]
        return (lambda x: blocks[1](blocks[0](x))), [q for b in blocks for q in b.parameters()]
    ps = [_params(device) for _ in range(2)]
    if kind == "checkpoint":
        run = lambda x: ckptfx.checkpoint(_block, ps[1], ckptfx.checkpoint(_block, ps[0], x))  # noqa: E731
    else:
        rblock = ckptfx.remat(_block)
        run = lambda x: rblock(ps[1], rblock(ps[0], x))  # noqa: E731
    return run, [w for p in ps for w in p.values()]


def _sin_count(fn: Callable[[], Any]) -> int:
    """The ``sin`` ops run by ``fn``: each block runs one in its forward, and its backward
    none (its derivative is a ``cos``), so in a backward they count replays. remat's replay
    runs a recorded segment and never calls Python, so its ops are what can be counted."""
    with OpCounter() as ops:
        fn()
    return ops.counts.get("sin", 0)


@pytest.mark.parametrize("prefire", [True, False], ids=["prefire", "lazy"])
@pytest.mark.parametrize("kind", ["checkpoint", "checkpoint_wrapper", "remat"])
def test_dx_then_two_dw_calls_replay_each_block_once(kind: str, prefire: bool) -> None:
    """Without a prefire the session is found at the first unpack, on a device thread that
    never saw the caller's session context."""
    run, params = _make(kind)
    x = _input(_device())
    torch.manual_seed(5)
    ref_out = run(x)
    # The reference: one plain backward of the same stage (bitwise against no checkpoint in
    # the tests above), and the sin ops that one backward's replays run.
    ref: list[torch.Tensor] = []
    one_backward = _sin_count(lambda: ref.extend(
        torch.autograd.grad(ref_out.square().sum(), [x, *params])))

    torch.manual_seed(5)
    with ckptfx.recompute_handle_collector_ctx() as handles:
        out = run(x)
    loss = out.square().sum()
    half = len(params) // 2
    sid = ("device", kind, prefire)

    def split_step() -> list[torch.Tensor]:
        if prefire:
            for h in handles:
                ckptfx.recompute_handle(h, sid)
        with ckptfx.recompute_session_ctx(sid, retain_on_unpack=True):
            dx = torch.autograd.grad(loss, [x], retain_graph=True)
        assert ckptfx.recompute_session_stats()[sid].replayed == 2
        with ckptfx.recompute_session_ctx(sid, retain_on_unpack=True):
            dw1 = torch.autograd.grad(loss, params[:half], retain_graph=True)
        with ckptfx.recompute_session_ctx(sid, retain_on_unpack=False):
            dw2 = torch.autograd.grad(loss, params[half:])
        return [*dx, *dw1, *dw2]

    got: list[torch.Tensor] = []
    try:
        replayed = _sin_count(lambda: got.extend(split_step()))
    finally:
        ckptfx.clear_recompute_session(sid)
    assert replayed == one_backward  # one replay per block for dx and both dw calls
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


def test_a_session_opened_on_a_device_thread_inside_a_session_backward_is_refused() -> None:
    """Contexts do not nest on the caller's thread; a hook running on a device thread for a
    session's backward is inside that session too, and is told so."""
    p, x = _params(_device()), _input(_device())
    out = ckptfx.checkpoint(_block, p, x)
    opened_on: list[int] = []

    def hook(grad: torch.Tensor) -> None:
        opened_on.append(threading.get_ident())
        with ckptfx.recompute_session_ctx("inner"):
            pass

    out.register_hook(hook)
    try:
        with pytest.raises(ckptfx.CheckpointError, match="do not nest"):
            with ckptfx.recompute_session_ctx("outer"):
                out.sum().backward()
    finally:
        ckptfx.clear_recompute_session("outer")
    assert opened_on and opened_on[0] != threading.get_ident()
    assert "inner" not in ckptfx.recompute_session_stats()


@pytest.mark.parametrize("kind", ["checkpoint", "remat"])
def test_grad_split_replays_each_block_once(kind: str) -> None:
    run, params = _make(kind)
    x = _input(_device())

    def loss_fn(params: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return run(x).square().sum()

    torch.manual_seed(5)
    ref = torch.autograd.grad(loss_fn(params, x), [x, *params])
    torch.manual_seed(5)
    one_forward = _sin_count(lambda: loss_fn(params, x))
    dx_fn, dw_fn = ckptfx.grad_split(loss_fn, x_argnums=1)
    torch.manual_seed(5)
    results: list[Any] = []
    ran = _sin_count(lambda: (results.append(dx_fn(params, x.detach(), session="mb")),
                              results.append(dw_fn("mb"))))
    (loss, dx), dw = results
    assert ran == 2 * one_forward  # the forward, then one replay per block for dx and dw
    assert all(torch.equal(a, b) for a, b in zip(ref, [dx, *dw]))


@pytest.mark.parametrize("policy", [None, "dots_saveable"])
def test_vjp_split_over_remat_blocks_is_exact(policy: str | None) -> None:
    device = _device()
    pol = None if policy is None else getattr(cp, policy)
    ws = [_params(device) for _ in range(2)]
    rblock = ckptfx.remat(_block, policy=pol)

    def fun(ws: list[dict[str, torch.Tensor]], x: torch.Tensor, rm: bool = True) -> torch.Tensor:
        for p in ws:
            x = rblock(p, x) if rm else _block(p, x)
        return x

    x = _input(device).detach()
    g = torch.randn(8, D, generator=torch.Generator().manual_seed(2)).to(device)
    flat = [w for p in ws for w in p.values()]
    torch.manual_seed(7)
    xr = x.clone().requires_grad_()
    ref = torch.autograd.grad(fun(ws, xr, False), [xr, *flat], g)
    torch.manual_seed(7)
    out, dx_fn, dw_fn = ckptfx.vjp_split(fun, ws, x, x_argnums=1)
    dx = dx_fn(g)
    dws = dw_fn()
    got = [dx, *(w for p in dws for w in p.values())]
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert not ckptfx.recompute_session_stats()


# -- offload --------------------------------------------------------------------------------


def test_offloaded_residuals_live_in_pinned_host_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    import ckptfx.recording.tracer as trace
    from ckptfx.offload import HostResidual

    device = _device()
    p, x = _params(device), _input(device)
    plain = lambda p, x: torch.tanh(x @ p["w1"]) @ p["w2"]  # noqa: E731
    block = ckptfx.remat(plain, policy=cp.offload_dot_with_no_batch_dims())
    tracers: list = []
    finish = trace.Tracer.finish
    monkeypatch.setattr(trace.Tracer, "finish",
                        lambda self: (tracers.append(self), finish(self))[1])
    out = block(p, x)
    packed = [ref() for ref in tracers[0].seg.kept.values() if ref() is not None]
    offloaded = [k for k in packed if isinstance(k, HostResidual)]
    assert offloaded
    for k in offloaded:  # between forward and backward the residual is on the host, pinned
        assert k.host.device.type == "cpu" and k.host.is_pinned()
    ref = torch.autograd.grad(plain(p, x).sum(), [x, *p.values()])
    got = torch.autograd.grad(out.sum(), [x, *p.values()])
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
