"""Accelerator checks (CUDA, NPU, XPU: whatever torch.accelerator reports).

Marked ``gpu`` and skipped where no accelerator is present; the CPU suite covers the same
behaviour on CPU. On a device they check what CPU cannot: the device generator restored for
replays, device autocast, autograd's device threads finding a session bound to the frame, and
offloading to pinned host memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import pytest

import ckptfx
from ckptfx import checkpoint_policies as cp

ACC = torch.accelerator.current_accelerator()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(ACC is None, reason="needs an accelerator"),
]


def _params(device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {k: (torch.randn(32, 32, generator=g) / 6).to(device).requires_grad_()
            for k in ("w1", "w2")}


def _block(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    h = F.dropout(F.gelu(x @ p["w1"]), 0.3, True)
    return F.dropout(h @ p["w2"], 0.2, True)


def _grads(fn, p, x, seed: int = 1) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    out = fn(p, x)
    return list(torch.autograd.grad(out.square().sum(), [x, *p.values()]))


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(u, v) for u, v in zip(a, b))


@pytest.mark.parametrize("variant", ["checkpoint", "remat", "remat_dots"])
@pytest.mark.parametrize("autocast", [False, True])
def test_device_dropout_and_autocast_are_exact(variant: str, autocast: bool) -> None:
    device = torch.device(ACC.type, 0)
    p, x = _params(device), torch.randn(8, 32, device=device, requires_grad=True)
    wrapped = {"checkpoint": lambda p, x: ckptfx.checkpoint(_block, p, x),
               "remat": ckptfx.remat(_block),
               "remat_dots": ckptfx.remat(_block, policy=cp.dots_saveable)}[variant]
    with torch.autocast(ACC.type, dtype=torch.bfloat16, enabled=autocast):
        ref = _grads(_block, p, x)
    with torch.autocast(ACC.type, dtype=torch.bfloat16, enabled=autocast):
        got = _grads(wrapped, p, x)
    assert _same(ref, got)
    # the backward's replay puts the device generator back where the forward left it
    mod = torch.get_device_module(ACC.type)
    torch.manual_seed(1)
    out = wrapped(p, x)
    after_forward = mod.get_rng_state(0)
    out.square().sum().backward()
    assert torch.equal(after_forward, mod.get_rng_state(0))


def test_session_found_on_autograd_device_threads() -> None:
    """On an accelerator autograd runs the backward on its device threads; the session is
    bound to the frames, so dx and dw share the prefire's replay there too."""
    device = torch.device(ACC.type, 0)
    p, x = _params(device), torch.randn(8, 32, device=device, requires_grad=True)
    runs = [0]

    def counted(p, x):
        runs[0] += 1
        return _block(p, x)

    ref = _grads(counted, p, x)
    runs[0] = 0
    torch.manual_seed(1)
    with ckptfx.recompute_handle_collector_ctx() as handles:
        out = ckptfx.checkpoint(counted, p, x)
    loss = out.square().sum()
    try:
        for h in handles:
            ckptfx.recompute_handle(h, "dev")
        with ckptfx.recompute_session_ctx("dev", retain_on_unpack=True):
            dx = torch.autograd.grad(loss, [x], retain_graph=True)
        with ckptfx.recompute_session_ctx("dev", retain_on_unpack=False):
            dw = torch.autograd.grad(loss, list(p.values()))
    finally:
        ckptfx.clear_recompute_session("dev")
    assert runs[0] == 2
    assert _same(ref, [*dx, *dw])


def test_offloaded_residuals_live_in_pinned_host_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    import ckptfx.recording.tracer as trace
    from ckptfx.recording.packs import _Offloaded

    device = torch.device(ACC.type, 0)
    p, x = _params(device), torch.randn(8, 32, device=device, requires_grad=True)
    plain = lambda p, x: torch.tanh(x @ p["w1"]) @ p["w2"]  # noqa: E731
    block = ckptfx.remat(plain, policy=cp.offload_dot_with_no_batch_dims())
    tracers: list = []
    finish = trace.Tracer.finish
    monkeypatch.setattr(trace.Tracer, "finish",
                        lambda self: (tracers.append(self), finish(self))[1])
    out = block(p, x)
    packed = [ref() for ref in tracers[0].seg.kept.values() if ref() is not None]
    offloaded = [k for k in packed if isinstance(k, _Offloaded)]
    assert offloaded
    for k in offloaded:  # between forward and backward the residual is on the host, pinned
        assert k.tensor.device.type == "cpu" and k.tensor.is_pinned()
    ref = torch.autograd.grad(plain(p, x).sum(), [x, *p.values()])
    got = torch.autograd.grad(out.sum(), [x, *p.values()])
    assert _same(list(ref), list(got))
