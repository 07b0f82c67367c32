"""ckptfx.remat: exact gradients under every policy, pytrees, static args, modules,
torch.func.functional_call, replay mechanics (kept values and residuals written in place,
frames freed with or without a backward), sessions, nesting, early stop, bad input."""

from __future__ import annotations

import dataclasses
import gc
import inspect
import os
import weakref
from collections import namedtuple
from typing import Any, Callable

import optree
import pytest
import torch
import torch.nn.functional as F
from torch import nn
import torch.utils.checkpoint as tcp
from torch.utils.checkpoint import CheckpointPolicy
from torch.utils._python_dispatch import TorchDispatchMode

import ckptfx
from ckptfx import checkpoint_policies as cp

from conftest import (Counted, OpCounter, assert_bitwise, grads, input_grads,
                      maybe_autocast)

pytestmark = pytest.mark.usefixtures("no_hooks_left_behind")
aten = torch.ops.aten


def torch_sac_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """A torch selective-checkpoint policy function, passed to remat unchanged."""
    if op in (aten.mm.default, aten.addmm.default, aten.bmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


POLICIES = {
    "none": None,
    "nothing": cp.nothing_saveable,
    "everything": cp.everything_saveable,
    "dots": cp.dots_saveable,
    "checkpoint_dots": cp.checkpoint_dots,
    "dots_no_batch": cp.dots_with_no_batch_dims_saveable,
    "only_names": cp.save_only_these_names("h", "attn"),
    "any_names_but": cp.save_any_names_but_these("h"),
    "both": cp.save_from_both_policies(cp.dots_with_no_batch_dims_saveable,
                                       cp.save_only_these_names("attn")),
    "save_and_offload": cp.save_and_offload_only_these_names(
        names_which_can_be_saved=["h"], names_which_can_be_offloaded=["attn", "g"]),
    "offload_dots": cp.offload_dot_with_no_batch_dims(),
    "torch_sac": torch_sac_policy,
}


# -- blocks ---------------------------------------------------------------------------------


def mlp(params: dict[str, torch.Tensor], x: torch.Tensor, act: nn.Module) -> torch.Tensor:
    h = ckptfx.checkpoint_name(act(x @ params["w1"] + params["b1"]), "h")
    h = F.dropout(h, p=0.3, training=True)
    g = ckptfx.checkpoint_name(torch.tanh(h @ params["w2"]), "g")
    return g * x


class Attention(nn.Module):
    """q/k/v Linears, batched matmul attention, softmax, dropout."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def block(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        s = torch.matmul(q, k.transpose(-1, -2)) / q.shape[-1] ** 0.5
        a = ckptfx.checkpoint_name(F.dropout(torch.softmax(s, -1), 0.2, training=True), "attn")
        return F.gelu(self.o(torch.bmm(a, v))) + x


def mlp_params(d: int = 6, h: int = 10) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w1": torch.randn(d, h, generator=g, requires_grad=True),
            "b1": torch.randn(h, generator=g, requires_grad=True),
            "w2": torch.randn(h, d, generator=g, requires_grad=True)}


def run(fn: Any, leaves: list[torch.Tensor], *args: Any, seed: int = 7,
        autocast: bool = False) -> list[torch.Tensor | None]:
    """Forward + backward from a fixed RNG seed; the gradients of ``leaves``."""
    for t in leaves:
        t.grad = None
    torch.manual_seed(seed)
    with maybe_autocast(autocast):
        out = fn(*args)
    (out.float() * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return grads(leaves)


def line_of(fn: Any, text: str) -> str:
    """``file:line (function)`` of the line of ``fn``'s source that contains ``text``."""
    lines, first = inspect.getsourcelines(fn)
    (n,) = [i for i, line in enumerate(lines) if text in line]
    return f"{os.path.basename(inspect.getsourcefile(fn))}:{first + n} ({fn.__name__})"


def segment_of(fn: Any, *args: Any) -> tuple[Any, Any]:
    """Run a remat'd ``fn`` under a collector: (output, the Segment of its frame)."""
    with ckptfx.recompute_handle_collector_ctx() as handles:
        out = fn(*args)
    assert len(handles) == 1
    return out, handles[0].frame.rerun.__self__


# -- gradients under every policy ------------------------------------------------------------


# POLICIES name the values of both blocks (mlp's "h"/"g", Attention's "attn"): each block warns
# once about the other's names, which is not what these tests are about.
@pytest.mark.filterwarnings("ignore::ckptfx.UnusedNameWarning")
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("act", ["gelu", "rrelu"])
@pytest.mark.parametrize("policy", list(POLICIES), ids=list(POLICIES))
def test_mlp_gradients_bitwise_under_every_policy(policy: str, act: str, autocast: bool) -> None:
    params = mlp_params()
    x = torch.randn(4, 6, requires_grad=True)
    module = nn.GELU() if act == "gelu" else nn.RReLU()
    leaves = [*params.values(), x]
    expected = run(mlp, leaves, params, x, module, autocast=autocast)
    block = ckptfx.remat(mlp, policy=POLICIES[policy], static_argnums=2)
    assert_bitwise(run(block, leaves, params, x, module, autocast=autocast), expected)


# POLICIES name the values of both blocks (mlp's "h"/"g", Attention's "attn"): each block warns
# once about the other's names, which is not what these tests are about.
@pytest.mark.filterwarnings("ignore::ckptfx.UnusedNameWarning")
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("policy", list(POLICIES), ids=list(POLICIES))
def test_attention_gradients_bitwise_under_every_policy(policy: str, autocast: bool) -> None:
    torch.manual_seed(0)
    attn = Attention()
    x = torch.randn(2, 5, 8, requires_grad=True)
    leaves = [*attn.parameters(), x]
    expected = run(attn.block, leaves, x, autocast=autocast)
    block = ckptfx.remat(attn.block, policy=POLICIES[policy])
    assert_bitwise(run(block, leaves, x, autocast=autocast), expected)


# Found in review of the fix for frames leaked by kept outputs (was test_review_regressions.py).
def test_everything_saveable_still_exact_with_dropout_and_bf16():
    # The detached residuals of the leak fix must not change any gradient.
    torch.manual_seed(0)
    x0, w0 = torch.randn(4, 8), torch.randn(8, 8)

    def block(x, w):
        h = torch.nn.functional.dropout((x @ w).relu(), 0.3, training=True)
        return torch.softmax(h @ w, dim=-1).tanh()

    def run(fn):
        x = x0.clone().requires_grad_()
        w = w0.clone().requires_grad_()
        torch.manual_seed(7)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn(x, w)
        return torch.autograd.grad(out.float().sum(), [x, w])

    ref = run(block)
    got = run(ckptfx.remat(block, policy=cp.everything_saveable))
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


# -- pytrees, static args, modules, functional_call ------------------------------------------

Pair = namedtuple("Pair", ["a", "b"])


@dataclasses.dataclass
class State:
    h: torch.Tensor
    scale: float


# A registered dataclass: ``h`` is a child, ``scale`` static metadata (global namespace,
# which is what remat flattens with).
optree.register_pytree_node(
    State, lambda s: ((s.h,), s.scale, ("h",)),
    lambda scale, children: State(children[0], scale),
    namespace=getattr(optree.registry, "__GLOBAL_NAMESPACE"),
)


def test_pytree_inputs_and_outputs_bitwise() -> None:
    w = torch.randn(5, 5, requires_grad=True)
    x = torch.randn(3, 5, requires_grad=True)
    y = torch.randn(3, 5, requires_grad=True)
    z = torch.randn(3, 5, requires_grad=True)
    counter = Counted(lambda inp: {
        "pair": Pair(torch.relu(inp["xs"][0] @ w), inp["xs"][1].sin() * inp["state"].scale),
        "list": [inp["state"].h.exp(), 3],
        "state": State(torch.tanh(inp["state"].h @ w), inp["state"].scale),
    })

    def loss(out: Any) -> torch.Tensor:
        return (out["pair"].a.sum() + out["pair"].b.sum() * 2 + out["list"][0].sum()
                + out["state"].h.sum() * out["list"][1])

    inp = {"xs": [x, y], "state": State(z, 0.5)}
    loss(counter(inp)).backward()
    expected = grads([w, x, y, z])
    for t in (w, x, y, z):
        t.grad = None
    out = ckptfx.remat(counter, policy=cp.dots_saveable)(inp)
    assert isinstance(out["pair"], Pair) and isinstance(out["state"], State)
    assert out["list"][1] == 3 and out["state"].scale == 0.5
    loss(out).backward()
    assert_bitwise(grads([w, x, y, z]), expected)
    assert counter.calls == 2  # plain + remat forward; the replay is the recorded segment


def test_static_argnums_and_argnames() -> None:
    x = torch.randn(4, 4, requires_grad=True)

    def f(x: torch.Tensor, n: int, *, mode: str) -> torch.Tensor:
        for _ in range(n):
            x = torch.relu(x @ x.T) if mode == "relu" else torch.tanh(x @ x.T)
        return x

    block = ckptfx.remat(f, static_argnums=(1,), static_argnames=("mode",))
    for n, mode in ((2, "relu"), (3, "tanh")):
        f(x, n, mode=mode).sum().backward()
        expected = grads([x])
        x.grad = None
        block(x, n, mode=mode).sum().backward()
        assert_bitwise(grads([x]), expected)
        x.grad = None


def test_module_forward_decorated_with_remat() -> None:
    class RematForwardBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(6, 12), nn.Linear(12, 6)
            self.calls = 0

        @ckptfx.remat(policy=cp.dots_saveable)
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return self.fc2(F.dropout(torch.relu(self.fc1(x)), 0.25))

    torch.manual_seed(0)
    m = RematForwardBlock()
    x = torch.randn(3, 6, requires_grad=True)
    leaves = [*m.parameters(), x]
    expected = run(RematForwardBlock.forward.__wrapped__.__get__(m), leaves, x)
    got = run(m, leaves, x)
    assert_bitwise(got, expected)
    assert m.calls == 2  # one plain, one remat forward; the backward replays the segment


def test_functional_call_of_module_with_remat_blocks() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
            self.block = ckptfx.remat(self._block, policy=cp.dots_saveable)

        def _block(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.b(torch.relu(self.a(x))))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.block(self.block(x))

    torch.manual_seed(0)
    net = Net()
    params = {k: v.detach().clone().requires_grad_() for k, v in net.named_parameters()}
    x = torch.randn(3, 6, requires_grad=True)
    leaves = [*params.values(), x]

    def plain(x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(net, params, (x,))

    net.block = net._block
    expected = run(plain, leaves, x)
    net.block = ckptfx.remat(net._block, policy=cp.dots_saveable)
    with ckptfx.recompute_handle_collector_ctx() as handles:
        got = run(plain, leaves, x)
    assert len(handles) == 2  # both calls were remat frames, not run plainly
    assert_bitwise(got, expected)


# -- replay mechanics ------------------------------------------------------------------------


def test_segment_replay_is_used_not_the_function() -> None:
    params = mlp_params()
    x = torch.randn(4, 6, requires_grad=True)
    leaves = [*params.values(), x]
    expected = run(mlp, leaves, params, x, nn.GELU())
    counted = Counted(mlp)
    out, seg = segment_of(ckptfx.remat(counted, static_argnums=2), params, x, nn.GELU())
    assert seg.replayable, seg.why_not
    for t in leaves:
        t.grad = None
    torch.manual_seed(7)
    out, seg = segment_of(ckptfx.remat(counted, static_argnums=2), params, x, nn.GELU())
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    assert_bitwise(grads(leaves), expected)
    assert counted.calls == 2  # the two forwards above; no replay re-ran the function
    assert seg.last_plan > 0


def _numpy_filled(x: torch.Tensor, w: torch.Tensor, calls: list[int]) -> torch.Tensor:
    calls[0] += 1
    buf = torch.empty(x.shape[0], w.shape[1])
    buf.numpy()[:] = torch.arange(w.shape[1], dtype=torch.float32).numpy()  # outside ATen
    return torch.tanh(x @ w) * buf


@pytest.mark.parametrize("early_stop", [True, False])
def test_not_replayable_block_reruns_the_function_exactly(early_stop: bool) -> None:
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, 5, requires_grad=True)
    calls = [0]
    _numpy_filled(x, w, calls).sum().backward()
    expected = grads([x, w])
    x.grad = w.grad = None
    calls = [0]
    block = ckptfx.remat(_numpy_filled, static_argnums=2, early_stop=early_stop)
    out, seg = segment_of(block, x, w, calls)
    assert not seg.replayable and "Tensor.numpy()" in seg.why_not  # its memory escaped
    out.sum().backward()
    assert calls[0] == 2  # forward + one re-run of the function
    assert_bitwise(grads([x, w]), expected)


def test_in_place_write_to_an_input_is_never_silently_wrong() -> None:
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return torch.relu(x @ w)

    w = torch.randn(4, 5, requires_grad=True)
    x0 = torch.randn(3, 4)
    out, seg = segment_of(ckptfx.remat(f), x0.clone(), w)
    assert not seg.replayable and "in place" in seg.why_not
    # The same error as torch.utils.checkpoint: the input the replay needs was overwritten.
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.utils.checkpoint.checkpoint(f, x0.clone(), w, use_reentrant=False).sum().backward()


def _output_and_grads(fn, x0, w0):
    x = x0.clone().requires_grad_()
    w = w0.clone().requires_grad_()
    out = fn(x, w)
    return out.detach(), torch.autograd.grad(out.sum(), [x, w])


def _transpose_inplace_block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # The matmul output is kept by dots_saveable because the replay of exp's output reads
    # it; it is then rewritten in place. The kept value must be the pre-write one (or none).
    h = x @ w
    h2 = h.T.contiguous()
    h2.t_()
    h.add_(h2)
    return h.exp()


# Found in review of remat's kept values written in place (was test_review_regressions.py).
@pytest.mark.parametrize("policy", [None, cp.dots_saveable, cp.everything_saveable])
def test_value_kept_for_replay_then_rewritten_in_place(policy):
    # Bug: the tracer detached held values inside the dispatch mode, where the alias gets its
    # own version counter, so "not rewritten since" always held and the replay read (and
    # wrote into) the rewritten tensor: gradients off by ~1e9.
    torch.manual_seed(0)
    x0, w0 = torch.randn(4, 6), torch.randn(6, 6)
    ref_out, ref = _output_and_grads(_transpose_inplace_block, x0, w0)
    out, got = _output_and_grads(ckptfx.remat(_transpose_inplace_block, policy=policy), x0, w0)
    assert torch.equal(out, ref_out)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


# Found in review of remat's kept values written in place (was test_review_regressions.py).
def test_kept_output_modified_after_forward_is_recomputed_not_read():
    # Bug: a value kept for the replay (dots_saveable keeps the matmul output that relu's
    # replay reads) that the caller then modifies in place was silently read by the replay.
    # It is recomputed from the inputs instead: plain autograd, which never saved it (relu
    # saves its output), is not affected by the write either.
    def block(x, w):
        h = x @ w
        return h, h.relu()

    x = torch.randn(4, 6, requires_grad=True)
    w = torch.randn(6, 6, requires_grad=True)
    got = []
    for fn in (block, ckptfx.remat(block, policy=cp.dots_saveable)):
        h, r = fn(x, w)
        with torch.no_grad():
            h.add_(5)
        got.append(torch.autograd.grad(r.sum(), [x, w]))
    assert all(torch.equal(a, b) for a, b in zip(*got))


# Found in review of remat's saved residuals written in place (was test_review_regressions.py).
def test_saved_residual_modified_after_forward_raises_like_autograd():
    # Bug: saved-tensor hooks switch off autograd's version check; a residual kept by
    # everything_saveable and modified in place was handed to the backward silently.
    def block(x, w):
        return (x @ w).exp()

    x = torch.randn(4, 6, requires_grad=True)
    w = torch.randn(6, 6, requires_grad=True)
    plain = block(x, w)
    plain.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(plain.sum(), [x, w])
    out = ckptfx.remat(block, policy=cp.everything_saveable)(x, w)
    out.mul_(2)
    with pytest.raises(ckptfx.CheckpointError, match="modified in place"):
        torch.autograd.grad(out.sum(), [x, w])


# A 3-D matmul is mm + _unsafe_view: the view shares the mm's storage but not its version
# counter, so an in-place write through it must not leave the kept mm looking intact.
X3 = torch.randn(2, 4, 6, generator=torch.Generator().manual_seed(1))
W = torch.randn(6, 6, generator=torch.Generator().manual_seed(2))


def _add_after_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    a = x @ w
    a.add_(w[0])
    return (a @ w).tanh()


def _write_slice_after_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    a = x @ w
    a[..., :3].mul_(w[0, :3])
    return (a @ w).tanh()


def _write_unsafe_chunk(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    a = x @ w
    p, _ = torch.unsafe_chunk(a, 2, dim=-1)
    p.mul_(2.0)
    return (a @ w).tanh()


# Found in review of remat's trace of matmul aliases (was test_review_regressions_2.py).
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fn", [_add_after_matmul, _write_slice_after_matmul,
                                _write_unsafe_chunk])
