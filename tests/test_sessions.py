"""Scheduled recomputation: collector, prefire, session contexts (also as decorators, and single
use), clear, stats.

Every test counts block runs with a counter inside the block and compares gradients bitwise
(``torch.equal``) with the same computation without checkpointing, in fp32 and under bf16
autocast, with dropout. Those that run a backward do so on the CPU and on the accelerator under
test (conftest's ``device``), where autograd runs it on its device threads; the argument checks
run on the CPU only.
"""

from __future__ import annotations

import functools
import gc
import weakref
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as tcp

import ckptfx
from ckptfx.kernel import handles as handles_mod
from ckptfx.kernel.frame import tls
from conftest import settle_device_threads
from models import D, Block

pytestmark = pytest.mark.usefixtures("no_sessions_left")
from ckptfx import CheckpointError

B = 4  # the batch; D is models.Block's width
AUTOCAST = [None, torch.bfloat16]


# -- helpers ------------------------------------------------------------------------------


class FallibleBlock(Block):
    """models.Block with a second, explicit dropout-like keep-mask after ``fc1``, a weakref
    to each run's mask (``seen``), and runs that raise on demand (``fail_on``); ``runs``
    counts forward calls (forward + replays)."""

    def __init__(self) -> None:
        super().__init__()
        self.fail_on: set[int] = set()  # run numbers (1-based) that raise
        # weakref to each run's keep-mask: a saved tensor that does not require grad, so the
        # replay caches this very object (a tensor requiring grad is cached detached)
        self.seen: list[weakref.ref[torch.Tensor]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.note_run()
        if self.runs in self.fail_on:
            raise RuntimeError(f"block failed on run {self.runs}")
        keep = torch.rand(x.shape[0], 1, device=x.device) > 0.1  # a second, dropout-like mask
        self.seen.append(weakref.ref(keep))
        h = self.fc1(x) * keep
        return x + self.fc2(F.dropout(F.gelu(h), self.p, self.training))


def make_blocks(n: int = 2, seed: int = 0, device: torch.device | str = "cpu"
                ) -> list[FallibleBlock]:
    torch.manual_seed(seed)
    return [FallibleBlock().train().to(device) for _ in range(n)]


def params_of(blocks: list[FallibleBlock]) -> list[torch.Tensor]:
    return [p for b in blocks for p in b.parameters()]


def runs_of(blocks: list[FallibleBlock]) -> list[int]:
    return [b.runs for b in blocks]


def reset_runs(blocks: list[FallibleBlock]) -> None:
    for b in blocks:
        b.runs = 0


def autocast_ctx(dtype: torch.dtype | None, device: torch.device) -> Any:
    """Autocast to ``dtype`` on ``device``'s type, or autocast disabled there (None)."""
    return (torch.autocast(device.type, dtype=dtype) if dtype is not None
            else torch.autocast(device.type, enabled=False))


def run_stack(blocks: list[FallibleBlock], x: torch.Tensor, mode: str, **kw: Any) -> torch.Tensor:
    for b in blocks:
        if mode == "plain":
            x = b(x)
        elif mode == "torch":
            x = tcp.checkpoint(b, x, use_reentrant=False, **kw)
        else:
            x = ckptfx.checkpoint(b, x, **kw)
    return x


def inputs(seed: int = 1, device: torch.device | str = "cpu"
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The input (a leaf requiring grad) and the output gradient, on ``device``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, D, generator=g).to(device).requires_grad_()
    gout = torch.randn(B, D, generator=g).to(device)
    return x, gout


def reference(blocks: list[FallibleBlock], x: torch.Tensor, gout: torch.Tensor,
              dtype: torch.dtype | None, seed: int = 1234) -> list[torch.Tensor]:
    """dx and every dw of the stack without checkpointing."""
    torch.manual_seed(seed)
    with autocast_ctx(dtype, x.device):
        out = run_stack(blocks, x, "plain")
    return list(torch.autograd.grad(out, [x, *params_of(blocks)], gout))


def assert_equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"gradient {i} differs"


def split_step(blocks: list[FallibleBlock], x: torch.Tensor, gout: torch.Tensor, sid: Any, *,
               dtype: torch.dtype | None = None, prefire: bool = True, per_param: bool = False,
               seed: int = 1234, **ckpt_kw: Any) -> list[torch.Tensor]:
    """Forward under a collector, prefire, dx (retain), dw (last consumer), clear."""
    params = params_of(blocks)
    torch.manual_seed(seed)
    with ckptfx.recompute_handle_collector_ctx() as handles:
        with autocast_ctx(dtype, x.device):
            out = run_stack(blocks, x, "ckptfx", **ckpt_kw)
    assert len(handles) == len(blocks)
    try:
        if prefire:
            for h in handles:
                ckptfx.recompute_handle(h, sid)
        with ckptfx.recompute_session_ctx(sid, retain_on_unpack=True):
            (dx,) = torch.autograd.grad(out, x, gout, retain_graph=True)
            dw = ([torch.autograd.grad(out, p, gout, retain_graph=True)[0] for p in params[:-1]]
                  if per_param else [])
        with ckptfx.recompute_session_ctx(sid, retain_on_unpack=False):
            if per_param:
                dw.append(torch.autograd.grad(out, params[-1], gout)[0])
            else:
                dw = list(torch.autograd.grad(out, params, gout))
    finally:
        ckptfx.clear_recompute_session(sid)
    return [dx, *dw]


# -- one replay -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", AUTOCAST)
def test_one_replay_prefire_dx_dw(device: torch.device, dtype: torch.dtype | None) -> None:
    blocks = make_blocks(1, device=device)
    x, gout = inputs(device=device)
    want = reference(blocks, x, gout, dtype)
    reset_runs(blocks)
    got = split_step(blocks, x, gout, "mb0", dtype=dtype)
    assert runs_of(blocks) == [2]
    assert_equal(got, want)


@pytest.mark.parametrize("dtype", AUTOCAST)
def test_several_frames_and_dw_per_parameter_share_one_replay(device: torch.device,
                                                              dtype: torch.dtype | None
                                                              ) -> None:
    blocks = make_blocks(3, device=device)
    x, gout = inputs(device=device)
    want = reference(blocks, x, gout, dtype)
    reset_runs(blocks)
    got = split_step(blocks, x, gout, ("stage0", 0), dtype=dtype, per_param=True)
    assert runs_of(blocks) == [2, 2, 2]
    assert_equal(got, want)


def test_torch_native_split_replays_per_call(device: torch.device) -> None:
    """The problem being solved: torch replays once per backward call (1 + 1 + k)."""
    blocks = make_blocks(1, device=device)
    x, gout = inputs(device=device)
    params = params_of(blocks)
    out = run_stack(blocks, x, "torch")
    torch.autograd.grad(out, x, gout, retain_graph=True)
    for p in params:
        torch.autograd.grad(out, p, gout, retain_graph=True)
    assert runs_of(blocks) == [2 + len(params)]


def _mm_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return tcp.CheckpointPolicy.MUST_SAVE
    return tcp.CheckpointPolicy.PREFER_RECOMPUTE


@pytest.mark.parametrize("dtype", AUTOCAST)
def test_sac_context_fn_cache_consumed_once_by_prefire(device: torch.device,
                                                      dtype: torch.dtype | None) -> None:
    context_fn = functools.partial(tcp.create_selective_checkpoint_contexts, _mm_policy)
    blocks = make_blocks(2, device=device)
    x, gout = inputs(device=device)
    want = reference(blocks, x, gout, dtype)

    # torch: a split backward over SAC replays twice and the second replay finds the cache
    # consumed.
    torch.manual_seed(1234)
    with autocast_ctx(dtype, device):
        out = run_stack(blocks, x, "torch", context_fn=context_fn)
    torch.autograd.grad(out, x, gout, retain_graph=True)
    with pytest.raises(RuntimeError, match="backward an extra time"):
        torch.autograd.grad(out, params_of(blocks), gout)

    reset_runs(blocks)
    params = params_of(blocks)
    torch.manual_seed(1234)
    with ckptfx.recompute_handle_collector_ctx() as handles:
        with autocast_ctx(dtype, device):
            out = run_stack(blocks, x, "ckptfx", context_fn=context_fn)
    try:
        for h in handles:
            ckptfx.recompute_handle(h, "sac")
        with ckptfx.recompute_session_ctx("sac", retain_on_unpack=True):
            got = list(torch.autograd.grad(out, x, gout, retain_graph=True))
            got += [torch.autograd.grad(out, p, gout, retain_graph=True)[0] for p in params]
    finally:
        ckptfx.clear_recompute_session("sac")
    assert runs_of(blocks) == [2, 2]
    assert_equal(got, want)
    # The prefire consumed the SAC cache: a further (native) replay finds it used up.
    with pytest.raises(RuntimeError, match="backward an extra time"):
        torch.autograd.grad(out, x, gout)


# -- environment ------------------------------------------------------------------------------


class MaskBlock(nn.Module):
    """Dropout with an explicit mask, so each run's mask can be compared."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.masks: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = (torch.rand(x.shape, device=x.device) > 0.5).to(x.dtype)
        self.masks.append(mask)
        return self.fc(x * mask)


def rng_states(device: torch.device) -> list[torch.Tensor]:
    """The CPU generator's state, and the device generator's where ``device`` is not the CPU
    (the masks of a block on the device are drawn from the latter)."""
    states = [torch.get_rng_state()]
    if device.type != "cpu":
        states.append(torch.get_device_module(device.type).get_rng_state(device))
    return states


def test_prefire_keeps_caller_rng_and_replays_forward_masks(device: torch.device) -> None:
    torch.manual_seed(0)
    block = MaskBlock().to(device)
    x, gout = inputs(device=device)
    torch.manual_seed(7)
    out_plain = block(x)
    want = torch.autograd.grad(out_plain, [x, *block.parameters()], gout)
    block.masks.clear()

    torch.manual_seed(7)
    with ckptfx.recompute_handle_collector_ctx() as handles:
        out = ckptfx.checkpoint(block, x)
    torch.rand(3, device=device)  # the caller moves on
    before = rng_states(device)
    try:
        ckptfx.recompute_handle(handles[0], "rng")
        assert all(map(torch.equal, rng_states(device), before))
        assert len(block.masks) == 2 and torch.equal(block.masks[0], block.masks[1])
        with ckptfx.recompute_session_ctx("rng", retain_on_unpack=False):
            got = torch.autograd.grad(out, [x, *block.parameters()], gout)
    finally:
        ckptfx.clear_recompute_session("rng")
    assert all(map(torch.equal, rng_states(device), before))
    assert len(block.masks) == 2
    assert_equal(list(got), list(want))


@pytest.mark.parametrize("prefire_ctx", ["outside", "disabled"])
def test_prefire_outside_autocast_replays_in_forward_dtype(device: torch.device,
                                                          prefire_ctx: str) -> None:
    blocks = make_blocks(2, device=device)
    x, gout = inputs(device=device)
    want = reference(blocks, x, gout, torch.bfloat16)
    reset_runs(blocks)
    params = params_of(blocks)
    torch.manual_seed(1234)
    with ckptfx.recompute_handle_collector_ctx() as handles:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = run_stack(blocks, x, "ckptfx")
    try:
        ctx = (torch.autocast(device.type, enabled=False) if prefire_ctx == "disabled"
               else autocast_ctx(None, device))
        with ctx:
            for h in handles:
                ckptfx.recompute_handle(h, "amp")
        assert not torch.is_autocast_enabled(device.type)
        with ckptfx.recompute_session_ctx("amp", retain_on_unpack=True):
            got = list(torch.autograd.grad(out, x, gout, retain_graph=True))
        with ckptfx.recompute_session_ctx("amp", retain_on_unpack=False):
            got += list(torch.autograd.grad(out, params, gout))
    finally:
        ckptfx.clear_recompute_session("amp")
    assert runs_of(blocks) == [2, 2]
    assert_equal(got, want)
    # and the autocast mattered: the fp32 gradients differ
    assert not torch.equal(reference(blocks, x, gout, None)[0], want[0])


# -- isolation ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", AUTOCAST)
def test_interleaved_microbatches_are_isolated(device: torch.device,
                                              dtype: torch.dtype | None) -> None:
    blocks = make_blocks(2, device=device)
    params = params_of(blocks)
    mbs = [inputs(seed, device=device) for seed in (11, 12, 13)]
    # Reference: the three forwards in the same order (same dropout masks), plain.
    torch.manual_seed(99)
    want = []
    outs = []
    for x, _ in mbs:
        with autocast_ctx(dtype, device):
            outs.append(run_stack(blocks, x, "plain"))
    for (x, g), out in zip(mbs, outs):
        want.append(list(torch.autograd.grad(out, [x, *params], g)))
    reset_runs(blocks)

    torch.manual_seed(99)
    outs, got = {}, {i: [] for i in range(3)}

    def fwd(i: int) -> None:
        with ckptfx.recompute_handle_collector_ctx() as handles:
            with autocast_ctx(dtype, device):
                outs[i] = run_stack(blocks, mbs[i][0], "ckptfx")
        for h in handles:
            ckptfx.recompute_handle(h, ("mb", i))

    def dx(i: int) -> None:
        with ckptfx.recompute_session_ctx(("mb", i), retain_on_unpack=True):
            got[i] += torch.autograd.grad(outs[i], mbs[i][0], mbs[i][1], retain_graph=True)

    def dw(i: int) -> None:
        try:
            with ckptfx.recompute_session_ctx(("mb", i), retain_on_unpack=False):
                got[i] += torch.autograd.grad(outs[i], params, mbs[i][1])
        finally:
            ckptfx.clear_recompute_session(("mb", i))

    try:
        # F1 F2 dx1 F3 dx2 dw1 dx3 dw2 dw3
        for step, i in [(fwd, 0), (fwd, 1), (dx, 0), (fwd, 2), (dx, 1), (dw, 0), (dx, 2),
                        (dw, 1), (dw, 2)]:
            step(i)
            live = ckptfx.recompute_session_stats()
            assert all(k[0] == "mb" for k in live)
    finally:
        for i in range(3):
            ckptfx.clear_recompute_session(("mb", i))
    assert runs_of(blocks) == [6, 6]
    for i in range(3):
        assert_equal(got[i], want[i])
    assert ckptfx.recompute_session_stats() == {}


def test_frame_reused_by_new_session_after_clear(device: torch.device) -> None:
    blocks = make_blocks(2, device=device)
    x, gout = inputs(device=device)
    want = reference(blocks, x, gout, None)
    reset_runs(blocks)
    params = params_of(blocks)
    torch.manual_seed(1234)
    with ckptfx.recompute_handle_collector_ctx() as handles:
        out = run_stack(blocks, x, "ckptfx")
    for sid in ("first", "second"):
        try:
            for h in handles:
                ckptfx.recompute_handle(h, sid)
            with ckptfx.recompute_session_ctx(sid, retain_on_unpack=True):
                got = list(torch.autograd.grad(out, x, gout, retain_graph=True))
            with ckptfx.recompute_session_ctx(sid, retain_on_unpack=False):
                got += torch.autograd.grad(out, params, gout, retain_graph=True)
        finally:
            ckptfx.clear_recompute_session(sid)
        assert_equal(got, want)
    assert runs_of(blocks) == [3, 3]


# -- failure ----------------------------------------------------------------------------------


def _collect_forward(blocks: list[FallibleBlock], x: torch.Tensor) -> tuple[torch.Tensor, list]:
    torch.manual_seed(1234)
    with ckptfx.recompute_handle_collector_ctx() as handles:
        out = run_stack(blocks, x, "ckptfx")
    return out, handles


def test_failed_prefire_then_clear_frames_work_natively(device: torch.device) -> None:
    blocks = make_blocks(2, device=device)
    x, gout = inputs(device=device)
    want = reference(blocks, x, gout, None)
    reset_runs(blocks)
    blocks[1].fail_on = {2}  # the prefire of the second block raises
    out, handles = _collect_forward(blocks, x)
    with pytest.raises(RuntimeError, match="failed on run 2"):
        for h in handles:
            ckptfx.recompute_handle(h, "bad")
    ckptfx.clear_recompute_session("bad")
    assert ckptfx.recompute_session_stats() == {}
    got = list(torch.autograd.grad(out, [x, *params_of(blocks)], gout))
    assert_equal(got, want)
    assert runs_of(blocks) == [3, 3]  # forward, prefire (one failed), native replay


@pytest.mark.parametrize("clear_first", [True, False])
def test_retry_after_failed_prefire(device: torch.device, clear_first: bool) -> None:
    blocks = make_blocks(2, device=device)
    x, gout = inputs(device=device)
    want = reference(blocks, x, gout, None)
    reset_runs(blocks)
    blocks[0].fail_on = {2}
    out, handles = _collect_forward(blocks, x)
    with pytest.raises(RuntimeError, match="failed on run 2"):
        ckptfx.recompute_handle(handles[0], "retry")
    if clear_first:
        ckptfx.clear_recompute_session("retry")
    try:
        for h in handles:
            ckptfx.recompute_handle(h, "retry")
        with ckptfx.recompute_session_ctx("retry", retain_on_unpack=True):
            got = list(torch.autograd.grad(out, x, gout, retain_graph=True))
        with ckptfx.recompute_session_ctx("retry", retain_on_unpack=False):
            got += torch.autograd.grad(out, params_of(blocks), gout)
    finally:
        ckptfx.clear_recompute_session("retry")
    assert_equal(got, want)
    assert runs_of(blocks) == [3, 2]


def test_failed_dx_then_clear_frames_work_again(device: torch.device) -> None:
    blocks = make_blocks(1, device=device)
    x, gout = inputs(device=device)
    want = reference(blocks, x, gout, None)
    reset_runs(blocks)
    out, handles = _collect_forward(blocks, x)
    try:
        ckptfx.recompute_handle(handles[0], "s")
        with ckptfx.recompute_session_ctx("s", retain_on_unpack=False):
            torch.autograd.grad(out, x, gout, retain_graph=True)
        with pytest.raises(CheckpointError, match="retain_on_unpack=True"):
            with ckptfx.recompute_session_ctx("s", retain_on_unpack=False):
                torch.autograd.grad(out, params_of(blocks), gout, retain_graph=True)
    finally:
        ckptfx.clear_recompute_session("s")
    got = list(torch.autograd.grad(out, [x, *params_of(blocks)], gout))
    assert_equal(got, want)
    assert runs_of(blocks) == [3]


def test_no_replayed_tensor_alive_after_clear(device: torch.device) -> None:
    blocks = make_blocks(2, device=device)
    x, gout = inputs(device=device)
    out, handles = _collect_forward(blocks, x)
    forward_hidden = [b.seen[-1] for b in blocks]
    assert all(r() is None for r in forward_hidden)  # checkpointed: not saved
    for h in handles:
        ckptfx.recompute_handle(h, "leak")
    replayed = [b.seen[-1] for b in blocks]
    assert all(r() is not None for r in replayed)  # cached for the session
    with ckptfx.recompute_session_ctx("leak", retain_on_unpack=True):
        torch.autograd.grad(out, x, gout, retain_graph=True)
    gc.collect()
    assert all(r() is not None for r in replayed)  # retained for dw
    ckptfx.clear_recompute_session("leak")
    gc.collect()
    assert all(r() is None for r in replayed)
    assert ckptfx.recompute_session_stats() == {}
    # The graph is still usable natively, and freeing it leaves nothing behind.
    frames = [weakref.ref(h.frame) for h in handles]
    torch.autograd.grad(out, params_of(blocks), gout)
    del out
    gc.collect()
    assert all(f() is None for f in frames)
    assert all(h.frame is None for h in handles)


def test_uncleared_session_vanishes_with_its_graph(device: torch.device) -> None:
    """No unbounded registry: a session never cleared goes when its frames go."""
    blocks = make_blocks(2, device=device)
    x, gout = inputs(device=device)
    for mb in range(3):
        out, handles = _collect_forward(blocks, x)
        for h in handles:
            ckptfx.recompute_handle(h, ("leaky", mb))
        with ckptfx.recompute_session_ctx(("leaky", mb), retain_on_unpack=True):
            torch.autograd.grad(out, x, gout, retain_graph=True)
        replayed = [b.seen[-1] for b in blocks]
        assert ("leaky", mb) in ckptfx.recompute_session_stats()
        del out, handles
        settle_device_threads()  # the device thread may still hold the finished task
        gc.collect()
        assert all(r() is None for r in replayed)
        assert ckptfx.recompute_session_stats() == {}


def test_uncleared_lazy_session_vanishes_with_its_graph(device: torch.device) -> None:
    blocks = make_blocks(1, device=device)
    x, gout = inputs(device=device)
    out, _ = _collect_forward(blocks, x)
    with ckptfx.recompute_session_ctx("lazy-leak", retain_on_unpack=True):
        torch.autograd.grad(out, x, gout, retain_graph=True)
    assert ckptfx.recompute_session_stats()["lazy-leak"].frames == 1
    replayed = blocks[0].seen[-1]
    del out
    gc.collect()
    assert replayed() is None
    assert ckptfx.recompute_session_stats() == {}


# -- lazy sessions and forwards inside a session ------------------------------------------------


@pytest.mark.parametrize("dtype", AUTOCAST)
@pytest.mark.parametrize("per_param", [False, True])
def test_lazy_session_shares_one_replay(device: torch.device, dtype: torch.dtype | None,
                                       per_param: bool) -> None:
    blocks = make_blocks(2, device=device)
    x, gout = inputs(device=device)
    want = reference(blocks, x, gout, dtype)
    reset_runs(blocks)
    got = split_step(blocks, x, gout, "lazy", dtype=dtype, prefire=False, per_param=per_param)
    assert runs_of(blocks) == [2, 2]
    assert_equal(got, want)


@pytest.mark.parametrize("prefire", [True, False])
def test_forward_inside_active_session(device: torch.device, prefire: bool) -> None:
    """Overlapped F and B (DualPipeV): forward of mb1 inside mb0's session contexts."""
    blocks = make_blocks(2, device=device)
    params = params_of(blocks)
    (x0, g0), (x1, g1) = inputs(21, device=device), inputs(22, device=device)
    torch.manual_seed(5)
    o0, o1 = run_stack(blocks, x0, "plain"), run_stack(blocks, x1, "plain")
    want0 = list(torch.autograd.grad(o0, [x0, *params], g0))
    want1 = list(torch.autograd.grad(o1, [x1, *params], g1))
    reset_runs(blocks)

    torch.manual_seed(5)
    with ckptfx.recompute_handle_collector_ctx() as h0:
        o0 = run_stack(blocks, x0, "ckptfx")
    try:
        if prefire:
            for h in h0:
                ckptfx.recompute_handle(h, 0)
        with ckptfx.recompute_session_ctx(0, retain_on_unpack=True):
            with ckptfx.recompute_handle_collector_ctx() as h1:
                o1 = run_stack(blocks, x1, "ckptfx")  # forward of the next micro-batch
            got0 = list(torch.autograd.grad(o0, x0, g0, retain_graph=True))
        with ckptfx.recompute_session_ctx(0, retain_on_unpack=False):
            got0 += torch.autograd.grad(o0, params, g0)
        if prefire:
            for h in h1:
                ckptfx.recompute_handle(h, 1)
        with ckptfx.recompute_session_ctx(1, retain_on_unpack=True):
            got1 = list(torch.autograd.grad(o1, x1, g1, retain_graph=True))
        with ckptfx.recompute_session_ctx(1, retain_on_unpack=False):
            got1 += torch.autograd.grad(o1, params, g1)
    finally:
        ckptfx.clear_recompute_session(0)
        ckptfx.clear_recompute_session(1)
    assert len(h1) == 2
    assert runs_of(blocks) == [4, 4]
    assert_equal(got0, want0)
    assert_equal(got1, want1)


# -- native fallback -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", AUTOCAST)
def test_without_session_split_replays_like_torch(device: torch.device,
                                                 dtype: torch.dtype | None) -> None:
    blocks = make_blocks(1, device=device)
    x, gout = inputs(device=device)
    params = params_of(blocks)
    want = reference(blocks, x, gout, dtype)
    results = {}
    for mode in ("torch", "ckptfx"):
        reset_runs(blocks)
        torch.manual_seed(1234)
        with autocast_ctx(dtype, device):
            out = run_stack(blocks, x, mode)
        got = list(torch.autograd.grad(out, x, gout, retain_graph=True))
        got += torch.autograd.grad(out, params, gout)
        assert_equal(got, want)
        results[mode] = runs_of(blocks)
    assert results["ckptfx"] == results["torch"] == [3]


def test_nested_checkpoints_work_natively_like_torch(device: torch.device) -> None:
    torch.manual_seed(0)
    inner, outer_lin = FallibleBlock().to(device), nn.Linear(D, D).to(device)
    calls = {"outer": 0}
    x, gout = inputs(device=device)

    def make_outer(ckpt: Callable[..., torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        def outer(t: torch.Tensor) -> torch.Tensor:
            calls["outer"] += 1
            return outer_lin(ckpt(inner, t.sin())).cos()
        return outer

    params = [*inner.parameters(), *outer_lin.parameters()]
    torch.manual_seed(3)
    want = torch.autograd.grad(make_outer(lambda f, t: f(t))(x), [x, *params], gout)
    counts = {}
    for name, ckpt in (("torch", functools.partial(tcp.checkpoint, use_reentrant=False)),
                       ("ckptfx", ckptfx.checkpoint)):
        calls["outer"] = 0
        inner.runs = 0
        torch.manual_seed(3)
        out = ckpt(make_outer(ckpt), x)
        got = torch.autograd.grad(out, [x, *params], gout)
        assert_equal(list(got), list(want))
        counts[name] = (calls["outer"], inner.runs)
    assert counts["ckptfx"] == counts["torch"]


# -- the context managers as decorators, single use ------------------------------------------
# They used to be ``contextlib.contextmanager`` generators: they stay usable as decorators
# and stay single use (a second entry is an error that leaves nothing behind).


def _counted_block(counter: list[int], device: torch.device | str = "cpu"
                   ) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]:
    """A block counting its runs in ``counter[0]``, and its weight (a leaf on ``device``)."""
    w = torch.randn(6, 6, generator=torch.Generator().manual_seed(0)).to(device)
    w.requires_grad_()

    def block(x: torch.Tensor) -> torch.Tensor:
        counter[0] += 1
        return F.gelu(x @ w) @ w

    return block, w


# Found in review of the session context managers as classes (was test_review_regressions_3.py).
def test_session_context_works_as_a_decorator_once_per_call(device: torch.device) -> None:
    calls = [0]
    block, w = _counted_block(calls, device)
    x = torch.randn(3, 6, device=device, requires_grad=True)
    expected = torch.autograd.grad(block(x).sum(), [x, w])
    calls[0] = 0

    @ckptfx.recompute_session_ctx("deco", retain_on_unpack=True)
    def dx(out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        assert tls.activation is not None and tls.activation.session.id == "deco"
        return torch.autograd.grad(out.sum(), [x], retain_graph=True)

    @ckptfx.recompute_session_ctx("deco", retain_on_unpack=False)
    def dw(out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(out.sum(), [w])

    for _ in range(2):  # a decorated function opens a new context at each call
        out = ckptfx.checkpoint(block, x)
        try:
            got = dx(out) + dw(out)
        finally:
            ckptfx.clear_recompute_session("deco")
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
        assert tls.activation is None
    assert calls[0] == 2 * 2  # per round: the forward and one replay for dx and dw


# Found in review of the session context managers as classes (was test_review_regressions_3.py).
def test_collector_works_as_a_decorator() -> None:
    block, _ = _counted_block([0])
    x = torch.randn(3, 6, requires_grad=True)

    @ckptfx.recompute_handle_collector_ctx()
    def forward() -> torch.Tensor:
        return ckptfx.checkpoint(block, x)

    with ckptfx.recompute_handle_collector_ctx() as outer:
        forward()
        forward()
    assert outer == []  # the decorated forwards collected into their own collectors
    assert not handles_mod.collecting()


# Found in review of the session context managers as classes (was test_review_regressions_3.py).
@pytest.mark.parametrize("make", [
    lambda: ckptfx.recompute_session_ctx("once"),
    lambda: ckptfx.recompute_handle_collector_ctx(),
], ids=["recompute_session_ctx", "recompute_handle_collector_ctx"])
def test_context_entered_twice_is_an_error_that_leaves_nothing(make: Callable[[], Any]
                                                                ) -> None:
    ctx = make()
    with ctx:
        pass
    with pytest.raises(RuntimeError, match="single use"):
        with ctx:
            pass
    assert tls.activation is None
    assert not handles_mod.collecting()
    assert "once" not in ckptfx.recompute_session_stats()


# -- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [None, [1], {"a": 1}])
def test_bad_session_id_is_value_error(bad: Any) -> None:
    blocks = make_blocks(1)
    x, _ = inputs()
    _, handles = _collect_forward(blocks, x)
    with pytest.raises(ValueError, match="session_id"):
        ckptfx.recompute_handle(handles[0], bad)
    with pytest.raises(ValueError, match="session_id"):
        with ckptfx.recompute_session_ctx(bad):
            pass
    with pytest.raises(ValueError, match="session_id"):
        ckptfx.clear_recompute_session(bad)
    assert ckptfx.recompute_session_stats() == {}
    assert handles[0].frame.session is None


@pytest.mark.parametrize("bad", [1, 0, None, "yes"])
def test_retain_on_unpack_must_be_bool(bad: Any) -> None:
    with pytest.raises(ValueError, match="retain_on_unpack"):
        with ckptfx.recompute_session_ctx("s", retain_on_unpack=bad):
            pass
    assert ckptfx.recompute_session_stats() == {}


def test_handle_not_from_collector() -> None:
    blocks = make_blocks(1)
    x, _ = inputs()
    _, handles = _collect_forward(blocks, x)
    for bad in (handles[0].frame, "handle", None, object()):
        with pytest.raises(ValueError, match="handle must be a RecomputeHandle"):
            ckptfx.recompute_handle(bad, "s")
    assert ckptfx.recompute_session_stats() == {}


@pytest.mark.parametrize("inner_id", ["a", "b"])
def test_nested_session_ctx_rejected(inner_id: str) -> None:
    with ckptfx.recompute_session_ctx("a"):
        with pytest.raises(CheckpointError, match="do not nest"):
            with ckptfx.recompute_session_ctx(inner_id):
                pass
    # the outer context closed cleanly and the thread can open a session again
    with ckptfx.recompute_session_ctx("c"):
        pass


def test_two_sessions_on_one_frame_rejected_naming_both(device: torch.device) -> None:
    blocks = make_blocks(1, device=device)
    x, gout = inputs(device=device)
    out, handles = _collect_forward(blocks, x)
    try:
        ckptfx.recompute_handle(handles[0], "first-id")
        with pytest.raises(CheckpointError) as err:
            ckptfx.recompute_handle(handles[0], "second-id")
        assert "first-id" in str(err.value) and "second-id" in str(err.value)
        # the rejected prefire left no session behind (even while its traceback lives)
        assert set(ckptfx.recompute_session_stats()) == {"first-id"}
        # bound by an open context: also rejected, naming both
        with ckptfx.recompute_session_ctx("first-id", retain_on_unpack=True):
            with pytest.raises(CheckpointError) as err:
                ckptfx.recompute_handle(handles[0], "third-id")
            assert "first-id" in str(err.value) and "third-id" in str(err.value)
            assert set(ckptfx.recompute_session_stats()) == {"first-id"}
    finally:
        ckptfx.clear_recompute_session("first-id")
    # afterwards the frame works natively
    torch.autograd.grad(out, x, gout)
    assert blocks[0].runs == 3


def test_checkpoint_created_during_scheduled_replay_rejected(device: torch.device) -> None:
    torch.manual_seed(0)
    inner = FallibleBlock().to(device)

    def outer(t: torch.Tensor) -> torch.Tensor:
        return ckptfx.checkpoint(inner, t.sin()).cos()

    x, gout = inputs(device=device)
    with ckptfx.recompute_handle_collector_ctx() as handles:
        out = ckptfx.checkpoint(outer, x)
    assert len(handles) == 2 and handles[1].frame.fn is inner
    outer_handle = handles[0]  # listed in the order the forwards started: outer first
    try:
        with pytest.raises(CheckpointError, match="not supported"):
            ckptfx.recompute_handle(outer_handle, "nested")
    finally:
        ckptfx.clear_recompute_session("nested")
    # the same graph still works natively
    torch.autograd.grad(out, x, gout)


def test_second_consumer_after_retain_false_is_clear_error(device: torch.device) -> None:
    blocks = make_blocks(1, device=device)
    x, gout = inputs(device=device)
    out, handles = _collect_forward(blocks, x)
    try:
        ckptfx.recompute_handle(handles[0], "once")
        with ckptfx.recompute_session_ctx("once", retain_on_unpack=False):
            torch.autograd.grad(out, x, gout, retain_graph=True)
            with pytest.raises(CheckpointError, match="already handed out") as err:
                torch.autograd.grad(out, params_of(blocks), gout, retain_graph=True)
            assert "'once'" in str(err.value)
    finally:
        ckptfx.clear_recompute_session("once")


def test_collector_skips_failed_and_no_grad_forwards() -> None:
    blocks = make_blocks(1)
    x, _ = inputs()
    blocks[0].fail_on = {1}
    with ckptfx.recompute_handle_collector_ctx() as handles:
        with pytest.raises(RuntimeError):
            ckptfx.checkpoint(blocks[0], x)
        with torch.no_grad():
            ckptfx.checkpoint(blocks[0], x)
    assert handles == []


# -- introspection ----------------------------------------------------------------------------


def _sin_exp(t: torch.Tensor) -> torch.Tensor:
    # saves exactly two tensors of t's size: sin's input and exp's result
    return (t * 2).sin().exp()


def test_session_stats_report_frames_tensors_bytes(device: torch.device) -> None:
    x, gout = inputs(device=device)
    with ckptfx.recompute_handle_collector_ctx() as handles:
        out = ckptfx.checkpoint(_sin_exp, ckptfx.checkpoint(_sin_exp, x))
    size = x.numel() * x.element_size()
    with ckptfx.recompute_handle_collector_ctx() as other_handles:
        other = ckptfx.checkpoint(_sin_exp, x)
    try:
        assert ckptfx.recompute_session_stats() == {}
        ckptfx.recompute_handle(handles[0], "s1")
        s = ckptfx.recompute_session_stats()["s1"]
        assert (s.session_id, s.frames, s.replayed, s.tensors, s.nbytes) == ("s1", 1, 1, 2,
                                                                             2 * size)
        ckptfx.recompute_handle(handles[1], "s1")
        ckptfx.recompute_handle(other_handles[0], "s2")
        stats = ckptfx.recompute_session_stats()
        assert set(stats) == {"s1", "s2"}
        assert (stats["s1"].frames, stats["s1"].tensors, stats["s1"].nbytes) == (2, 4, 4 * size)
        assert (stats["s2"].frames, stats["s2"].tensors, stats["s2"].nbytes) == (1, 2, 2 * size)
        with ckptfx.recompute_session_ctx("s1", retain_on_unpack=False):
            torch.autograd.grad(out, x, gout, retain_graph=True)
        s = ckptfx.recompute_session_stats()["s1"]
        assert (s.frames, s.tensors, s.nbytes) == (2, 0, 0)
        ckptfx.clear_recompute_session("s1")
        assert set(ckptfx.recompute_session_stats()) == {"s2"}
        ckptfx.clear_recompute_session("s1")  # idempotent
        ckptfx.clear_recompute_session("never-seen")  # unknown id: no-op
        del other
        gc.collect()
        assert ckptfx.recompute_session_stats() == {}  # graph freed: session gone
    finally:
        for sid in ("s1", "s2"):
            ckptfx.clear_recompute_session(sid)


def _aliasing_block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    a = x.view(-1).sin()  # sin saves a view of the input x: no memory of the replay's
    # mm saves a view of the activation a (counted) and w.t(), a view of a leaf (not)
    return torch.nn.functional.linear(a.view_as(x), w).exp()  # exp saves its result (counted)


@pytest.mark.parametrize("prefire", [True, False])
def test_session_stats_leave_out_replayed_views_of_inputs_and_parameters(device: torch.device,
                                                                          prefire: bool
                                                                          ) -> None:
    # The first session replay of a frame notes which saved tensors alias an input or a
    # parameter (a view or the tensor itself): they hold no memory of the replay's own.
    x = torch.randn(4, 8, device=device, requires_grad=True)
    w = torch.randn(8, 8, device=device, requires_grad=True)
    with ckptfx.recompute_handle_collector_ctx() as handles:
        out = ckptfx.checkpoint(_aliasing_block, x, w)
    try:
        if prefire:
            ckptfx.recompute_handle(handles[0], "s")
        else:  # replayed at its first unpack, inside the session's context
            with ckptfx.recompute_session_ctx("s", retain_on_unpack=True):
                torch.autograd.grad(out, w, torch.ones_like(out), retain_graph=True)
        s = ckptfx.recompute_session_stats()["s"]
        # a (4 x 8 floats, viewed by mm's saved input) and exp's result (4 x 8 floats)
        assert (s.frames, s.replayed, s.tensors, s.nbytes) == (1, 1, 2, 2 * 4 * 8 * 4)
    finally:
        ckptfx.clear_recompute_session("s")
