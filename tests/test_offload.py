"""Offload that overlaps (``ckptfx.offload``): residuals copied to host memory on a side stream in
the forward, reloaded ahead of the backward, one reload per block per session.

The device tests run on the accelerator (the fake one in CI, ``tests/fake_device``): its memory
is host memory, so a copy to the host really is made, and its stream log (fake_device.cpp Rule
4) shows on which stream each copy, event and wait was issued, and any host wait.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy

import ckptfx
from ckptfx import checkpoint_policies as cp
from ckptfx.offload import HostGroup, HostResidual
from ckptfx.offload.pool import HostPool, size_class
from conftest import (ACCELERATOR, assert_bitwise, maybe_autocast, needs_accelerator,
                      settle_device_threads)

B, D = 8, 32
WIDTHS = (64, 128, 192)  # one hidden width per block: a reload's bytes name its block


def _weights(device: torch.device | str, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ws = []
    for h in WIDTHS:
        ws.append((torch.randn(D, h, generator=g) / 6).to(device, dtype).requires_grad_())
        ws.append((torch.randn(h, D, generator=g) / 6).to(device, dtype).requires_grad_())
    return ws


def _input(device: torch.device | str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(B, D, generator=g).to(device).requires_grad_()


def _block(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    h = F.dropout(torch.tanh(x @ w1), 0.25)
    return x + h @ w2


def _model(block: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def run(x: torch.Tensor, ws: list[torch.Tensor]) -> torch.Tensor:
        for i in range(len(WIDTHS)):
            x = block(x, ws[2 * i], ws[2 * i + 1])
        return x
    return run


def _grads(run: Callable[..., torch.Tensor], x: torch.Tensor, ws: list[torch.Tensor],
           autocast: bool = False, seed: int = 7) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    if x.device.type != "cpu":
        torch.get_device_module(x.device.type).manual_seed(seed)
    with maybe_autocast(autocast, x.device.type):
        out = run(x, ws)
    return list(torch.autograd.grad(out.float().square().sum(), [x, *ws]))


def _device() -> torch.device:
    assert ACCELERATOR is not None
    return torch.device(ACCELERATOR.type, 0)


def _stream_log() -> Any:
    import fake_device

    if not fake_device.available():  # a real accelerator: no log to read
        pytest.skip("the stream log is the fake accelerator's")
    return fake_device.stream_log()


def _offload_matmuls(**options: Any) -> Callable[..., Any]:
    offload = ckptfx.Offload(**options)

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return offload if op is torch.ops.aten.mm.default else False
    return policy


def _sac_offload_matmuls() -> Any:
    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return (CheckpointPolicy.MUST_CPU_OFFLOAD if op is torch.ops.aten.mm.default
                else CheckpointPolicy.PREFER_RECOMPUTE)
    return policy


POLICIES = {
    "offload_dot_with_no_batch_dims": cp.offload_dot_with_no_batch_dims,
    "save_and_offload_only_these_names": lambda: cp.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=["h"]),
    "sac_must_cpu_offload": _sac_offload_matmuls,
    "prefetch_0": lambda: _offload_matmuls(prefetch=0),
    "prefetch_2": lambda: _offload_matmuls(prefetch=2),
}


def _named_block(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    h = ckptfx.checkpoint_name(x @ w1, "h")
    return x + F.dropout(torch.tanh(h), 0.25) @ w2


# -- gradients ---------------------------------------------------------------------------------


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_offload_on_the_cpu_keeps_values_and_gradients_bitwise(name: str, autocast: bool) -> None:
    body = _named_block if name.startswith("save_and") else _block
    x, ws = _input("cpu"), _weights("cpu")
    expected = _grads(_model(body), x, ws, autocast)
    got = _grads(_model(ckptfx.remat(body, policy=POLICIES[name]())), x, ws, autocast)
    assert_bitwise(got, expected)


@needs_accelerator
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_offloaded_values_come_back_bitwise_on_the_device(name: str, autocast: bool) -> None:
    body = _named_block if name.startswith("save_and") else _block
    device = _device()
    x, ws = _input(device), _weights(device)
    expected = _grads(_model(body), x, ws, autocast)
    before = ckptfx.offload_pool_stats().in_use_bytes
    got = _grads(_model(ckptfx.remat(body, policy=POLICIES[name]())), x, ws, autocast)
    assert_bitwise(got, expected)
    gc.collect()
    assert ckptfx.offload_pool_stats().in_use_bytes == before


@needs_accelerator
def test_a_torch_sac_policy_given_to_checkpoint_offloads_for_real_and_stays_bitwise() -> None:
    """torch's selective-checkpoint policy answering MUST_CPU_OFFLOAD, as
    ``ckptfx.checkpoint(..., policy=)``: the matmul outputs go to host memory (torch's eager
    checkpoint keeps them on the device), with the gradients of no checkpointing."""
    device = _device()
    x, ws = _input(device), _weights(device)
    expected = _grads(_model(_block), x, ws)

    def block(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        return ckptfx.checkpoint(_block, x, w1, w2, policy=_sac_offload_matmuls())
    with _stream_log() as log:
        got = _grads(_model(block), x, ws)
    assert [e[3] for e in log if e[0] == "d2h"] == [B * h * 4 for h in WIDTHS]
    assert_bitwise(got, expected)


# -- the forward: copies on the side stream, device memory freed -----------------------------


@needs_accelerator
def test_copies_to_the_host_run_on_a_side_stream_and_never_wait_on_the_host() -> None:
    device = _device()
    x, ws = _input(device), _weights(device)
    run = _model(ckptfx.remat(_block, policy=cp.offload_dot_with_no_batch_dims()))
    with _stream_log() as forward:
        out = run(x, ws)
    with _stream_log() as backward:
        torch.autograd.grad(out.sum(), [x, *ws])
    d2h = [e for e in forward if e[0] == "d2h"]
    assert [e[3] for e in d2h] == [B * h * 4 for h in WIDTHS]  # one per block, its mm output
    assert all(e[2] != 0 for e in d2h)  # not the default (compute) stream
    side = d2h[0][2]
    # each copy is ordered after the compute stream (the side stream waits on an event the
    # compute stream recorded), and its own event is recorded on the side stream
    for e in d2h:
        i = forward.index(e)
        assert forward[i - 1][0] == "wait" and forward[i - 1][2] == side
        assert forward[i + 1][0] == "record" and forward[i + 1][2] == side
    assert not [e for e in forward + backward if e[0] == "sync"]  # no host waits at all


@needs_accelerator
def test_device_memory_of_offloaded_values_is_freed_between_forward_and_backward() -> None:
    device = _device()
    x, ws = _input(device), _weights(device)
    settle_device_threads()  # an earlier backward's graph is freed now, not while measuring
    gc.collect()
    gc.disable()  # no other test's garbage freed inside the measured forwards
    try:
        kept = torch.accelerator.memory_allocated(device)
        out = _model(ckptfx.remat(_block, policy=cp.dots_with_no_batch_dims_saveable))(x, ws)
        kept = torch.accelerator.memory_allocated(device) - kept
        del out
        offloaded = torch.accelerator.memory_allocated(device)
        pool = ckptfx.offload_pool_stats().in_use_bytes
        out = _model(ckptfx.remat(_block, policy=cp.offload_dot_with_no_batch_dims()))(x, ws)
        offloaded = torch.accelerator.memory_allocated(device) - offloaded
        host = ckptfx.offload_pool_stats().in_use_bytes - pool
    finally:
        gc.enable()
    # dots_saveable keeps both matmul outputs of each block; relu-free h @ w2 is read by no
    # backward, so only x @ w1 is a residual: exactly its bytes left the device
    assert kept - offloaded == sum(B * h * 4 for h in WIDTHS)
    assert host == sum(size_class(B * h * 4) for h in WIDTHS)  # the pool's size classes
    del out
    gc.collect()
    assert ckptfx.offload_pool_stats().in_use_bytes == pool


# -- the backward: reloads ahead, on the side stream, waited for on the device --------------


def _reload_order(log: list[tuple[str, int, int, int]]) -> list[tuple[str, int]]:
    """The side-stream copies back (by block) and the compute stream's waits on their events,
    in issue order."""
    events: dict[int, int] = {}
    out: list[tuple[str, int]] = []
    last_block = None
    for i, (kind, _, stream, value) in enumerate(log):
        if kind == "h2d" and stream != 0:
            last_block = WIDTHS.index(value // (B * 4))
            out.append(("reload", last_block))
        elif kind == "record" and stream != 0 and last_block is not None:
            events[value] = last_block
            last_block = None
        elif kind == "wait" and stream == 0 and value in events:
            out.append(("wait", events[value]))
    return out


@needs_accelerator
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_the_next_blocks_are_reloaded_while_this_one_runs_its_backward(prefetch: int) -> None:
    device = _device()
    x, ws = _input(device), _weights(device)
    expected = _grads(_model(_block), x, ws)
    torch.manual_seed(7)
    torch.get_device_module(device.type).manual_seed(7)
    out = _model(ckptfx.remat(_block, policy=_offload_matmuls(prefetch=prefetch)))(x, ws)
    with _stream_log() as log:
        grads = torch.autograd.grad(out.float().square().sum(), [x, *ws])
    assert_bitwise(grads, expected)
    order = [step for i, step in enumerate(_reload_order(log))
             if step not in _reload_order(log)[:i]]  # the first wait on each reload
    last = len(WIDTHS) - 1
    assert order[0] == ("reload", last)
    ahead = [("reload", last - k) for k in range(1, prefetch + 1) if last - k >= 0]
    # block L-1's reload (and L-2's with prefetch 2) is issued before the compute stream
    # first waits for block L's: it runs under block L's backward
    assert order[1:1 + len(ahead)] == ahead
    assert order[1 + len(ahead)] == ("wait", last)
    assert sorted(s for s in order if s[0] == "reload") == [("reload", b) for b in range(last + 1)]


@needs_accelerator
def test_one_reload_per_block_per_session_across_dx_and_k_dw_calls() -> None:
    device = _device()
    x, ws = _input(device), _weights(device)
    expected = _grads(_model(_block), x, ws)
    run = _model(ckptfx.remat(_block, policy=cp.offload_dot_with_no_batch_dims()))
    torch.manual_seed(7)
    torch.get_device_module(device.type).manual_seed(7)
    loss = run(x, ws).float().square().sum()
    groups = [ws[0::2], ws[1::2]]  # k = 2 weight groups, each its own backward call
    try:
        with _stream_log() as log, ckptfx.recompute_session_ctx("mb", retain_on_unpack=True):
            dx = torch.autograd.grad(loss, x, retain_graph=True)
            dw = [torch.autograd.grad(loss, group, retain_graph=True) for group in groups]
    finally:
        ckptfx.clear_recompute_session("mb")
    reloads = [e for e in log if e[0] == "h2d" and e[2] != 0]
    assert sorted(e[3] for e in reloads) == sorted(B * h * 4 for h in WIDTHS)  # once each
    got = [*dx, *(dw[i % 2][i // 2] for i in range(len(ws)))]
    assert_bitwise(got, expected)
    del loss
    gc.collect()
    assert ckptfx.offload_pool_stats().in_use_bytes == 0


@needs_accelerator
def test_vjp_split_reloads_each_block_once_for_dx_and_dw() -> None:
    device = _device()
    x, ws = _input(device), _weights(device)
    expected = _grads(_model(_block), x, ws)
    run = _model(ckptfx.remat(_block, policy=cp.offload_dot_with_no_batch_dims()))

    def fun(ws: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return run(x, ws).float().square().sum()

    torch.manual_seed(7)
    torch.get_device_module(device.type).manual_seed(7)
    with _stream_log() as log:
        out, dx_fn, dw_fn = ckptfx.vjp_split(fun, ws, x, x_argnums=1)
        dx = dx_fn(torch.ones_like(out))
        dw = dw_fn()
    reloads = [e for e in log if e[0] == "h2d" and e[2] != 0]
    assert sorted(e[3] for e in reloads) == sorted(B * h * 4 for h in WIDTHS)
    assert_bitwise([dx, *dw], expected)
    gc.collect()
    assert ckptfx.offload_pool_stats().in_use_bytes == 0


@needs_accelerator
def test_a_prefire_issues_the_reload_before_the_backward() -> None:
    device = _device()
    x, ws = _input(device), _weights(device)
    block = ckptfx.remat(_block, policy=cp.offload_dot_with_no_batch_dims())
    with ckptfx.recompute_handle_collector_ctx() as handles:
        out = _model(block)(x, ws)
    with _stream_log() as prefire:
        for h in handles:
            ckptfx.recompute_handle(h, "mb0")
    try:
        with _stream_log() as backward, ckptfx.recompute_session_ctx("mb0"):
            torch.autograd.grad(out.sum(), [x, *ws])
    finally:
        ckptfx.clear_recompute_session("mb0")
    assert len([e for e in prefire if e[0] == "h2d" and e[2] != 0]) == len(WIDTHS)
    assert not [e for e in backward if e[0] == "h2d" and e[2] != 0]


@needs_accelerator
def test_a_second_backward_with_retain_graph_reloads_and_stays_bitwise() -> None:
    device = _device()
    x, ws = _input(device), _weights(device)
    torch.manual_seed(7)
    torch.get_device_module(device.type).manual_seed(7)
    out = _model(ckptfx.remat(_block, policy=cp.offload_dot_with_no_batch_dims()))(x, ws)
    first = torch.autograd.grad(out.sum(), [x, *ws], retain_graph=True)
    gc.collect()
    with _stream_log() as log:
        second = torch.autograd.grad(out.sum(), [x, *ws])
    assert_bitwise(second, first)
    assert len([e for e in log if e[0] == "h2d" and e[2] != 0]) == len(WIDTHS)


# -- layout, sizes, writes ------------------------------------------------------------------


def _qkv_block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    q, k, v = (x @ w).chunk(3, dim=-1)  # three views of one storage, each saved
    return (q * k * v).sum(-1, keepdim=True) * x


@needs_accelerator
def test_views_of_one_storage_are_copied_once_and_keep_their_layout() -> None:
    device = _device()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(B, D, generator=g).to(device).requires_grad_()
    w = (torch.randn(D, 3 * D, generator=g) / 6).to(device).requires_grad_()
    expected = torch.autograd.grad(_qkv_block(x, w).sum(), [x, w])
    block = ckptfx.remat(_qkv_block, policy=_offload_matmuls())
    with _stream_log() as log:
        out = block(x, w)
    assert [e[3] for e in log if e[0] == "d2h"] == [B * 3 * D * 4]  # the one storage
    residuals = [r for r in ckptfx.saved_residuals(block, x, w) if r.kind == "offloaded"]
    assert len(residuals) == 3
    assert_bitwise(torch.autograd.grad(out.sum(), [x, w]), expected)


@needs_accelerator
def test_values_below_min_bytes_stay_on_the_device() -> None:
    device = _device()
    x, ws = _input(device), _weights(device)
    big = B * max(WIDTHS) * 4
    block = ckptfx.remat(_block, policy=_offload_matmuls(min_bytes=big))
    kinds = {r.kind for r in ckptfx.saved_residuals(block, x, ws[0], ws[1])
             if r.source.startswith("output")}
    assert kinds == {"saved"}  # B x 64 floats < min_bytes
    with _stream_log() as log:
        out = _model(block)(x, ws)
    assert [e[3] for e in log if e[0] == "d2h"] == [big]  # only the widest block's
    expected = _grads(_model(_block), x, ws)
    del out
    assert_bitwise(_grads(_model(block), x, ws), expected)


def _write_after_save(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = torch.tanh(x @ w)  # saves its output y
    out = y * 2
    y.mul_(3)  # a saved value, offloaded: its copy may still be reading it
    return out


@needs_accelerator
def test_a_write_to_a_value_being_copied_waits_for_the_copy_and_is_refused_as_torch_does() -> None:
    device = _device()
    g = torch.Generator().manual_seed(4)
    x = torch.randn(B, D, generator=g).to(device).requires_grad_()
    w = (torch.randn(D, 4 * D, generator=g) / 6).to(device).requires_grad_()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(_write_after_save(x, w).sum(), [x, w])
    offload_all = ckptfx.Offload()
    block = ckptfx.remat(_write_after_save, policy=lambda ctx, op, *a, **k: offload_all)
    with _stream_log() as log:
        out = block(x, w)
    copies = {log[i + 1][3] for i, e in enumerate(log) if e[0] == "d2h"}
    write = next(i for i, e in enumerate(log) if e[0] == "wait" and e[2] == 0 and e[3] in copies)
    assert write < len(log)  # the compute stream waited for the copy out before the write
    with pytest.raises(ckptfx.CheckpointError, match="modified in place after it was saved"):
        torch.autograd.grad(out.sum(), [x, w])


@needs_accelerator
def test_an_output_still_being_copied_holds_the_caller_back() -> None:
    device = _device()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(B, D, generator=g).to(device).requires_grad_()
    w = (torch.randn(D, D, generator=g) / 6).to(device).requires_grad_()

    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ w) @ w  # the last mm's output is returned, and saved by no one

    def saves_output(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = x @ w
        return y, torch.exp(y)  # exp saves its output: y is a residual and an output
    remat = ckptfx.remat(saves_output, policy=_offload_matmuls())
    with _stream_log() as log:
        y, e = remat(x, w)
    copies = {log[i + 1][3] for i, entry in enumerate(log) if entry[0] == "d2h"}
    assert any(entry[0] == "wait" and entry[2] == 0 and entry[3] in copies for entry in log)
    y.add_(1)  # the caller may write its output once the block returned
    expected = torch.autograd.grad(torch.exp(x @ w).sum(), [x, w])
    assert_bitwise(torch.autograd.grad(e.sum(), [x, w]), expected)
    del block


# -- lifetimes ------------------------------------------------------------------------------


@needs_accelerator
def test_no_buffer_or_event_outlives_the_step_and_the_next_step_reuses_the_buffers() -> None:
    device = _device()
    x, ws = _input(device), _weights(device)
    run = _model(ckptfx.remat(_block, policy=cp.offload_dot_with_no_batch_dims()))
    gc.collect()
    before = ckptfx.offload_pool_stats()
    refs: list[Any] = []
    events: list[list[torch.Event]] = []
    made = HostGroup.__init__

    def spy(self: HostGroup, *args: Any, **kwargs: Any) -> None:
        made(self, *args, **kwargs)
        refs.append(weakref.ref(self))
        events.append(self.buffers.d2h)  # the list: its events are appended as copies go
    HostGroup.__init__ = spy  # type: ignore[method-assign]
    try:
        for _ in range(2):
            torch.autograd.grad(run(x, ws).sum(), [x, *ws])
    finally:
        HostGroup.__init__ = made  # type: ignore[method-assign]
    event_refs = [weakref.ref(e) for group in events for e in group]
    del events
    gc.collect()
    after = ckptfx.offload_pool_stats()
    assert len(refs) == 2 * len(WIDTHS) and all(r() is None for r in refs)
    assert len(event_refs) == 2 * len(WIDTHS) and all(r() is None for r in event_refs)
    assert after.in_use_bytes == before.in_use_bytes
    # the second step found the first step's buffers in the pool
    assert after.allocations - before.allocations <= len(WIDTHS)


@needs_accelerator
def test_a_dropped_graph_frees_host_and_device_memory() -> None:
    device = _device()
    x, ws = _input(device), _weights(device)
    settle_device_threads()
    gc.collect()
    base = torch.accelerator.memory_allocated(device)
    pool = ckptfx.offload_pool_stats().in_use_bytes
    out = _model(ckptfx.remat(_block, policy=cp.offload_dot_with_no_batch_dims()))(x, ws)
    groups = [weakref.ref(r.group) for r in gc.get_referrers(HostResidual)
              if isinstance(r, HostResidual)]
    assert ckptfx.offload_pool_stats().in_use_bytes > pool
    del out
    gc.collect()
    assert all(g() is None for g in groups)
    assert ckptfx.offload_pool_stats().in_use_bytes == pool
    assert torch.accelerator.memory_allocated(device) == base


@needs_accelerator
def test_host_memory_that_cannot_be_had_is_a_clear_error_leaving_no_state(
        monkeypatch: pytest.MonkeyPatch) -> None:
    device = _device()
    x, ws = _input(device), _weights(device)
    ckptfx.empty_offload_pool()

    def no_memory(self: HostPool, nbytes: int) -> torch.Tensor:
        raise RuntimeError("CUDA error: out of memory (pinned)")
    monkeypatch.setattr(HostPool, "_allocate", no_memory)
    before = ckptfx.offload_pool_stats().in_use_bytes
    run = _model(ckptfx.remat(_block, policy=cp.offload_dot_with_no_batch_dims()))
    with pytest.raises(ckptfx.CheckpointError, match="could not allocate .* pinned host "
                       "memory.*empty_offload_pool.*offload_dst='cpu'"):
        run(x, ws)
    gc.collect()
    assert ckptfx.offload_pool_stats().in_use_bytes == before
    monkeypatch.undo()
    expected = _grads(_model(_block), x, ws)
    assert_bitwise(_grads(run, x, ws), expected)  # works again once memory can be had


# -- bad input --------------------------------------------------------------------------------


def test_a_host_memory_kind_given_as_src_points_at_dst() -> None:
    with pytest.raises(ValueError, match=r"the host memory is dst, the second argument: "
                                         r"Offload\(dst='pinned_host'\)"):
        ckptfx.Offload("pinned_host")


@pytest.mark.parametrize("field, value, error", [
    ("min_bytes", -1, ValueError), ("min_bytes", 1.5, TypeError), ("prefetch", -2, ValueError),
    ("prefetch", "1", TypeError), ("prefetch", True, TypeError)])
def test_offload_options_are_checked(field: str, value: Any, error: type) -> None:
    with pytest.raises(error, match=f"Offload: {field} must be an int >= 0"):
        ckptfx.Offload(**{field: value})


# -- a whole transformer block, everything it keeps offloaded ------------------------------


@needs_accelerator
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("attention", ["bmm", "matmul"])
def test_a_transformer_block_offloading_everything_it_keeps_is_bitwise(
        attention: str, autocast: bool) -> None:
    """Every value the backward or the replay reads in host memory (views of qkv, attention
    probabilities, layer-norm statistics, dropout masks), three blocks, dropout on."""
    from ckptfx.bench.blocks import Block

    device = _device()
    torch.manual_seed(0)
    blocks = [Block(32, heads=4, dropout=0.1, attention=attention).to(device) for _ in range(3)]
    params = [p for b in blocks for p in b.parameters()]
    x = torch.randn(2, 16, 32).to(device).requires_grad_()
    everything = ckptfx.Offload(min_bytes=0)
    remats = [ckptfx.remat(b, policy=lambda ctx, op, *a, **k: everything) for b in blocks]

    def run(fns: list[Any]) -> list[torch.Tensor]:
        torch.manual_seed(3)
        torch.get_device_module(device.type).manual_seed(3)
        with maybe_autocast(autocast, device.type):
            h = x
            for fn in fns:
                h = fn(h)
        return list(torch.autograd.grad(h.float().square().sum(), [x, *params]))

    expected = run(blocks)
    with _stream_log() as log:
        got = run(remats)
    assert_bitwise(got, expected)
    assert [e for e in log if e[0] == "d2h"]  # it did go to the host
    gc.collect()
    assert ckptfx.offload_pool_stats().in_use_bytes == 0



# -- what the reviewers found: sessions, budgets, the pool ---------------------------------


@needs_accelerator
def test_a_backward_never_prefetches_into_its_session_a_block_of_another_micro_batch() -> None:
    """Forward mb0, forward mb1, then mb1's backward first in its session: its prefetch may
    reload mb0's last block early, but never registers it to mb1's session, so mb0's
    backward in its own session works and is bitwise."""
    device = _device()
    ws = _weights(device)
    x0, x1 = _input(device), (_input(device) * 2).detach().requires_grad_()
    run = _model(ckptfx.remat(_block, policy=cp.offload_dot_with_no_batch_dims()))

    def grads_of(x: torch.Tensor) -> Any:
        return _grads(run, x, ws)
    expected = [grads_of(x0), grads_of(x1)]
    torch.manual_seed(7)
    torch.get_device_module(device.type).manual_seed(7)
    l0 = run(x0, ws).float().square().sum()
    torch.manual_seed(7)
    torch.get_device_module(device.type).manual_seed(7)
    l1 = run(x1, ws).float().square().sum()
    try:
        with ckptfx.recompute_session_ctx("mb1"):
            g1 = torch.autograd.grad(l1, [x1, *ws])
        with ckptfx.recompute_session_ctx("mb0"):
            g0 = torch.autograd.grad(l0, [x0, *ws])
    finally:
        ckptfx.clear_recompute_session("mb0")
        ckptfx.clear_recompute_session("mb1")
    assert_bitwise(g0, expected[0])
    assert_bitwise(g1, expected[1])


@needs_accelerator
def test_a_budget_of_nothing_on_the_device_still_offloads() -> None:
    device = _device()
    ws = _weights(device)
    x = torch.randn(512, D, generator=torch.Generator().manual_seed(1)).to(device)
    x.requires_grad_()  # each block's matmul output is over the budget's 64 KiB minimum
    block = ckptfx.remat(_block, policy=cp.memory_budget(0.0, offload=1.0))
    expected = _grads(_model(_block), x, ws)
    _grads(_model(block), x, ws)  # plans
    with _stream_log() as log:
        got = _grads(_model(block), x, ws)
    assert [e for e in log if e[0] == "d2h"]
    assert_bitwise(got, expected)


def test_the_pool_reuses_buffers_across_shapes_and_caches_no_more_than_it_ever_used() -> None:
    pool = HostPool(torch.device("cpu"), pinned=False)
    most, classes = 0, set()
    for step in range(40):
        sizes = [1000 * (step % 7 + 1), 3000 * (step % 5 + 1), 70_000 + 97 * step]
        bufs = [pool.take(n) for n in sizes]
        assert all(b.numel() >= n and b.numel() == size_class(n) for b, n in zip(bufs, sizes))
        classes.update(b.numel() for b in bufs)
        most = max(most, sum(b.numel() for b in bufs))
        for b in bufs:
            pool.give(b)
        assert pool.in_use == 0 and pool.cached <= 2 * most
    assert pool.allocations <= len(classes) + 3  # 40 steps, 120 buffers: a few allocations
    assert size_class(1) == 4096 and size_class(4097) == 8192
    assert all(n <= size_class(n) <= n * 9 // 8 + 4096 for n in (5000, 70_001, 10**6 + 3))


@needs_accelerator
def test_copied_and_reloaded_memory_is_handed_to_the_allocator_with_the_side_stream() -> None:
    """A device source freed while its copy out may run, or a reload buffer freed unread,
    is recorded on the side stream (the allocator waits for it), never freed bare."""
    device = _device()
    x, ws = _input(device), _weights(device)
    with _stream_log() as log:
        out = _model(ckptfx.remat(_block, policy=cp.offload_dot_with_no_batch_dims()))(x, ws)
        torch.autograd.grad(out.sum(), [x, *ws])
    side = {e[2] for e in log if e[0] == "d2h"}
    recorded = [e for e in log if e[0] == "record_stream"]
    assert len(side) == 1 and 0 not in side
    assert [e[3] for e in recorded if e[2] in side].count(B * WIDTHS[0] * 4) == 2  # out, back
    assert len([e for e in recorded if e[2] in side]) == 2 * len(WIDTHS)


@needs_accelerator
def test_apply_activation_checkpointing_offloads_a_model_budget() -> None:
    from ckptfx.bench.blocks import Block

    device = _device()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.ModuleList(Block(32) for _ in range(3))).to(device)
    layers = model[0]
    params = list(model.parameters())
    x = torch.randn(4, 512, 32).to(device).requires_grad_()

    def step() -> list[torch.Tensor]:
        h = x
        for layer in layers:
            h = layer(h)
        return list(torch.autograd.grad(h.square().sum(), [x, *params]))

    expected = step()
    ckptfx.apply_activation_checkpointing(model, memory_budget=0.1, offload=0.5)
    step()  # plans
    with _stream_log() as log:
        got = step()
    assert [e for e in log if e[0] == "d2h"]  # what the budget could not keep went to host
    assert_bitwise(got, expected)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"offload": 0.2}, ValueError, "offload= is the host share of memory_budget="),
    ({"memory_budget": 0.2, "offload": "a"}, TypeError, "offload"),
    ({"memory_budget": 0.2, "offload": 1.5}, ValueError, "offload")])
def test_apply_activation_checkpointing_checks_offload(kwargs: dict, error: type,
                                                       match: str) -> None:
    from ckptfx.bench.blocks import MLPBlock

    model = torch.nn.Sequential(torch.nn.ModuleList(MLPBlock(8, 16) for _ in range(2)))
    with pytest.raises(error, match=match):
        ckptfx.apply_activation_checkpointing(model, **kwargs)
    assert not any("_ckptfx_options" in m.__dict__ for m in model.modules())  # no state left


@needs_accelerator
def test_a_value_read_by_the_replay_and_by_autograd_is_reloaded_once() -> None:
    """gelu(x @ w1) @ w2 offloading x @ w1: the replay reads it (to recompute gelu's output)
    and gelu's backward unpacks it: one copy back serves both."""
    device = _device()
    g = torch.Generator().manual_seed(8)
    w1 = (torch.randn(D, 4 * D, generator=g) / 6).to(device).requires_grad_()
    w2 = (torch.randn(4 * D, D, generator=g) / 6).to(device).requires_grad_()
    x = torch.randn(4 * B, D, generator=g).to(device)

    def mlp(x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x @ w1) @ w2

    expected = torch.autograd.grad(mlp(x).sum(), [w1, w2])
    out = ckptfx.remat(mlp, policy=cp.offload_dot_with_no_batch_dims())(x)
    with _stream_log() as log:
        got = torch.autograd.grad(out.sum(), [w1, w2])
    assert [e[3] for e in log if e[0] == "h2d" and e[2] != 0] == [4 * B * 4 * D * 4]
    assert_bitwise(got, expected)


@needs_accelerator
@pytest.mark.parametrize("transform", ["grad", "vmap_grad"])
def test_torch_func_over_an_offloading_block_on_the_device_is_bitwise(transform: str) -> None:
    device = _device()
    g = torch.Generator().manual_seed(9)
    x, w, w2 = (torch.randn(16, 16, generator=g).to(device) for _ in range(3))

    def body(x: torch.Tensor, w: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        return (F.gelu(x @ w) @ w2).sum()

    block = ckptfx.remat(body, policy=_offload_matmuls(min_bytes=0))

    def run(f: Callable[..., torch.Tensor]) -> Any:
        grad = torch.func.grad(f, argnums=(1, 2))
        if transform == "vmap_grad":
            return torch.func.vmap(grad, in_dims=(0, None, None))(x.view(4, 4, 16), w, w2)
        return grad(x, w, w2)

    assert_bitwise(list(run(block)), list(run(body)))


@needs_accelerator
def test_an_offloaded_output_the_caller_still_holds_is_read_there_not_reloaded() -> None:
    device = _device()
    g = torch.Generator().manual_seed(10)
    x = torch.randn(B, D, generator=g).to(device).requires_grad_()
    w = (torch.randn(D, D, generator=g) / 6).to(device).requires_grad_()

    def block(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x @ w
        return y, torch.exp(y)  # exp saves its output; y is kept for the replay of exp's

    expected = torch.autograd.grad(torch.exp(x @ w).sum(), [x, w])
    y, e = ckptfx.remat(block, policy=_offload_matmuls(min_bytes=0))(x, w)
    with _stream_log() as log:
        got = torch.autograd.grad(e.sum(), [x, w])
    assert not [entry for entry in log if entry[0] == "h2d" and entry[2] != 0]
    assert_bitwise(got, expected)
    del y
