"""The handle collector: which checkpointed calls a forward made, for a scheduler to prefire.

Rules

1. Every frame (``ckptfx.checkpoint`` or ``ckptfx.remat``) whose forward starts inside a
   ``recompute_handle_collector_ctx`` takes its place in the innermost one at once
   (``collect``), so handles are listed in the order the forwards started: an outer block
   before the blocks nested in it. A forward that raises takes its handle back
   (``uncollect``); one that runs without grad makes no frame and lists nothing.

2. The open collector is a ContextVar: per thread and per asyncio task.

3. A ``RecomputeHandle`` holds its frame weakly (nothing here keeps memory alive); what a
   handle is used for (prefire, registration) is session.py's.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from typing import Any, Callable

from ckptfx.kernel.frame import Frame

__all__ = ["RecomputeHandle", "collect", "collecting", "forward_to_outer_collector",
           "recompute_handle_collector_ctx", "uncollect", "used_twice"]

_collector: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "ckptfx_collector", default=None
)


class RecomputeHandle:
    """An opaque reference to one checkpointed call, from ``recompute_handle_collector_ctx``.

    It holds its frame weakly: once the graph of that call is freed the handle is inert.
    Handles come from the collector; constructing one around anything but a kernel
    ``Frame`` is a ``TypeError``.

    Example::

        with ckptfx.recompute_handle_collector_ctx() as handles:
            out = ckptfx.checkpoint(block, x)
        handle = handles[0]          # a RecomputeHandle: pass it to recompute_handle
    """

    __slots__ = ("_frame",)

    def __init__(self, frame: Frame) -> None:
        if not isinstance(frame, Frame):
            raise TypeError(
                "RecomputeHandle wraps a ckptfx kernel Frame, got "
                f"{type(frame).__name__}; do not construct handles: get them from "
                "`with ckptfx.recompute_handle_collector_ctx() as handles:` around the forward"
            )
        self._frame = weakref.ref(frame)

    @property
    def frame(self) -> Frame | None:
        """The checkpointed call's kernel frame, or None once its graph was freed."""
        ref = getattr(self, "_frame", None)  # None for a handle made without __init__
        return None if ref is None else ref()

    def __repr__(self) -> str:
        frame = self._frame()
        return f"<RecomputeHandle {'(freed)' if frame is None else frame!r}>"


# A handle made by the kernel, whose frame needs no check (one per block of a split step)
_new_handle: Callable[[type[RecomputeHandle]], RecomputeHandle] = object.__new__


def recompute_handle_collector_ctx() -> _Collector:
    """Collect a ``RecomputeHandle`` for each checkpointed call made in this scope.

    Every frame created by ``ckptfx.checkpoint`` or ``ckptfx.remat`` inside the ``with`` block
    (on this thread or task) whose forward completed with grad enabled is in the yielded
    list, in the order the forwards *started*: an outer block comes before the blocks nested
    in it. The innermost collector gets it. A forward that raised, or ran without grad, adds
    nothing.

    Example::

        with ckptfx.recompute_handle_collector_ctx() as handles:
            out = model(x)
        for h in handles:
            ckptfx.recompute_handle(h, session_id=("stage0", mb))
    """
    return _Collector()


def used_twice(what: str) -> RuntimeError:
    """The error of a single-use context manager (this one, a session's) entered again."""
    return RuntimeError(
        f"ckptfx: this {what}() object was already entered once; it is single use, like a "
        f"contextlib context manager. Call {what}() again for each with-block."
    )


class _Collector(contextlib.ContextDecorator):
    """``recompute_handle_collector_ctx``'s context manager (a class: one per forward of a
    split step). Single use; as a decorator, a new one per call."""

    __slots__ = ("handles", "token")

    def _recreate_cm(self) -> _Collector:
        return _Collector()

    def __enter__(self) -> list[RecomputeHandle]:
        if hasattr(self, "handles"):
            raise used_twice("recompute_handle_collector_ctx")
        self.handles: list[RecomputeHandle] = []
        self.token = _collector.set(self.handles)
        return self.handles

    def __exit__(self, *exc: Any) -> None:
        _collector.reset(self.token)


def forward_to_outer_collector(handles: list[RecomputeHandle]) -> None:
    """Hand ``handles`` (collected by an inner collector that a library opened for itself)
    to the collector active now, in order, as if no inner collector had been opened."""
    outer = _collector.get()
    if outer is not None:
        outer.extend(handles)


def collecting() -> bool:
    """True inside a ``recompute_handle_collector_ctx`` on this thread or task."""
    return _collector.get() is not None


def collect(frame: Frame) -> list[RecomputeHandle] | None:
    """Called by the kernel when a frame's forward *starts*: the frame's handle takes its
    place in the innermost collector now, so handles are listed in the order their forwards
    started (an outer block before the blocks nested in it) and a scheduler that prefires in
    list order replays an outer block, whose replay re-creates the inner ones, first.
    Returns what to pass to ``uncollect`` if the forward does not complete."""
    handles = _collector.get()
    if handles is not None:
        handle = _new_handle(RecomputeHandle)  # RecomputeHandle(frame), without its check
        handle._frame = weakref.ref(frame)
        handles.append(handle)
    return handles


def uncollect(handles: list[RecomputeHandle] | None, frame: Frame) -> None:
    """Take back the handle ``collect`` listed for a forward that raised."""
    if handles is not None:
        for i in range(len(handles) - 1, -1, -1):
            if handles[i].frame is frame:
                del handles[i]
                return