def test_remat_kept_mm_rewritten_through_matmul_alias(fn: Callable[..., torch.Tensor],
                                                      amp: bool) -> None:
    r = ckptfx.remat(fn, policy=cp.dots_saveable)
    ref = input_grads(fn, [X3, W], amp)
    got = input_grads(r, [X3, W], amp)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


def _relu_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return torch.relu(torch.relu(x @ w1) @ w2) @ w1.T


def test_dots_saveable_replays_fewer_ops_and_no_matmul() -> None:
    x = torch.randn(4, 6, requires_grad=True)
    w1 = torch.randn(6, 8, requires_grad=True)
    w2 = torch.randn(8, 8, requires_grad=True)
    plans, backward_mms = {}, {}
    with OpCounter() as plain_ops:
        out = _relu_mlp(x, w1, w2)
    with OpCounter() as plain_bwd:
        out.sum().backward()
    for name, policy in (("nothing", cp.nothing_saveable), ("dots", cp.dots_saveable)):
        out, seg = segment_of(ckptfx.remat(_relu_mlp, policy=policy), x, w1, w2)
        with OpCounter() as bwd:
            out.sum().backward()
        plans[name] = seg.last_plan
        backward_mms[name] = bwd.counts.get("mm", 0)
    assert 0 < plans["dots"] < plans["nothing"]
    # Saved matmul outputs are not recomputed: the backward runs only its own matmuls.
    assert backward_mms["dots"] == plain_bwd.counts["mm"]
    assert backward_mms["nothing"] == plain_bwd.counts["mm"] + 2  # two matmuls replayed
    assert plain_ops.counts["mm"] == 3


