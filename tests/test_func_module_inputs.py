"""remat on the torch.func path reads module parameters as inputs.

Two false "outside tensor" errors, from the fuzzer's minimal reproductions:

- ``torch.func.grad(lambda p, x: remat(blk)(p, x).sum())(p, x)`` with
  ``p = dict(model.named_parameters())``: the parameters are leaves that require grad, and a
  view of one taken inside the block (``p["w"].T``; grad mode is off in a Function's forward,
  where such a view is a leaf that requires grad too) was taken for a tensor from outside;
- ``remat(module)(x)`` under ``torch.func.functional_call`` (the module itself passed to
  remat, not its bound method): the module's parameters were not found as inputs.

Each is compared bitwise with the same transform of the plain function, with the block's
runs counted inside it (the torch.func path runs the Python block once per forward and once
per backward).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, jacfwd, jacrev, vjp, vmap

import ckptfx
from conftest import assert_tree_bitwise
from ckptfx import checkpoint_policies as cp

pytestmark = pytest.mark.usefixtures("no_hooks_left_behind")

POLICIES = {"none": None, "dots": cp.dots_saveable, "everything": cp.everything_saveable}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


# -- parameters of a model passed as a dict: leaves that require grad -------------------------


def _dict_block(calls: list[int]):
    def blk(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        h = torch.tanh(x @ p["0.weight"].T + p["0.bias"])  # .T: a view of an input leaf
        return h @ p["2.weight"].t() + p["2.bias"]

    return blk


TRANSFORMS = {
    "grad": lambda f: grad(lambda p, x: f(p, x).sum()),
    "vjp": lambda f: (lambda p, x: vjp(f, p, x)[1](torch.ones(5, 3))),
    "jacrev": lambda f: jacrev(f),
    "jacfwd": lambda f: jacfwd(f),
    "vmap_grad": lambda f: vmap(grad(lambda p, x: f(p, x).sum()), in_dims=(None, 0)),
}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("transform", TRANSFORMS)
def test_named_parameters_dict_under_torch_func(transform: str, policy: str) -> None:
    model = _model()
    p = dict(model.named_parameters())  # leaves that require grad, as the fuzzer passed them
    assert all(t.requires_grad and t.is_leaf for t in p.values())
    x = torch.randn(5, 4)
    plain_calls, remat_calls = [0], [0]
    expected = TRANSFORMS[transform](_dict_block(plain_calls))(p, x)
    block = ckptfx.remat(_dict_block(remat_calls), policy=POLICIES[policy])
    got = TRANSFORMS[transform](block)(p, x)
    assert_tree_bitwise(got, expected)
    if transform in ("grad", "vjp"):
        assert plain_calls[0] == 1
        assert remat_calls[0] == 2  # the forward and one replay for the one backward


def test_named_parameters_dict_under_grad_replays_once() -> None:
    model = _model()
    p = dict(model.named_parameters())
    x = torch.randn(5, 4)
    calls = [0]
    blk = _dict_block(calls)
    expected = grad(lambda p, x: blk(p, x).sum())(p, x)
    got = grad(lambda p, x: ckptfx.remat(blk)(p, x).sum())(p, x)
    assert_tree_bitwise(got, expected)
    assert calls[0] == 1 + 2


def test_a_closure_parameter_keeps_its_gradient() -> None:
    # A leaf requiring grad read from a closure (a view of one too): the transform's result
    # still depends on it for plain autograd outside, bitwise as the plain function's.
    w = torch.randn(4, 3, requires_grad=True)
    x = torch.randn(5, 4)
    for block in (lambda x: x @ w, lambda x: x @ w.T.T):
        g_plain = grad(lambda x: block(x).sum())(x)
        g = grad(lambda x: ckptfx.remat(block)(x).sum())(x)
        assert torch.equal(g, g_plain) and g.requires_grad == g_plain.requires_grad
        outer = torch.autograd.grad(g.pow(2).sum(), w)[0]
        assert torch.equal(outer, torch.autograd.grad(g_plain.pow(2).sum(), w)[0])


# -- remat(module) under functional_call --------------------------------------------------------


class _CountedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 3)
        self.register_buffer("scale", torch.tensor(1.5))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.fc2(torch.tanh(self.fc1(x)) * self.scale)


class _Outer(nn.Module):
    def __init__(self, use_remat: bool, policy: Any = None) -> None:
        super().__init__()
        self.sub = _CountedMLP()
        self.use_remat = use_remat
        self.policy = policy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_remat:  # the module itself is the remat'd block, not its bound method
            return ckptfx.remat(self.sub, policy=self.policy)(x) * 2
        return self.sub(x) * 2


def _pair(policy: Any = None) -> tuple[_Outer, _Outer, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    plain = _Outer(False)
    rem = _Outer(True, policy)
    rem.load_state_dict(plain.state_dict())
    params = {k: v.detach().clone() for k, v in plain.named_parameters()}
    return plain, rem, params


MODULE_TRANSFORMS = {k: v for k, v in TRANSFORMS.items() if k != "vjp"}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("transform", MODULE_TRANSFORMS)
def test_remat_of_a_module_under_functional_call(transform: str, policy: str) -> None:
    plain, rem, params = _pair(POLICIES[policy])
    x = torch.randn(5, 4)
    T = MODULE_TRANSFORMS[transform]
    expected = T(lambda p, x: functional_call(plain, p, (x,)))(params, x)
    got = T(lambda p, x: functional_call(rem, p, (x,)))(params, x)
    assert_tree_bitwise(got, expected)
    if transform == "grad":
        assert plain.sub.calls == 1 and rem.sub.calls == 2


def test_remat_of_a_module_under_functional_call_plain_autograd() -> None:
    plain, rem, params = _pair()
    x = torch.randn(5, 4, requires_grad=True)
    p1 = {k: v.clone().requires_grad_() for k, v in params.items()}
    p2 = {k: v.clone().requires_grad_() for k, v in params.items()}
    functional_call(plain, p1, (x,)).sum().backward()
    gx = x.grad.clone()
    x.grad = None
    functional_call(rem, p2, (x,)).sum().backward()
    assert_tree_bitwise({k: v.grad for k, v in p2.items()}, {k: v.grad for k, v in p1.items()})
    assert torch.equal(x.grad, gx)
    assert rem.sub.calls == 1  # the recorded replay does not call the module again


def test_remat_of_a_module_called_directly_under_grad() -> None:
    # The module's own parameters (not functional_call's): a gradient by the input only.
    plain, rem, _ = _pair()
    x = torch.randn(5, 4)
    expected = grad(lambda x: plain.sub(x).sum())(x)
    got = grad(lambda x: ckptfx.remat(rem.sub)(x).sum())(x)
    assert torch.equal(got, expected)
