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
   included, as ``scan(remat(f))`` does): the forward keeps n/k group inputs of I bytes, a
   group's replay holds k layers' saved activations of A bytes each: n I / k + k A, least at
   k = sqrt(n I / A), where it is 2 sqrt(n I A): memory in sqrt(n). With ``every=None`` the
   first layer runs as a group of its own and its frame's saved-tensor sizes (what the
   determinism check records: shapes and dtypes, no clock) give A; the other layers go in
   groups of ``round(sqrt((n - 1) I / A))``. A transformer layer saves tens of times its
   input, so that is 1 until n is large (measured: benchmarks/bench_layers.py); for layers
   that save about their input it is about sqrt(n). Without the sizes
   (``determinism_check="none"``), ``round(sqrt(n))``. Each group is one
   ``ckptfx.checkpoint`` call, or one ``ckptfx.remat`` call under ``policy``; its handle
   reaches the caller's ``recompute_handle_collector_ctx`` as any checkpoint's does.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import nn

from ckptfx.checkpoint import check_use_reentrant, checkpoint
from ckptfx.kernel.handles import (
    forward_to_outer_collector,
    recompute_handle_collector_ctx,
)
from ckptfx.remat import remat

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
    cache, ckptfx.budget): each layer's class and parameter and buffer shapes; None when a
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
    check_use_reentrant(use_reentrant, "checkpoint_sequential")
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

    Every group is checkpointed, the last included (``scan`` over ``remat`` in JAX), for
    one extra forward of compute. By default (``every=None``) the group size is chosen for
    the least memory, about 2 sqrt(n I A) for n layers with inputs of I bytes that save A
    bytes each: the first layer is checkpointed alone and its saved-tensor sizes give A,
    the rest go in groups of ``round(sqrt((n - 1) I / A))`` (see this module's Rule 2). With ``policy``, each group is ``ckptfx.remat``'d
    under it instead (``checkpoint_kwargs`` then must be empty); otherwise the groups are
    ``ckptfx.checkpoint`` calls with ``checkpoint_kwargs``.

    Example::

        out = ckptfx.checkpoint_layers(model.layers, x)           # every ~sqrt(n) layers
        out = ckptfx.checkpoint_layers(model.layers, x, every=2,
                                       policy=ckptfx.checkpoint_policies.dots_saveable)
    """
    layers = _as_list(layers, "layers")
    n = len(layers)
    if every is not None and (isinstance(every, bool) or not isinstance(every, int)):
        raise TypeError(f"every must be an int or None, got {type(every).__name__}")
    if every is not None and every < 1:
        raise ValueError(f"every must be at least 1, got {every}")
    if policy is not None and checkpoint_kwargs:
        raise TypeError("checkpoint_layers: checkpoint keywords "
                        f"({', '.join(checkpoint_kwargs)}) do not apply with policy= (remat)")

    def run_group(start: int, end: int, x: Any) -> Any:
        group = _run(layers, start, end - 1)
        if policy is None:
            return checkpoint(group, x, **checkpoint_kwargs)
        key = _group_key(layers[start:end])
        if key is not None:  # identical groups share a budget's plan
            group.__ckptfx_plan_key__ = key  # type: ignore[attr-defined]
        return remat(group, policy=policy)(x)

    start = 0
    if every is None:
        if n == 0:
            return input
        every = sqrt_group_size(n)
        if torch.is_grad_enabled() and isinstance(input, torch.Tensor):
            input_bytes = input.numel() * input.element_size()
            with recompute_handle_collector_ctx() as handles:
                input = run_group(0, 1, input)
            if handles:
                forward_to_outer_collector(handles)
            saved = _saved_bytes(handles)
            start = 1
            if saved:  # n I / k + k A is least at k = sqrt(n I / A)
                every = max(1, min(n - 1, round(math.sqrt((n - 1) * input_bytes / saved))))
    for s in range(start, n, every):
        input = run_group(s, min(s + every, n), input)
    return input


def _saved_bytes(handles: list[Any]) -> int:
    """Bytes one checkpointed call saved for its backward, from the shapes and dtypes its
    frame recorded for the determinism check (0 when it recorded none)."""
    if len(handles) != 1:
        return 0
    frame = handles[0].frame
    metas = getattr(frame, "metas", None)
    if not metas:
        return 0
    return sum(math.prod(shape) * torch.empty((), dtype=dtype).element_size()
               for shape, dtype, _ in metas)