def test_frame_and_segment_are_freed_with_the_graph() -> None:
    x = torch.randn(4, 6, requires_grad=True)
    w1 = torch.randn(6, 8, requires_grad=True)
    w2 = torch.randn(8, 8, requires_grad=True)
    out, seg = segment_of(ckptfx.remat(_relu_mlp, policy=cp.dots_saveable), x, w1, w2)
    assert seg.single_use  # kept matmul outputs live on the segment
    kept = weakref.ref(seg.single_use[0].tensor)
    seg_ref = weakref.ref(seg)
    del out, seg
    gc.collect()
    assert seg_ref() is None and kept() is None


# Found in review of remat's frames dropped without a backward (was test_review_regressions.py).
@pytest.mark.parametrize("policy", [cp.everything_saveable, cp.dots_saveable, None])
def test_graph_dropped_without_backward_frees_frame(policy):
    # Bug: a kept output of an op that saves its own output (relu, exp) held its autograd
    # node through the packed tensor: a cycle through the C++ graph that gc cannot break,
    # so every graph dropped without a backward leaked with all its activations.
    w = torch.randn(8, 8, requires_grad=True)

    def block(x):
        return (x @ w).relu().exp().sin()

    x = torch.randn(4, 8, requires_grad=True)
    with ckptfx.recompute_handle_collector_ctx() as handles:
        out = ckptfx.remat(block, policy=policy)(x)
    assert len(handles) == 1 and handles[0].frame is not None
    del out
    gc.collect()
    assert handles[0].frame is None


