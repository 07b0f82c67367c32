"""FSDP2 under the kernel's prefire: unshard a module's parameter groups before its replay.

Rules

1. ``recompute_handle`` (a scheduler's own prefire) unshards, before the replay, the FSDP2
   trees of the modules the block's frame refers to (the session asks whether a process group
   exists before calling ``before_prefire``): the module of a bound method
   (``checkpoint_wrapper``, ``remat(block.forward)``), a module called as the block
   (``checkpoint(block, x)``), modules passed to it as arguments, and modules the block's
   function holds in its default arguments or closure, one level deep, in lists, tuples and
   dict values too: ``remat(lambda x, b=b: b(x))``, and ``remat(Block.forward)`` bound to a
   block (``block.forward = ckptfx.remat(Block.forward).__get__(block)``, whose call remat
   flattens into a function that holds ``block`` among the call's non-tensor arguments).
   Without such a module (a function that reaches its modules through a global, or through
   an attribute chain of a non-module object) the frame cannot know them, and a replay that
   reads resharded parameters is refused with a ``CheckpointError``: prefire it through
   ``vjp_split`` / ``grad_split`` (``dx_fn.prefire()``) or ``ckptfx.pipelining``, which note
   the FSDP modules their forward runs through, call ``unshard()`` on the FSDP modules before
   ``recompute_handle``, or let the session replay the block lazily, inside the backward,
   where FSDP's pre-backward hook has unsharded it.
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
    """Rule 1: unshard the FSDP2 trees of the modules ``frame``'s block refers to, before
    its prefire (the caller asks first whether a process group exists)."""
    done: list[Any] = []
    for module in _modules_of(frame):
        if all(module is not m for m in done):
            done.append(module)
            unshard_fsdp_modules(module)


def _modules_of(frame: Any) -> list[torch.nn.Module]:
    """The modules ``frame``'s block refers to (Rule 1), in the order found."""
    fn = frame.fn
    found: list[torch.nn.Module] = []
    _add_modules(found, fn, 0)
    _add_modules(found, getattr(fn, "__self__", None), 0)
    for value in (*frame.inputs, *frame.kwargs.values()):
        _add_modules(found, value, 1)
    _add_modules(found, getattr(fn, "__defaults__", None), 1)
    _add_modules(found, getattr(fn, "__kwdefaults__", None), 1)
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        _add_modules(found, value, 1)
        _add_modules(found, getattr(value, "__self__", None), 0)
    return found


def _add_modules(found: list[torch.nn.Module], value: Any, depth: int) -> None:
    """Append ``value`` if it is a module, else, ``depth`` levels down, the modules among the
    items of a list, tuple or dict."""
    if isinstance(value, torch.nn.Module):
        found.append(value)
    elif depth > 0 and isinstance(value, (list, tuple)):
        for item in value:
            _add_modules(found, item, depth - 1)
    elif depth > 0 and isinstance(value, dict):
        for item in value.values():
            _add_modules(found, item, depth - 1)
