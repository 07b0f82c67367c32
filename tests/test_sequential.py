"""checkpoint_sequential against torch's (gradients, call counts, errors) and
checkpoint_layers (exact, sqrt(n) groups, shared budget plans)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.utils.checkpoint as tcp
from torch import nn

import ckptfx
from ckptfx import budget
from ckptfx import checkpoint_policies as cp

from conftest import Counted, assert_bitwise, grads

pytestmark = pytest.mark.usefixtures("no_hooks_left_behind")


def make_layers(n: int, d: int = 12) -> list[Any]:
    torch.manual_seed(0)
    layers: list[Any] = []
    for i in range(n):
        layers.append(Counted(nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Dropout(0.2))))
    return layers


def run(variant: str, layers: list[Any], segments: int, x: torch.Tensor,
        **kw: Any) -> tuple[list, list[int]]:
    for layer in layers:
        layer.calls = 0
        for p in layer.fn.parameters():
            p.grad = None
    x.grad = None
    torch.manual_seed(7)
    if variant == "plain":
        out = x
        for layer in layers:
            out = layer(out)
    elif variant == "torch":
        out = tcp.checkpoint_sequential(layers, segments, x, use_reentrant=False, **kw)
    else:
        out = ckptfx.checkpoint_sequential(layers, segments, x, **kw)
    out.sum().backward()
    params = [p for layer in layers for p in layer.fn.parameters()]
    return grads([x, *params]), [layer.calls for layer in layers]


@pytest.mark.parametrize("n, segments", [(1, 1), (4, 1), (4, 2), (5, 2), (6, 3), (7, 7)])
def test_checkpoint_sequential_matches_torch(n: int, segments: int) -> None:
    layers = make_layers(n)
    x = torch.randn(3, 12, requires_grad=True)
    plain, plain_calls = run("plain", layers, segments, x)
    ref, torch_calls = run("torch", layers, segments, x)
    got, calls = run("ckptfx", layers, segments, x)
    assert_bitwise(ref, plain)
    assert_bitwise(got, ref)
    assert calls == torch_calls  # the same segments replayed
    assert plain_calls == [1] * n


def test_checkpoint_sequential_takes_sequential_and_preserve_rng_state() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    x = torch.randn(2, 8, requires_grad=True)
    results = []
    for fn in (tcp.checkpoint_sequential, ckptfx.checkpoint_sequential):
        model.zero_grad()
        x.grad = None
        fn(model, 2, x, use_reentrant=False, preserve_rng_state=False).sum().backward()
        results.append(grads([x, *model.parameters()]))
    assert_bitwise(results[1], results[0])


def test_checkpoint_sequential_errors() -> None:
    layers = make_layers(3)
    x = torch.randn(2, 12, requires_grad=True)
    with pytest.raises(ValueError) as theirs:
        tcp.checkpoint_sequential(layers, 2, x, use_reentrant=False, bogus=1, other=2)
    with pytest.raises(ValueError) as ours:
        ckptfx.checkpoint_sequential(layers, 2, x, bogus=1, other=2)
    assert str(ours.value) == str(theirs.value)
    with pytest.raises(ValueError, match="use_reentrant=True is not supported"):
        ckptfx.checkpoint_sequential(layers, 2, x, use_reentrant=True)
    with pytest.raises(ZeroDivisionError):  # torch's, for the record
        tcp.checkpoint_sequential(layers, 0, x, use_reentrant=False)
    for bad in (0, 4):
        with pytest.raises(ValueError, match="segments must be between 1 and"):
            ckptfx.checkpoint_sequential(layers, bad, x)
    with pytest.raises(TypeError, match="segments must be an int"):
        ckptfx.checkpoint_sequential(layers, 2.0, x)
    with pytest.raises(TypeError, match="functions must be"):
        ckptfx.checkpoint_sequential(lambda x: x, 1, x)


@pytest.mark.parametrize("n, every", [(1, None), (4, None), (10, None), (9, 3), (10, 4)])
def test_checkpoint_layers_is_exact(n: int, every: int | None) -> None:
    layers = make_layers(n)
    x = torch.randn(3, 12, requires_grad=True)
    plain, _ = run("plain", layers, 1, x)
    for layer in layers:
        layer.calls = 0
        layer.fn.zero_grad()
    x.grad = None
    torch.manual_seed(7)
    with ckptfx.recompute_handle_collector_ctx() as handles:
        out = ckptfx.checkpoint_layers(layers, x, every=every)
    out.sum().backward()
    assert [layer.calls for layer in layers] == [2] * n  # forward + one replay each
    assert_bitwise(grads([x, *[p for l in layers for p in l.fn.parameters()]]), plain)
    if every is not None:
        assert len(handles) == -(-n // every)  # ceil(n / every) groups, the last included
    else:  # the first layer alone (it measures A), then groups: all reach the collector
        assert 1 <= len(handles) <= n


@pytest.mark.parametrize("n", [5, 10, 17])
def test_checkpoint_layers_sizes_groups_from_measured_activations(n: int) -> None:
    """Layers saving one input-sized tensor (A = I): groups of round(sqrt(n - 1)) after the
    first; layers saving 8 (A = 8 I): round(sqrt((n - 1) / 8)). Counted as frames."""
    x = torch.randn(4, 16, requires_grad=True)

    def small(h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h)  # saves its output: I bytes

    def big(h: torch.Tensor) -> torch.Tensor:
        for _ in range(8):
            h = torch.tanh(h)  # eight saved outputs: 8 I bytes
        return h

    for layer, ratio in ((small, 1), (big, 8)):
        with ckptfx.recompute_handle_collector_ctx() as handles:
            ckptfx.checkpoint_layers([layer] * n, x).sum().backward()
        k = max(1, min(n - 1, round(((n - 1) / ratio) ** 0.5)))
        assert len(handles) == 1 + -(-(n - 1) // k), (layer, n, k)
    # without the sizes (no determinism check): round(sqrt(n))
    with ckptfx.recompute_handle_collector_ctx() as handles:
        ckptfx.checkpoint_layers([big] * n, x, determinism_check="none").sum().backward()
    k = ckptfx.sequential.sqrt_group_size(n)
    assert len(handles) == 1 + -(-(n - 1) // k)


def test_checkpoint_layers_with_a_budget_plans_once_for_identical_groups(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = budget.Frontier.from_recording
    monkeypatch.setattr(budget.Frontier, "from_recording",
                        classmethod(lambda cls, t: calls.append(1) or real(t)))
    torch.manual_seed(1)
    layers = nn.ModuleList(nn.Sequential(nn.Linear(12, 12), nn.GELU()) for _ in range(6))
    x = torch.randn(3, 12, requires_grad=True)
    out = x
    for layer in layers:
        out = layer(out)
    out.sum().backward()
    ref = grads([x, *layers.parameters()])
    for _ in range(2):
        layers.zero_grad()
        x.grad = None
        ckptfx.checkpoint_layers(layers, x, every=2,
                                 policy=cp.memory_budget(0.5)).sum().backward()
        assert_bitwise(grads([x, *layers.parameters()]), ref)
    assert len(calls) == 1


def test_checkpoint_layers_bad_input() -> None:
    layers = make_layers(2)
    x = torch.randn(2, 12)
    with pytest.raises(ValueError, match="every must be at least 1"):
        ckptfx.checkpoint_layers(layers, x, every=0)
    with pytest.raises(TypeError, match="every must be an int"):
        ckptfx.checkpoint_layers(layers, x, every=1.5)
    with pytest.raises(TypeError, match="do not apply with policy"):
        ckptfx.checkpoint_layers(layers, x, policy=cp.dots_saveable, early_stop=False)
    with pytest.raises(TypeError, match=r"layers\[1\] must be callable"):
        ckptfx.checkpoint_layers([layers[0], 3], x)
