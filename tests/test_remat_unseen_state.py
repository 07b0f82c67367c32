"""remat's recorded replay and what a recording cannot see: memory written outside the
dispatcher, a default dtype, grad-mode-dependent kernels, inference tensors.

A block whose forward touched state the recording cannot see is re-run as a Python function
(tracer.py Rule 4) or replayed under that state (segment.py Rule 3c), never replayed from a
recording that silently omits it. Every case is compared bitwise with plain autograd; the
block's Python runs are counted inside it.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import ckptfx
from ckptfx import checkpoint_policies as cp
from conftest import assert_bitwise

POLICIES = {
    "nothing": cp.nothing_saveable,
    "dots": cp.dots_saveable,
    "everything": cp.everything_saveable,
}


def _grads(fn: Callable[..., Any], x: torch.Tensor, params: list[torch.Tensor]
           ) -> list[torch.Tensor]:
    torch.manual_seed(0)
    out = fn(x)
    out = out[0] if isinstance(out, tuple) else out
    return [out, *torch.autograd.grad(out.square().sum(), [x, *params])]


# -- memory written outside the dispatcher ---------------------------------------------------


def _write_outside(kind: str, h: torch.Tensor) -> None:
    """Write into the block value ``h`` where no ATen op records it."""
    if kind == "numpy_item":
        h.detach().numpy()[0, 0] = 5.0
    elif kind == "numpy_inplace":
        a = h.detach().numpy()
        a *= 2
    elif kind == "from_numpy":
        torch.from_numpy(h.detach().numpy()).add_(1.5)
    elif kind == "dlpack":
        torch.from_dlpack(h.detach()).mul_(3)
    elif kind == "set_storage":
        alias = torch.empty(0).set_(h.detach().untyped_storage(), 0, h.shape)
        alias.add_(1)
    elif kind == "set_tensor":
        alias = torch.empty(0)
        alias.set_(h.detach())
        alias.sub_(0.5)
    else:
        raise AssertionError(kind)


WRITES = ["numpy_item", "numpy_inplace", "from_numpy", "dlpack", "set_storage", "set_tensor"]


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("kind", WRITES)
def test_value_written_outside_the_dispatcher_reruns_the_block(kind: str, policy: str) -> None:
    w = torch.randn(4, 4, requires_grad=True)
    calls = [0]

    def block(x: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        h = torch.tanh(x @ w)
        _write_outside(kind, h)
        return (h @ w).sin()

    x = torch.randn(3, 4, requires_grad=True)
    expected = _grads(block, x, [w])
    rematted = ckptfx.remat(block, policy=POLICIES[policy])
    for _ in range(2):  # the first call is recorded; a later one may run unrecorded
        calls[0] = 0
        assert_bitwise(_grads(rematted, x, [w]), expected)
        # the forward, and one re-run of the function where the policy dropped h's producer
        assert calls[0] == (1 if policy == "everything" else 2)


def test_input_handed_to_numpy_keeps_the_recorded_replay() -> None:
    """Only the block's own values count: reading a parameter through NumPy (a common way to
    log it) leaves the block replayable from its recording."""
    w = torch.randn(4, 4, requires_grad=True)
    seen = []

    def block(x: torch.Tensor) -> torch.Tensor:
        seen.append(float(w.detach().numpy()[0, 0]))
        return torch.tanh(x @ w).sin()

    x = torch.randn(3, 4, requires_grad=True)
    with ckptfx.recompute_handle_collector_ctx() as handles:
        out = ckptfx.remat(block)(x)
    assert handles[0].frame.rerun.__self__.replayable
    out.sum().backward()
    assert len(seen) == 1


# -- the default dtype ------------------------------------------------------------------------


def _factory_block(w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    def block(x: torch.Tensor) -> torch.Tensor:
        # ATen resolves the default dtype inside these factories
        ramp = torch.linspace(0, 1, x.shape[1])
        noise = torch.randn(x.shape)
        return (torch.tanh(x @ w) * ramp + noise).sin()
    return block


@pytest.mark.parametrize("policy", list(POLICIES))
def test_replay_runs_under_the_forward_default_dtype(policy: str) -> None:
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 4, requires_grad=True)
    block = _factory_block(w)
    expected = _grads(block, x, [w])
    torch.manual_seed(0)
    out = ckptfx.remat(block, policy=POLICIES[policy])(x)
    torch.set_default_dtype(torch.float64)
    try:
        actual = [out, *torch.autograd.grad(out.square().sum(), [x, w])]
        assert torch.get_default_dtype() == torch.float64  # the caller's, put back
    finally:
        torch.set_default_dtype(torch.float32)
    assert_bitwise(actual, expected)


def test_default_dtype_changed_inside_the_block_reruns_it() -> None:
    w = torch.randn(4, 4, requires_grad=True)

    def block(x: torch.Tensor) -> torch.Tensor:
        torch.set_default_dtype(torch.float64)
        try:
            ramp = torch.linspace(0, 1, x.shape[1]).float()
        finally:
            torch.set_default_dtype(torch.float32)
        return (torch.tanh(x @ w) * ramp).sin()

    x = torch.randn(3, 4, requires_grad=True)
    expected = _grads(block, x, [w])
    with ckptfx.recompute_handle_collector_ctx() as handles:
        torch.manual_seed(0)
        out = ckptfx.remat(block)(x)
    seg = handles[0].frame.rerun.__self__
    assert not seg.replayable and "default dtype" in seg.why_not
    assert_bitwise([out, *torch.autograd.grad(out.square().sum(), [x, w])], expected)


# -- modules torch's checkpoint runs ----------------------------------------------------------


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU])
def test_recurrent_module_replays_bitwise(cell: type[nn.Module], policy: str) -> None:
    """The oneDNN LSTM layer returns the workspace its backward reads only under grad mode:
    the replay runs with grad mode on, below autograd."""
    torch.manual_seed(0)
    rnn = cell(4, 5, num_layers=2, batch_first=True)
    x = torch.randn(2, 3, 4, requires_grad=True)
    params = list(rnn.parameters())
    assert_bitwise(_grads(ckptfx.remat(rnn, policy=POLICIES[policy]), x, params),
                   _grads(rnn, x, params))


def _batch_norm() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Tanh())


def _spectral_norm() -> nn.Module:
    torch.manual_seed(0)
    return nn.utils.parametrizations.spectral_norm(nn.Linear(4, 4))


@pytest.mark.parametrize("policy", list(POLICIES))
def test_batch_norm_updating_its_running_stats_replays_bitwise(policy: str) -> None:
    """A train-mode BatchNorm writes its running statistics in the block's own forward: not
    a modification between the forward and the backward."""
    x = torch.randn(6, 4, requires_grad=True)
    plain, rematted, theirs = _batch_norm(), _batch_norm(), _batch_norm()
    assert_bitwise(_grads(ckptfx.remat(rematted, policy=POLICIES[policy]), x,
                          list(rematted.parameters())),
                   _grads(plain, x, list(plain.parameters())))
    if policy == "everything":  # nothing to recompute: the forward updated them once
        assert_bitwise(list(rematted.buffers()), list(plain.buffers()), "buffer")
    else:  # the block is re-run and updates them again, as under torch's checkpoint
        _grads(lambda x: checkpoint(theirs, x, use_reentrant=False), x,
               list(theirs.parameters()))
        assert_bitwise(list(rematted.buffers()), list(theirs.buffers()), "buffer")


def test_spectral_norm_with_everything_kept_replays_bitwise() -> None:
    x = torch.randn(6, 4, requires_grad=True)
    plain, rematted = _spectral_norm(), _spectral_norm()
    assert_bitwise(_grads(ckptfx.remat(rematted, policy=cp.everything_saveable), x,
                          list(rematted.parameters())),
                   _grads(plain, x, list(plain.parameters())))
    assert_bitwise(list(rematted.buffers()), list(plain.buffers()), "buffer")


@pytest.mark.parametrize("policy", ["nothing", "dots"])
def test_block_that_rewrites_state_it_read_refuses_to_rerun(policy: str) -> None:
    """spectral_norm's power iteration reads its vector ``u`` and then writes it in place: a
    re-run would start from the new ``u`` (torch's checkpoint silently computes other
    gradients). The backward raises before any gradient is written."""
    x = torch.randn(6, 4, requires_grad=True)
    sn = _spectral_norm()
    out = ckptfx.remat(sn, policy=POLICIES[policy])(x)
    with pytest.raises(ckptfx.CheckpointError, match="that it also writes in place"):
        out.square().sum().backward()
    assert x.grad is None and all(p.grad is None for p in sn.parameters())


@pytest.mark.parametrize("policy", list(POLICIES))
def test_inference_mode_region_inside_the_block_replays_bitwise(policy: str) -> None:
    lin = nn.Linear(4, 4)
    with torch.inference_mode():
        offset = torch.full((4,), 0.25)  # an inference tensor from outside the block

    def block(x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            scale = torch.ones(4) * 2 + x.detach().mean()
        return F.gelu(lin(x)) + scale + offset

    x = torch.randn(6, 4, requires_grad=True)
    params = list(lin.parameters())
    assert_bitwise(_grads(ckptfx.remat(block, policy=POLICIES[policy]), x, params),
                   _grads(block, x, params))


@pytest.mark.parametrize("prefire", [False, True], ids=["lazy", "prefire"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_value_written_through_numpy_after_it_was_saved_reruns_to_the_end(
        policy: str, prefire: bool) -> None:
    """Plain autograd's backward reads the saved tensor's memory, NumPy's write included; the
    re-run must reach that write, though it comes after the block's last saved tensor."""
    w = torch.randn(4, 4, requires_grad=True)

    def block(x: torch.Tensor) -> torch.Tensor:
        h = x @ w
        s = torch.sin(h)  # saves h
        h.detach().numpy()[:, 0] = 5.0
        return s

    x = torch.randn(3, 4, requires_grad=True)
    expected = _grads(block, x, [w])
    with ckptfx.recompute_handle_collector_ctx() as handles:
        torch.manual_seed(0)
        out = ckptfx.remat(block, policy=POLICIES[policy])(x)
    session = "numpy-after-save"
    try:
        if prefire:
            for handle in handles:
                ckptfx.recompute_handle(handle, session)
        with ckptfx.recompute_session_ctx(session, retain_on_unpack=False):
            actual = [out, *torch.autograd.grad(out.square().sum(), [x, w])]
    finally:
        ckptfx.clear_recompute_session(session)
    assert_bitwise(actual, expected)


