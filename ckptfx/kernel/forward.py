"""The kernel's forward entry point: one checkpointed call of a Python function.

``run_checkpointed`` makes a ``Frame`` (frame.py) for the call, lists it with the handle
collector (handles.py) and the refill scope (refill.py) when they are open, and runs the
function under the frame's saved-tensor hooks and the collectives log (collectives.py).
``ckptfx.checkpoint``, ``checkpoint_wrapper`` and the compile lowering check their options
and call it; it checks nothing itself. (``remat`` makes its frames itself: a recorded call
pushes the recorder's hooks, not these.)
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Iterator

import torch
from torch.utils.checkpoint import noop_context_fn

from ckptfx import _compat
from ckptfx.kernel.collectives import forward_context
from ckptfx.kernel.debug import DebugLogs
from ckptfx.kernel.frame import (
    NULL_CONTEXT,
    Frame,
    refuse_new_frame_in_scheduled_replay,
    tls,
    unpack_hook,
)
from ckptfx.kernel.function_replay import rerun_function
from ckptfx.kernel.handles import collect, uncollect
from ckptfx.kernel.refill import (
    NoteExplicitDraws,
    first_node,
    plain_saves,
    scope_on_top,
)

__all__ = ["run_checkpointed"]


def run_checkpointed(
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    context_fn: Callable[[], tuple[ContextManager, ContextManager]] = noop_context_fn,
    determinism_check: str = "default",
    debug: bool = False,
    preserve_rng_state: bool = True,
    early_stop: bool = True,
) -> Any:
    """The forward of a checkpoint call, options already checked."""
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    if tls.scheduled_replay:
        refuse_new_frame_in_scheduled_replay("a checkpoint")
    logs = None
    if debug:
        logs = DebugLogs()
        forward_ctx, recompute_ctx = logs.contexts()
    elif context_fn is noop_context_fn:
        forward_ctx = recompute_ctx = None
    else:
        forward_ctx, recompute_ctx = context_fn()
    refill = scope_on_top()  # a ckptfx.refill_outputs() context around this block, if any
    with plain_saves(refill):
        frame = Frame(function, args, kwargs, rerun=rerun_function,
                      preserve_rng_state=preserve_rng_state,
                      determinism_check=determinism_check, early_stop=early_stop,
                      recompute_ctx=recompute_ctx, debug=logs)
    handles = collect(frame)
    first = first_node() if refill is not None else None
    suppressed = True
    collectives = forward_context(frame)
    if refill is not None:  # refill.py Rule 2c
        collectives = _noting_draws(collectives, frame)
    # frame.py Rule 4b: a frame handed to a scheduler reads its session replays in C
    _compat.push_saved_tensors_hooks(
        frame.pack, unpack_hook if handles is None else frame.reads.__getitem__)
    try:
        if forward_ctx is None and collectives is NULL_CONTEXT:
            out = function(*args, **kwargs)  # nothing to enter: the common case, kept lean
            suppressed = False
        else:
            with (forward_ctx if forward_ctx is not None else NULL_CONTEXT), collectives:
                out = function(*args, **kwargs)
                suppressed = False
    except BaseException:
        uncollect(handles, frame)
        raise
    finally:
        _compat.pop_saved_tensors_hooks()
    if suppressed:
        uncollect(handles, frame)
        raise RuntimeError(
            "ckptfx.checkpoint: the forward context from context_fn suppressed an exception "
            "raised by the checkpointed function; checkpoint has no output to return for a "
            "failed forward."
        )
    frame.forward_finished(out)
    if refill is not None:
        refill.register(frame, out, args, first_node=first)
    return out



@contextlib.contextmanager
def _noting_draws(ctx: ContextManager, frame: Frame) -> Iterator[None]:
    with ctx, NoteExplicitDraws(frame):
        yield
