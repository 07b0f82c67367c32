"""The tracers active on this thread: the one shared fact of policies/names.py and tracer.py.

A remat forward pushes its recorder (tracer.py's ``Tracer``, or func_path/block.py's keep mode)
here; ``checkpoint_name`` (policies/names.py) hands a name to the innermost one. Living
below both modules, it lets each import it without importing the other.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["active_tracer", "reporting", "tracer_stack"]


class _TracerStack(threading.local):
    tracers: list[Any]
    report: list[tuple[Any, ...]] | None  # open while saved_residuals runs the function

    def __init__(self) -> None:
        self.tracers = []
        self.report = None


tracer_stack = _TracerStack()


def reporting() -> bool:
    """True while ``saved_residuals`` runs a function on this thread."""
    return tracer_stack.report is not None


def active_tracer() -> Any:
    """The innermost recorder of a remat forward on this thread, or None."""
    tracers = tracer_stack.tracers
    return tracers[-1] if tracers else None
