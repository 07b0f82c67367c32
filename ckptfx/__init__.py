"""ckptfx: JAX-style rematerialization for PyTorch, with a split backward that replays once.

Public names only; each lives in the module named after its idea (``ckptfx.frame``: the
kernel, ``ckptfx.session``: scheduled recomputation, ``ckptfx.remat``, ``ckptfx.split``...),
whose docstring opens with the rules it keeps.
"""

from . import _compat
from ._collectives import register_collective
from .checkpoint import checkpoint, checkpoint_wrapper, noop_context_fn, unwrap_checkpoint
from .frame import CheckpointError
from .policies import Offload, UnusedNameWarning, checkpoint_name, checkpoint_policies
from .remat import remat
from .residuals import Residual, print_saved_residuals, saved_residuals
from .session import (
    RecomputeHandle,
    SessionStats,
    clear_recompute_session,
    recompute_handle,
    recompute_handle_collector_ctx,
    recompute_session_ctx,
    recompute_session_stats,
)
from .split import grad_split, vjp_split

_compat.import_npu()

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "Offload",
    "Residual",
    "UnusedNameWarning",
    "checkpoint_name",
    "checkpoint_policies",
    "print_saved_residuals",
    "remat",
    "saved_residuals",
    "RecomputeHandle",
    "SessionStats",
    "checkpoint",
    "checkpoint_wrapper",
    "clear_recompute_session",
    "noop_context_fn",
    "recompute_handle",
    "recompute_handle_collector_ctx",
    "recompute_session_ctx",
    "recompute_session_stats",
    "register_collective",
    "unwrap_checkpoint",
    "grad_split",
    "vjp_split",
]
