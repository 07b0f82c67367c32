"""Scheduled recomputation across real threads.

Autograd may unpack saved tensors on a thread that never saw the caller's context (CUDA and
NPU device threads do). Here dx and dw run in fresh ``threading.Thread``s (no context copied),
and the session must still be found: two block runs, gradients bitwise equal to no checkpoint.
One session context entered on two threads at once refuses the second entry.

Each backward test runs on the CPU and on the accelerator under test (conftest's ``device``),
where autograd runs the backward on its own device thread, not on the thread that called it.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import pytest
import torch
import ckptfx
from models import D, Block

pytestmark = pytest.mark.usefixtures("no_sessions_left")

B = 4  # the batch; D is models.Block's width
AUTOCAST = [None, torch.bfloat16]


class ThreadNotingBlock(Block):
    """models.Block that also notes the thread of each run (``threads``), counting under a
    lock: runs come from several threads."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[str] = []
        self._lock = threading.Lock()

    def note_run(self) -> None:
        with self._lock:
            self.runs += 1
            self.threads.append(threading.current_thread().name)


def make_blocks(n: int = 2, device: torch.device | str = "cpu") -> list[ThreadNotingBlock]:
    torch.manual_seed(0)
    return [ThreadNotingBlock().train().to(device) for _ in range(n)]


def params_of(blocks: list[ThreadNotingBlock]) -> list[torch.Tensor]:
    return [p for b in blocks for p in b.parameters()]


def autocast_ctx(dtype: torch.dtype | None, device: torch.device) -> Any:
    """Autocast to ``dtype`` on ``device``'s type, or autocast disabled there (None)."""
    return (torch.autocast(device.type, dtype=dtype) if dtype is not None
            else torch.autocast(device.type, enabled=False))


def run_stack(blocks: list[ThreadNotingBlock], x: torch.Tensor, ckpt: bool) -> torch.Tensor:
    for b in blocks:
        x = ckptfx.checkpoint(b, x) if ckpt else b(x)
    return x


def inputs(seed: int = 1, device: torch.device | str = "cpu"
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The input (a leaf requiring grad) and the output gradient, on ``device``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, D, generator=g).to(device).requires_grad_()
    return x, torch.randn(B, D, generator=g).to(device)


def reference(blocks: list[ThreadNotingBlock], x: torch.Tensor, g: torch.Tensor,
              dtype: torch.dtype | None = None, seed: int = 1234) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    with autocast_ctx(dtype, x.device):
        out = run_stack(blocks, x, False)
    grads = list(torch.autograd.grad(out, [x, *params_of(blocks)], g))
    for b in blocks:
        b.runs, b.threads = 0, []
    return grads


def forward(blocks: list[ThreadNotingBlock], x: torch.Tensor, dtype: torch.dtype | None = None,
            seed: int = 1234) -> tuple[torch.Tensor, list[ckptfx.RecomputeHandle]]:
    torch.manual_seed(seed)
    with ckptfx.recompute_handle_collector_ctx() as handles:
        with autocast_ctx(dtype, x.device):
            out = run_stack(blocks, x, True)
    return out, handles


def in_thread(fn: Callable[[], Any], name: str) -> Any:
    """Run ``fn`` in a fresh thread (no context copied); return its result or re-raise."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as err:  # noqa: BLE001 - re-raised on the caller's thread
            box["error"] = err

    t = threading.Thread(target=target, name=name)
    t.start()
    t.join(timeout=60)
    assert not t.is_alive()
    if "error" in box:
        raise box["error"]
    return box["value"]


def backward_thread(device: torch.device) -> str:
    """The name of the thread that runs a backward started on this thread over tensors on
    ``device``: this thread on the CPU, autograd's device thread on an accelerator."""
    names: list[str] = []
    t = torch.zeros(1, device=device, requires_grad=True)
    y = t.clone()
    y.register_hook(lambda grad: names.append(threading.current_thread().name))
    torch.autograd.grad(y.sum(), t)
    assert len(names) == 1
    return names[0]


def assert_equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"gradient {i} differs"


