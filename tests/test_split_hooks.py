"""Hooks under the split backward: tensor hooks, ``retain_grad``, and pre- and post-hooks of
autograd nodes on the input path fire as often as in one fused ``torch.autograd.grad``, with
its gradients, and the gradients they change are its gradients, bit for bit.

The hooked tensors sit where dx and dw meet: ``a = l1(x)`` is the output of an intermediate
(``addmm``, whose weight edges dw follows), ``h = tanh(a)`` the next node's. The reference is
the same function without any checkpoint, one ``torch.autograd.grad`` for the input and every
weight. Each test runs under both passes (``ckptfx.split.weight_calls``) and with the block
after ``h`` plain, under ``ckptfx.checkpoint`` and under ``ckptfx.remat``, on the CPU and on
the accelerator (the ``device`` fixture).
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn as nn

import ckptfx
import ckptfx.split.weight_calls as weight_calls
from ckptfx.split.input_pass import input_pass

from conftest import assert_bitwise

pytestmark = pytest.mark.usefixtures("no_hooks_left_behind")

VARIANTS = ["plain", "checkpoint", "remat"]


@pytest.fixture(params=["per_group", "fused"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(weight_calls, "_force", request.param)
    return request.param


class _Net:
    """``l3(block(tanh(l1(x))))``, ``block = l2 . relu``; ``install(a, h)`` hooks the first
    forward's ``a = l1(x)`` and ``h`` (a replay does not call it)."""

    def __init__(self, device: torch.device, variant: str) -> None:
        torch.manual_seed(0)
        self.l1, self.l2, self.l3 = (nn.Linear(4, 4).to(device) for _ in range(3))
        self.variant = variant
        self.runs = 0
        if variant == "remat" and not hasattr(ckptfx, "remat"):  # pragma: no cover
            pytest.skip("ckptfx.remat not available in this tree")
        self.rblock = ckptfx.remat(self.block) if variant == "remat" else None

    def params(self) -> list[torch.Tensor]:
        return [*self.l1.parameters(), *self.l2.parameters(), *self.l3.parameters()]

    def block(self, h: torch.Tensor) -> torch.Tensor:
        self.runs += 1
        return self.l2(torch.relu(h))

    def __call__(self, x: torch.Tensor, install: Callable[..., None], ck: bool = True
                 ) -> torch.Tensor:
        a = self.l1(x)
        h = torch.tanh(a)
        install(a, h)
        if not ck or self.variant == "plain":
            y = self.block(h)
        elif self.variant == "checkpoint":
            y = ckptfx.checkpoint(self.block, h)
        else:
            y = self.rblock(h)  # type: ignore[misc]
        return self.l3(y)


