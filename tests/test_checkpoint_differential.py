"""Differential suite: each block under no checkpoint, torch's checkpoint and ckptfx.

For every block, on the CPU and on the accelerator under test (``device``), in fp32 and
under bf16 autocast on that device (backward run outside autocast): gradients of ckptfx are
bitwise equal to no checkpoint (``torch.equal``), the block runs as many times as under
torch's non-reentrant checkpoint, and the backward leaves the caller's RNG state (the CPU
generator's and the device's) where the forward left it. Where torch 2.13 is wrong
(``nn.RReLU`` as the last op under early_stop) the test says so and checks that ckptfx is
right.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import optree
import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import ckptfx
from conftest import (VARIANTS, Counted, assert_bitwise, checkpoint_fn, grads, maybe_autocast,
                      run_variant)

pytestmark = pytest.mark.usefixtures("no_hooks_left_behind")

D = 8  # feature size: small on purpose


# -- blocks --------------------------------------------------------------------------------
# Each builder gets the checkpoint callable of the variant (for blocks that checkpoint inside
# themselves) and the device, and returns (block, args, kwargs, leaves). It is called under a
# fixed seed, so every variant sees the same parameters and inputs.


def _x(*shape: int, device: torch.device) -> torch.Tensor:
    """A leaf on ``device``, drawn on the CPU (the same numbers on every device)."""
    return torch.randn(*shape).to(device).requires_grad_()


def _rng_state(device: torch.device) -> list[torch.Tensor]:
    """The caller's generator states: the CPU's, and the device's where it is not the CPU."""
    states = [torch.get_rng_state()]
    if device.type != "cpu":
        states.append(torch.get_device_module(device.type).get_rng_state(device.index))
    return states


def _rng_moved(before: list[torch.Tensor], device: torch.device) -> bool:
    return any(not torch.equal(a, b) for a, b in zip(before, _rng_state(device)))


def build_mlp(ck, device):
    mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D)).to(device)
    x = _x(4, D, device=device)
    return mlp, (x,), {}, [x, *mlp.parameters()]


def build_attention(ck, device):
    layer = nn.TransformerEncoderLayer(D, nhead=2, dim_feedforward=2 * D, dropout=0.1,
                                       batch_first=True).to(device)
    layer.train()
    x = _x(2, 5, D, device=device)
    return layer, (x,), {}, [x, *layer.parameters()]


def build_layer_norm(ck, device):
    w, b = _x(D, device=device), _x(D, device=device)
    x = _x(4, D, device=device)
    return (lambda x: F.layer_norm(x * 2, (D,), w, b).tanh()), (x,), {}, [x, w, b]


def build_dropout(ck, device):
    w = _x(D, device=device)
    x = _x(4, D, device=device)
    return (lambda x: F.dropout(x.sin(), 0.5, training=True) * w), (x,), {}, [x, w]


def build_rrelu_mid(ck, device):
    act, lin = nn.RReLU(0.1, 0.3), nn.Linear(D, D).to(device)
    x = _x(4, D, device=device)
    return (lambda x: lin(act(x * 1.5))), (x,), {}, [x, *lin.parameters()]


def build_rrelu_last(ck, device):
    # rrelu_with_noise saves its noise buffer before filling it: an early stop at the pack of
    # that buffer (torch 2.13) hands out an unfilled buffer.
    lin, act = nn.Linear(D, D).to(device), nn.RReLU(0.1, 0.3)
    x = _x(4, D, device=device)
    return (lambda x: act(lin(x))), (x,), {}, [x, *lin.parameters()]


def build_inplace(ck, device):
    w = _x(D, device=device)
    x = _x(4, D, device=device)

    def block(x):
        y = x * 2
        y.add_(1).mul_(w)
        y = y.exp() * 0.1  # exp saves its output; the mul makes a fresh tensor to mutate
        y.mul_(x)
        return y.relu_()

    return block, (x,), {}, [x, w]


