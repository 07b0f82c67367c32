"""remat's recorder: blocks that were falsely "not replayable" are replayed.

From the fuzzer's minimal reproductions:

- ``F.rrelu(training=True)``: autograd packs ``rrelu_with_noise``'s ``noise`` (an input it
  then fills) before the op reaches the recorder; that was taken for "a write to a value
  autograd saved". The recorder now refers such a pack to the value the op left, so the
  replay refills the noise with the forward's recorded RNG state;
- a kept ``torch.empty_like(...)`` buffer: with a reference to the new tensor held (the
  policy keeps it), torch's factory dispatches an extra ``aten.detach`` of it, taken for a
  read of an uninitialised buffer. A view reads no values;
- a block that truly is not replayable re-ran its Python function even when every holder
  stood for an input (nothing to recompute), and a nested checkpoint inside then hit the
  "created while a block was being replayed for a recompute session" error, whose message
  said remat'd outer blocks had no such limit.

Everything is compared bitwise with plain autograd from the same seed; the block's Python
runs are counted inside it, the recorded replay's ops with a dispatch mode.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

import ckptfx
from ckptfx import checkpoint_policies as cp
from conftest import OpCounter, assert_bitwise, grads

pytestmark = [
    pytest.mark.usefixtures("no_hooks_left_behind", "no_sessions_left"),
    # the policy matrix names a value no block tags ('unused'): that warning is tested elsewhere
    pytest.mark.filterwarnings("ignore::ckptfx.UnusedNameWarning"),
]

POLICIES = {
    "none": None,
    "everything": cp.everything_saveable,
    "dots": cp.dots_saveable,
    "offload_dots": cp.offload_dot_with_no_batch_dims(),
    "names": cp.save_any_names_but_these("unused"),
}


def segment_of(fn: Any, *args: Any) -> tuple[Any, Any]:
    with ckptfx.recompute_handle_collector_ctx() as handles:
        out = fn(*args)
    assert len(handles) == 1
    return out, handles[0].frame.rerun.__self__


# -- the blocks ----------------------------------------------------------------------------


def _rrelu(x, w, calls):
    calls[0] += 1
    return F.rrelu(x @ w, 0.1, 0.3, training=True) * 2


def _rrelu_inplace(x, w, calls):
    calls[0] += 1
    h = x @ w
    F.rrelu(h, training=True, inplace=True)
    return h.sin() @ w.T


_ACT = nn.RReLU(0.1, 0.3)


def _rrelu_module_last(x, w, calls):
    calls[0] += 1
    return _ACT(torch.tanh(x @ w))  # the noise is the last tensor saved: early stop's hazard


def _empty_like_copy(x, w, calls):
    calls[0] += 1
    h = x @ w
    buf = torch.empty_like(h)
    buf.copy_(h.cos())
    return (buf * h).sum(-1)


def _empty_like_normal(x, w, calls):
    calls[0] += 1
    h = x @ w
    noise = torch.empty_like(h).normal_()
    return torch.tanh(noise * h)


def _dropout(x, w, calls):  # empty_like + bernoulli_ inside dropout
    calls[0] += 1
    return F.dropout(x @ w, 0.3, True) @ w.T


BLOCKS: dict[str, Callable[..., torch.Tensor]] = {
    "rrelu": _rrelu, "rrelu_inplace": _rrelu_inplace, "rrelu_module_last": _rrelu_module_last,
    "empty_like_copy": _empty_like_copy, "empty_like_normal": _empty_like_normal,
    "dropout": _dropout,
}


def _leaves() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(4, 6, requires_grad=True), torch.randn(6, 8, requires_grad=True)


def _plain(block, x, w) -> list[torch.Tensor | None]:
    x.grad = w.grad = None
    torch.manual_seed(5)
    block(x, w, [0]).sum().backward()
    out = grads([x, w])
    x.grad = w.grad = None
    return out


@pytest.mark.parametrize("early_stop", [True, False])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", BLOCKS)
def test_replayed_from_the_recording_bitwise(name: str, policy: str, early_stop: bool) -> None:
    block = BLOCKS[name]
    x, w = _leaves()
    expected = _plain(block, x, w)
    calls = [0]
    torch.manual_seed(5)
    r = ckptfx.remat(block, policy=POLICIES[policy], early_stop=early_stop, static_argnums=2)
    out, seg = segment_of(r, x, w, calls)
    assert seg.replayable, seg.why_not
    state = torch.get_rng_state()
    out.sum().backward(retain_graph=True)
    assert_bitwise(grads([x, w]), expected)
    x.grad = w.grad = None
    out.sum().backward()  # a second backward replays again: the same noise
    assert_bitwise(grads([x, w]), expected)
    assert calls[0] == 1  # the forward only: no replay ran the Python function
    assert torch.equal(torch.get_rng_state(), state)  # the replay left the caller's RNG


def test_rrelu_noise_is_refilled_by_the_replay() -> None:
    # Nothing kept: the noise is recomputed by the recorded rrelu_with_noise (RNG recorded),
    # not by re-running the block.
    x, w = _leaves()
    expected = _plain(_rrelu, x, w)
    calls = [0]
    torch.manual_seed(5)
    out, seg = segment_of(ckptfx.remat(_rrelu, static_argnums=2), x, w, calls)
    assert seg.replayable, seg.why_not
    with OpCounter() as ops:
        out.sum().backward()
    assert_bitwise(grads([x, w]), expected)
    assert calls[0] == 1
    assert ops.counts.get("rrelu_with_noise") == 1  # the replay refilled the noise once
    assert ops.counts.get("mm", 0) == 1 + 2  # the replayed x @ w, then the dx and dw mm


def test_kept_empty_like_buffer_is_replayable() -> None:
    x, w = _leaves()
    expected = _plain(_empty_like_normal, x, w)
    calls = [0]
    torch.manual_seed(5)
    r = ckptfx.remat(_empty_like_normal, policy=cp.everything_saveable, static_argnums=2)
    with OpCounter() as fwd:
        out, seg = segment_of(r, x, w, calls)
    assert fwd.counts.get("detach", 0) >= 1  # torch's factory detaches the held new tensor
    assert seg.replayable, seg.why_not
    out.sum().backward()
    assert_bitwise(grads([x, w]), expected)
    assert calls[0] == 1


# -- sessions, nested checkpoints --------------------------------------------------------------


def _inner(h: torch.Tensor, w: torch.Tensor, calls: list[int]) -> torch.Tensor:
    calls[0] += 1
    return torch.tanh(h @ w)


def _outer_block(kind: str, nest: str, calls: list[int], inner_calls: list[int]):
    inner_remat = ckptfx.remat(_inner, static_argnums=2)

    def block(x, w1, w2):
        calls[0] += 1
        h = x @ w1
        if kind == "rrelu":
            h = F.rrelu(h, training=True)
        elif kind == "empty_like":
            buf = torch.empty_like(h)
            buf.copy_(h.sin())
            h = h * buf
        elif kind == "numpy":  # filled outside the dispatcher: truly not replayable
            buf = torch.empty(h.shape[1])
            buf.numpy()[:] = 0.5
            h = h * buf
        if nest == "checkpoint":
            h = ckptfx.checkpoint(_inner, h, w2, inner_calls)
        elif nest == "remat":
            h = inner_remat(h, w2, inner_calls)
        return h @ w2.T

    return block


def _session_step(block, x, w1, w2, policy, prefire: bool):
    with ckptfx.recompute_handle_collector_ctx() as handles:
        out = ckptfx.remat(block, policy=policy)(x, w1, w2)
    seg = handles[0].frame.rerun.__self__
    loss = out.sum()
    session = "mb0"
    try:
        if prefire:
            for h in handles:
                ckptfx.recompute_handle(h, session)
        with ckptfx.recompute_session_ctx(session, retain_on_unpack=True):
            dx, groups = stage_backward_input([loss], None, [x], [w1, w2])
        x.grad = dx[0]
        for i, group in enumerate(groups):
            last = i == len(groups) - 1
            with ckptfx.recompute_session_ctx(session, retain_on_unpack=not last):
                stage_backward_weight([w1, w2], [group], retain_graph=not last)
    finally:
        ckptfx.clear_recompute_session(session)
    return seg


def _three_leaves() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return (torch.randn(4, 6, requires_grad=True), torch.randn(6, 8, requires_grad=True),
            torch.randn(8, 8, requires_grad=True))


@pytest.mark.parametrize("prefire", [True, False], ids=["prefire", "lazy"])
@pytest.mark.parametrize("policy", ["none", "everything", "dots"])
@pytest.mark.parametrize("nest", ["none", "checkpoint", "remat"])
@pytest.mark.parametrize("kind", ["rrelu", "empty_like"])
def test_sessions_with_nested_blocks(kind: str, nest: str, policy: str, prefire: bool) -> None:
    x, w1, w2 = _three_leaves()
    block = _outer_block(kind, nest, [0], [0])
    torch.manual_seed(3)
    block(x, w1, w2).sum().backward()
    expected = grads([x, w1, w2])
    x.grad = w1.grad = w2.grad = None
    calls, inner_calls = [0], [0]
    block = _outer_block(kind, nest, calls, inner_calls)
    torch.manual_seed(3)
    seg = _session_step(block, x, w1, w2, POLICIES[policy], prefire)
    assert seg.replayable, seg.why_not
    assert_bitwise(grads([x, w1, w2]), expected)
    assert calls[0] == 1  # the outer block is replayed from its recording, once
    # A nested ckptfx.checkpoint replays its function once for the session; a nested remat
    # replays from its own recording.
    assert inner_calls[0] == {"none": 0, "checkpoint": 2, "remat": 1}[nest]


@pytest.mark.parametrize("prefire", [True, False], ids=["prefire", "lazy"])
@pytest.mark.parametrize("nest", ["none", "checkpoint", "remat"])
def test_not_replayable_with_nothing_to_recompute_runs_no_python(nest: str, prefire: bool) -> None:
    # everything_saveable keeps every value autograd saves; the holders left stand for the
    # block's inputs (and w2.T, a view of one), which need no Python to rebuild.
    x, w1, w2 = _three_leaves()
    block = _outer_block("numpy", nest, [0], [0])
    block(x, w1, w2).sum().backward()
    expected = grads([x, w1, w2])
    x.grad = w1.grad = w2.grad = None
    calls, inner_calls = [0], [0]
    block = _outer_block("numpy", nest, calls, inner_calls)
    seg = _session_step(block, x, w1, w2, cp.everything_saveable, prefire)
    assert not seg.replayable and "Tensor.numpy()" in seg.why_not
    assert_bitwise(grads([x, w1, w2]), expected)
    assert calls[0] == 1
    assert inner_calls[0] == {"none": 0, "checkpoint": 2, "remat": 1}[nest]


def test_not_replayable_with_nothing_to_recompute_plain_backward() -> None:
    x, w1, w2 = _three_leaves()
    block = _outer_block("numpy", "none", [0], [0])
    block(x, w1, w2).sum().backward()
    expected = grads([x, w1, w2])
    x.grad = w1.grad = w2.grad = None
    calls = [0]
    out, seg = segment_of(ckptfx.remat(_outer_block("numpy", "none", calls, [0]),
                                       policy=cp.everything_saveable), x, w1, w2)
    assert not seg.replayable
    with OpCounter() as ops:
        out.sum().backward()
    assert_bitwise(grads([x, w1, w2]), expected)
    assert calls[0] == 1
    assert ops.counts.get("mm") == 4  # the backward's own; nothing of the block re-ran


def test_not_replayable_nested_checkpoint_under_a_session_says_why() -> None:
    # Truly not replayable and something to recompute: the function re-runs and the nested
    # checkpoint it creates is refused, with a message that is true for remat'd outer blocks.
    x, w1, w2 = _three_leaves()
    calls = [0]
    block = _outer_block("numpy", "checkpoint", calls, [0])
    with pytest.raises(ckptfx.CheckpointError) as info:
        _session_step(block, x, w1, w2, None, prefire=True)
    message = str(info.value)
    assert "created while a block was being replayed" in message
    assert "has no such limit" not in message
    assert "remat'd block whose recording cannot be replayed" in message
    assert calls[0] == 2  # the forward, and the re-run that met the nested checkpoint


# -- what stays not replayable -------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["none", "everything"])
def test_a_write_after_a_save_is_still_not_replayable(policy: str) -> None:
    def saved_then_written(x):
        y = x.sin().exp()  # exp saves its output
        y.add_(1)
        return y * 2

    def indices_then_written(x):
        v, i = x.sin().max(0)  # max saves its indices (an output with no gradient)
        i.add_(0)
        return v.sum() + x[i.clamp(0, 0)].sum()

    for fn in (saved_then_written, indices_then_written):
        x = torch.randn(3, 4, requires_grad=True)
        _, seg = segment_of(ckptfx.remat(fn, policy=POLICIES[policy]), x)
        assert not seg.replayable and "autograd saved" in seg.why_not


def test_residual_report_names_the_op_that_filled_a_kept_buffer() -> None:
    x, w = _leaves()
    r = ckptfx.remat(_rrelu, policy=cp.everything_saveable, static_argnums=2)
    sources = [res.source for res in ckptfx.saved_residuals(r, x, w, [0])]
    assert any(s.startswith("output of aten.rrelu_with_noise") for s in sources), sources
    assert not any("empty_like" in s for s in sources), sources