@pytest.mark.parametrize("dtype", AUTOCAST)
@pytest.mark.parametrize("per_param", [False, True])
def test_dx_dw_in_fresh_threads_ctx_on_main(device: torch.device, dtype: torch.dtype | None,
                                            per_param: bool) -> None:
    """The session context is opened on the main thread around thread start/join."""
    blocks = make_blocks(device=device)
    params = params_of(blocks)
    x, g = inputs(device=device)
    want = reference(blocks, x, g, dtype)
    out, handles = forward(blocks, x, dtype)
    sid = ("stage", 0)
    try:
        for h in handles:
            ckptfx.recompute_handle(h, sid)
        with ckptfx.recompute_session_ctx(sid, retain_on_unpack=True):
            got = list(in_thread(lambda: torch.autograd.grad(out, x, g, retain_graph=True),
                                 "dx"))
            if per_param:
                got += [in_thread(lambda p=p: torch.autograd.grad(out, p, g, retain_graph=True),
                                  f"dw-{i}")[0] for i, p in enumerate(params[:-1])]
        with ckptfx.recompute_session_ctx(sid, retain_on_unpack=False):
            last = params[-1:] if per_param else params
            got += in_thread(lambda: torch.autograd.grad(out, last, g), "dw")
    finally:
        ckptfx.clear_recompute_session(sid)
    assert [b.runs for b in blocks] == [2, 2]
    assert all(name == "MainThread" for b in blocks for name in b.threads)  # fwd + prefire
    assert_equal(got, want)


@pytest.mark.parametrize("dtype", AUTOCAST)
@pytest.mark.parametrize("prefire", [True, False])
def test_thread_opens_the_session_ctx_itself(device: torch.device, dtype: torch.dtype | None,
                                             prefire: bool) -> None:
    blocks = make_blocks(device=device)
    params = params_of(blocks)
    x, g = inputs(device=device)
    want = reference(blocks, x, g, dtype)
    out, handles = forward(blocks, x, dtype)
    sid = "mb"
    unpacked_on: list[str] = []  # the thread dx's backward runs on, so unpacks on

    def dx() -> list[torch.Tensor]:
        unpacked_on.append(backward_thread(device))
        with ckptfx.recompute_session_ctx(sid, retain_on_unpack=True):
            return list(torch.autograd.grad(out, x, g, retain_graph=True))

    def dw() -> list[torch.Tensor]:
        with ckptfx.recompute_session_ctx(sid, retain_on_unpack=False):
            return list(torch.autograd.grad(out, params, g))

    try:
        if prefire:
            for h in handles:
                ckptfx.recompute_handle(h, sid)
        got = in_thread(dx, "dx") + in_thread(dw, "dw")
    finally:
        ckptfx.clear_recompute_session(sid)
    assert [b.runs for b in blocks] == [2, 2]
    # dx's thread itself on the CPU; autograd's device thread, which has no context of its
    # own, on an accelerator
    assert (unpacked_on == ["dx"]) == (device.type == "cpu")
    assert unpacked_on[0] != "MainThread"
    replayed_on = {b.threads[1] for b in blocks}
    assert replayed_on == ({"MainThread"} if prefire else set(unpacked_on))
    assert_equal(got, want)


def test_prefire_on_one_thread_dx_on_another_dw_on_main(device: torch.device) -> None:
    blocks = make_blocks(device=device)
    x, g = inputs(device=device)
    want = reference(blocks, x, g)
    out, handles = forward(blocks, x)
    try:
        in_thread(lambda: [ckptfx.recompute_handle(h, 7) for h in handles], "prefire")
        with ckptfx.recompute_session_ctx(7, retain_on_unpack=True):
            got = list(in_thread(lambda: torch.autograd.grad(out, x, g, retain_graph=True),
                                 "dx"))
        with ckptfx.recompute_session_ctx(7, retain_on_unpack=False):
            got += torch.autograd.grad(out, params_of(blocks), g)
    finally:
        ckptfx.clear_recompute_session(7)
    assert [b.runs for b in blocks] == [2, 2]
    assert [b.threads[1] for b in blocks] == ["prefire", "prefire"]
    assert_equal(got, want)