def _dropout_relu_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return torch.relu(F.dropout(x @ w1, 0.5) @ w2) @ w1.T


@pytest.mark.parametrize("block", [_relu_mlp, _dropout_relu_mlp])
def test_values_kept_only_for_the_replay_are_single_use(block: Any) -> None:
    """A matmul output kept only because the replay reads it (relu saves its own output,
    dropout its mask) is let go by the first replay; a second backward (retain_graph)
    recomputes it, with the same dropout mask: bitwise the plain gradients both times."""
    x = torch.randn(4, 6, requires_grad=True)
    w1 = torch.randn(6, 8, requires_grad=True)
    w2 = torch.randn(8, 8, requires_grad=True)
    torch.manual_seed(5)
    out = block(x, w1, w2)
    expected = torch.autograd.grad(out.sum(), [x, w1, w2])
    torch.manual_seed(5)
    out, seg = segment_of(ckptfx.remat(block, policy=cp.dots_saveable), x, w1, w2)
    assert seg.single_use and not seg.extra
    kept = [weakref.ref(k.tensor) for k in seg.single_use]
    loss = out.sum()
    with OpCounter() as first:
        g1 = torch.autograd.grad(loss, [x, w1, w2], retain_graph=True)
    plan_first = seg.last_plan
    gc.collect()
    assert not seg.single_use and all(r() is None for r in kept)  # freed, the graph alive
    with OpCounter() as second:
        g2 = torch.autograd.grad(loss, [x, w1, w2])
    assert seg.last_plan > plan_first  # the second replay rebuilt them from the inputs
    assert second.counts["mm"] > first.counts["mm"]
    assert_bitwise(g1, expected)
    assert_bitwise(g2, expected)


