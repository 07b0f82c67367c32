"""Which pass a split takes (``ckptfx.split.weight_calls``): per group, or one fused backward in
dx where blocks are small.

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
from ckptfx.split.input_pass import input_pass

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


@pytest.mark.parametrize("mode", [None, "per_group", "fused"])
def test_weight_passes_bitwise_counted(mode: str | None, monkeypatch: pytest.MonkeyPatch,
                                       device: torch.device) -> None:
    """Both passes give the fused gradients bit for bit with one replay per block, and run a
    custom Function's backward once per block. Under the rule (None) these small blocks take
    the fused pass, custom Function or not; per group, dw starts at one intermediate per
    linear layer (fc1's ``addmm`` for w1 and b1, fc2's ``mm`` for w2)."""
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
    passed = dx_fn._split.passed
    assert passed.mode == ("per_group" if mode == "per_group" else "fused")
    if mode == "per_group":
        assert len(passed.plan.intermediates) == 4
    dw_fn()
    assert _Scale.calls == 2  # dw ran none again
    assert runs == [4]  # two blocks: forward + one replay each
    assert_bitwise([dx, *(w.grad for w in ws)], ref)


def test_rule_is_a_function_of_shapes() -> None:
    """Small blocks take the fused pass, large ones the per-group pass; no weights: per group."""
    small = [torch.zeros(256, 64), torch.zeros(256), torch.zeros(64, 256), torch.zeros(64)]
    act = torch.zeros(8, 64)
    assert weight_calls.fused_backward_pays([act], [act], small)
    large = [torch.zeros(1024, 256), torch.zeros(1024), torch.zeros(256, 1024)]
    seq = torch.zeros(8, 128, 256)
    assert not weight_calls.fused_backward_pays([seq], [seq], large)
    # A scalar loss (grad_split) takes its rows from the inputs.
    assert not weight_calls.fused_backward_pays([torch.zeros(())], [seq], large)
    assert not weight_calls.fused_backward_pays([act], [act], [])


def test_split_follows_the_rule(monkeypatch: pytest.MonkeyPatch, device: torch.device) -> None:
    """The shapes decide, whatever nodes the graph holds (a custom Function's backward runs
    once in either pass)."""
    ws = _weights(device=device)
    x, g = torch.randn(3, 8).to(device), torch.randn(3, 8).to(device)
    for limit, custom, mode in ((weight_calls.ENGINE_CALL_FLOPS, False, "fused"),
                                (0, False, "per_group"),
                                (weight_calls.ENGINE_CALL_FLOPS, True, "fused"),
                                (0, True, "per_group")):
        monkeypatch.setattr(weight_calls, "ENGINE_CALL_FLOPS", limit)
        _, dx_fn, dw_fn = ckptfx.vjp_split(lambda t: _fun(t, ws, [0], True, custom), x,
                                           params=ws)
        dx_fn(g)
        assert dx_fn._split.passed.mode == mode
        dw_fn()
    for w in ws:
        w.grad = None


@pytest.mark.parametrize("mode", ["per_group", "fused"])
@pytest.mark.parametrize("split", ["vjp_split", "grad_split"])
def test_random_custom_backward_runs_once_in_either_pass(
        split: str, mode: str, monkeypatch: pytest.MonkeyPatch, device: torch.device) -> None:
    """A custom backward with a random draw on the input path between two weights'
    intermediates runs once (in dx), and dx and dw are bitwise plain autograd's with the same
    seed."""
    monkeypatch.setattr(weight_calls, "_force", mode)
    torch.manual_seed(0)
    w1 = torch.randn(16, 8).to(device).requires_grad_()
    w2 = torch.randn(8, 16).to(device).requires_grad_()

    def fun(a: torch.Tensor, b: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.tanh(_Noisy.apply(F.linear(x, a))), b)

    x, g = torch.randn(3, 8).to(device), torch.randn(3, 8).to(device)
    torch.manual_seed(7)
    xr = x.clone().requires_grad_()
    ref = torch.autograd.grad(fun(w1, w2, xr), [xr, w1, w2], g)
    torch.manual_seed(7)
    if split == "vjp_split":
        _, dx_fn, dw_fn = ckptfx.vjp_split(lambda t: fun(w1, w2, t), x, params=[w1, w2])
        dx = dx_fn(g)
        assert dx_fn._split.passed.mode == mode
        dw_fn()
        got = [dx, w1.grad, w2.grad]
    else:
        gx, gw = ckptfx.grad_split(lambda a, b, t: (fun(a, b, t) * g).sum(), x_argnums=2)
        (_, dx) = gx(w1, w2, x, session=0)
        got = [dx, *gw(0)]
    assert_bitwise(got, ref)


def _recurrences(xs: torch.Tensor, w: torch.Tensor, b: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` recurrences over ``xs`` in turn, each adding ``b`` at every step; the first step's
    ``h0 @ w + b`` does not depend on the input (it is on the weight side)."""
    out = xs.new_zeros(())
    for _ in range(n):
        h = xs.new_zeros(xs.shape[1:])
        for t in range(xs.shape[0]):
            h = torch.tanh(xs[t] + (h @ w + b))
        out = out + h.sum()
    return out


@pytest.mark.parametrize("n", [1, 2])
def test_a_sum_the_weight_pass_would_reorder_takes_the_fused_pass(
        n: int, monkeypatch: pytest.MonkeyPatch, device: torch.device) -> None:
    """A bias added at every step of two recurrences in turn: a fused backward adds its six
    gradients in an order (the second recurrence's weight-side first step between the first's
    steps and the second's) that the per-group pass, which hands the intermediates' in first,
    cannot reproduce; the split takes the fused pass there and is bitwise. One recurrence
    orders the same either way and stays per group."""
    monkeypatch.setattr(weight_calls, "_force", "per_group")
    torch.manual_seed(0)
    w, b = torch.randn(8, 8).to(device) / 3, torch.randn(8).to(device)
    w.requires_grad_()
    b.requires_grad_()
    xs = torch.randn(3, 4, 8).to(device)
    xr = xs.clone().requires_grad_()
    ref = torch.autograd.grad(_recurrences(xr, w, b, n), [xr, w, b])
    dx_fn, dw_fn = ckptfx.grad_split(
        lambda w, b, x: ckptfx.checkpoint(_recurrences, x, w, b, n), x_argnums=2)
    (_, dx) = dx_fn(w, b, xs, session="rec")
    got = [dx, *dw_fn("rec")]
    assert_bitwise(got, ref)
    _, vdx, vdw = ckptfx.vjp_split(lambda x: _recurrences(x, w, b, n), xs, params=[w, b])
    vdx(torch.ones(()))
    assert vdx._split.passed.mode == ("fused" if n == 2 else "per_group")
    vdw()
    assert_bitwise([w.grad, b.grad], ref[1:])
    w.grad = b.grad = None


def test_a_sum_the_weight_pass_would_reorder_is_refused_under_data_parallel() -> None:
    """Under DDP or FSDP2 (which reduce in dw) there is no fused pass to take: the reordered
    sum is a ``CheckpointError`` naming the node, raised before any gradient is computed."""
    torch.manual_seed(0)
    w = (torch.randn(8, 8) / 3).requires_grad_()
    b = torch.randn(8).requires_grad_()
    xs = torch.randn(3, 4, 8).requires_grad_()
    out = _recurrences(xs, w, b, 2)
    with pytest.raises(ckptfx.CheckpointError, match="AccumulateGrad.*three or more"):
        input_pass("dp", [out], [torch.ones(())], [xs], [w, b], True, "vjp_split", True, True)
    assert xs.grad is None and w.grad is None and b.grad is None
