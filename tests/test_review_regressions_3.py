"""Regressions found by the third review (issue 17's overhead work): the session context
managers as classes, and the cached torch.distributed check.

The context managers used to be ``contextlib.contextmanager`` generators: they stay usable as
decorators and stay single use (a second entry is an error that leaves nothing behind).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

import ckptfx
from ckptfx import _collectives, _collector, _compat
from ckptfx.frame import tls


def _counted_block(counter: list[int]
                   ) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]:
    w = torch.randn(6, 6, generator=torch.Generator().manual_seed(0), requires_grad=True)

    def block(x: torch.Tensor) -> torch.Tensor:
        counter[0] += 1
        return F.gelu(x @ w) @ w

    return block, w


def test_session_context_works_as_a_decorator_once_per_call() -> None:
    calls = [0]
    block, w = _counted_block(calls)
    x = torch.randn(3, 6, requires_grad=True)
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
    assert not _collector.collecting()


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
    assert not _collector.collecting()
    assert "once" not in ckptfx.recompute_session_stats()


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


def test_distributed_check_follows_a_replaced_c10d_world(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    # torch may replace c10d's state object at run time (its threaded test harness does):
    # the check reads the one in place now, as torch.distributed.is_initialized does.
    c10d = torch.distributed.distributed_c10d

    class World:
        default_pg = object()

    assert _compat.distributed_initialized() is torch.distributed.is_initialized()
    monkeypatch.setattr(c10d, "_world", World())
    assert torch.distributed.is_initialized() is True
    assert _compat.distributed_initialized() is True
    assert _collectives.watch_needed() is True


def test_replay_env_leaves_every_context_when_one_exit_raises() -> None:
    # A replay environment enters the forward's autocast and torch.device contexts; if one
    # exit raises (here the device context's), the others are left all the same and the
    # caller's RNG is put back: no autocast outlives the replay.
    from ckptfx._env import ReplayEnv

    class ExitRaises:
        def __enter__(self) -> None:
            pass

        def __exit__(self, *exc: object) -> None:
            raise RuntimeError("device context exit failed")

    with torch.autocast("cpu", dtype=torch.bfloat16):
        env = ReplayEnv([], True)
    env.device_ctx = ExitRaises()
    torch.manual_seed(7)
    before = torch.get_rng_state()
    with pytest.raises(RuntimeError, match="device context exit failed"):
        with env.restored():
            assert torch.is_autocast_enabled("cpu")
            torch.rand(3)
    assert not torch.is_autocast_enabled("cpu")
    assert torch.equal(torch.get_rng_state(), before)