def _explicit_generators(x: torch.Tensor, g: torch.Generator, replayable: bool) -> torch.Tensor:
    mask = torch.bernoulli(torch.full_like(x, 0.5), generator=g)  # generator= by keyword
    counts = torch.poisson(x.detach().exp() * 3, g)  # ... and positionally, in its schema
    h = (x.sin() * mask).cos() * counts
    if not replayable:
        buf = torch.empty(h.shape[-1])
        buf.numpy()[:] = 0.5  # filled outside ATen: the replay re-runs the function
        h = h * buf
    return h.tanh().sum()


@pytest.mark.parametrize("transform, replayable", [
    ("autograd", True), ("autograd", False),
    ("torch.func.grad", True),  # that path re-runs the function in its backward anyway
], ids=["recorded", "rerun", "torch.func"])
def test_explicit_generators_replay_exactly(transform: str, replayable: bool) -> None:
    """Ops drawing from a user's torch.Generator replay with the numbers the forward drew
    (torch's checkpoint and ckptfx.checkpoint draw new ones), and the backward leaves the
    generator where the forward left it."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 6, requires_grad=True)
    block = ckptfx.remat(_explicit_generators, static_argnums=(1, 2))
    got = []
    for fn in (_explicit_generators, block):
        g.manual_seed(3)
        if transform == "autograd":
            out = fn(x, g, replayable)
            after_forward = g.get_state()
            got.append(torch.autograd.grad(out, x)[0])
        else:
            got.append(torch.func.grad(fn)(x.detach(), g, replayable))
            after_forward = None
        if after_forward is not None:
            assert torch.equal(g.get_state(), after_forward)  # the replay put it back
    assert_bitwise(got[1:], got[:1])


def test_explicit_generator_under_the_kernel_is_torchs_limit() -> None:
    """Differential: torch's checkpoint and ckptfx.checkpoint both replay a block drawing
    from an explicit generator with the generator's current state (documented; the kernel
    cannot see the op), while remat is exact."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 6, requires_grad=True)
    results = {}
    for name, fn in (("plain", _explicit_generators),
                     ("torch", lambda *a: tcp.checkpoint(_explicit_generators, *a,
                                                         use_reentrant=False)),
                     ("ckptfx.checkpoint", lambda *a: ckptfx.checkpoint(_explicit_generators, *a)),
                     ("remat", ckptfx.remat(_explicit_generators, static_argnums=(1, 2)))):
        g.manual_seed(3)
        results[name] = torch.autograd.grad(fn(x, g, True), x)[0]
    assert torch.equal(results["remat"], results["plain"])
    assert not torch.equal(results["torch"], results["plain"])
    assert not torch.equal(results["ckptfx.checkpoint"], results["plain"])


