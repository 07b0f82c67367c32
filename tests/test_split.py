"""vjp_split and grad_split: dx and dw as two functions sharing one replay.

Every parity test compares with ``torch.autograd.grad`` of the same function without any
checkpoint, bit for bit (``torch.equal``), in fp32 and under bf16 autocast, with dropout.
Block runs are counted by a counter inside the block. Every test runs dx and dw (the error
tests too, between their bad calls), so every test takes the ``device`` fixture: it runs on the
CPU and on the accelerator, where autograd runs dx and dw on its device threads.
"""

from __future__ import annotations

import gc
import threading
import weakref
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as tcp
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import ckptfx
import ckptfx.split.weight_calls as weight_calls

from conftest import assert_bitwise, maybe_autocast
from models import D, H, Block

pytestmark = pytest.mark.usefixtures("no_hooks_left_behind")

AUTOCAST = [False, True]


class Stack(nn.Module):
    """Blocks run under a chosen checkpoint: "plain", "torch" or "ckptfx"."""

    def __init__(self, n: int = 3, variant: str = "ckptfx") -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(norm=True) for _ in range(n))
        self.variant = variant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            if self.variant == "plain":
                x = b(x)
            elif self.variant == "torch":
                x = tcp.checkpoint(b, x, use_reentrant=False)
            else:
                x = ckptfx.checkpoint(b, x)
        return x

    def runs(self) -> list[int]:
        return [b.runs for b in self.blocks]

    def reset(self) -> None:
        for b in self.blocks:
            b.runs = 0


def make_stack(variant: str = "ckptfx", n: int = 3,
               device: torch.device | str = "cpu") -> Stack:
    torch.manual_seed(0)
    return Stack(n, variant).to(device)


def reference(stack: Stack, x: torch.Tensor, g: torch.Tensor, autocast: bool,
              seed: int = 7) -> list[torch.Tensor]:
    """dx and every parameter gradient of the plain stack, in one fused backward."""
    variant, stack.variant = stack.variant, "plain"
    try:
        torch.manual_seed(seed)
        xr = x.detach().requires_grad_()
        with maybe_autocast(autocast, x.device):
            out = stack(xr)
        return list(torch.autograd.grad(out, [xr, *stack.parameters()], g))
    finally:
        stack.variant = variant
        stack.reset()