def test_prefire_inside_open_ctx_binds_for_worker_threads(device: torch.device) -> None:
    """Prefired while its session context is open: the frame is bound at once, so a dx on a
    thread without the context still reads the prefire (bug found: it replayed again)."""
    blocks = make_blocks(device=device)
    x, g = inputs(device=device)
    want = reference(blocks, x, g)
    out, handles = forward(blocks, x)
    try:
        with ckptfx.recompute_session_ctx("in-ctx", retain_on_unpack=True):
            for h in handles:
                ckptfx.recompute_handle(h, "in-ctx")
            got = list(in_thread(lambda: torch.autograd.grad(out, x, g, retain_graph=True),
                                 "dx"))
        with ckptfx.recompute_session_ctx("in-ctx", retain_on_unpack=False):
            got += in_thread(lambda: torch.autograd.grad(out, params_of(blocks), g), "dw")
    finally:
        ckptfx.clear_recompute_session("in-ctx")
    assert [b.runs for b in blocks] == [2, 2]
    assert_equal(got, want)


def test_unprefired_frames_on_foreign_thread_fall_back_to_native(device: torch.device) -> None:
    """Lazy discovery needs the context on the unpacking thread; without it the backward is
    torch's (one replay per call) and still exact."""
    blocks = make_blocks(device=device)
    x, g = inputs(device=device)
    want = reference(blocks, x, g)
    out, _ = forward(blocks, x)
    try:
        with ckptfx.recompute_session_ctx("s", retain_on_unpack=True):
            got = list(in_thread(lambda: torch.autograd.grad(out, x, g, retain_graph=True),
                                 "dx"))
        with ckptfx.recompute_session_ctx("s", retain_on_unpack=False):
            got += in_thread(lambda: torch.autograd.grad(out, params_of(blocks), g), "dw")
    finally:
        ckptfx.clear_recompute_session("s")
    assert [b.runs for b in blocks] == [3, 3]
    assert_equal(got, want)


def test_forward_on_a_thread_while_another_thread_holds_a_session(device: torch.device) -> None:
    blocks = make_blocks(device=device)
    params = params_of(blocks)
    (x0, g0), (x1, g1) = inputs(1, device=device), inputs(2, device=device)
    want0 = reference(blocks, x0, g0, seed=10)
    want1 = reference(blocks, x1, g1, seed=11)
    out0, handles0 = forward(blocks, x0, seed=10)
    for h in handles0:
        ckptfx.recompute_handle(h, "held")
    opened, done = threading.Event(), threading.Event()
    box: dict[str, Any] = {}

    def holder() -> None:
        try:
            with ckptfx.recompute_session_ctx("held", retain_on_unpack=True):
                opened.set()
                assert done.wait(timeout=60)
                box["dx"] = list(torch.autograd.grad(out0, x0, g0, retain_graph=True))
        except BaseException as err:  # noqa: BLE001
            box["error"] = err
            opened.set()

    t = threading.Thread(target=holder, name="holder")
    t.start()
    try:
        assert opened.wait(timeout=60)
        # While "holder" has its session open: a new micro-batch's forward, and its own
        # split backward under another session, on this thread.
        out1, handles1 = forward(blocks, x1, seed=11)
        assert len(handles1) == 2
        try:
            for h in handles1:
                ckptfx.recompute_handle(h, "other")
            with ckptfx.recompute_session_ctx("other", retain_on_unpack=True):
                got1 = list(torch.autograd.grad(out1, x1, g1, retain_graph=True))
            with ckptfx.recompute_session_ctx("other", retain_on_unpack=False):
                got1 += torch.autograd.grad(out1, params, g1)
        finally:
            ckptfx.clear_recompute_session("other")
    finally:
        done.set()
        t.join(timeout=60)
    try:
        if "error" in box:
            raise box["error"]
        with ckptfx.recompute_session_ctx("held", retain_on_unpack=False):
            got0 = box["dx"] + list(torch.autograd.grad(out0, params, g0))
    finally:
        ckptfx.clear_recompute_session("held")
    assert [b.runs for b in blocks] == [4, 4]
    assert_equal(got0, want0)
    assert_equal(got1, want1)


# Found in review of the session context managers as classes (was test_review_regressions_3.py).
def test_session_context_shared_by_two_threads_refuses_the_second() -> None:
    ctx = ckptfx.recompute_session_ctx("shared")
    errors: list[BaseException] = []
    inside, release = threading.Event(), threading.Event()

    def first() -> None:
        with ctx:
            inside.set()
            release.wait(10)

    def second() -> None:
        inside.wait(10)
        try:
            with ctx:
                pass
        except RuntimeError as err:
            errors.append(err)
        finally:
            release.set()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert len(errors) == 1 and "single use" in str(errors[0])
    assert "shared" not in ckptfx.recompute_session_stats()
