"""Remat over repeated layers: ``checkpoint_sequential`` (torch's) and ``checkpoint_layers``
(the sqrt(n) schedule JAX users get from ``scan`` over ``remat``).

Rules

1. ``checkpoint_sequential`` is torch's function on ckptfx's kernel: the same signature, the
   same split (``len(functions) // segments`` per segment, every segment but the last
   checkpointed, the last run as is), the same keyword errors. It is non-reentrant only:
   ``use_reentrant`` must be False or None (torch's None means True and warns; here None
   means False, the only variant there is). Where torch fails with an unrelated error
   (``segments=0``: ZeroDivisionError; more segments than functions: "range() arg 3 must
   not be zero") ckptfx raises a ``ValueError`` naming ``segments``.

2. ``checkpoint_layers`` checkpoints *every* group of ``every`` consecutive layers (the last
   included, as ``scan(remat(f))`` does): the forward keeps n/k group inputs, a group's
   replay holds k layers' activations, so ``every = round(sqrt(n))`` gives about 2 sqrt(n)
   layers' worth of memory instead of n. Each group is one ``ckptfx.checkpoint`` call, or
   one ``ckptfx.remat`` call under ``policy`` when one is given.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch
from torch import nn

from .checkpoint import checkpoint
from .remat import remat

__all__ = ["checkpoint_layers", "checkpoint_sequential"]


def _as_list(functions: Any, arg: str) -> list[Callable[..., Any]]:
    if isinstance(functions, nn.Sequential):
        return list(functions.children())
    if isinstance(functions, (nn.ModuleList, list, tuple)):
        functions = list(functions)
    else:
        raise TypeError(f"{arg} must be an nn.Sequential, an nn.ModuleList or a list of "
                        f"modules or functions, got {type(functions).__name__}")
    for i, f in enumerate(functions):
        if not callable(f):
            raise TypeError(f"{arg}[{i}] must be callable, got {type(f).__name__}")
    return functions


def _run(functions: list[Callable[..., Any]], start: int, end: int) -> Callable[[Any], Any]:
    def forward(input: Any) -> Any:
        for j in range(start, end + 1):
            input = functions[j](input)
        return input
    return forward


def _group_key(group: list[Callable[..., Any]]) -> tuple[Any, ...] | None:
    """What makes two groups of layers record the same ops (for a memory budget's plan
    cache, budget.py): each layer's class and parameter and buffer shapes; None when a
    layer is a plain function (its identity is then the key)."""
    key = []
    for f in group:
        if not isinstance(f, nn.Module):
            return None
        key.append((type(f), f.training,
                    tuple((tuple(t.shape), t.dtype) for t in (*f.parameters(), *f.buffers()))))
    return tuple(key)


def checkpoint_sequential(functions: Any, segments: int, input: torch.Tensor,
                          use_reentrant: bool | None = None, **kwargs: Any) -> Any:
    """Run ``functions`` in order on ``input``, checkpointing all segments but the last.

    torch's ``torch.utils.checkpoint.checkpoint_sequential`` on ckptfx's kernel (so its
    segments work with sessions, prefire and ``grad_split``): ``functions`` is an
    ``nn.Sequential`` or a list of modules/functions, split into ``segments`` chunks of
    ``len(functions) // segments``; the last chunk takes the rest and is not checkpointed.
    The only keyword is ``preserve_rng_state`` (default True); others are a ``ValueError``
    ("Unexpected keyword arguments: ..."), as with torch.

    Example::

        model = nn.Sequential(*[Block() for _ in range(8)])
        out = ckptfx.checkpoint_sequential(model, 4, x)
        out.sum().backward()
    """
    if use_reentrant:
        raise ValueError(
            "use_reentrant=True is not supported: ckptfx.checkpoint_sequential is "
            "non-reentrant only. Pass use_reentrant=False (or omit it).")
    preserve = kwargs.pop("preserve_rng_state", True)
    if kwargs:
        raise ValueError("Unexpected keyword arguments: " + ",".join(arg for arg in kwargs))
    functions = _as_list(functions, "functions")
    if isinstance(segments, bool) or not isinstance(segments, int):
        raise TypeError(f"segments must be an int, got {type(segments).__name__}")
    if not 1 <= segments <= max(len(functions), 1):
        raise ValueError(f"segments must be between 1 and the number of functions "
                         f"({len(functions)}), got {segments}")
    size = len(functions) // segments
    end = -1
    for start in range(0, size * (segments - 1), size):
        end = start + size - 1
        input = checkpoint(_run(functions, start, end), input, use_reentrant=False,
                           preserve_rng_state=preserve)
    return _run(functions, end + 1, len(functions) - 1)(input)


def sqrt_group_size(n: int) -> int:
    """The group size for n layers that minimises kept inputs plus one group's replay
    (n/k + k): the nearest integer to sqrt(n), at least 1."""
    return max(1, round(math.sqrt(n)))


def checkpoint_layers(layers: Any, input: Any, every: int | None = None, *,
                      policy: Callable[..., Any] | None = None,
                      **checkpoint_kwargs: Any) -> Any:
    """Run ``layers`` in order on ``input``, checkpointing each group of ``every`` layers.

    Every group is checkpointed, the last included (``scan`` over ``remat`` in JAX). By
    default ``every`` is ``round(sqrt(len(layers)))``: the forward keeps about sqrt(n) group
    inputs and a backward replays one group at a time, so memory grows as sqrt(n) layers,
    for one extra forward of compute. With ``policy``, each group is ``ckptfx.remat``'d
    under it instead (``checkpoint_kwargs`` then must be empty); otherwise the groups are
    ``ckptfx.checkpoint`` calls with ``checkpoint_kwargs``.

    Example::

        out = ckptfx.checkpoint_layers(model.layers, x)           # every ~sqrt(n) layers
        out = ckptfx.checkpoint_layers(model.layers, x, every=2,
                                       policy=ckptfx.checkpoint_policies.dots_saveable)
    """
    layers = _as_list(layers, "layers")
    n = len(layers)
    if every is None:
        every = sqrt_group_size(n)
    if isinstance(every, bool) or not isinstance(every, int):
        raise TypeError(f"every must be an int or None, got {type(every).__name__}")
    if every < 1:
        raise ValueError(f"every must be at least 1, got {every}")
    if policy is not None and checkpoint_kwargs:
        raise TypeError("checkpoint_layers: checkpoint keywords "
                        f"({', '.join(checkpoint_kwargs)}) do not apply with policy= (remat)")
    for start in range(0, n, every):
        group = _run(layers, start, min(start + every, n) - 1)
        if policy is not None:
            key = _group_key(layers[start:start + every])
            if key is not None:  # identical groups share a budget's plan
                group.__ckptfx_plan_key__ = key  # type: ignore[attr-defined]
            input = remat(group, policy=policy)(input)
        else:
            input = checkpoint(group, input, **checkpoint_kwargs)
    return input
