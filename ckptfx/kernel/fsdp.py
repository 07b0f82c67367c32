"""FSDP2 under the kernel's prefire: unshard a module's parameter groups before its replay.

Rules

1. ``recompute_handle`` (a scheduler's own prefire) of a block whose function is a module's
   forward (``checkpoint_wrapper``) unshards the FSDP2 trees in that module first (the session
   asks whether a process group exists before calling ``before_prefire``). A frame of a
   plain function does not know its modules: prefire it through ``vjp_split`` or
   ``ckptfx.pipelining``, or call ``unshard()`` on the FSDP modules before the prefire.
2. The states and parameter groups of a module are read here, once, for the kernel and for
   the split's data-parallel handling (``ckptfx.split.data_parallel``) alike; every private
   FSDP attribute is reached through ``ckptfx._compat``.
"""

from __future__ import annotations

from typing import Any

import torch

from ckptfx import _compat

__all__ = ["add_fsdp_states", "before_prefire", "param_groups", "unshard", "unshard_fsdp_modules",
           "wrapper_classes"]


def wrapper_classes() -> tuple[type, type]:
    """``(FSDPModule, DistributedDataParallel)``, imported when first asked for."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    return FSDPModule, DistributedDataParallel


def add_fsdp_states(states: list[Any], module: Any) -> None:
    """Append the FSDP2 states of ``module``'s tree (an ``FSDPModule``) not yet in ``states``."""
    state = _compat.fsdp_state_of(module)
    if state is not None and all(s is not state for s in states):
        for s in _compat.fsdp_all_states(state):
            if all(s is not t for t in states):
                states.append(s)


def param_groups(states: list[Any]) -> list[Any]:
    """The FSDP2 parameter groups of ``states``, in order."""
    return [g for s in states for g in _compat.fsdp_param_groups(s)]


def unshard(states: list[Any]) -> None:
    """Unshard every parameter group of ``states``, so a replay reads full parameters."""
    for g in param_groups(states):
        _compat.fsdp_unshard(g)


def unshard_fsdp_modules(module: Any) -> None:
    """Unshard every FSDP2 parameter group in ``module``'s tree (a pipeline stage's prefire)."""
    if not _compat.distributed_initialized():
        return
    fsdp_cls, _ = wrapper_classes()
    states: list[Any] = []
    for m in module.modules():
        if isinstance(m, fsdp_cls):
            add_fsdp_states(states, m)
    unshard(states)


def before_prefire(frame: Any) -> None:
    """Rule 1: unshard the FSDP2 trees of a module-method frame before its prefire (the
    caller asks first whether a process group exists)."""
    module = getattr(frame.fn, "__self__", None)
    if isinstance(module, torch.nn.Module):
        unshard_fsdp_modules(module)
