"""Per-call overhead work: the replay's early stop without its watch where the
forward proves it needless (frame.py Rule 6b), the recorder's flat arguments, dw's contexts.

Speed itself is measured in benchmarks/bench_overhead.py; these tests pin the behaviour the
faster paths must keep: the same replayed ops as torch's checkpoint, bitwise gradients, and
the watch kept wherever the proof is missing."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tcp

import ckptfx
from ckptfx.kernel.last_op import node_never_writes_an_input
from ckptfx.recording.segment import flatten_tree, output_leaves
from conftest import OpCounter, assert_bitwise


def _frame_of(fn, *args):
    with ckptfx.recompute_handle_collector_ctx() as handles:
        out = ckptfx.checkpoint(fn, *args)
    return out, handles[0].frame  # the outermost: collected first


def _backward_ops(fn, x, w) -> dict[str, int]:
    out = fn(x, w)
    with OpCounter() as c:
        torch.autograd.grad(out.sum(), [x, w])
    return c.counts


def _mlp(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x + F.linear(F.gelu(F.linear(x, w)), w).sin().cos() * 0 + F.linear(F.gelu(x), w)


def test_last_op_that_writes_nothing_replays_without_the_watch() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    _, frame = _frame_of(_mlp, x, w)
    assert frame.watch_last_op is False  # the last saving op is addmm: nothing to watch
    # The replay stops where torch's does: the same ops, and the same gradients as plain.
    ours = _backward_ops(lambda a, b: ckptfx.checkpoint(_mlp, a, b), x, w)
    theirs = _backward_ops(lambda a, b: tcp.checkpoint(_mlp, a, b, use_reentrant=False), x, w)
    assert ours == theirs
    expected = torch.autograd.grad(_mlp(x, w).sum(), [x, w])
    assert_bitwise(torch.autograd.grad(ckptfx.checkpoint(_mlp, x, w).sum(), [x, w]), expected)


def test_last_op_filling_a_saved_buffer_keeps_the_watch() -> None:
    # rrelu_with_noise packs its noise, then draws it: the replay must let it finish.
    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.rrelu(F.linear(x, w), training=True)

    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    torch.manual_seed(1)
    expected = torch.autograd.grad(block(x, w).square().sum(), [x, w])
    torch.manual_seed(1)
    out, frame = _frame_of(block, x, w)
    assert frame.watch_last_op is True
    assert_bitwise(torch.autograd.grad(out.square().sum(), [x, w]), expected)


def test_frame_made_inside_the_forward_keeps_the_watch() -> None:
    def inner(x: torch.Tensor) -> torch.Tensor:
        return x.sin() * 2

    def outer(x: torch.Tensor) -> torch.Tensor:
        return ckptfx.checkpoint(inner, x.exp())

    x = torch.randn(5, requires_grad=True)
    expected = torch.autograd.grad(inner(x.exp()).sum(), [x])
    out, frame = _frame_of(outer, x)
    assert frame.watch_last_op is True  # its last pack is the inner frame's input
    assert_bitwise(torch.autograd.grad(out.sum(), [x]), expected)


def test_nodes_judged_by_the_op_they_name() -> None:
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)

    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):  # type: ignore[override]
            ctx.save_for_backward(a)
            return a * 2

        @staticmethod
        def backward(ctx, g):  # type: ignore[override]
            return g * 2

    assert node_never_writes_an_input(F.linear(x, w, w[0]).grad_fn)     # addmm
    assert node_never_writes_an_input(F.layer_norm(x, (8,)).grad_fn)
    assert not node_never_writes_an_input(F.rrelu(x, training=True).grad_fn)  # writes noise
    assert not node_never_writes_an_input(Twice.apply(x).grad_fn)       # a custom Function
    assert not node_never_writes_an_input(torch.log1p(x).grad_fn)       # name does not map


def test_recorder_keeps_number_lists_whole_and_flattens_tensor_lists() -> None:
    t, u = torch.randn(2), torch.randn(2)
    leaves, spec = flatten_tree((t, [2, 3, 4]), {})
    assert leaves[0] is t and leaves[1] == [2, 3, 4] and spec == (2, ())
    leaves, spec = flatten_tree(([t, u], 0), {})
    assert leaves[0] is t and leaves[1] is u and type(spec) is not tuple  # optree's spec
    assert list(output_leaves((t, None, u))) == [t, None, u]
    assert output_leaves(t) == (t,)


def test_remat_with_view_sizes_and_cat_replays_bitwise() -> None:
    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = (x @ w).view(2, 2, 8).permute(1, 0, 2).reshape(4, 8).relu()
        return torch.cat([h, h.exp()], 1).sum(0)

    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    expected = torch.autograd.grad(block(x, w).square().sum(), [x, w])
    for policy in (None, ckptfx.checkpoint_policies.dots_saveable):
        out = ckptfx.remat(block, policy=policy)(x, w)
        assert_bitwise(torch.autograd.grad(out.square().sum(), [x, w]), expected)


def test_vjp_split_with_one_group_per_linear_replays_once_and_clears() -> None:
    torch.manual_seed(0)
    calls = [0]
    layers = [torch.nn.Linear(8, 8) for _ in range(4)]

    def block(x: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        for layer in layers:
            x = F.gelu(layer(x))
        return x

    params = [p for layer in layers for p in layer.parameters()]
    x, g = torch.randn(3, 8, requires_grad=True), torch.randn(3, 8)
    expected = torch.autograd.grad(block(x), [x, *params], g)
    calls[0] = 0
    out, dx_fn, dw_fn = ckptfx.vjp_split(lambda a: ckptfx.checkpoint(block, a), x, params=params)
    dx = dx_fn(g)
    dw_fn()  # params= gradients go to .grad
    assert calls[0] == 2  # the forward and one replay, for dx and the 4 weight groups
    assert_bitwise([dx, *(p.grad for p in params)], expected)
    assert ckptfx.recompute_session_stats() == {}


def test_plain_autograd_never_creates_functorchs_thread_state(monkeypatch) -> None:
    # Reading functorch's level creates the thread's functorch state, which every autograd
    # node run afterwards copies (_compat.functorch_level): checkpoint, remat and a split
    # under plain autograd must find "no transform" without asking.
    asked = []

    def spy(name):
        real = getattr(torch._C._functorch, name)

        def call(*a):
            asked.append(name)
            return real(*a)
        return call

    for name in ("maybe_current_level", "peek_interpreter_stack"):
        monkeypatch.setattr(torch._C._functorch, name, spy(name))
    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    ckptfx.checkpoint(_mlp, x, w).sum().backward()
    ckptfx.remat(_mlp)(x, w).sum().backward()
    ckptfx.remat(_mlp, policy=ckptfx.checkpoint_policies.dots_saveable)(x, w).sum().backward()
    _, dx_fn, dw_fn = ckptfx.vjp_split(lambda a: ckptfx.checkpoint(_mlp, a, w), x,
                                       params=[w])
    dx_fn(torch.ones(4, 8))
    dw_fn()
    assert asked == []
    # inside a transform the level is still read
    torch.func.grad(lambda a: ckptfx.checkpoint(_mlp, a, w).sum())(x.detach())
    assert "maybe_current_level" in asked
