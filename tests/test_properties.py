"""Property tests: random blocks under random policies replay exactly.

Hypothesis builds a block from a menu of ops (matmuls, activations, dropout, in-place
updates, views, reductions, names) and a policy; remat, checkpoint and split backward of the
block must give gradients bitwise equal to the plain block, with the same dropout masks.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptfx
from ckptfx import checkpoint_policies as cp

D = 6

OPS = [
    "linear", "relu", "gelu", "tanh", "dropout", "add_", "mul_self", "view_roundtrip",
    "layer_norm", "softmax", "transpose_matmul", "name", "sigmoid_", "cat_split", "exp_sum",
    "noise", "matmul3d_add_",
]

# Random programs use a random subset of the names the policies below refer to, so the
# remat'd blocks rightly warn about the others (UnusedNameWarning); not what these tests check.
pytestmark = pytest.mark.filterwarnings("ignore::ckptfx.UnusedNameWarning")

POLICIES = [
    None,
    cp.nothing_saveable,
    cp.everything_saveable,
    cp.dots_saveable,
    cp.dots_with_no_batch_dims_saveable,
    cp.save_only_these_names("n0", "n2"),
    cp.save_any_names_but_these("n1"),
    cp.save_from_both_policies(cp.dots_saveable, cp.save_only_these_names("n0")),
    cp.save_and_offload_only_these_names(names_which_can_be_saved=["n0"],
                                         names_which_can_be_offloaded=["n1"]),
    cp.offload_dot_with_no_batch_dims(),
]


def make_block(ops: list[str]):
    def block(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        n_names = 0
        for i, op in enumerate(ops):
            w = params[f"w{i % 3}"]
            if op == "linear":
                x = x @ w
            elif op == "relu":
                x = torch.relu(x)
            elif op == "gelu":
                x = F.gelu(x)
            elif op == "tanh":
                x = torch.tanh(x)
            elif op == "dropout":
                x = F.dropout(x, 0.3, True)
            elif op == "add_":
                x = x * 1.5
                x.add_(w[0])
            elif op == "mul_self":
                x = x * x.tanh()
            elif op == "view_roundtrip":
                x = x.reshape(-1).view(x.shape) * 2
            elif op == "layer_norm":
                x = F.layer_norm(x, x.shape[-1:])
            elif op == "softmax":
                x = torch.softmax(x, -1)
            elif op == "transpose_matmul":
                x = torch.softmax(x @ x.t(), -1) @ x  # attention-like: (4,4) @ (4,D)
                x = torch.bmm(x.unsqueeze(0), w.unsqueeze(0)).squeeze(0)  # batch dims
            elif op == "name":
                x = ckptfx.checkpoint_name(x, f"n{n_names % 3}")
                n_names += 1
            elif op == "sigmoid_":
                x = torch.sigmoid(x)
            elif op == "cat_split":
                a, b = torch.cat([x, x * 3], dim=-1).split(D, dim=-1)
                x = a * b
            elif op == "matmul3d_add_":  # mm + _unsafe_view, then a write through the view
                y = x.reshape(2, 2, D) @ w
                y.add_(0.5)
                x = y.reshape(4, D)
            elif op == "noise":
                x = x + torch.rand_like(x) * 0.1
            elif op == "exp_sum":
                x = (x - x.max(-1, keepdim=True).values).exp()
                x = x / x.sum(-1, keepdim=True)
        return x

    return block


def grads(fn, params: dict[str, torch.Tensor], x: torch.Tensor, seed: int) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    out = fn(params, x)
    return list(torch.autograd.grad(out.square().sum(), [x, *params.values()],
                                    allow_unused=True))


def _bitwise(u: torch.Tensor, v: torch.Tensor) -> bool:
    """torch.equal, except that NaN equals NaN (a block may overflow; both runs must agree)."""
    nan_u, nan_v = torch.isnan(u), torch.isnan(v)
    return torch.equal(nan_u, nan_v) and torch.equal(u.masked_fill(nan_u, 0), v.masked_fill(nan_v, 0))


def same(a: list, b: list) -> bool:
    return all((u is None and v is None) or (u is not None and v is not None and _bitwise(u, v))
               for u, v in zip(a, b))


def inputs() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    params = {f"w{i}": (torch.randn(D, D, generator=g) / D**0.5).requires_grad_()
              for i in range(3)}
    return params, torch.randn(4, D, generator=g, requires_grad=True)


@settings(max_examples=int(os.environ.get("CKPTFX_PROPERTY_EXAMPLES", 150)), deadline=None, derandomize=os.environ.get("CKPTFX_PROPERTY_RANDOM") is None)
@given(ops=st.lists(st.sampled_from(OPS), min_size=1, max_size=10),
       policy=st.sampled_from(POLICIES), seed=st.integers(0, 2**16), bf16=st.booleans())
def test_remat_is_bitwise_exact(ops: list[str], policy, seed: int, bf16: bool) -> None:
    block = make_block(ops)
    params, x = inputs()
    # One autocast region per run: autocast caches the bf16 casts of leaf tensors for the whole
    # region, so a second forward in the same region would reuse the first one's casts (and
    # their graph), for plain autograd and for torch's checkpoint alike.
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        ref = grads(block, params, x, seed)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        got = grads(ckptfx.remat(block, policy=policy), params, x, seed)
    assert same(ref, got), (ops, policy)


@settings(max_examples=int(os.environ.get("CKPTFX_PROPERTY_EXAMPLES", 40)), deadline=None,
          derandomize=os.environ.get("CKPTFX_PROPERTY_RANDOM") is None)
@given(ops=st.lists(st.sampled_from(OPS), min_size=1, max_size=10),
       policy=st.sampled_from(POLICIES), seed=st.integers(0, 2**16))
def test_remat_second_backward_is_bitwise_exact(ops: list[str], policy, seed: int) -> None:
    """Two backward calls over one remat forward (retain_graph): the second replay rebuilds
    what the first let go of (single-use kept values, freed intermediates), bitwise."""
    block = make_block(ops)
    params, x = inputs()
    ref = grads(block, params, x, seed)
    torch.manual_seed(seed)
    loss = ckptfx.remat(block, policy=policy)(params, x).square().sum()
    leaves = [x, *params.values()]
    first = torch.autograd.grad(loss, leaves, retain_graph=True, allow_unused=True)
    second = torch.autograd.grad(loss, leaves, allow_unused=True)
    assert same(ref, list(first)) and same(ref, list(second)), (ops, policy)


@settings(max_examples=int(os.environ.get("CKPTFX_PROPERTY_EXAMPLES", 30)), deadline=None, derandomize=os.environ.get("CKPTFX_PROPERTY_RANDOM") is None)
@given(ops=st.lists(st.sampled_from(OPS), min_size=1, max_size=8),
       policy=st.sampled_from(POLICIES), seed=st.integers(0, 2**16))
def test_split_session_is_bitwise_exact_and_replays_once(ops: list[str], policy, seed: int
                                                         ) -> None:
    runs = [0]
    plain = make_block(ops)

    def block(params, x):
        runs[0] += 1
        return plain(params, x)

    params, x = inputs()
    ref = grads(block, params, x, seed)
    for wrap in (lambda f: (lambda p, x: ckptfx.checkpoint(f, p, x)),
                 lambda f: ckptfx.remat(f, policy=policy)):
        runs[0] = 0
        torch.manual_seed(seed)
        with ckptfx.recompute_handle_collector_ctx() as handles:
            out = wrap(block)(params, x)
        g = 2 * out.detach()
        sid = ("prop", seed)
        try:
            for h in handles:
                ckptfx.recompute_handle(h, sid)
            with ckptfx.recompute_session_ctx(sid, retain_on_unpack=True):
                dx = torch.autograd.grad(out, x, g, retain_graph=True, allow_unused=True)
            with ckptfx.recompute_session_ctx(sid, retain_on_unpack=False):
                dw = torch.autograd.grad(out, list(params.values()), g, allow_unused=True)
        finally:
            ckptfx.clear_recompute_session(sid)
        assert same(ref, [*dx, *dw]), (ops, policy)
        assert runs[0] <= 2  # forward + at most one replay (remat's segment replay: none)
    assert not ckptfx.recompute_session_stats()


@settings(max_examples=int(os.environ.get("CKPTFX_PROPERTY_EXAMPLES", 30)), deadline=None,
          derandomize=os.environ.get("CKPTFX_PROPERTY_RANDOM") is None)
@given(ops=st.lists(st.sampled_from(OPS), min_size=1, max_size=8),
       policy=st.sampled_from(POLICIES), seed=st.integers(0, 2**16))
def test_torch_func_grad_is_bitwise_exact(ops: list[str], policy, seed: int) -> None:
    block = make_block(ops)
    params, x = inputs()
    params = {k: v.detach() for k, v in params.items()}
    x = x.detach()

    def loss(fn):
        return lambda p, x: fn(p, x).square().sum()

    torch.manual_seed(seed)
    ref = torch.func.grad(loss(block), argnums=(0, 1))(params, x)
    torch.manual_seed(seed)
    got = torch.func.grad(loss(ckptfx.remat(block, policy=policy)), argnums=(0, 1))(params, x)
    assert same([*ref[0].values(), ref[1]], [*got[0].values(), got[1]]), (ops, policy)


@settings(max_examples=int(os.environ.get("CKPTFX_PROPERTY_EXAMPLES", 30)), deadline=None,
          derandomize=os.environ.get("CKPTFX_PROPERTY_RANDOM") is None)
@given(ops=st.lists(st.sampled_from(OPS), min_size=1, max_size=8),
       policy=st.sampled_from(POLICIES), seed=st.integers(0, 2**16),
       wrap=st.sampled_from(["checkpoint", "remat", "none"]), nblocks=st.integers(1, 3))
def test_vjp_split_is_bitwise_exact_and_replays_once(ops: list[str], policy, seed: int,
                                                     wrap: str, nblocks: int) -> None:
    runs = [0]
    plain = make_block(ops)

    def block(params, x):
        runs[0] += 1
        return plain(params, x)

    if wrap == "checkpoint":
        wrapped = lambda p, x: ckptfx.checkpoint(block, p, x)  # noqa: E731
    elif wrap == "remat":
        wrapped = ckptfx.remat(block, policy=policy)
    else:
        wrapped = block

    def stage(fn):
        def run(params, x):
            for _ in range(nblocks):
                x = fn(params, x)
            return x
        return run

    params, x = inputs()
    torch.manual_seed(seed)
    out = stage(block)(params, x)
    g = torch.randn_like(out)
    leaves = [x, *params.values()]
    ref = torch.autograd.grad(out, leaves, g, allow_unused=True)
    # vjp_split, like torch.func.vjp, gives zeros for an unused input where autograd gives None
    ref = [torch.zeros_like(t) if r is None else r for r, t in zip(ref, leaves)]
    runs[0] = 0
    torch.manual_seed(seed)
    split_out, dx_fn, dw_fn = ckptfx.vjp_split(stage(wrapped), params, x, x_argnums=1)
    assert _bitwise(split_out, out.detach())
    dx = dx_fn(g)
    dw = dw_fn()
    assert same(list(ref), [dx, *dw.values()]), (ops, policy, wrap)
    if wrap == "checkpoint":
        # forward + at most one replay per block, however many parameter groups (a block
        # that saves no tensor is never replayed)
        assert nblocks <= runs[0] <= 2 * nblocks
    assert not ckptfx.recompute_session_stats()
