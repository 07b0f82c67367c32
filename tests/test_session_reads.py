"""frame.py Rule 4b: a retaining session's reads are a dict lookup in C, with no Python.

A forward under a handle collector pushes ``frame.reads.__getitem__`` as its unpack hook;
session.py fills ``reads`` while a retaining, unlogged activation is bound, and empties it
otherwise, so a miss falls through to ``unpack_hook``. Calls of ckptfx's Python functions
during backward calls are counted with a profile hook (on the caller's thread, and on
autograd's device thread where the backward runs there), gradients are compared bitwise with
the plain computation (fp32 and bf16 autocast, dropout), block runs with a counter inside the
block; every test runs on the CPU and on the accelerator under test (conftest's ``device``).
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import weakref
from typing import Any, Callable

import pytest
import torch

import ckptfx
from conftest import assert_bitwise
from models import D, Block

pytestmark = pytest.mark.usefixtures("no_sessions_left")

B = 4  # the batch; D is models.Block's width
# The package's own folder: a checkout is often named ckptfx too, and its tests are not ckptfx.
_PACKAGE = os.path.dirname(ckptfx.__file__) + os.sep


def on_backward_thread(device: torch.device, fn: Callable[[], Any]) -> None:
    """Call ``fn`` on the thread that runs the backward calls this thread makes over tensors
    on ``device`` (autograd's device thread on an accelerator), from a hook of a tiny backward
    with nothing checkpointed in it."""
    ran: list[bool] = []

    def hook(grad: torch.Tensor) -> None:
        fn()
        ran.append(True)

    t = torch.zeros(1, device=device, requires_grad=True)
    y = t.clone()
    y.register_hook(hook)
    torch.autograd.grad(y.sum(), t)
    assert ran == [True]


class PythonCalls:
    """Counts calls of ckptfx's Python functions while active (``with``), on this thread and,
    for ``device`` an accelerator, on autograd's thread for that device, where this thread's
    backward calls unpack."""

    def __init__(self, device: torch.device) -> None:
        self.calls = 0
        self.device = device

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(_PACKAGE):
            self.calls += 1

    def __enter__(self) -> "PythonCalls":
        if self.device.type != "cpu":
            on_backward_thread(self.device, lambda: sys.setprofile(self._profile))
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc: Any) -> None:
        sys.setprofile(None)
        if self.device.type != "cpu":
            on_backward_thread(self.device, lambda: sys.setprofile(None))


def setup(device: torch.device, n: int = 2, dtype: torch.dtype | None = None
          ) -> tuple[Any, ...]:
    """``n`` blocks, their parameters, the input and output gradient, all on ``device``; the
    stack's forward (under ``device``'s autocast to ``dtype`` unless None), and the gradients
    of the input and parameters without checkpointing."""
    torch.manual_seed(0)
    blocks = [Block().to(device) for _ in range(n)]
    params = [p for b in blocks for p in b.parameters()]
    x = torch.randn(B, D).to(device).requires_grad_()
    gout = torch.randn(B, D).to(device)

    def stack(checkpointed: bool) -> torch.Tensor:
        torch.manual_seed(7)
        h = x
        with torch.autocast(device.type, dtype=dtype or torch.bfloat16,
                            enabled=dtype is not None):
            for b in blocks:
                h = ckptfx.checkpoint(b, h) if checkpointed else b(h)
        return h

    want = list(torch.autograd.grad(stack(False), [x, *params], gout))
    for b in blocks:
        b.runs = 0
    return blocks, params, x, gout, stack, want


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_retained_reads_run_no_python(device: torch.device, dtype: torch.dtype | None) -> None:
    blocks, params, x, gout, stack, want = setup(device, dtype=dtype)
    with ckptfx.recompute_handle_collector_ctx() as handles:
        out = stack(True)
    try:
        for h in handles:
            ckptfx.recompute_handle(h, "mb")
        with (ckptfx.recompute_session_ctx("mb", retain_on_unpack=True),
              PythonCalls(device) as kept):
            got = [torch.autograd.grad(out, x, gout, retain_graph=True)[0]]
            got += [torch.autograd.grad(out, p, gout, retain_graph=True)[0]
                    for p in params[:-1]]
        assert kept.calls == 0  # dx and every dw group but the last: all reads in C
        with (ckptfx.recompute_session_ctx("mb", retain_on_unpack=False),
              PythonCalls(device) as last):
            got.append(torch.autograd.grad(out, params[-1], gout)[0])
        assert last.calls > 0  # the last consumer drops what it reads: in Python
    finally:
        ckptfx.clear_recompute_session("mb")
    assert_bitwise(got, want)
    assert [b.runs for b in blocks] == [2, 2]  # forward + one replay, however many reads


def test_reads_follow_the_binding(device: torch.device) -> None:
    blocks, params, x, gout, stack, _ = setup(device, n=1)
    with ckptfx.recompute_handle_collector_ctx() as handles:
        out = stack(True)
    frame = handles[0].frame
    live = sum(ref() is not None for ref in frame.holders)
    try:
        ckptfx.recompute_handle(handles[0], "mb")
        assert len(frame.reads) == 0  # replayed, not bound
        with ckptfx.recompute_session_ctx("mb", retain_on_unpack=True):
            assert len(frame.reads) == live
            torch.autograd.grad(out, x, gout, retain_graph=True)
            assert len(frame.reads) == live  # retained: still there for dw
            ckptfx.kernel.session.tls.activation.record([])  # a logging dx leaves the dict
            assert len(frame.reads) == 0
        assert len(frame.reads) == 0
        with ckptfx.recompute_session_ctx("mb", retain_on_unpack=False):
            assert len(frame.reads) == 0  # the last consumer reads in Python
        with ckptfx.recompute_session_ctx("mb", retain_on_unpack=True):
            assert len(frame.reads) == live
            ckptfx.clear_recompute_session("mb")
            assert len(frame.reads) == 0
    finally:
        ckptfx.clear_recompute_session("mb")


def test_lazy_replay_fills_the_reads(device: torch.device) -> None:
    """No prefire: the first read replays (in Python), every later one is a dict hit."""
    blocks, params, x, gout, stack, want = setup(device)
    with ckptfx.recompute_handle_collector_ctx():
        out = stack(True)
    try:
        with ckptfx.recompute_session_ctx("lazy", retain_on_unpack=True):
            with PythonCalls(device) as first:
                got = [torch.autograd.grad(out, x, gout, retain_graph=True)[0]]
            assert first.calls > 0  # the first read of each block replays it
            with PythonCalls(device) as later:
                got += [torch.autograd.grad(out, p, gout, retain_graph=True)[0]
                        for p in params]
            assert later.calls == 0  # the replays filled the dicts
    finally:
        ckptfx.clear_recompute_session("lazy")
    assert_bitwise(got, want)
    assert [b.runs for b in blocks] == [2, 2]


def test_native_backward_of_a_collected_frame_is_torchs(device: torch.device) -> None:
    """Outside sessions the dict is empty: each backward replays and hands out once."""
    blocks, params, x, gout, stack, want = setup(device, n=1)
    with ckptfx.recompute_handle_collector_ctx():
        out = stack(True)
    got = list(torch.autograd.grad(out, [x, *params], gout, retain_graph=True))
    again = list(torch.autograd.grad(out, [x, *params], gout))
    assert_bitwise(got, want)
    assert_bitwise(again, want)
    assert blocks[0].runs == 3  # forward + one replay per backward, as torch


def test_frames_free_without_gc_after_the_session(device: torch.device) -> None:
    """The filled dict (frame -> reads -> holder -> frame) is emptied at the context's exit,
    so the graph and its frames go by reference counting alone."""
    blocks, params, x, gout, stack, _ = setup(device)
    gc.disable()
    try:
        with ckptfx.recompute_handle_collector_ctx() as handles:
            out = stack(True)
        frames = [weakref.ref(h.frame) for h in handles]
        for h in handles:
            ckptfx.recompute_handle(h, "mb")
        with ckptfx.recompute_session_ctx("mb", retain_on_unpack=True):
            torch.autograd.grad(out, x, gout, retain_graph=True)
        with ckptfx.recompute_session_ctx("mb", retain_on_unpack=False):
            torch.autograd.grad(out, params, gout)
        ckptfx.clear_recompute_session("mb")
        del out, handles
        assert all(f() is None for f in frames)
    finally:
        gc.enable()


def test_without_a_collector_reads_stay_in_python(device: torch.device) -> None:
    """A forward nobody collected keeps the plain hook (no dict miss on the native path)."""
    blocks, params, x, gout, stack, want = setup(device)
    out = stack(True)
    try:
        with ckptfx.recompute_session_ctx("plain", retain_on_unpack=True):
            got = [torch.autograd.grad(out, x, gout, retain_graph=True)[0]]
            with PythonCalls(device) as later:
                got += [torch.autograd.grad(out, p, gout, retain_graph=True)[0]
                        for p in params]
            assert later.calls > 0
    finally:
        ckptfx.clear_recompute_session("plain")
    assert_bitwise(got, want)


def test_reads_from_a_thread_that_never_saw_the_session(device: torch.device) -> None:
    blocks, params, x, gout, stack, want = setup(device)
    with ckptfx.recompute_handle_collector_ctx() as handles:
        out = stack(True)
    got: dict[str, list[torch.Tensor]] = {}
    errors: list[BaseException] = []

    def dw() -> None:
        try:
            got["dw"] = list(torch.autograd.grad(out, params, gout, retain_graph=True))
        except BaseException as err:  # reported below
            errors.append(err)

    try:
        for h in handles:
            ckptfx.recompute_handle(h, "mb")
        with ckptfx.recompute_session_ctx("mb", retain_on_unpack=True):
            dx = torch.autograd.grad(out, x, gout, retain_graph=True)[0]
            worker = threading.Thread(target=dw)  # a fresh thread: no context copied
            worker.start()
            worker.join(timeout=60)
            assert not worker.is_alive() and not errors, errors
    finally:
        ckptfx.clear_recompute_session("mb")
    assert_bitwise([dx, *got["dw"]], want)
    assert [b.runs for b in blocks] == [2, 2]


def test_a_clear_during_the_replay_keeps_nothing(device: torch.device) -> None:
    """A session cleared while its replay runs (another thread abandoning the micro-batch)
    keeps nothing of that replay: the read at hand uses it, the frame caches nothing, and a
    new session replays the block afresh."""
    blocks, params, x, gout, stack, want = setup(device, n=1)
    block = blocks[0]
    forward = block.forward

    def clearing_forward(h: torch.Tensor) -> torch.Tensor:
        if block.runs == 1:  # the replay (the forward was run 1)
            ckptfx.clear_recompute_session("s1")
        return forward(h)

    with ckptfx.recompute_handle_collector_ctx() as handles:
        out = stack(True)
    frame = handles[0].frame
    block.forward = clearing_forward  # type: ignore[method-assign]
    try:
        with ckptfx.recompute_session_ctx("s1", retain_on_unpack=True):
            got = list(torch.autograd.grad(out, [x, *params], gout, retain_graph=True))
        assert_bitwise(got, want)
        assert frame.session is None and frame.session_replay is None and not frame.reads
        assert all(not isinstance(k, ckptfx.kernel.session.Session) for k in frame.replays)
        runs = block.runs
        ckptfx.recompute_handle(handles[0], "s2")
        assert block.runs == runs + 1  # replayed for the new session, not the old replay
        with ckptfx.recompute_session_ctx("s2", retain_on_unpack=False):
            again = list(torch.autograd.grad(out, [x, *params], gout))
        assert_bitwise(again, want)
    finally:
        ckptfx.clear_recompute_session("s1")
        ckptfx.clear_recompute_session("s2")


def test_prefire_inside_an_open_context_fills_the_reads(device: torch.device) -> None:
    blocks, params, x, gout, stack, want = setup(device)
    with ckptfx.recompute_handle_collector_ctx() as handles:
        out = stack(True)
    try:
        with ckptfx.recompute_session_ctx("mb", retain_on_unpack=True):
            for h in handles:
                ckptfx.recompute_handle(h, "mb")
            assert all(len(h.frame.reads) > 0 for h in handles)
            with PythonCalls(device) as reads:
                got = list(torch.autograd.grad(out, [x, *params], gout, retain_graph=True))
            assert reads.calls == 0
    finally:
        ckptfx.clear_recompute_session("mb")
    assert_bitwise(got, want)
    assert [b.runs for b in blocks] == [2, 2]