def _inputs(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(3, 4).to(device), torch.randn(3, 4).to(device)


def _plain(net: _Net, x: torch.Tensor, c: torch.Tensor, install: Callable[..., None]
           ) -> list[torch.Tensor]:
    """dx and every weight gradient of one fused backward, without a checkpoint."""
    xr = x.clone().requires_grad_()
    out = net(xr, install, ck=False)
    return list(torch.autograd.grad(out, [xr, *net.params()], c))


def _split(net: _Net, x: torch.Tensor, c: torch.Tensor, install: Callable[..., None]
           ) -> tuple[list[Any], str]:
    """dx and every weight gradient (from ``.grad``) of vjp_split, and the pass it took."""
    params = net.params()
    for p in params:
        p.grad = None
    _, dx_fn, dw_fn = ckptfx.vjp_split(lambda t: net(t, install), x, params=params)
    dx = dx_fn(c)
    taken = dx_fn._split.passed.mode
    dw_fn()
    got = [dx, *(p.grad for p in params)]
    for p in params:
        p.grad = None
    return got, taken


@pytest.mark.parametrize("variant", VARIANTS)
def test_retained_grads_are_plain_autograds(variant: str, mode: str,
                                            device: torch.device) -> None:
    """``retain_grad()`` on an intermediate's output and on the next tensor: after dw each
    ``.grad`` is the one a fused backward leaves (not twice it), and a checkpointed block
    ran twice."""
    net = _Net(device, variant)
    x, c = _inputs(device)
    kept: dict[str, dict[str, torch.Tensor]] = {"plain": {}, "split": {}}

    def retain(into: dict[str, torch.Tensor]) -> Callable[..., None]:
        def install(a: torch.Tensor, h: torch.Tensor) -> None:
            a.retain_grad()
            h.retain_grad()
            into.update(a=a, h=h)
        return install

    ref = _plain(net, x, c, retain(kept["plain"]))
    net.runs = 0
    got, taken = _split(net, x, c, retain(kept["split"]))
    assert taken == mode
    assert_bitwise(got, ref)
    assert_bitwise([kept["split"]["a"].grad, kept["split"]["h"].grad],
                   [kept["plain"]["a"].grad, kept["plain"]["h"].grad])
    # forward + one replay; remat replays its recorded ops, not the Python block
    assert net.runs == {"plain": 1, "checkpoint": 2, "remat": 1}[variant]


@pytest.mark.parametrize("variant", VARIANTS)
def test_counting_hooks_fire_as_often_as_in_plain_autograd(variant: str, mode: str,
                                                           device: torch.device) -> None:
    """Tensor hooks on ``a`` and ``h``, a pre-hook on ``a``'s node (an intermediate) and a
    hook on a weight: each fires as many times as in a fused backward, on its gradients."""
    net = _Net(device, variant)
    x, c = _inputs(device)
    seen: dict[str, list[torch.Tensor]] = {}

    def log(name: str) -> Callable[[Any], None]:
        def hook(g: Any) -> None:
            seen.setdefault(name, []).append(g if isinstance(g, torch.Tensor) else g[0])
        return hook

    def install(a: torch.Tensor, h: torch.Tensor) -> None:
        a.register_hook(log("a"))
        h.register_hook(log("h"))
        a.grad_fn.register_prehook(log("a node"))

    handle = net.l1.weight.register_hook(log("l1.weight"))
    try:
        _plain(net, x, c, install)
        ref, seen = seen, {}
        _, taken = _split(net, x, c, install)
    finally:
        handle.remove()
    assert taken == mode
    assert sorted(seen) == sorted(ref) == ["a", "a node", "h", "l1.weight"]
    for name in ref:
        assert_bitwise(seen[name], ref[name], name)  # as often, the same gradients


@pytest.mark.parametrize("variant", VARIANTS)
def test_gradient_changing_hooks_give_plain_autograds_gradients(variant: str, mode: str,
                                                                device: torch.device) -> None:
    """Hooks that change gradients on the input path (a tensor hook on the intermediate's
    output, one on ``h``, a pre-hook on the intermediate): dx and every weight gradient are
    a fused backward's, so dw does not apply them again."""
    net = _Net(device, variant)
    x, c = _inputs(device)

    def install(a: torch.Tensor, h: torch.Tensor) -> None:
        a.register_hook(lambda g: g * 3)
        h.register_hook(lambda g: g + 1)
        a.grad_fn.register_prehook(lambda gs: (gs[0] * 0.5,))

    ref = _plain(net, x, c, install)
    got, taken = _split(net, x, c, install)
    assert taken == mode
    assert_bitwise(got, ref)


@pytest.mark.parametrize("variant", VARIANTS)
def test_post_hook_on_a_builtin_intermediate_takes_the_fused_pass(
        variant: str, mode: str, device: torch.device) -> None:
    """A post-hook on ``a``'s ``addmm`` node sees the weight half of its outputs and here
    doubles it: dx and dw cannot split that, so the split takes the fused pass, where the
    hook fires once with a fused backward's gradients."""
    net = _Net(device, variant)
    x, c = _inputs(device)
    calls: list[int] = []

    def post(grad_inputs: tuple[Any, ...], _: tuple[Any, ...]) -> tuple[Any, ...]:
        calls.append(sum(g is not None for g in grad_inputs))
        return tuple(None if g is None else g * 2 for g in grad_inputs)

    def install(a: torch.Tensor, h: torch.Tensor) -> None:
        a.grad_fn.register_hook(post)

    ref = _plain(net, x, c, install)
    ref_calls, calls[:] = list(calls), []
    got, taken = _split(net, x, c, install)
    assert taken == "fused"
    assert calls == ref_calls == [3]  # once, with the bias, input and weight gradients
    assert_bitwise(got, ref)


class _Mul(torch.autograd.Function):
    """``x * w`` as a custom Function: an intermediate whose backward returns both halves."""

    calls = 0

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        _Mul.calls += 1
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum(0)


def test_post_hook_on_a_custom_intermediate_stays_per_group(monkeypatch: pytest.MonkeyPatch,
                                                            device: torch.device) -> None:
    """A custom Function computes its weight half in dx, where its post-hook sees and changes
    it as in a fused backward: the per-group pass keeps what the hook returned, and neither
    the backward nor the hook runs again in dw."""
    monkeypatch.setattr(weight_calls, "_force", "per_group")
    torch.manual_seed(0)
    w = torch.randn(4).to(device).requires_grad_()
    lin = nn.Linear(4, 4).to(device)
    x, c = _inputs(device)
    calls: list[int] = []

    def post(grad_inputs: tuple[Any, ...], _: tuple[Any, ...]) -> tuple[Any, ...]:
        calls.append(1)
        return (grad_inputs[0], grad_inputs[1] + 1)

    def fun(t: torch.Tensor) -> torch.Tensor:
        y = _Mul.apply(torch.tanh(t), w)
        y.grad_fn.register_hook(post)
        return lin(y)

    params = [w, *lin.parameters()]
    xr = x.clone().requires_grad_()
    ref = torch.autograd.grad(fun(xr), [xr, *params], c)
    calls[:], _Mul.calls = [], 0
    _, dx_fn, dw_fn = ckptfx.vjp_split(fun, x, params=params)
    dx = dx_fn(c)
    assert dx_fn._split.passed.mode == "per_group"
    dw_fn()
    assert calls == [1] and _Mul.calls == 1
    assert_bitwise([dx, *(p.grad for p in params)], ref)


def test_post_hook_under_data_parallel_is_refused_before_any_work(device: torch.device) -> None:
    """Under DDP or FSDP2 (which reduce in dw) there is no fused pass to take: a post-hook on
    a built-in intermediate is a ``CheckpointError`` naming the node and what to use, raised
    before any gradient is computed."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 4).to(device)
    x = torch.randn(3, 4).to(device).requires_grad_()
    out = lin(torch.tanh(x))
    calls: list[int] = []
    out.grad_fn.register_hook(lambda gi, go: calls.append(1))
    with pytest.raises(ckptfx.CheckpointError, match="AddmmBackward0.*register_prehook"):
        input_pass("dp", [out], [torch.ones_like(out)], [x], list(lin.parameters()),
                   True, "vjp_split", True, True)
    assert not calls and x.grad is None
    assert "dp" not in ckptfx.recompute_session_stats()


@pytest.mark.parametrize("variant", VARIANTS)
def test_grad_split_sees_hooks_as_plain_autograd(variant: str, mode: str,
                                                 device: torch.device) -> None:
    """grad_split: a retained ``.grad``, a counting hook and a gradient-changing hook as in one
    fused backward of the loss."""
    net = _Net(device, variant)
    x, _ = _inputs(device)
    seen: dict[str, Any] = {}

    def install(a: torch.Tensor, h: torch.Tensor) -> None:
        h.retain_grad()
        seen["h"] = h
        a.register_hook(lambda g: seen.setdefault("calls", []).append(g) or g * 2)

    # The parameters are passed as they are (they require grad), so the ones net uses are
    # the ones grad_split differentiates.
    params = dict(zip("abcdef", net.params()))

    def loss(p: dict[str, torch.Tensor], t: torch.Tensor) -> torch.Tensor:
        return net(t, install).square().sum()

    xr = x.clone().requires_grad_()
    ref = torch.autograd.grad(loss(params, xr), [xr, *net.params()])
    ref_h, ref_calls = seen.pop("h").grad, seen.pop("calls")
    dx_fn, dw_fn = ckptfx.grad_split(loss, x_argnums=1)
    _, dx = dx_fn(params, x, session="hooks")
    grads = dw_fn("hooks")
    assert_bitwise([dx, *grads.values()], ref)
    assert_bitwise([seen["h"].grad], [ref_h])
    assert_bitwise(seen["calls"], ref_calls)


@pytest.mark.parametrize("variant", VARIANTS)
def test_post_accumulate_grad_hooks_fire_once_with_the_gradient(variant: str, mode: str,
                                                                device: torch.device) -> None:
    """``register_post_accumulate_grad_hook`` (an optimizer step in the backward) runs once
    per parameter after dw wrote ``.grad``, seeing what a fused ``backward()`` leaves."""
    net = _Net(device, variant)
    x, c = _inputs(device)
    params = net.params()
    seen: dict[str, dict[int, list[torch.Tensor]]] = {"plain": {}, "split": {}}
    which = ["plain"]
    handles = [p.register_post_accumulate_grad_hook(
        lambda p, i=i: seen[which[0]].setdefault(i, []).append(p.grad.clone()))
        for i, p in enumerate(params)]
    xr = x.clone().requires_grad_()
    net(xr, lambda a, h: None, ck=False).backward(c)
    for p in params:
        p.grad = None
    which[0] = "split"
    _split(net, x, c, lambda a, h: None)
    for h in handles:
        h.remove()
    assert sorted(seen["split"]) == sorted(seen["plain"]) == list(range(len(params)))
    for i in range(len(params)):
        assert len(seen["split"][i]) == len(seen["plain"][i]) == 1
        assert_bitwise(seen["split"][i], seen["plain"][i])