def inputs(shape: tuple[int, ...] = (2, 5, D),
           device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` and the cotangent ``g``, drawn on the CPU (the same values on every device)."""
    torch.manual_seed(1)
    return torch.randn(shape).to(device), torch.randn(shape).to(device)


@pytest.fixture(params=["per_group", "fused"])
def weight_pass(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both passes (``ckptfx.split.weight_calls``): dw from the intermediates' captured
    gradients, or one fused backward in dx (what the rule picks for these small blocks)."""
    monkeypatch.setattr(weight_calls, "_force", request.param)
    return request.param


@pytest.fixture
def per_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-group weight pass, whose dx trims what dw will not read."""
    monkeypatch.setattr(weight_calls, "_force", "per_group")


# -- parity, one replay ---------------------------------------------------------------------


@pytest.mark.parametrize("autocast", AUTOCAST)
def test_vjp_split_bitwise_and_one_replay_per_block(autocast: bool, weight_pass: str,
                                                     device: torch.device) -> None:
    stack = make_stack(device=device)
    x, g = inputs(device=device)
    ref = reference(stack, x, g, autocast)
    params = list(stack.parameters())
    torch.manual_seed(7)
    with maybe_autocast(autocast, device):
        out, dx_fn, dw_fn = ckptfx.vjp_split(stack, x, params=params)
    assert out.grad_fn is None  # the split owns the graph
    dx = dx_fn(g)
    assert stack.runs() == [2, 2, 2]  # forward + the prefire replay, already
    assert dw_fn() == ()  # no non-x primals: nothing returned, .grad filled
    assert stack.runs() == [2, 2, 2]  # dw read the same replay
    assert_bitwise([dx, *(p.grad for p in params)], ref)


@pytest.mark.parametrize("variant", ["plain", "torch", "ckptfx"])
def test_differential_variants_same_grads_counted_runs(variant: str, weight_pass: str,
                                                       device: torch.device) -> None:
    """Same split under no checkpoint, torch's checkpoint and ckptfx: grads equal, runs differ
    where dx and dw are two backward calls (per group)."""
    stack = make_stack(variant, device=device)
    x, g = inputs(device=device)
    ref = reference(stack, x, g, False)
    params = list(stack.parameters())
    torch.manual_seed(7)
    out, dx_fn, dw_fn = ckptfx.vjp_split(stack, x, params=params)
    dx = dx_fn(g)
    dw_fn()
    assert_bitwise([dx, *(p.grad for p in params)], ref)
    runs = stack.runs()
    if variant == "plain":
        assert runs == [1, 1, 1]
    elif variant == "ckptfx":
        assert runs == [2, 2, 2]
    elif weight_pass == "per_group":
        # torch replays for dx and again for dw's weight halves
        assert all(r > 2 for r in runs), runs
    else:
        assert runs == [2, 2, 2]  # one fused backward in dx: torch replays once too


def test_primals_as_pytrees_functional_params(device: torch.device) -> None:
    """vjp_split(fun, params_dict, x, x_argnums=1): dw_fn returns the dict of grads."""
    stack = make_stack(device=device)
    x, g = inputs(device=device)
    ref = reference(stack, x, g, False)
    params = dict(stack.named_parameters())

    def fun(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(stack, p, (x,))

    torch.manual_seed(7)
    out, dx_fn, dw_fn = ckptfx.vjp_split(fun, params, x, x_argnums=1)
    dx = dx_fn(g)
    dw = dw_fn()
    assert isinstance(dw, dict) and list(dw) == list(params)
    assert_bitwise([dx, *dw.values()], ref)
    assert all(p.grad is None for p in stack.parameters())  # returned, not accumulated
    assert stack.runs() == [2, 2, 2]


@pytest.mark.parametrize("autocast", AUTOCAST)
def test_has_aux_tuple_argnums_multiple_outputs(autocast: bool, device: torch.device) -> None:
    torch.manual_seed(0)
    # plain tensors: differentiated anyway
    w1, w2 = torch.randn(D, H).to(device), torch.randn(H, D).to(device)
    a, b = torch.randn(3, D).to(device), torch.randn(3, D).to(device)
    runs = [0]

    def block(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        runs[0] += 1
        return F.dropout(torch.tanh(x @ w1), 0.3, True) @ w2

    def fun(xs: dict, ws: tuple, checkpoint: bool = True) -> tuple:
        h = xs["a"] + 2 * xs["b"]
        y = ckptfx.checkpoint(block, h, *ws) if checkpoint else block(h, *ws)
        return (y, {"side": ws[1].sum()}), {"aux": y.detach().sum(), "n": 3}

    gy, gs = torch.randn(3, D).to(device), torch.tensor(0.5, device=device)
    torch.manual_seed(3)
    prim = ({"a": a.requires_grad_(), "b": b.requires_grad_()},
            (w1.requires_grad_(), w2.requires_grad_()))
    with maybe_autocast(autocast, device):
        (y, side), aux = fun(*prim, checkpoint=False)
    ref = torch.autograd.grad([y, side["side"]], [a, b, w1, w2], [gy, gs])
    runs[0] = 0
    torch.manual_seed(3)
    with maybe_autocast(autocast, device):
        out, dx_fn, dw_fn, aux2 = ckptfx.vjp_split(fun, *prim, x_argnums=(0,), has_aux=True)
    assert aux2["n"] == 3 and torch.equal(aux2["aux"], aux["aux"])
    (dxs,) = dx_fn((gy, {"side": gs}))
    dws = dw_fn()
    assert_bitwise([dxs["a"], dxs["b"], *dws], ref)
    assert runs[0] == 2


def test_inputs_not_differentiable_and_output_independent_of_inputs(device: torch.device) -> None:
    """Token ids as x (no dx), and an output that does not depend on x: all grads in dw."""
    torch.manual_seed(0)
    emb = nn.Embedding(10, D).to(device)
    stack = make_stack(n=2, device=device)
    extra = nn.Parameter(torch.randn(D).to(device))
    ids = torch.randint(0, 10, (2, 5)).to(device)
    params = [*emb.parameters(), *stack.parameters(), extra]

    def fun(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return stack(emb(ids)), extra * 3

    g1, g2 = torch.randn(2, 5, D).to(device), torch.randn(D).to(device)
    torch.manual_seed(7)
    stack.variant = "plain"
    ref = torch.autograd.grad(list(fun(ids)), params, [g1, g2])
    stack.variant = "ckptfx"
    stack.reset()
    torch.manual_seed(7)
    out, dx_fn, dw_fn = ckptfx.vjp_split(fun, ids, params=params)
    assert dx_fn((g1, g2)) is None  # integer input: no gradient
    dw_fn()
    assert_bitwise([p.grad for p in params], ref)
    assert stack.runs() == [2, 2]


def _assert_same_grad(a: torch.Tensor, e: torch.Tensor) -> None:
    """Bit for bit, a sparse gradient's layout, coalesced flag, indices and values included."""
    assert a.layout == e.layout and a.dtype == e.dtype and a.shape == e.shape
    if e.is_sparse:
        assert a.is_coalesced() == e.is_coalesced()
        assert torch.equal(a._indices(), e._indices()) and torch.equal(a._values(), e._values())
    assert torch.equal(a.to_dense(), e.to_dense())


@pytest.mark.parametrize("ck", [False, True])
def test_sparse_embedding_gradient_accumulates_as_backward_does(ck: bool, weight_pass: str,
                                                                device: torch.device) -> None:
    """``nn.Embedding(sparse=True)``: its weight's ``.grad`` is sparse, uncoalesced, with the
    indices and values ``backward()`` gives, first set and then accumulated over a second
    step, as plain ``backward()`` leaves them; the dense weights too."""
    if device.type not in ("cpu", "cuda"):
        pytest.skip(f"no sparse kernels on {device.type} (plain backward() fails there too)")
    torch.manual_seed(0)
    emb, lin = nn.Embedding(10, D, sparse=True).to(device), nn.Linear(D, D).to(device)
    params = [*emb.parameters(), *lin.parameters()]
    steps = [torch.tensor([[1, 2, 1], [3, 1, 0]]), torch.tensor([[4, 1, 4], [0, 0, 9]])]
    x, g = inputs((2, 3, D), device=device)

    def block(idx: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return lin(torch.tanh(emb(idx.to(device)) + t))

    def fun(t: torch.Tensor, idx: torch.Tensor, use_ck: bool) -> torch.Tensor:
        return ckptfx.checkpoint(block, idx, t) if use_ck else block(idx, t)

    expected = []
    for idx in steps:  # two plain backward() calls accumulate
        fun(x.clone().requires_grad_(), idx, False).backward(g)
        expected.append([p.grad.clone() for p in params])
    for p in params:
        p.grad = None
    for idx, ref in zip(steps, expected):
        _, dx_fn, dw_fn = ckptfx.vjp_split(lambda t, i=idx: fun(t, i, ck), x, params=params)
        dx_fn(g)
        dw_fn()
        assert params[0].grad.is_sparse
        for p, e in zip(params, ref):
            _assert_same_grad(p.grad, e)


def test_unused_input_gets_zeros_and_existing_grad_accumulates(device: torch.device) -> None:
    stack = make_stack(n=1, device=device)
    x, g = inputs(device=device)
    unused = torch.randn(4).to(device)
    params = list(stack.parameters())
    ref = reference(stack, x, g, False)
    for p in params:
        p.grad = torch.ones_like(p)
    torch.manual_seed(7)
    out, dx_fn, dw_fn = ckptfx.vjp_split(lambda x, u: stack(x), x, unused, x_argnums=(0, 1),
                                         params=params)
    dx, du = dx_fn(g)
    dw_fn()
    assert torch.equal(du, torch.zeros(4, device=device))
    assert_bitwise([dx, *(p.grad for p in params)], [ref[0], *(r + 1 for r in ref[1:])])


def test_shared_weight_used_by_two_blocks(weight_pass: str, device: torch.device) -> None:
    """A block used twice: each weight's two gradients, from two intermediates, sum as in a
    fused backward, bit for bit."""
    torch.manual_seed(0)
    blk = Block(norm=True).to(device)
    x, g = inputs(device=device)

    def fun(x: torch.Tensor, ck: bool = True) -> torch.Tensor:
        for _ in range(2):
            x = ckptfx.checkpoint(blk, x) if ck else blk(x)
        return x

    params = list(blk.parameters())
    torch.manual_seed(7)
    xr = x.clone().requires_grad_()
    ref = torch.autograd.grad(fun(xr, False), [xr, *params], g)
    blk.runs = 0
    torch.manual_seed(7)
    out, dx_fn, dw_fn = ckptfx.vjp_split(fun, x, params=params)
    dx = dx_fn(g)
    dw_fn()
    assert_bitwise([dx, *(p.grad for p in params)], ref)
    assert blk.runs == 4  # two calls, each forward + one replay


# -- one backward's work --------------------------------------------------------------------


def _flops(fn: Callable[[], Any]) -> int:
    with FlopCounterMode(display=False) as fc:
        fn()
    return fc.get_total_flops()


def test_dx_plus_dw_flops_equal_one_fused_backward(weight_pass: str, device: torch.device) -> None:
    """Either pass does one fused backward's work: per group split between dx and dw, fused
    all of it in dx."""
    # Functional blocks: FlopCounterMode's module tracker hooks nn.Module calls (replays too).
    torch.manual_seed(0)
    ws = [(torch.randn(H, D).to(device).requires_grad_(),
           torch.randn(D, H).to(device).requires_grad_()) for _ in range(3)]
    params = [w for pair in ws for w in pair]

    def block(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        return x + F.linear(F.dropout(F.gelu(F.linear(x, w1)), 0.25, True), w2)

    def fun(x: torch.Tensor, ck: bool) -> torch.Tensor:
        for w1, w2 in ws:
            x = ckptfx.checkpoint(block, x, w1, w2) if ck else block(x, w1, w2)
        return x

    x, g = inputs(device=device)
    for ck in (False, True):
        torch.manual_seed(7)
        xr = x.clone().requires_grad_()
        out = fun(xr, ck)
        weights_only = _flops(lambda: torch.autograd.grad(out, params, g, retain_graph=True))
        inputs_only = _flops(lambda: torch.autograd.grad(out, [xr], g, retain_graph=True))
        fused = _flops(lambda: torch.autograd.grad(out, [xr, *params], g))
        torch.manual_seed(7)
        _, dx_fn, dw_fn = ckptfx.vjp_split(fun, x, ck, params=params)
        prefire = _flops(dx_fn.prefire)
        dx_flops = _flops(lambda: dx_fn(g))
        dw_flops = _flops(dw_fn)
        assert (prefire > 0) == ck  # the one replay of each block (its forward matmuls)
        # (a checkpointed graph's own backward replays: that is the prefire's work)
        assert prefire + dx_flops + dw_flops == fused
        if weight_pass == "per_group":
            # dx an input backward's work, dw only the weight gradients' (no replay)
            assert prefire + dx_flops == inputs_only and 0 < dw_flops < weights_only
        else:
            assert dw_flops == 0


# -- memory between dx and dw ---------------------------------------------------------------


def test_dx_drops_replayed_tensors_only_dx_needed(per_group: None, device: torch.device) -> None:
    """After dx the session keeps matmul inputs, not the GELU input or the dropout mask."""
    torch.manual_seed(0)
    blk = Block(p=0.5, norm=True).to(device)
    x, g = inputs(device=device)
    torch.manual_seed(7)
    # What the block computes, for identifying the replayed tensors by value.
    with torch.no_grad():
        pre = blk.fc1(blk.ln(x))  # saved by GELU's backward only
        mask_like = F.dropout(F.gelu(pre), 0.5, True)  # fc2's input (dropout output)
    params = list(blk.parameters())
    torch.manual_seed(7)
    out, dx_fn, dw_fn = ckptfx.vjp_split(lambda x: ckptfx.checkpoint(blk, x), x, params=params)
    sid = dx_fn.session
    dx_fn.prefire()
    before = ckptfx.recompute_session_stats()[sid]

    def held() -> list[torch.Tensor]:
        (frame,) = [f for f in ckptfx.kernel.session._registry[sid].frames]
        return [t for t in frame.session_replay if t is not None]

    def holds(value: torch.Tensor) -> bool:
        # Linear saves its 3-d input flattened to 2-d: compare values, not shapes.
        return any(t.numel() == value.numel() and torch.equal(t.reshape(-1), value.reshape(-1))
                   for t in held())

    assert holds(pre) and holds(mask_like)
    dx_fn(g)
    after = ckptfx.recompute_session_stats()[sid]
    assert after.tensors < before.tensors and after.nbytes < before.nbytes
    assert not holds(pre)  # GELU's saved input: read by dx only
    assert holds(mask_like)  # fc2's saved input: read by fc2.weight's gradient
    assert not any(t.dtype == torch.bool for t in held())  # no dropout mask
    dw_fn()
    assert sid not in ckptfx.recompute_session_stats()
    torch.manual_seed(7)
    xr = x.clone().requires_grad_()
    ref = torch.autograd.grad(blk(xr), params, g)
    assert_bitwise([p.grad for p in params], ref)


def test_nothing_alive_after_dw(weight_pass: str, device: torch.device) -> None:
    stack = make_stack(device=device)
    x, g = inputs(device=device)
    torch.manual_seed(7)
    out, dx_fn, dw_fn = ckptfx.vjp_split(stack, x, params=list(stack.parameters()))
    dx_fn.prefire()
    split = dx_fn._split
    frames = [h.frame for h in split.handles]
    replayed = [weakref.ref(t) for f in frames for t in f.session_replay if t is not None]
    frame_refs = [weakref.ref(f) for f in frames]
    del frames
    dx = dx_fn(g)
    captured = [weakref.ref(t) for pair in split.passed.captured.values() for grads in pair
                for t in grads if t is not None]
    assert replayed and (bool(captured) == (weight_pass == "per_group"))
    dw_fn()
    del split
    gc.collect()
    assert all(r() is None for r in replayed)
    assert all(r() is None for r in captured)
    assert all(r() is None for r in frame_refs)  # the graph is gone too
    assert dx is not None


# -- lifecycle and errors -------------------------------------------------------------------


def test_order_errors_and_bad_arguments_leave_no_state(device: torch.device) -> None:
    stack = make_stack(n=1, device=device)
    x, g = inputs(device=device)
    params = list(stack.parameters())
    out, dx_fn, dw_fn = ckptfx.vjp_split(stack, x, params=params, session="s0")
    with pytest.raises(RuntimeError, match="before dx_fn"):
        dw_fn()
    with pytest.raises(ValueError, match="cotangent leaf 0 has shape"):
        dx_fn(torch.randn(3, device=device))
    with pytest.raises(ValueError, match="structure"):
        dx_fn((g, g))
    with pytest.raises(ValueError, match="already used"):
        ckptfx.vjp_split(stack, x, session="s0")
    dx_fn(g)  # still usable after the bad calls
    with pytest.raises(RuntimeError, match="already ran"):
        dx_fn(g)
    with pytest.raises(RuntimeError, match="past it"):
        dx_fn.prefire()
    dw_fn()
    with pytest.raises(RuntimeError, match="consumed"):
        dw_fn()
    with pytest.raises(RuntimeError, match="consumed"):
        dx_fn(g)
    assert "s0" not in ckptfx.recompute_session_stats()
    ckptfx.vjp_split(stack, x, session="s0")  # the key is free again

    with pytest.raises(TypeError, match="x_argnums"):
        ckptfx.vjp_split(stack, x, x_argnums="0")
    with pytest.raises(ValueError, match="out of range"):
        ckptfx.vjp_split(stack, x, x_argnums=1)
    with pytest.raises(TypeError, match="params must"):
        ckptfx.vjp_split(stack, x, params=3)
    with pytest.raises(TypeError, match="fun must be callable"):
        ckptfx.vjp_split(3, x)
    with pytest.raises(ValueError, match="hashable"):
        ckptfx.vjp_split(stack, x, session=["unhashable"])
    with pytest.raises(TypeError, match="pair"):
        ckptfx.vjp_split(stack, x, has_aux=True)
    xr = x.clone().requires_grad_()
    with pytest.raises(ValueError, match="also passed as a weight"):
        ckptfx.vjp_split(lambda a, b: a * b, xr, xr, x_argnums=0)
    assert not ckptfx.recompute_session_stats()


def test_clear_abandons_the_split(device: torch.device) -> None:
    stack = make_stack(n=1, device=device)
    x, g = inputs(device=device)
    out, dx_fn, dw_fn = ckptfx.vjp_split(stack, x, params=list(stack.parameters()))
    dx_fn(g)
    ckptfx.clear_recompute_session(dx_fn.session)
    with pytest.raises(RuntimeError, match="was cleared"):
        dw_fn()
    with pytest.raises(RuntimeError, match="consumed"):
        dw_fn()


@pytest.mark.parametrize("first_call", ["dx_fn", "prefire", "dw_fn"])
def test_clear_before_any_block_joined_the_session_abandons_the_split(
        first_call: str, device: torch.device) -> None:
    """Cleared right after the split was made (nothing prefired, dx not run: no block is in
    the session yet), the split is abandoned as the docstring says: the next call raises,
    releases the graph, and leaves nothing behind. (A prefire that fails clears the session
    itself, which does not abandon the split: test_failed_prefire_can_be_retried.)"""
    stack = make_stack(n=2, device=device)
    x, g = inputs(device=device)
    params = list(stack.parameters())
    out, dx_fn, dw_fn = ckptfx.vjp_split(stack, x, params=params, session="early")
    frames = [weakref.ref(h.frame) for h in dx_fn._split.handles]
    ckptfx.clear_recompute_session("early")
    if first_call == "dw_fn":
        with pytest.raises(ckptfx.CheckpointError, match="'early' was cleared"):
            dw_fn()  # not "call dx_fn first": the split is gone
    with pytest.raises(ckptfx.CheckpointError, match="'early' was cleared|consumed"):
        dx_fn(g) if first_call != "prefire" else dx_fn.prefire()
    with pytest.raises(ckptfx.CheckpointError, match="consumed"):
        dw_fn()
    gc.collect()
    assert all(f() is None for f in frames)  # the graph is released
    assert not ckptfx.recompute_session_stats() and all(p.grad is None for p in params)
    # The key is free again: a new split under it runs as usual.
    _, dx_fn, dw_fn = ckptfx.vjp_split(stack, x, params=params, session="early")
    dx_fn(g)
    dw_fn()
    assert all(p.grad is not None for p in params)


def test_an_abandoned_split_frees_its_key_and_leaves_the_next_split_alone(
        device: torch.device) -> None:
    """Cleared by the user, a split no longer holds its key, even while its functions are
    still referenced: a new split takes the key, and calling the old split afterwards
    (which raises and releases it) clears nothing of the new one's session."""
    stack = make_stack(n=2, device=device)
    x, g = inputs(device=device)
    params = list(stack.parameters())
    expected = reference(stack, x, g, False)[1:]  # the parameters' gradients (seed 7)
    _, old_dx, old_dw = ckptfx.vjp_split(stack, x, params=params, session="reuse")
    ckptfx.clear_recompute_session("reuse")
    torch.manual_seed(7)
    _, dx_fn, dw_fn = ckptfx.vjp_split(stack, x, params=params, session="reuse")
    dx_fn.prefire()  # the new split's blocks join the session
    with pytest.raises(ckptfx.CheckpointError, match="'reuse' was cleared"):
        old_dx(g)
    assert ckptfx.recompute_session_stats()["reuse"].replayed == 2  # the new replays stay
    dx_fn(g)
    dw_fn()
    assert_bitwise([p.grad for p in params], expected)
    assert not ckptfx.recompute_session_stats()


def test_dw_that_raises_still_releases_everything(per_group: None, device: torch.device) -> None:
    torch.manual_seed(0)
    blk, head = Block(norm=True).to(device), nn.Linear(D, D).to(device)
    x, g = inputs(device=device)
    out, dx_fn, dw_fn = ckptfx.vjp_split(lambda x: head(ckptfx.checkpoint(blk, x)), x,
                                         params=[*blk.parameters(), *head.parameters()])
    dx_fn(g)
    split = dx_fn._split
    (frame,) = [h.frame for h in split.handles]
    replayed = [weakref.ref(t) for t in frame.session_replay if t is not None]
    frame_ref = weakref.ref(frame)
    del frame
    with torch.no_grad():
        head.weight.add_(1)  # saved by head's (un-checkpointed) node: dw must fail
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        dw_fn()
    del split
    gc.collect()
    assert all(r() is None for r in replayed) and frame_ref() is None
    assert not ckptfx.recompute_session_stats()
    with pytest.raises(RuntimeError, match="consumed"):
        dw_fn()


def test_failed_prefire_can_be_retried(device: torch.device) -> None:
    fail = [True]
    torch.manual_seed(0)
    blk = Block(norm=True).to(device)

    def flaky(x: torch.Tensor) -> torch.Tensor:
        if blk.runs == 1 and fail[0]:
            fail[0] = False
            blk.runs += 1
            raise RuntimeError("replay failed")
        return blk(x)

    x, g = inputs(device=device)
    torch.manual_seed(7)
    xr = x.clone().requires_grad_()
    ref = torch.autograd.grad(blk(xr), [xr, *blk.parameters()], g)
    blk.runs = 0
    torch.manual_seed(7)
    out, dx_fn, dw_fn = ckptfx.vjp_split(lambda x: ckptfx.checkpoint(flaky, x), x,
                                         params=list(blk.parameters()))
    with pytest.raises(RuntimeError, match="replay failed"):
        dx_fn.prefire()
    dx = dx_fn(g)
    dw_fn()
    assert_bitwise([dx, *(p.grad for p in blk.parameters())], ref)


# -- grad_split -----------------------------------------------------------------------------


def _loss_fn(stack: Stack) -> Callable[..., torch.Tensor]:
    def loss(params: dict[str, torch.Tensor], x: torch.Tensor, *, scale: float = 1.0) -> Any:
        y = torch.func.functional_call(stack, params, (x,))
        return (y.square().mean() * scale), y.detach().sum()

    return loss


def _reference_loss(stack: Stack, x: torch.Tensor, seed: int) -> list[torch.Tensor]:
    variant, stack.variant = stack.variant, "plain"
    torch.manual_seed(seed)
    xr = x.clone().requires_grad_()
    out = (stack(xr).square().mean() * 2.0)
    stack.variant = variant
    stack.reset()
    return list(torch.autograd.grad(out, [xr, *stack.parameters()]))


def test_grad_split_sessions_interleaved_on_threads(device: torch.device) -> None:
    """F1 F2 dx1 F3 dx2 dw1 dx3 dw2 dw3, dx and dw on threads that did not run the forward."""
    stack = make_stack(device=device)
    params = dict(stack.named_parameters())
    dx_fn, dw_fn = ckptfx.grad_split(_loss_fn(stack), x_argnums=1, has_aux=True)
    xs = [torch.randn(2, 5, D).to(device) for _ in range(3)]
    refs = [_reference_loss(stack, x, 10 + i) for i, x in enumerate(xs)]
    results: dict[tuple[str, int], Any] = {}

    def on_thread(name: str, i: int, fn: Callable[[], Any]) -> None:
        t = threading.Thread(target=lambda: results.__setitem__((name, i), fn()))
        t.start()
        t.join()

    def dx(i: int) -> None:
        torch.manual_seed(10 + i)
        on_thread("dx", i, lambda: dx_fn(params, xs[i], session=("mb", i), scale=2.0))

    def dw(i: int) -> None:
        on_thread("dw", i, lambda: dw_fn(("mb", i)))

    dx(0)
    dx(1)
    dw(0)
    dx(2)
    dw(1)
    dw(2)
    for i in range(3):
        (value, aux), dxi = results[("dx", i)]
        assert value.ndim == 0 and aux.ndim == 0
        dwi = results[("dw", i)]
        assert_bitwise([dxi, *dwi.values()], refs[i])
    assert stack.runs() == [6, 6, 6]  # three micro-batches, two runs each
    assert not ckptfx.recompute_session_stats()


def test_grad_split_keeps_only_what_dw_reads_between_dx_and_dw(
        monkeypatch: pytest.MonkeyPatch, per_group: None, device: torch.device) -> None:
    """grad_split trims the session after dx as vjp_split does: fewer tensors and bytes held
    than with every replayed tensor retained, the same gradients, nothing held after dw."""
    import ckptfx.split.passes as split_passes

    stack = make_stack(device=device)
    params = dict(stack.named_parameters())
    x = torch.randn(2, 5, D).to(device)
    dx_fn, dw_fn = ckptfx.grad_split(_loss_fn(stack), x_argnums=1, has_aux=True)
    held, grads = {}, {}
    for trim in (False, True):
        monkeypatch.setattr(split_passes, "trim_enabled", trim)
        torch.manual_seed(10)
        (_, _), dx = dx_fn(params, x, session=("trim", trim), scale=2.0)
        stats = ckptfx.recompute_session_stats()[("trim", trim)]
        held[trim] = (stats.tensors, stats.nbytes)
        grads[trim] = [dx, *dw_fn(("trim", trim)).values()]
        assert ("trim", trim) not in ckptfx.recompute_session_stats()
    assert held[True][0] < held[False][0] and held[True][1] < held[False][1], held
    ref = _reference_loss(stack, x, 10)
    assert_bitwise(grads[True], ref)
    assert_bitwise(grads[False], ref)


def test_grad_split_errors(device: torch.device) -> None:
    stack = make_stack(n=1, device=device)
    params = dict(stack.named_parameters())
    dx_fn, dw_fn = ckptfx.grad_split(_loss_fn(stack), x_argnums=1, has_aux=True)
    x = torch.randn(2, 5, D).to(device)
    with pytest.raises(RuntimeError, match="no dx_fn"):
        dw_fn("a")  # unknown, or dw before dx
    dx_fn(params, x, session="a")
    with pytest.raises(RuntimeError, match="already in flight"):
        dx_fn(params, x, session="a")
    dw_fn("a")
    with pytest.raises(RuntimeError, match="no dx_fn"):
        dw_fn("a")  # consumed
    dx_fn(params, x, session="a")  # the key may be reused once consumed
    dw_fn("a")
    with pytest.raises(ValueError, match="hashable"):
        dx_fn(params, x, session=None)
    bad_dx, _ = ckptfx.grad_split(lambda p, x: torch.func.functional_call(stack, p, (x,)),
                                  x_argnums=1)
    with pytest.raises(TypeError, match="scalar"):
        bad_dx(params, x, session="b")
    with pytest.raises(TypeError, match="x_argnums"):
        ckptfx.grad_split(_loss_fn(stack), x_argnums=None)
    assert not ckptfx.recompute_session_stats()


def test_grad_split_tuple_argnums_and_single_remaining(device: torch.device) -> None:
    torch.manual_seed(0)
    w = torch.randn(D, D).to(device)
    a, b = torch.randn(3, D).to(device), torch.randn(3, D).to(device)

    def f(a: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return ckptfx.checkpoint(lambda a, b, w: ((a @ w).tanh() * b).sum(), a, b, w)

    ar, wr, br = (t.clone().requires_grad_() for t in (a, w, b))
    ref = torch.autograd.grad(((ar @ wr).tanh() * br).sum(), [ar, br, wr])
    dx_fn, dw_fn = ckptfx.grad_split(f, x_argnums=(0, 2))
    value, (da, db) = dx_fn(a, w, b, session=0)
    dwv = dw_fn(0)
    assert isinstance(dwv, torch.Tensor)  # one remaining argument: its gradient, not a tuple
    assert_bitwise([da, db, dwv], ref)


class _CountOps(TorchDispatchMode):
    """Counts calls of one aten op (replays of a recorded segment never call Python)."""

    def __init__(self, op: Any) -> None:
        super().__init__()
        self.op, self.count = op, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is self.op:
            self.count += 1
        return func(*args, **(kwargs or {}))


# -- remat'd blocks -------------------------------------------------------------------------


@pytest.mark.parametrize("policy", [None, "dots_saveable"])
def test_vjp_split_over_remat_blocks(policy: str | None, device: torch.device) -> None:
    """remat frames are kernel frames: one replay shared by dx and dw, bitwise grads."""
    if not hasattr(ckptfx, "remat"):  # pragma: no cover - remat lands in parallel
        pytest.skip("ckptfx.remat not available in this tree")
    pol = None if policy is None else getattr(ckptfx.checkpoint_policies, policy)
    torch.manual_seed(0)
    ws = [{"w1": torch.randn(D, H).to(device).requires_grad_(),
           "w2": torch.randn(H, D).to(device).requires_grad_()} for _ in range(3)]
    runs = [0]

    def block(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        runs[0] += 1
        return x + F.dropout(torch.tanh(x @ p["w1"]), 0.25, True) @ p["w2"]

    rblock = ckptfx.remat(block, policy=pol)

    def fun(ws: list, x: torch.Tensor, rm: bool = True) -> torch.Tensor:
        for p in ws:
            x = rblock(p, x) if rm else block(p, x)
        return x

    x, g = torch.randn(4, D).to(device), torch.randn(4, D).to(device)
    flat = [w for p in ws for w in p.values()]
    torch.manual_seed(7)
    xr = x.clone().requires_grad_()
    ref = torch.autograd.grad(fun(ws, xr, False), [xr, *flat], g)
    runs[0] = 0
    torch.manual_seed(7)
    out, dx_fn, dw_fn = ckptfx.vjp_split(fun, ws, x, x_argnums=1)
    assert runs[0] == 3
    # remat replays a recorded segment, not the Python function: count the replayed tanh ops.
    with _CountOps(torch.ops.aten.tanh.default) as tanh:
        dx = dx_fn(g)
        dws = dw_fn()
    assert tanh.count == 3  # one replay per block, shared by dx and dw
    assert_bitwise([dx, *(w for p in dws for w in p.values())], ref)
    assert not ckptfx.recompute_session_stats()