def test_default_dtype_set_and_restored_inside_the_block_reruns_it() -> None:
    """Type promotion reads the default dtype too (an integer tensor times a Python float):
    a change undone before the block returns is still seen, at the op that ran under it."""
    idx = torch.arange(4)

    def block(x: torch.Tensor) -> torch.Tensor:
        torch.set_default_dtype(torch.float64)
        try:
            s = idx * 0.1  # float64 here
        finally:
            torch.set_default_dtype(torch.float32)
        return (x * s.exp()).sin()

    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    expected = _grads(block, x, [])
    with ckptfx.recompute_handle_collector_ctx() as handles:
        torch.manual_seed(0)
        out = ckptfx.remat(block)(x)
    assert not handles[0].frame.rerun.__self__.replayable
    assert_bitwise([out, *torch.autograd.grad(out.square().sum(), [x])], expected)


@pytest.mark.parametrize("variant", ["checkpoint", "remat_later_call", "remat_not_replayable"])
def test_function_rerun_runs_under_the_forward_default_dtype(variant: str) -> None:
    """The replays that re-run the Python function restore the forward's default dtype as
    the recorded replay does (torch's checkpoint computes other gradients here)."""
    idx = torch.arange(4)

    def block(x: torch.Tensor) -> torch.Tensor:
        if variant == "remat_not_replayable":
            x.detach().numpy()  # its memory escapes: the block is re-run
        return torch.tanh(x * (idx * 0.1).to(torch.float64))

    rematted = ckptfx.remat(block)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    torch.set_default_dtype(torch.float64)
    try:
        expected = _grads(block, x, [])
        if variant == "remat_later_call":
            rematted(x)  # the first call, recorded; the next one runs unrecorded
        torch.manual_seed(0)
        out = (ckptfx.checkpoint(block, x) if variant == "checkpoint" else rematted(x))
    finally:
        torch.set_default_dtype(torch.float32)
    assert_bitwise([out, *torch.autograd.grad(out.square().sum(), [x])], expected)


@pytest.mark.parametrize("policy", ["nothing", "dots"])
def test_block_that_writes_state_and_then_reads_it_refuses_to_rerun(policy: str) -> None:
    """A counter the block increments and then reads: a re-run would increment it again and
    read that (torch's checkpoint silently computes other gradients)."""
    scale = torch.ones(4)
    w = torch.randn(4, 4, requires_grad=True)

    def block(x: torch.Tensor) -> torch.Tensor:
        scale.add_(1)
        return torch.tanh(x @ w * scale)

    x = torch.randn(3, 4, requires_grad=True)
    out = ckptfx.remat(block, policy=POLICIES[policy])(x)
    with pytest.raises(ckptfx.CheckpointError, match="that it also writes in place"):
        out.square().sum().backward()
    assert x.grad is None and w.grad is None
