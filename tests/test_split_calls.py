"""How the split's weight pass calls the engine (``ckptfx.split.weight_calls``) and when dx frees
the replayed tensors only it reads (``ckptfx.split.passes`` Rule 4).

Parity is bitwise against a fused backward without any checkpoint; work is counted (block
runs, a custom Function's backward calls, engine groups), never timed. Tests that run dx and
dw take the ``device`` fixture: on the CPU and on the accelerator, where autograd runs them on
its device threads (the custom backwards, and their random draw, included).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ckptfx
import ckptfx.split.weight_calls as weight_calls

from conftest import assert_bitwise

pytestmark = pytest.mark.usefixtures("no_hooks_left_behind")


class _Scale(torch.autograd.Function):
    """x * 2 with a counted backward (a custom node on the input path)."""

    calls = 0

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x * 2

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        _Scale.calls += 1
        return g * 2


def _weights(n: int = 2, d: int = 8, h: int = 16,
             device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """Leaf weights ``w1, b1, w2`` per block, drawn on the CPU, on ``device``."""
    torch.manual_seed(0)
    ws = []
    for _ in range(n):
        ws += [torch.randn(h, d), torch.randn(h), torch.randn(d, h)]
    return [w.to(device).requires_grad_() for w in ws]


class _Noisy(torch.autograd.Function):
    """Identity whose backward adds a random draw (stochastic rounding, gradient noise)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return g + 1e-3 * torch.randn_like(g)


def _block(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
           runs: list[int], custom: bool = True) -> torch.Tensor:
    runs[0] += 1
    h = F.dropout(F.gelu(F.linear(_Scale.apply(x) if custom else x * 2, w1, b1)), 0.25, True)
    return x + F.linear(h, w2)


def _fun(x: torch.Tensor, ws: list[torch.Tensor], runs: list[int], ck: bool,
         custom: bool = True) -> torch.Tensor:
    for i in range(0, len(ws), 3):
        args = (x, *ws[i:i + 3], runs, custom)
        x = ckptfx.checkpoint(_block, *args) if ck else _block(*args)
    return x


@pytest.mark.parametrize("mode", [None, "per_group", "whole"])
def test_weight_passes_bitwise_counted(mode: str | None, monkeypatch: pytest.MonkeyPatch,
                                       device: torch.device) -> None:
    """Both passes give the fused gradients bit for bit with one replay per block. Under the
    rule (None) these small blocks' custom Function forces the per-group pass, whose custom
    backward runs once; the whole pass, forced (for measurement only), runs the one that leads
    to weights once more, in dw (deterministic here)."""
    monkeypatch.setattr(weight_calls, "_force", mode)
    ws = _weights(device=device)
    x, g = torch.randn(3, 8).to(device), torch.randn(3, 8).to(device)
    torch.manual_seed(5)
    xr = x.clone().requires_grad_()
    ref = torch.autograd.grad(_fun(xr, ws, [0], False), [xr, *ws], g)
    runs = [0]
    torch.manual_seed(5)
    _, dx_fn, dw_fn = ckptfx.vjp_split(lambda t: _fun(t, ws, runs, True), x, params=ws)
    _Scale.calls = 0
    dx = dx_fn(g)
    assert _Scale.calls == 2  # one per block, as in a fused backward
    split = dx_fn._split
    assert len(split.groups) == (1 if mode == "whole" else 4)  # (w1, b1) and w2, per block
    dw_fn()
    # The whole pass re-runs the second block's (its input leads to the first block's
    # weights), not the first block's (its input is x, no weight).
    assert _Scale.calls == (3 if mode == "whole" else 2)
    assert runs == [4]  # two blocks: forward + one replay each
    assert_bitwise([dx, *(w.grad for w in ws)], ref)


def test_rule_is_a_function_of_shapes() -> None:
    """Small blocks take the whole pass, large ones the per-group pass; no weights: per group."""
    small = [torch.zeros(256, 64), torch.zeros(256), torch.zeros(64, 256), torch.zeros(64)]
    act = torch.zeros(8, 64)
    assert weight_calls.whole_backward_pays([act], [act], small)
    large = [torch.zeros(1024, 256), torch.zeros(1024), torch.zeros(256, 1024)]
    seq = torch.zeros(8, 128, 256)
    assert not weight_calls.whole_backward_pays([seq], [seq], large)
    # A scalar loss (grad_split) takes its rows from the inputs.
    assert not weight_calls.whole_backward_pays([torch.zeros(())], [seq], large)
    assert not weight_calls.whole_backward_pays([act], [act], [])


def test_split_follows_the_rule(monkeypatch: pytest.MonkeyPatch, device: torch.device) -> None:
    """Built-in nodes only: the shapes decide; a custom Function: per group at any size."""
    ws = _weights(device=device)
    x, g = torch.randn(3, 8).to(device), torch.randn(3, 8).to(device)
    for limit, custom, groups in ((weight_calls.ENGINE_CALL_FLOPS, False, 1), (0, False, 4),
                                  (weight_calls.ENGINE_CALL_FLOPS, True, 4)):
        monkeypatch.setattr(weight_calls, "ENGINE_CALL_FLOPS", limit)
        _, dx_fn, dw_fn = ckptfx.vjp_split(lambda t: _fun(t, ws, [0], True, custom), x,
                                           params=ws)
        dx_fn(g)
        assert len(dx_fn._split.groups) == groups
        dw_fn()
    for w in ws:
        w.grad = None


@pytest.mark.parametrize("split", ["vjp_split", "grad_split"])
def test_random_custom_backward_takes_the_per_group_pass(split: str,
                                                         device: torch.device) -> None:
    """A custom backward with a random draw on the input path of small blocks: the rule takes
    the per-group pass (the whole one would draw again in dw and give other weight gradients),
    and dx and dw are bitwise plain autograd's with the same seed."""
    torch.manual_seed(0)
    w1 = torch.randn(16, 8).to(device).requires_grad_()
    w2 = torch.randn(8, 16).to(device).requires_grad_()

    def fun(a: torch.Tensor, b: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.tanh(_Noisy.apply(F.linear(x, a))), b)

    x, g = torch.randn(3, 8).to(device), torch.randn(3, 8).to(device)
    assert weight_calls.whole_backward_pays([g], [x], [w1, w2])  # small: shapes alone say whole
    torch.manual_seed(7)
    xr = x.clone().requires_grad_()
    ref = torch.autograd.grad(fun(w1, w2, xr), [xr, w1, w2], g)
    torch.manual_seed(7)
    if split == "vjp_split":
        _, dx_fn, dw_fn = ckptfx.vjp_split(lambda t: fun(w1, w2, t), x, params=[w1, w2])
        dx = dx_fn(g)
        assert not dx_fn._split.groups[0].roots  # per group, not rooted at the outputs
        dw_fn()
        got = [dx, w1.grad, w2.grad]
    else:
        gx, gw = ckptfx.grad_split(lambda a, b, t: (fun(a, b, t) * g).sum(), x_argnums=2)
        (_, dx) = gx(w1, w2, x, session=0)
        got = [dx, *gw(0)]
    assert_bitwise(got, ref)
