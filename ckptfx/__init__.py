"""ckptfx: JAX-style rematerialization for PyTorch, with a split backward that replays once.

The public names, re-exported: ``checkpoint`` / ``checkpoint_wrapper`` (torch's
non-reentrant checkpoint, with sessions and policies), ``apply_activation_checkpointing``
(one line for a whole model), ``remat`` with ``checkpoint_policies`` and ``checkpoint_name``,
``saved_residuals`` reports, scheduled recomputation (``recompute_handle`` and friends) and
``vjp_split`` / ``grad_split``. The guide and the API reference are in the docs
(``mkdocs serve`` in a checkout; built from these docstrings). How the package is laid out,
and which way its imports point, is in README.md ("How it works").

Example::

    import ckptfx
    ckptfx.apply_activation_checkpointing(model, policy=ckptfx.checkpoint_policies.dots_saveable)
"""

from ckptfx import _compat
from ckptfx._public import report_home as _report_home
from ckptfx.budget import memory_budget_policies
from ckptfx.checkpoint import checkpoint, checkpoint_wrapper, noop_context_fn, unwrap_checkpoint
from ckptfx.integrations import apply_activation_checkpointing
from ckptfx.kernel.collectives import register_collective
from ckptfx.kernel.frame import CheckpointError
from ckptfx.kernel.refill import refill_outputs
from ckptfx.kernel.session import (
    RecomputeHandle,
    SessionStats,
    clear_recompute_session,
    recompute_handle,
    recompute_handle_collector_ctx,
    recompute_session_ctx,
    recompute_session_stats,
)
from ckptfx.lowering import CompiledBlockWarning, CompiledReplayWarning, CompileOffloadWarning
from ckptfx.offload import (
    OffloadPoolStats,
    empty_offload_pool,
    offload_in_compile,
    offload_pool_stats,
)
from ckptfx.policies import Offload, UnusedNameWarning, checkpoint_name, checkpoint_policies
from ckptfx.remat import remat
from ckptfx.residuals import Residual, print_saved_residuals, saved_residuals
from ckptfx.sequential import checkpoint_layers, checkpoint_sequential
from ckptfx.split import grad_split, vjp_split

# Back-compat, outside ``__all__``: importable from here before ckptfx had subpackages; the
# documented paths are ``ckptfx.checkpoint_policies.memory_budget`` and ``ckptfx.budget``.
from ckptfx.budget import memory_budget

_compat.import_npu()

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CompileOffloadWarning",
    "CompiledBlockWarning",
    "CompiledReplayWarning",
    "Offload",
    "OffloadPoolStats",
    "RecomputeHandle",
    "Residual",
    "SessionStats",
    "UnusedNameWarning",
    "apply_activation_checkpointing",
    "checkpoint",
    "checkpoint_layers",
    "checkpoint_name",
    "checkpoint_policies",
    "checkpoint_sequential",
    "checkpoint_wrapper",
    "clear_recompute_session",
    "empty_offload_pool",
    "grad_split",
    "memory_budget_policies",
    "noop_context_fn",
    "offload_in_compile",
    "offload_pool_stats",
    "print_saved_residuals",
    "recompute_handle",
    "recompute_handle_collector_ctx",
    "recompute_session_ctx",
    "recompute_session_stats",
    "refill_outputs",
    "register_collective",
    "remat",
    "saved_residuals",
    "unwrap_checkpoint",
    "vjp_split",
]

# Every public name reports where users import it from (as httpx does): ``ckptfx``, or the
# public module that owns it (``ckptfx.policies``, ``ckptfx.budget``). The names that pickles
# store keep theirs: policy classes name ``ckptfx.policies`` (its Rule 2), and torch's own
# ``noop_context_fn`` stays torch's.
_report_home(__name__, [
    obj for obj in map(globals().__getitem__, __all__)
    if callable(obj) and getattr(obj, "__module__", "").startswith("ckptfx.")
    and obj.__module__ not in ("ckptfx.policies", "ckptfx.budget")])
