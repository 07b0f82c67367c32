"""Call signatures, and caches kept per remat'd function without keeping anything alive.

Two things learn from a block's first call and reuse it for later calls that look the same:
a memory budget's plan (ckptfx.budget) and the knowledge that a block which keeps nothing may
run unrecorded (unrecorded.py). Both key on a ``signature`` (what a later call must share with
the first for the lesson to carry over) inside a cache found by ``per_function``.

Rules

1. A signature holds the tensors' metadata (shape, dtype, device, ``requires_grad``), the
   structure of the arguments, the non-tensor arguments (by value when they are plain Python
   values, else by identity, so that a cached entry never keeps a module alive) and the
   autocast state of the devices involved. No tensor is referenced.
2. The cache of a function lives as long as the function. Bound methods and partials are
   made anew at each call (``module.forward``; Hugging Face passes
   ``partial(Layer.__call__, layer, ...)`` per layer call), so theirs lives with the module
   they are bound to (or the function they wrap), keyed by the function and the partials'
   non-tensor arguments. An object that cannot be weakly referenced gets a cache for this
   call only.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Sequence

import optree
import torch

__all__ = ["flat_signature", "per_function", "signature"]

_BY_VALUE = frozenset({bool, int, float, complex, str, bytes, torch.dtype, torch.device})


def signature(args: tuple, kwargs: dict, tensors: Sequence[torch.Tensor]) -> tuple:
    """The signature of a call (Rule 1): ``tensors`` are the tensor leaves of ``(args,
    kwargs)``, in flattening order.

    Example::

        signature((x, 3), {}, [x]) == signature((x.clone(), 3), {}, [x])   # True
    """
    leaves, spec = optree.tree_flatten((args, kwargs), none_is_leaf=True)
    rest = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            continue
        if leaf is None or type(leaf) in _BY_VALUE:
            rest.append((type(leaf), leaf))
        else:  # by identity: a cached entry must not keep a module (``self``) alive
            rest.append((type(leaf), id(leaf)))
    return _metas(tensors), str(spec), tuple(rest), _autocast(tensors)


def flat_signature(tensors: Sequence[torch.Tensor]) -> tuple:
    """The signature of a call whose arguments are ``tensors``, positional, nothing else
    (the common ``block(x)``): as ``signature`` means it, without building a pytree. It
    never equals a ``signature`` (a different length), so both kinds share one cache."""
    return _metas(tensors), _autocast(tensors)


def _metas(tensors: Sequence[torch.Tensor]) -> tuple:
    return tuple((t.shape, t.dtype, t.device, t.requires_grad) for t in tensors)


def _autocast(tensors: Sequence[torch.Tensor]) -> tuple:
    devices = {t.device.type for t in tensors}
    devices.add("cpu")
    return tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                 for d in sorted(devices) if torch.amp.is_autocast_available(d))


def per_function(fun: Callable[..., Any],
                 by_function: "weakref.WeakKeyDictionary[Any, dict[Any, Any]]",
                 by_owner: "weakref.WeakKeyDictionary[Any, dict[Any, dict[Any, Any]]]"
                 ) -> dict[Any, Any]:
    """The cache of ``fun`` (Rule 2): ``by_function`` holds those of plain functions,
    ``by_owner`` those of bound methods and partials, per module (or wrapped function).

    Example::

        _plans = weakref.WeakKeyDictionary(); _owned = weakref.WeakKeyDictionary()
        per_function(layer.forward, _plans, _owned) is per_function(layer.forward, _plans,
                                                                    _owned)   # True
    """
    bound: list[Any] = []
    inner, owner = fun, None
    while isinstance(inner, functools.partial):
        args = inner.args
        if owner is None and args and isinstance(args[0], torch.nn.Module):
            owner, args = args[0], args[1:]
        bound.append(signature(args, inner.keywords, ()))
        inner = inner.func
    func = getattr(inner, "__func__", None)
    if owner is None and func is not None:
        owner, inner = getattr(inner, "__self__", None), func
    try:
        if inner is fun:
            return by_function.setdefault(fun, {})
        key = (inner, tuple(bound))
        return by_owner.setdefault(owner if owner is not None else inner, {}
                                   ).setdefault(key, {})
    except TypeError:  # not weakly referenceable: a cache for this call only
        return {}