def test_a_replay_that_raises_raises_again_when_retried() -> None:
    """A replay refused because a tensor from outside the arguments changed is refused again
    when retried: the refusal comes before the replay takes over its single-use values."""
    w = torch.randn(6, 6, requires_grad=True)
    x = torch.randn(4, 6, requires_grad=True)
    out = ckptfx.remat(lambda x: torch.relu(x @ w).sum(), policy=cp.dots_saveable)(x)
    with torch.no_grad():
        w.add_(1)  # a tensor read from outside the arguments, changed before the backward
    for _ in range(2):
        with pytest.raises(ckptfx.CheckpointError, match="modified in place"):
            torch.autograd.grad(out, [x, w], retain_graph=True)


def test_must_save_ops_are_never_run_again() -> None:
    """An op a torch policy marks MUST_SAVE (say, a collective) runs once however many
    replays the block has; a PREFER_SAVE keep only the replay reads may be recomputed."""
    calls = {"must": 0, "prefer": 0}
    doubled = {}
    for kind in calls:
        @torch.library.custom_op(f"ckptfx_test::twice_{kind}", mutates_args=())
        def twice(x: torch.Tensor, kind: str = kind) -> torch.Tensor:
            calls[kind] += 1
            return x * 2

        twice.register_autograd(lambda ctx, g: g * 2)
        doubled[kind] = twice
    x = torch.randn(4, 6, requires_grad=True)
    w = torch.randn(6, 6, requires_grad=True)
    for kind, answer in (("must", CheckpointPolicy.MUST_SAVE),
                         ("prefer", CheckpointPolicy.PREFER_SAVE)):
        op = doubled[kind]

        def policy(ctx: Any, func: Any, *args: Any, op: Any = op, answer: Any = answer,
                   **kwargs: Any) -> Any:
            return answer if func is op._opoverload else CheckpointPolicy.PREFER_RECOMPUTE

        def block(x: torch.Tensor, w: torch.Tensor, op: Any = op) -> torch.Tensor:
            return torch.relu(op(x @ w)).sum()  # relu saves its output: the op's is replay-only

        expected = torch.autograd.grad(block(x, w), [x, w])
        calls[kind] = 0
        out = ckptfx.remat(block, policy=policy)(x, w)
        grads = [torch.autograd.grad(out, [x, w], retain_graph=True),
                 torch.autograd.grad(out, [x, w])]
        for g in grads:
            assert_bitwise(g, expected)
        assert calls[kind] == (1 if kind == "must" else 2), (kind, calls)


# -- sessions --------------------------------------------------------------------------------


def _two_layer(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
               calls: list[int]) -> torch.Tensor:
    calls[0] += 1
    buf = torch.empty(w1.shape[1])
    buf.numpy()[:] = 0.5  # makes the block not replayable: each replay re-runs (and counts)
    return torch.tanh(torch.relu(x @ w1) * buf @ w2)