def build_views(ck, device):
    w = _x(D, D, device=device)
    x = _x(4, D, device=device)

    def block(x):
        y = x.t()[1:].reshape(-1)  # non-contiguous view, then a copy
        z = (x @ w).view(2, 2, D).transpose(0, 1)
        return z.narrow(2, 0, D // 2).exp() * y[: D // 2].sin()

    return block, (x,), {}, [x, w]


def build_multi_out(ck, device):
    w = _x(D, device=device)
    x, y = _x(4, D, device=device), _x(4, D, device=device)
    return (lambda x, y: ((x * w).sin(), 3, (y.cos() * x, "tag"), None)), (x, y), {}, [x, y, w]


def build_dict_out(ck, device):
    w = _x(D, device=device)
    x = _x(4, D, device=device)
    return (lambda x: {"a": (x * w).tanh(), "b": [x.exp(), {"c": x.sigmoid() * w}],
                       "n": 1.5}), (x,), {}, [x, w]


def build_kwargs(ck, device):
    w, bias = _x(D, device=device), _x(D, device=device)
    x = _x(4, D, device=device)

    def block(x, *, scale, bias, mode="sin"):
        y = (x * w * scale).sin() if mode == "sin" else x.cos()
        return y * bias + bias.exp()

    return block, (x,), {"scale": 0.5, "bias": bias, "mode": "sin"}, [x, w, bias]


def build_backward_inside(ck, device):
    w = _x(D, device=device)
    x = _x(4, D, device=device)

    def block(x):
        # A gradient taken inside the block: the block's own graph is run backward during
        # its forward (and again during the replay).
        y = (x * w).sin()
        (g,) = torch.autograd.grad(y.sum(), w, create_graph=True)
        return y * g

    return block, (x,), {}, [x, w]


CASES: dict[str, Callable[..., Any]] = {
    "mlp": build_mlp,
    "attention": build_attention,
    "layer_norm": build_layer_norm,
    "dropout": build_dropout,
    "rrelu_mid": build_rrelu_mid,
    "rrelu_last": build_rrelu_last,
    "inplace": build_inplace,
    "views": build_views,
    "multi_out": build_multi_out,
    "dict_out": build_dict_out,
    "kwargs": build_kwargs,
    "backward_inside": build_backward_inside,
}


def _loss(out: Any, device: torch.device) -> torch.Tensor:
    """A fixed random projection of every tensor in ``out`` (a pytree), summed on ``device``.

    The cotangents come from a private CPU generator (the same numbers on every device), so
    the caller's RNG does not move.
    """
    gen = torch.Generator().manual_seed(123)
    total = torch.zeros((), device=device)
    for leaf in optree.tree_leaves(out, none_is_leaf=False):
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            cotangent = torch.randn(leaf.shape, generator=gen).to(device)
            total = total + (leaf.float() * cotangent).sum()
    return total


def run_case(name: str, variant: str, autocast: bool, device: torch.device, **options: Any):
    """Forward + backward of one case; returns (grads, out, block calls, rng moved?)."""
    torch.manual_seed(0)
    fn, args, kwargs, leaves = CASES[name](checkpoint_fn(variant), device)
    block = Counted(fn)
    with maybe_autocast(autocast, device):
        out = run_variant(variant, block, *args, **kwargs,
                          **{f"ckpt_{k}": v for k, v in options.items()})
        loss = _loss(out, device)
    rng_after_forward = _rng_state(device)
    loss.backward()  # outside autocast, as in a training loop
    rng_moved = _rng_moved(rng_after_forward, device)
    return grads(leaves), out, block.calls, rng_moved


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_differential(name: str, autocast: bool, device: torch.device) -> None:
    results = {v: run_case(name, v, autocast, device) for v in VARIANTS}
    g_plain, out_plain, calls_plain, _ = results["plain"]
    g_ck, out_ck, calls_ck, rng_moved_ck = results["ckptfx"]
    g_torch, _, calls_torch, rng_moved_torch = results["torch"]

    assert_bitwise(g_ck, g_plain)
    assert calls_plain == 1
    # backward_inside: the gradient taken during the forward already replays the block once.
    assert calls_ck == calls_torch == (3 if name == "backward_inside" else 2)
    assert not rng_moved_ck and not rng_moved_torch
    # Outputs (structure, non-tensors and values) are those of the plain call.
    assert optree.tree_structure(out_ck, none_is_leaf=True) == optree.tree_structure(
        out_plain, none_is_leaf=True)
    for a, b in zip(optree.tree_leaves(out_ck, none_is_leaf=True),
                    optree.tree_leaves(out_plain, none_is_leaf=True)):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b

    if name == "rrelu_last":
        # Documents the reference: torch 2.13's early stop hands out RReLU's noise buffer
        # before it is filled, so its gradients differ from no checkpoint.
        assert any(not torch.equal(a, b) for a, b in zip(g_torch, g_plain) if a is not None)
    else:
        assert_bitwise(g_torch, g_plain, "torch's gradient")


@pytest.mark.parametrize("early_stop", [True, False])
@pytest.mark.parametrize("name", ["rrelu_last", "dropout", "inplace"])
def test_early_stop_never_changes_gradients(name: str, early_stop: bool,
                                            device: torch.device) -> None:
    g_plain = run_case(name, "plain", False, device)[0]
    g_ck, _, calls, _ = run_case(name, "ckptfx", False, device, early_stop=early_stop)
    assert_bitwise(g_ck, g_plain)
    assert calls == 2


@pytest.mark.parametrize("last", ["linear", "rrelu"])
def test_early_stop_runs_the_ops_torch_runs_unless_the_last_op_fills_a_saved_buffer(
        last: str, device: torch.device) -> None:
    """The replay stops where torch's does (in the pack of the last saved tensor, so the
    final addmm is skipped), except when that op writes a tensor it saved: rrelu fills its
    saved noise buffer after packing it, and ckptfx lets it finish (torch does not)."""
    torch.manual_seed(0)
    lin1, lin2 = nn.Linear(D, D).to(device), nn.Linear(D, D).to(device)
    act = nn.RReLU(0.1, 0.3)

    def block(x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(lin1(x))
        return lin2(h) if last == "linear" else act(h)

    x = _x(3, D, device=device)
    torch.manual_seed(1)
    g_plain = torch.autograd.grad(block(x).sum(), [x, *lin1.parameters()])
    replayed = {}
    for variant in ("ckptfx", "torch"):
        torch.manual_seed(1)
        out = checkpoint_fn(variant)(block, x)
        with _OpCounter() as ops:
            g = torch.autograd.grad(out.sum(), [x, *lin1.parameters()])
        if variant == "ckptfx" or last == "linear":
            assert_bitwise(g, g_plain)
        ops.counts.pop("aten.detach", None)  # the pack hooks' own detaches differ
        replayed[variant] = ops.counts
    if last == "linear":
        assert replayed["ckptfx"] == replayed["torch"]
    else:
        assert replayed["ckptfx"]["aten.rrelu_with_noise"] == 1
        assert "aten.rrelu_with_noise" not in replayed["torch"]
        del replayed["ckptfx"]["aten.rrelu_with_noise"]
        assert replayed["ckptfx"] == replayed["torch"]


# -- nested checkpoints --------------------------------------------------------------------


def _nested_run(variant: str, autocast: bool, device: torch.device):
    torch.manual_seed(0)
    ck = checkpoint_fn(variant)
    w = _x(D, device=device)
    x = _x(4, D, device=device)
    inner = Counted(lambda h: F.dropout(h.sin() * w, 0.3, training=True).cos())

    def outer_fn(x):
        h = (x * 2).tanh()
        return ck(inner, h).exp() * h

    outer = Counted(outer_fn)
    with maybe_autocast(autocast, device):
        loss = _loss(ck(outer, x), device)
    loss.backward()
    return grads([x, w]), outer.calls, inner.calls


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_nested_checkpoints(autocast: bool, device: torch.device) -> None:
    g_plain, *_ = _nested_run("plain", autocast, device)
    g_torch, outer_t, inner_t = _nested_run("torch", autocast, device)
    g_ck, outer_c, inner_c = _nested_run("ckptfx", autocast, device)
    assert_bitwise(g_ck, g_plain)
    assert_bitwise(g_torch, g_plain, "torch's gradient")
    assert (outer_t, inner_t) == (2, 3)  # the reference, measured
    assert (outer_c, inner_c) == (outer_t, inner_t)


# -- selective activation checkpointing (torch's SAC contexts through context_fn) ----------


def _save_mm_policy(ctx, op, *args, **kwargs):
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return torch_checkpoint.CheckpointPolicy.MUST_SAVE
    return torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE


def _prefer_save_policy(ctx, op, *args, **kwargs):
    return (torch_checkpoint.CheckpointPolicy.PREFER_SAVE
            if op is torch.ops.aten.sin.default
            else torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE)


SAC_POLICIES = {
    "save_mm_fn": _save_mm_policy,
    "save_mm_list": [torch.ops.aten.mm.default, torch.ops.aten.addmm.default],
    "prefer_save_sin": _prefer_save_policy,
}


class _OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts ATen ops that actually run (SAC-cached ones never reach this mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _sac_run(variant: str, policy: Any, autocast: bool, device: torch.device):
    torch.manual_seed(0)
    lin1, lin2 = nn.Linear(D, 2 * D).to(device), nn.Linear(2 * D, D).to(device)
    x = _x(4, D, device=device)
    block = Counted(lambda x: lin2(F.dropout(lin1(x).sin(), 0.2, training=True)).relu())
    opts = {}
    if policy is not None:
        opts["ckpt_context_fn"] = functools.partial(
            torch_checkpoint.create_selective_checkpoint_contexts, policy)
    with maybe_autocast(autocast, device):
        loss = _loss(run_variant(variant, block, x, **opts), device)
    with _OpCounter() as ops:
        loss.backward()
    return grads([x, *lin1.parameters(), *lin2.parameters()]), block.calls, ops.counts


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("policy", list(SAC_POLICIES))
def test_selective_checkpoint_policies(policy: str, autocast: bool,
                                       device: torch.device) -> None:
    g_plain, _, _ = _sac_run("plain", None, autocast, device)
    g_torch, calls_t, ops_t = _sac_run("torch", SAC_POLICIES[policy], autocast, device)
    g_ck, calls_c, ops_c = _sac_run("ckptfx", SAC_POLICIES[policy], autocast, device)
    _, _, ops_full = _sac_run("ckptfx", None, autocast, device)
    assert_bitwise(g_ck, g_plain)
    assert_bitwise(g_torch, g_plain, "torch's gradient")
    assert calls_c == calls_t == 2
    assert ops_c == ops_t  # the same ops recomputed, the same ones served from the cache
    saved_op = "aten.sin" if policy == "prefer_save_sin" else (
        "aten.addmm" if "aten.addmm" in ops_full else "aten.mm")
    assert ops_c.get(saved_op, 0) < ops_full[saved_op]  # the policy did save something


def test_selective_checkpoint_second_backward_same_error_as_torch(
        device: torch.device) -> None:
    # Each SAC cache entry is single-use: a retain_graph second backward is refused alike.
    errors = {}
    for variant in ("torch", "ckptfx"):
        torch.manual_seed(0)
        lin = nn.Linear(D, D).to(device)
        x = _x(4, D, device=device)
        ctx_fn = functools.partial(torch_checkpoint.create_selective_checkpoint_contexts,
                                   _save_mm_policy)
        loss = run_variant(variant, lambda x: lin(x).sin(), x, ckpt_context_fn=ctx_fn).sum()
        loss.backward(retain_graph=True)
        with pytest.raises(RuntimeError) as info:
            loss.backward()
        errors[variant] = info
    assert type(errors["ckptfx"].value) is type(errors["torch"].value)
    assert "backward an extra time" in str(errors["ckptfx"].value)


def _unsafe_view_write(x, w1, w2):
    # With a 3-D x, matmul is mm + aten._unsafe_view: t shares the cached mm output's storage
    # but not its version counter, so torch's mutation check cannot see the add_.
    t = torch.tanh(x @ w1) @ w2
    t.add_(1.5)
    return t.sin()


def _view_write(x, w1, w2):
    t = torch.tanh(x @ w1) @ w2
    t.view(-1)[:3].mul_(2.0)  # a write through a view of the cached value
    return t.sin() @ w1


def _cached_inplace_op(x, w1, w2):
    t = x @ w1
    t.add_(torch.ones_like(t))  # the policy caches this add_ itself
    return t.sin() @ w2


_MM = [torch.ops.aten.mm.default]

SAC_WRITES = {
    # name: (block, the ops the SAC policy caches, what torch 2.13's checkpoint does with a
    # 3-D x, and with a 2-D x)
    "unsafe_view_write": (_unsafe_view_write, _MM, "wrong", "refused"),
    "view_write": (_view_write, _MM, "wrong", "refused"),
    "cached_inplace_op": (_cached_inplace_op, _MM + [torch.ops.aten.add_.Tensor], "refused",
                          "refused"),
}


def _sac_write_run(variant: str, block: Any, ops: list, x_dims: int, early_stop: bool,
                   device: torch.device) -> Any:
    """Gradients of ``block`` (or the RuntimeError text) with a [2, 3, 5] or [6, 5] x, under
    a SAC context_fn that caches ``ops``, early stop as given."""
    torch.manual_seed(0)
    x = _x(*((2, 3, 5) if x_dims == 3 else (6, 5)), device=device)
    w1, w2 = _x(5, 5, device=device), _x(5, 5, device=device)
    ctx_fn = functools.partial(torch_checkpoint.create_selective_checkpoint_contexts, ops)
    with torch_checkpoint.set_checkpoint_early_stop(early_stop):  # torch's global; ckptfx's
        out = run_variant(variant, block, x, w1, w2,              # per call, below
                          **({} if variant == "plain" else {"ckpt_context_fn": ctx_fn}),
                          **({"ckpt_early_stop": early_stop} if variant == "ckptfx" else {}))
    try:
        return torch.autograd.grad(_loss(out, device), [x, w1, w2])
    except RuntimeError as err:
        return str(err)


@pytest.mark.parametrize("early_stop", [True, False])
@pytest.mark.parametrize("x_dims", [3, 2])
@pytest.mark.parametrize("name", list(SAC_WRITES))
def test_selective_checkpoint_value_written_later_in_the_block_is_recomputed(
        name: str, x_dims: int, early_stop: bool, device: torch.device) -> None:
    """A value torch's SAC contexts cached and the block then writes in place (through
    matmul's _unsafe_view, a view, or the cached op itself) is recomputed by the replay:
    ckptfx's gradients are plain autograd's, bit for bit. torch's replay hands the written
    value out (wrong gradients with a 3-D x, where the write escapes its version check) or
    refuses it ("has been mutated")."""
    block, ops, torch_3d, torch_2d = SAC_WRITES[name]
    g_plain = _sac_write_run("plain", block, ops, x_dims, early_stop, device)
    g_ck = _sac_write_run("ckptfx", block, ops, x_dims, early_stop, device)
    assert not isinstance(g_ck, str), g_ck
    assert_bitwise(g_ck, g_plain)
    g_torch = _sac_write_run("torch", block, ops, x_dims, early_stop, device)
    if (torch_3d if x_dims == 3 else torch_2d) == "wrong":
        assert any(not torch.equal(a, b) for a, b in zip(g_torch, g_plain))
    else:
        assert "cached during selective activation checkpoint has been mutated" in g_torch


@pytest.mark.parametrize("x_dims", [3, 2])
def test_selective_checkpoint_output_written_after_the_forward_is_recomputed(
        x_dims: int, device: torch.device) -> None:
    """The block's output aliases a cached mm output and the caller writes it after the
    forward: the replay recomputes the mm, so the gradients are those of the forward as it
    ran, as without SAC (plain autograd refuses the write: the output was saved)."""

    def block(x, w1, w2):
        t = torch.tanh(x @ w1) @ w2  # the cached mm output, as t
        return t, torch.tanh(t @ w1)

    results = []
    for variant, sac, write in (("plain", False, False), ("ckptfx", True, True),
                                ("ckptfx", False, True)):
        torch.manual_seed(0)
        x = _x(*((2, 3, 5) if x_dims == 3 else (6, 5)), device=device)
        w1, w2 = _x(5, 5, device=device), _x(5, 5, device=device)
        opts = {"ckpt_context_fn": functools.partial(
            torch_checkpoint.create_selective_checkpoint_contexts,
            [torch.ops.aten.mm.default])} if sac else {}
        t, u = run_variant(variant, block, x, w1, w2, **opts)
        if write:
            with torch.no_grad():
                t.mul_(3.0)
        results.append(torch.autograd.grad(_loss(u, device), [x, w1, w2]))
    assert_bitwise(results[1], results[0])
    assert_bitwise(results[2], results[0])


def test_checkpoint_wrapper_sac_context_fn_recomputes_a_written_cache() -> None:
    """checkpoint_wrapper's context_fn goes the same way as checkpoint's (3-D x, the write
    through _unsafe_view)."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1, self.w2 = nn.Parameter(torch.randn(5, 5)), nn.Parameter(torch.randn(5, 5))

        def forward(self, x):
            return _unsafe_view_write(x, self.w1, self.w2)

    grads_of = {}
    for wrapped in (False, True):
        torch.manual_seed(0)
        block = Block()
        if wrapped:
            ckptfx.checkpoint_wrapper(block, context_fn=functools.partial(
                torch_checkpoint.create_selective_checkpoint_contexts, _MM))
        x = torch.randn(2, 3, 5, requires_grad=True)
        grads_of[wrapped] = torch.autograd.grad(block(x).sum(), [x, *block.parameters()])
    assert_bitwise(grads_of[True], grads_of[False])


def test_selective_checkpoint_without_writes_keeps_what_torch_keeps(device: torch.device
                                                                   ) -> None:
    """The write watch leaves an untouched cache alone: the replay serves every mm from it,
    as torch's does."""
    counts = {}
    for variant in ("torch", "ckptfx"):
        torch.manual_seed(0)
        x, w = _x(2, 3, D, device=device), _x(D, D, device=device)
        ctx_fn = functools.partial(torch_checkpoint.create_selective_checkpoint_contexts,
                                   [torch.ops.aten.mm.default])
        out = run_variant(variant, lambda x: torch.tanh(torch.tanh(x @ w) @ w).sum(), x,
                          ckpt_context_fn=ctx_fn)
        with _OpCounter() as ops:
            out.backward()
        counts[variant] = ops.counts
    assert counts["ckptfx"] == counts["torch"]
    assert counts["ckptfx"]["aten.mm"] == 4  # the backward's own: no mm replayed


# -- checkpoint_wrapper ---------------------------------------------------------------------


class GatedBlock(nn.Module):
    """A pre-norm residual MLP whose forward takes a keyword-only ``gate`` (the wrapper passes
    keyword arguments through), its MLP an ``nn.Sequential`` (``ff``) whose runs a test counts."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.ff = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Dropout(0.1),
                                nn.Linear(2 * D, D))

    def forward(self, x: torch.Tensor, *, gate: torch.Tensor | None = None) -> torch.Tensor:
        y = self.ff(self.norm(x))
        return x + (y if gate is None else y * gate)


def _wrapper_run(variant: str, autocast: bool, device: torch.device):
    torch.manual_seed(0)
    model = nn.Sequential(GatedBlock(), GatedBlock()).to(device)
    names_before = [n for n, _ in model.named_parameters()]
    keys_before = list(model.state_dict())
    if variant == "ckptfx":
        for block in model:
            ckptfx.checkpoint_wrapper(block)
        assert [n for n, _ in model.named_parameters()] == names_before
        assert list(model.state_dict()) == keys_before
        assert all(isinstance(b, GatedBlock) for b in model)
    x = _x(4, D, device=device)
    gate = _x(D, device=device)
    with maybe_autocast(autocast, device):
        h = x
        for block in model:
            if variant == "torch":
                h = torch_checkpoint.checkpoint(block, h, use_reentrant=False, gate=gate)
            else:
                h = block(h, gate=gate)
        loss = _loss(h, device)
    loss.backward()
    return grads([x, gate, *model.parameters()])


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_checkpoint_wrapper(autocast: bool, device: torch.device) -> None:
    g_plain = _wrapper_run("plain", autocast, device)
    g_torch = _wrapper_run("torch", autocast, device)
    g_ck = _wrapper_run("ckptfx", autocast, device)
    assert_bitwise(g_ck, g_plain)
    assert_bitwise(g_torch, g_plain, "torch's gradient")


def test_checkpoint_wrapper_replays_once_per_backward(device: torch.device) -> None:
    torch.manual_seed(0)
    block = GatedBlock().to(device)
    calls = Counted(lambda: None)
    block.register_forward_pre_hook(lambda m, a: calls())  # runs on the wrapper's call only
    inner_calls = Counted(block.ff.forward)
    block.ff.forward = inner_calls
    ckptfx.checkpoint_wrapper(block)
    block(_x(4, D, device=device)).sum().backward()
    assert calls.calls == 1  # module hooks are not re-run by the replay
    assert inner_calls.calls == 2  # the forward ran, then one replay
    ckptfx.unwrap_checkpoint(block)
    assert type(block) is GatedBlock
    block(_x(4, D, device=device)).sum().backward()
    assert inner_calls.calls == 3


def test_early_stop_exact_under_a_user_dispatch_mode(device: torch.device) -> None:
    """A dispatch mode active during backward (a FLOP counter, a profiler) runs torch calls
    inside each op; the stop must still wait for rrelu to fill its saved noise."""
    g_plain = run_case("rrelu_last", "plain", False, device)[0]
    torch.manual_seed(0)
    fn, args, kwargs, leaves = CASES["rrelu_last"](checkpoint_fn("ckptfx"), device)
    out = ckptfx.checkpoint(fn, *args, **kwargs)
    loss = _loss(out, device)
    with _OpCounter():
        loss.backward()
    assert_bitwise(grads(leaves), g_plain)
