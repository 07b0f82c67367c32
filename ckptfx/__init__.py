"""ckptfx: JAX-style rematerialization for PyTorch, with a split backward that replays once.

The public names, re-exported: ``checkpoint`` / ``checkpoint_wrapper`` (torch's
non-reentrant checkpoint, with sessions and policies), ``apply_activation_checkpointing``
(one line for a whole model), ``remat`` with ``checkpoint_policies`` and ``checkpoint_name``,
``saved_residuals`` reports, scheduled recomputation (``recompute_handle`` and friends) and
``vjp_split`` / ``grad_split``. The guide and the API reference are in the docs
(``mkdocs serve`` in a checkout; built from these docstrings).

Example::

    import ckptfx
    ckptfx.apply_activation_checkpointing(model, policy=ckptfx.checkpoint_policies.dots_saveable)
"""

from . import _compat
from ._compile import CompiledBlockWarning, CompiledReplayWarning, CompileOffloadWarning
from ._collectives import register_collective
from .checkpoint import checkpoint, checkpoint_wrapper, noop_context_fn, unwrap_checkpoint
from .frame import CheckpointError
from .integrations import apply_activation_checkpointing
from .policies import Offload, UnusedNameWarning, checkpoint_name, checkpoint_policies
from .refill import refill_outputs
from .remat import remat
from .budget import memory_budget, memory_budget_policies
from .sequential import checkpoint_layers, checkpoint_sequential
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

checkpoint_policies.memory_budget = memory_budget

_compat.import_npu()

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "apply_activation_checkpointing",
    "CompileOffloadWarning",
    "CompiledBlockWarning",
    "CompiledReplayWarning",
    "Offload",
    "Residual",
    "UnusedNameWarning",
    "checkpoint_name",
    "checkpoint_policies",
    "memory_budget_policies",
    "checkpoint_layers",
    "checkpoint_sequential",
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
    "refill_outputs",
    "register_collective",
    "unwrap_checkpoint",
    "grad_split",
    "vjp_split",
]