@pytest.mark.parametrize("replayable", [True, False])
def test_session_prefire_dx_dw_replays_once(replayable: bool) -> None:
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    torch.manual_seed(0)
    w1 = torch.randn(6, 8, requires_grad=True)
    w2 = torch.randn(8, 6, requires_grad=True)
    x = torch.randn(4, 6, requires_grad=True)
    calls = [0]
    fn = _two_layer if not replayable else (
        lambda x, w1, w2, calls: torch.tanh(torch.relu(x @ w1) * 0.5 @ w2))
    fn(x, w1, w2, calls).sum().backward()
    expected = grads([x, w1, w2])
    x.grad = w1.grad = w2.grad = None
    calls = [0]
    block = ckptfx.remat(fn, static_argnums=3)
    with ckptfx.recompute_handle_collector_ctx() as handles:
        out = block(x, w1, w2, calls)
    seg = handles[0].frame.rerun.__self__
    assert seg.replayable is replayable
    loss = out.sum()
    session = "mb0"
    try:
        ckptfx.recompute_handle(handles[0], session)
        plan_after_prefire = seg.last_plan
        with ckptfx.recompute_session_ctx(session, retain_on_unpack=True):
            dx, param_groups = stage_backward_input([loss], None, [x], [w1, w2])
        x.grad = dx[0]
        for i, group in enumerate(param_groups):
            with ckptfx.recompute_session_ctx(session, retain_on_unpack=i < len(param_groups) - 1):
                stage_backward_weight([w1, w2], [group], retain_graph=i < len(param_groups) - 1)
    finally:
        ckptfx.clear_recompute_session(session)
    assert_bitwise(grads([x, w1, w2]), expected)
    if replayable:
        assert plan_after_prefire > 0 and calls[0] == 0
    else:
        assert calls[0] == 2  # forward + the single prefire replay, for dx and both dw


# -- nesting, early stop ---------------------------------------------------------------------


def test_nested_remat_each_block_keeps_by_its_own_policy() -> None:
    inner_calls = [0]

    def inner(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        inner_calls[0] += 1
        u = torch.relu(h @ w)  # inner's own value: recomputed under inner's policy
        return u @ w  # inner's output is a value of outer: kept by outer's dots policy

    inner_r = ckptfx.remat(inner, policy=cp.nothing_saveable)

    def outer(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        h = torch.relu(x @ w1)
        return torch.tanh(inner_r(h, w2))

    x = torch.randn(4, 6, requires_grad=True)
    w1 = torch.randn(6, 8, requires_grad=True)
    w2 = torch.randn(8, 8, requires_grad=True)
    outer(x, w1, w2).sum().backward()
    expected = grads([x, w1, w2])
    x.grad = w1.grad = w2.grad = None
    outer_r = ckptfx.remat(outer, policy=cp.dots_saveable)
    with OpCounter() as fwd:
        out = outer_r(x, w1, w2)
    with OpCounter() as bwd:
        out.sum().backward()
    assert_bitwise(grads([x, w1, w2]), expected)
    # Outer keeps its matmul x@w1 (dots_saveable); the inner block, nothing_saveable, keeps
    # none of its own matmuls: its h@w is replayed in the backward (plain backward: 6 mm).
    assert fwd.counts["mm"] == 3
    assert bwd.counts["mm"] == 6 + 1
    assert inner_calls[0] == 2  # the plain forward and the remat forward; no re-run
    residuals = ckptfx.saved_residuals(outer_r, x, w1, w2)
    saved = sorted(r.source for r in residuals if r.kind != "argument")
    assert saved == sorted([
        f"output of aten.mm at {line_of(inner, 'return u @ w')}",
        f"output of aten.mm at {line_of(outer, 'h = torch.relu')}",
    ])


def test_rrelu_exact_with_early_stop_when_the_function_reruns() -> None:
    act = nn.RReLU()

    def f(x: torch.Tensor, w: torch.Tensor, calls: list[int]) -> torch.Tensor:
        calls[0] += 1
        buf = torch.empty(w.shape[1])
        buf.numpy()[:] = 2.0
        return act(x @ w) * buf  # RReLU saves its noise before filling it

    x = torch.randn(4, 6, requires_grad=True)
    w = torch.randn(6, 8, requires_grad=True)
    expected = run(f, [x, w], x, w, [0])
    calls = [0]
    got = run(ckptfx.remat(f, early_stop=True, static_argnums=2), [x, w], x, w, calls)
    assert calls[0] == 2
    assert_bitwise(got, expected)


# -- bad input -------------------------------------------------------------------------------


def test_policy_not_callable_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="policy"):
        ckptfx.remat(lambda x: x, policy="dots")


def test_static_argnums_out_of_range_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="static_argnums 2"):
        ckptfx.remat(lambda x, n: x * n, static_argnums=2)
    block = ckptfx.remat(lambda *a: a[0] * 2, static_argnums=3)
    with pytest.raises(ValueError, match="static_argnums 3"):
        block(torch.randn(2, requires_grad=True))


