"""The named policies of ``checkpoint_policies``: JAX's policies, as frozen dataclasses.

The names and meanings follow ``jax.checkpoint_policies``. Each policy is a tiny frozen
dataclass with ``__call__`` (hashable, so a cache can key on it), made by a value
(``dots_saveable``) or a factory (``save_only_these_names("attn")``). "Dots" are the matrix
products: ``mm``, ``addmm``, ``mv``, ``addmv``, ``dot`` and ``vdot`` (no batch dimensions),
``bmm``, ``baddbmm`` and ``addbmm`` (batch dimensions), and convolutions. ``matmul``,
``linear`` and ``einsum`` reach the dispatcher as these, so a ``matmul`` of 3-D by 2-D is a
dot without batch dimensions (as in JAX) and a batched ``matmul`` is a ``bmm``. Fused
attention kernels are not dots.

Rules:

1. **Bad input fails where it is written**, in the style of torch's messages (what, which
   argument, what to write instead): a bare string or a non-string where names go (a
   ``TypeError``: the string would be read as the names of its letters), an un-called
   factory or a policy class where a policy goes. The dataclasses check their fields too,
   so a policy built directly is held to the same rules as one made by a factory.
2. **Every factory has a call to suggest** (``_FACTORY_CALLS``): passing it un-called is
   refused with that call, ``memory_budget`` (budget_policy.py) included.

The protocol these answer to is protocol.py's; what remat says about a policy it is given
(descriptions, unused names) is checks.py's. Pickles (``torch.save`` of a model whose
checkpointed blocks hold a policy) name ``ckptfx.policies``, the public module, whose
``__init__`` relabels each class's ``__module__``: a class can move between these modules
without breaking a saved model, as long as ``ckptfx.policies`` still exports it.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
import weakref
from typing import Any, Callable, Iterable

import torch

from ckptfx.policies.budget_policy import memory_budget
from ckptfx.policies.protocol import (
    MUST_SAVE,
    Decision,
    Offload,
    Policy,
    call_policy,
    name_of,
    referenced_names,
)

__all__ = ["DOTS", "checkpoint_policies"]

aten = torch.ops.aten

_DOTS_NO_BATCH = frozenset({
    aten.mm.default, aten.addmm.default, aten.mv.default, aten.addmv.default,
    aten.dot.default, aten.vdot.default,
})
_DOTS_BATCH = frozenset({aten.bmm.default, aten.baddbmm.default, aten.addbmm.default})
_CONVS = frozenset({
    aten.convolution.default, aten._convolution.default,
    aten.convolution_overrideable.default, aten.mkldnn_convolution.default,
})
for _name in ("cudnn_convolution", "miopen_convolution"):
    _packet = getattr(aten, _name, None)
    if _packet is not None and hasattr(_packet, "default"):
        _CONVS = _CONVS | {_packet.default}
DOTS = _DOTS_NO_BATCH | _DOTS_BATCH | _CONVS


@dataclasses.dataclass(frozen=True)
class EverythingSaveable(Policy):
    """Save every value the backward needs: no recomputation (plain autograd's memory).

    Example::

        ckptfx.remat(f, policy=checkpoint_policies.everything_saveable)
    """

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Decision:
        return True


@dataclasses.dataclass(frozen=True)
class NothingSaveable(Policy):
    """Save only the block's inputs; recompute everything else (the default).

    Example::

        ckptfx.remat(f, policy=checkpoint_policies.nothing_saveable)   # same as remat(f)
    """

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Decision:
        return False


@dataclasses.dataclass(frozen=True)
class DotsSaveable(Policy):
    """Save the outputs of matrix products (and convolutions unless ``only_if_no_batch_dims``,
    which keeps only products without batch dimensions); recompute the cheap elementwise ops.
    ``checkpoint_policies.dots_saveable`` (alias ``checkpoint_dots``) and
    ``checkpoint_policies.dots_with_no_batch_dims_saveable`` are its two values.

    Example::

        ckptfx.remat(f, policy=checkpoint_policies.dots_saveable)
        ckptfx.remat(f, policy=checkpoint_policies.dots_with_no_batch_dims_saveable)
    """

    only_if_no_batch_dims: bool = False

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Decision:
        if self.only_if_no_batch_dims:
            return op in _DOTS_NO_BATCH
        return op in DOTS


@dataclasses.dataclass(frozen=True)
class SaveOnlyTheseNames(Policy):
    """Save only values tagged with one of ``names`` by ``checkpoint_name``; made by
    ``checkpoint_policies.save_only_these_names``.

    Example::

        policy = checkpoint_policies.save_only_these_names("attn_out")
    """

    names: frozenset[str]

    def __post_init__(self) -> None:
        object.__setattr__(self, "names", _name_set(self.names, "names", type(self).__name__))

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Decision:
        return name_of(op, kwargs) in self.names

    def referenced_names(self) -> frozenset[str]:
        return self.names


@dataclasses.dataclass(frozen=True)
class SaveAnyNamesButThese(Policy):
    """Save every named value except those in ``names``; unnamed values are recomputed. Made
    by ``checkpoint_policies.save_any_names_but_these``.

    Example::

        policy = checkpoint_policies.save_any_names_but_these("mlp_hidden")
    """

    names: frozenset[str]

    def __post_init__(self) -> None:
        object.__setattr__(self, "names", _name_set(self.names, "names", type(self).__name__))

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Decision:
        name = name_of(op, kwargs)
        return name is not None and name not in self.names

    def referenced_names(self) -> frozenset[str]:
        return self.names


@dataclasses.dataclass(frozen=True)
class SaveFromBothPolicies(Policy):
    """Save what either policy saves (offload if one offloads and neither saves). Made by
    ``checkpoint_policies.save_from_both_policies``.

    Example::

        policy = checkpoint_policies.save_from_both_policies(
            checkpoint_policies.dots_saveable, checkpoint_policies.save_only_these_names("h"))
    """

    first: Callable[..., Any]
    second: Callable[..., Any]

    def __post_init__(self) -> None:
        check_policy(self.first, "policy_1")
        check_policy(self.second, "policy_2")

    def referenced_names(self) -> frozenset[str]:
        return referenced_names(self.first) | referenced_names(self.second)

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Decision:
        a = call_policy(self.first, ctx, op, args, kwargs)
        b = call_policy(self.second, ctx, op, args, kwargs)
        for keep in (MUST_SAVE, True):  # the stronger keep wins
            if a is keep or b is keep:
                return keep
        return a if isinstance(a, Offload) else b


@dataclasses.dataclass(frozen=True)
class SaveAndOffloadOnlyTheseNames(Policy):
    """Save the values named in ``names_which_can_be_saved``, offload those named in
    ``names_which_can_be_offloaded``, recompute the rest. Made by
    ``checkpoint_policies.save_and_offload_only_these_names``.

    Example::

        policy = checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=["attn_out"], names_which_can_be_offloaded=["mlp_in"])
    """

    names_which_can_be_saved: frozenset[str]
    names_which_can_be_offloaded: frozenset[str]
    offload: Offload

    def __post_init__(self) -> None:
        where = type(self).__name__
        for field in ("names_which_can_be_saved", "names_which_can_be_offloaded"):
            object.__setattr__(self, field, _name_set(getattr(self, field), field, where))
        if not isinstance(self.offload, Offload):
            raise TypeError(
                f"{where}: offload must be a ckptfx Offload, got {type(self.offload).__name__}"
            )
        both = self.names_which_can_be_saved & self.names_which_can_be_offloaded
        if both:
            raise ValueError(
                f"names {sorted(both)} are in both names_which_can_be_saved and "
                "names_which_can_be_offloaded; a name is either saved or offloaded"
            )

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Decision:
        name = name_of(op, kwargs)
        if name in self.names_which_can_be_saved:
            return True
        if name in self.names_which_can_be_offloaded:
            return self.offload
        return False

    def referenced_names(self) -> frozenset[str]:
        return self.names_which_can_be_saved | self.names_which_can_be_offloaded


@dataclasses.dataclass(frozen=True)
class OffloadDotWithNoBatchDims(Policy):
    """Offload the outputs of matrix products without batch dimensions to host memory. Made
    by ``checkpoint_policies.offload_dot_with_no_batch_dims``.

    Example::

        policy = checkpoint_policies.offload_dot_with_no_batch_dims()
    """

    offload: Offload

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Decision:
        return self.offload if op in _DOTS_NO_BATCH else False


def _name_set(value: Any, arg: str, where: str) -> frozenset[str]:
    """``value`` (an iterable of strings) as a frozenset; a ``TypeError`` naming ``arg`` for
    a bare string (which would be read as its letters), a non-iterable or a non-string item."""
    if isinstance(value, (str, bytes)):
        raise TypeError(
            f"{where}: {arg} must be a collection of names (strings), got the "
            f"{type(value).__name__} {value!r}, which would be read as the names of its "
            f"letters; write {arg}=[{value!r}]"
        )
    try:
        items = tuple(value)
    except TypeError:
        raise TypeError(
            f"{where}: {arg} must be a collection of names (a list, tuple or set of strings), "
            f"got {type(value).__name__} {value!r}"
        ) from None
    for n in items:
        if not isinstance(n, str):
            raise TypeError(
                f"{where}: {arg} must contain only names (strings, as given to "
                f"ckptfx.checkpoint_name), got {type(n).__name__} {n!r}"
            )
    return frozenset(items)


def _star_names(names: tuple[Any, ...], where: str) -> frozenset[str]:
    """The ``*names`` of ``save_only_these_names`` / ``save_any_names_but_these``."""
    for n in names:
        if isinstance(n, str):
            continue
        if isinstance(n, (list, tuple, set, frozenset)):
            raise TypeError(
                f"{where} takes each name as its own argument, as in JAX "
                f"({where}('attn', 'mlp')), got a {type(n).__name__} {n!r}; "
                f"unpack it: {where}(*names)"
            )
        raise TypeError(
            f"{where}: names must be strings (as given to ckptfx.checkpoint_name), got "
            f"{type(n).__name__} {n!r}"
        )
    return frozenset(names)


def check_policy(p: Any, arg: str = "policy") -> Callable[..., Any]:
    """``p`` if it is a policy; otherwise a ``TypeError`` saying what to write instead."""
    hint = factory_call(p)
    if hint is not None:
        raise TypeError(
            f"{arg}=checkpoint_policies.{p.__name__} is a policy factory, not a policy: call "
            f"it, e.g. {arg}=checkpoint_policies.{hint}"
        )
    if p is Offload or isinstance(p, Offload):
        raise TypeError(
            f"{arg}={'Offload' if p is Offload else repr(p)}: an Offload is what a policy "
            f"returns for an op, not a policy: e.g. {arg}=lambda ctx, op, *args, **kwargs: "
            "ckptfx.Offload() if op is torch.ops.aten.mm.default else False, or "
            f"{arg}=checkpoint_policies.offload_dot_with_no_batch_dims()"
        )
    if isinstance(p, type) and issubclass(p, Policy):
        raise TypeError(
            f"{arg}={p.__name__} is a policy class, not a policy: pass an instance, "
            f"e.g. {arg}={p.__name__}(...), or a checkpoint_policies value"
        )
    if not callable(p):
        raise TypeError(
            f"{arg} must be a checkpoint policy (a ckptfx.checkpoint_policies value or a "
            f"torch selective-checkpoint policy function), got {type(p).__name__}"
        )
    error = checkpoint_function_error(p, arg)
    if error is not None:
        raise error
    if not isinstance(p, Policy) and not _takes_ctx_and_op(p):
        raise TypeError(
            f"{arg}: a policy function is called as policy(ctx, op, *args, **kwargs), as "
            f"torch's selective-checkpoint policies are (JAX's policy(prim, *avals, "
            f"**params) does not carry over); {getattr(p, '__name__', p)!r} cannot take "
            "(ctx, op)"
        )
    return p


# Functions that checkpoint (or wrap a module to checkpoint it), by module and name: what a
# user passes where torch's apply_activation_checkpointing takes checkpoint_wrapper_fn.
_CHECKPOINT_FUNCTIONS = frozenset({
    ("torch.utils.checkpoint", "checkpoint"),
    ("torch.utils.checkpoint", "checkpoint_sequential"),
    ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "checkpoint_wrapper"),
    ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "offload_wrapper"),
    ("ckptfx", "checkpoint"),  # ckptfx's public functions report the package (__init__.py)
    ("ckptfx", "checkpoint_wrapper"),
    ("ckptfx", "remat"),
})


def unpartial(f: Any) -> Any:
    """``f`` without its ``functools.partial`` layers."""
    while isinstance(f, functools.partial):
        f = f.func
    return f


def checkpoint_function_error(p: Any, arg: str, note: str = "") -> TypeError | None:
    """The ``TypeError`` for a checkpoint function or module wrapper (or a
    ``functools.partial`` of one) passed as the policy ``arg``, ending with ``note``; None
    for anything else."""
    f = unpartial(p)
    key = (getattr(f, "__module__", None), getattr(f, "__qualname__", None))
    if key not in _CHECKPOINT_FUNCTIONS:
        return None
    return TypeError(
        f"{arg} takes what a checkpointed block keeps (a ckptfx.checkpoint_policies value "
        f"or a torch selective-checkpoint policy function), got the checkpoint function "
        f"{key[0]}.{key[1]}: ckptfx applies the checkpoint itself. Leave {arg} out for a "
        f"plain checkpoint, or pass e.g. {arg}=checkpoint_policies.dots_saveable{note}"
    )


_ARITY_OK: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()


def _takes_ctx_and_op(fn: Any) -> bool:
    """Whether ``fn`` can be called with two positional arguments. Cached per function, or
    per class for a callable object (``checkpoint(policy=...)`` checks its policy on every
    call). A signature that cannot be read passes: the call decides."""
    owner: Any = fn if isinstance(fn, (types.FunctionType, types.MethodType)) else type(fn)
    if isinstance(fn, functools.partial):
        owner = None  # a partial's arguments are its own: not cached
    if owner is not None:
        cached = _ARITY_OK.get(owner)
        if cached is not None:
            return cached
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read (a builtin, an odd callable)
        return True
    try:
        sig.bind(None, None)
        ok = True
    except TypeError:
        ok = False
    if owner is not None:
        _ARITY_OK[owner] = ok
    return ok


def save_only_these_names(*names: str) -> Policy:
    """Save only the values tagged with one of ``names`` by ``checkpoint_name``; recompute
    everything else. Names are separate arguments, as in JAX:
    ``save_only_these_names("attn", "mlp")`` (``*names`` for a list). A bare list, or a
    name that is not a string, is a ``TypeError``. ``remat`` warns once per block
    (``UnusedNameWarning``) about names no ``checkpoint_name`` in the block uses.

    Example::

        @ckptfx.remat(policy=checkpoint_policies.save_only_these_names("attn_out"))
        def block(x, w):
            a = ckptfx.checkpoint_name(torch.softmax(x @ w, -1), "attn_out")  # kept
            return torch.relu(a @ w)                                          # recomputed
    """
    return SaveOnlyTheseNames(_star_names(names, "save_only_these_names"))


def save_any_names_but_these(*names: str) -> Policy:
    """Save every value tagged by ``checkpoint_name`` except those named in ``names``
    (separate string arguments, as in ``save_only_these_names``); recompute untagged
    values.

    Example::

        @ckptfx.remat(policy=checkpoint_policies.save_any_names_but_these("big"))
        def block(x, w):
            big = ckptfx.checkpoint_name(x @ w, "big")          # recomputed
            small = ckptfx.checkpoint_name(big.sum(-1), "small")  # kept
            return small.exp()
    """
    return SaveAnyNamesButThese(_star_names(names, "save_any_names_but_these"))


def save_from_both_policies(policy_1: Callable[..., Any], policy_2: Callable[..., Any]) -> Policy:
    """Save what either policy saves. Each argument is a policy (not a factory: write
    ``save_only_these_names("attn")``, not ``save_only_these_names``).

    Example::

        cp = checkpoint_policies
        policy = cp.save_from_both_policies(cp.dots_with_no_batch_dims_saveable,
                                            cp.save_only_these_names("attn"))
    """
    return SaveFromBothPolicies(check_policy(policy_1, "policy_1"),
                                check_policy(policy_2, "policy_2"))


def save_and_offload_only_these_names(
    *,
    names_which_can_be_saved: Iterable[str],
    names_which_can_be_offloaded: Iterable[str],
    offload_src: str = "device",
    offload_dst: str = "pinned_host",
) -> Policy:
    """Save the values named in ``names_which_can_be_saved``, offload to host memory those
    named in ``names_which_can_be_offloaded``, recompute the rest. Both are collections of
    strings (``["attn"]``); a bare string would be read as its letters and is a
    ``TypeError``, as are non-iterables and non-string items.

    Example::

        policy = checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=["attn_out"],
            names_which_can_be_offloaded=["mlp_in"],   # kept in host memory
        )
    """
    where = "save_and_offload_only_these_names"
    return SaveAndOffloadOnlyTheseNames(
        _name_set(names_which_can_be_saved, "names_which_can_be_saved", where),
        _name_set(names_which_can_be_offloaded, "names_which_can_be_offloaded", where),
        Offload(offload_src, offload_dst),
    )


def offload_dot_with_no_batch_dims(offload_src: str = "device",
                                   offload_dst: str = "pinned_host") -> Policy:
    """Offload the outputs of matrix products without batch dimensions to host memory
    (``offload_dst``: ``"pinned_host"`` or ``"cpu"``), recompute everything else.

    Example::

        block = ckptfx.remat(f, policy=checkpoint_policies.offload_dot_with_no_batch_dims())
    """
    return OffloadDotWithNoBatchDims(Offload(offload_src, offload_dst))


# Each factory, with the call to write instead of passing it un-called.
_FACTORY_CALLS: dict[Callable[..., Any], str] = {
    save_only_these_names: "save_only_these_names('attn_out')",
    save_any_names_but_these: "save_any_names_but_these('attn_out')",
    save_from_both_policies: "save_from_both_policies(checkpoint_policies.dots_saveable, "
                             "checkpoint_policies.save_only_these_names('attn_out'))",
    save_and_offload_only_these_names: "save_and_offload_only_these_names("
                                       "names_which_can_be_saved=['attn_out'], "
                                       "names_which_can_be_offloaded=[])",
    offload_dot_with_no_batch_dims: "offload_dot_with_no_batch_dims()",
    memory_budget: "memory_budget(0.5)",
}


def factory_call(p: Any) -> str | None:
    for factory, call in _FACTORY_CALLS.items():
        if p is factory:
            return call
    return None


everything_saveable = EverythingSaveable()
nothing_saveable = NothingSaveable()
dots_saveable = DotsSaveable()
checkpoint_dots = dots_saveable
dots_with_no_batch_dims_saveable = DotsSaveable(only_if_no_batch_dims=True)

# jax.checkpoint_policies names ckptfx does not have, and what to use instead.
_NOT_HERE = {
    "save_anything_except_these_names": (
        "a checkpoint_name tags a value after the op that made it was decided, so a policy "
        "cannot take back a value another rule keeps; keep what you want instead: "
        "save_only_these_names(...), save_from_both_policies(dots_saveable, "
        "save_only_these_names(...)), or memory_budget(fraction)"),
}


class _PolicyNamespace(types.SimpleNamespace):
    """The policies ``ckptfx.remat(policy=...)``, ``ckptfx.checkpoint(policy=...)`` and
    ``apply_activation_checkpointing(policy=...)`` take, named as in
    ``jax.checkpoint_policies``: values (``dots_saveable``) and factories
    (``save_only_these_names("attn")``). A torch selective-checkpoint policy function works
    wherever a policy does.

    Example::

        from ckptfx import checkpoint_policies as cp
        block = ckptfx.remat(block, policy=cp.save_only_these_names("attn"))
    """

    def __getattr__(self, name: str) -> Any:  # only for names not found
        if name.startswith("__"):
            raise AttributeError(name)
        known = ", ".join(n for n in vars(self) if not n.startswith("_"))
        why = _NOT_HERE.get(name)
        raise AttributeError(
            f"ckptfx.checkpoint_policies has no policy {name!r}"
            + (f" (JAX's: {why})" if why else "")
            + f". It has: {known}. A torch selective-checkpoint policy function "
            "(ctx, op, *args, **kwargs) can be passed as policy= directly"
        )


checkpoint_policies = _PolicyNamespace(
    everything_saveable=everything_saveable,
    nothing_saveable=nothing_saveable,
    dots_saveable=dots_saveable,
    checkpoint_dots=checkpoint_dots,
    dots_with_no_batch_dims_saveable=dots_with_no_batch_dims_saveable,
    checkpoint_dots_with_no_batch_dims=dots_with_no_batch_dims_saveable,  # JAX's alias
    save_only_these_names=save_only_these_names,
    save_any_names_but_these=save_any_names_but_these,
    save_from_both_policies=save_from_both_policies,
    save_and_offload_only_these_names=save_and_offload_only_these_names,
    offload_dot_with_no_batch_dims=offload_dot_with_no_batch_dims,
    memory_budget=memory_budget,
)