def test_replay_frees_each_intermediate_after_its_last_use() -> None:
    """The recorded replay holds a value only until the last op that reads it, as the forward
    did; it does not keep every intermediate alive until the replay ends."""
    seen: dict[str, Any] = {}

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.sin.default:
                seen["sin"] = weakref.ref(out)
            elif func is torch.ops.aten.exp.default:
                seen["sin output alive at exp"] = seen["sin"]() is not None
            return out

    # Saved: x (by sin) and exp's output (by exp and cos); sin's output is read by mul only.
    block = ckptfx.remat(lambda x: (x.sin() * 2).exp().cos())
    x = torch.randn(64, requires_grad=True)
    out = block(x)
    with Watch():
        out.grad_fn._saved_self  # read outside backward: replays the segment (sin, mul, exp)
    assert seen["sin output alive at exp"] is False
    ref = (x.sin() * 2).exp().cos()
    out.sum().backward()
    g = x.grad.clone()
    x.grad = None
    ref.sum().backward()
    assert_bitwise([g], [x.grad])


def test_bad_static_argnums_raise_under_no_grad_too() -> None:
    block = ckptfx.remat(lambda *a: a[0] * 2, static_argnums=3)
    with torch.no_grad(), pytest.raises(ValueError, match="static_argnums 3"):
        block(torch.randn(2))


@pytest.mark.parametrize("transform", ["autograd", "torch.func.grad"])
def test_flat_tensor_call_and_pytree_call_agree(transform: str) -> None:
    """``block(x, w)`` (tensors only: the flat path, no pytree built) and the same block fed
    through a dict (the pytree path) compute the same values and gradients, bitwise."""
    def flat(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.dropout(torch.tanh(x @ w), 0.3).sum()

    flat_block = ckptfx.remat(flat, policy=cp.dots_saveable)
    tree_block = ckptfx.remat(lambda p: flat(p["x"], p["w"]), policy=cp.dots_saveable)
    x, w = torch.randn(4, 5), torch.randn(5, 3)
    results = []
    for fn in (flat, flat_block, lambda x, w: tree_block({"x": x, "w": w})):
        torch.manual_seed(3)
        if transform == "autograd":
            xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
            out = fn(xs, ws)
            out.backward()
            results.append([out.detach(), xs.grad, ws.grad])
        else:
            g, out = torch.func.grad_and_value(fn, argnums=(0, 1))(x, w)
            results.append([out, *g])
    assert_bitwise(results[1], results[0])
    assert_bitwise(results[2], results[0])


def test_static_argnums_pointing_at_a_tensor_is_a_value_error() -> None:
    block = ckptfx.remat(lambda x, y: x * y, static_argnums=1)
    x = torch.randn(2, requires_grad=True)
    with pytest.raises(ValueError, match="static_argnums 1 points at a tensor"):
        block(x, torch.randn(2))
    with pytest.raises(ValueError, match="static_argnames 'y' points at a tensor"):
        ckptfx.remat(lambda x, y: x * y, static_argnames="y")(x, y=torch.randn(2))


@pytest.mark.parametrize("call", ["mm", "@"])
def test_policy_returning_a_non_decision_is_an_error_naming_the_op(call: str) -> None:
    """A CheckpointError, not a TypeError: Tensor.__matmul__ turns a TypeError into Python's
    "unsupported operand type(s) for @", which names neither the policy nor the op."""
    def body(x: torch.Tensor) -> torch.Tensor:
        return (torch.mm(x, x) if call == "mm" else x @ x).sin()

    block = ckptfx.remat(body, policy=lambda ctx, op, *a, **k: "save")
    with pytest.raises(ckptfx.CheckpointError, match="returned 'save' .*aten.mm"):
        block(torch.randn(3, 3, requires_grad=True))
    returns_the_class = ckptfx.remat(body, policy=lambda ctx, op, *a, **k: ckptfx.Offload)
    with pytest.raises(ckptfx.CheckpointError, match=r"call it: ckptfx.Offload\(\)"):
        returns_the_class(torch.randn(3, 3, requires_grad=True))

    def raises(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("my policy's own bug")
    with pytest.raises(ckptfx.CheckpointError, match="raised a TypeError .*my policy's own bug"):
        ckptfx.remat(body, policy=raises)(torch.randn(3, 3, requires_grad=True))


@pytest.mark.parametrize("policy", [ckptfx.Offload, ckptfx.Offload()], ids=["class", "instance"])
def test_an_offload_given_as_the_policy_says_it_is_an_answer(policy: Any) -> None:
    with pytest.raises(TypeError, match="an Offload is what a policy returns for an op"):
        ckptfx.remat(lambda x: x.sin(), policy=policy)
