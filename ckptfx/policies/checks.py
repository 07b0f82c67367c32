"""What ``remat`` checks and says about the policy it is given.

Rules:

1. **Misuse is named in the user's own words.** A policy passed where ``remat``'s function
   goes, an un-called factory or a policy class is refused with a message that spells the
   policy as the user wrote it (``describe_policy``) and the call to write instead.
2. **Unused names warn once.** A name-based policy whose names a block never uses warns
   once per remat'd function (``UnusedNameWarning``), as JAX users asked for: ``NameCheck``
   opens a ``NameScope`` around each forward and judges the first one that completes.
"""

from __future__ import annotations

import inspect
import warnings
import weakref
from typing import Any, Callable

from torch import nn

from ckptfx._user_stack import user_stacklevel
from ckptfx.policies.named import (
    SaveAndOffloadOnlyTheseNames,
    SaveAnyNamesButThese,
    SaveFromBothPolicies,
    SaveOnlyTheseNames,
    checkpoint_policies,
    factory_call,
    unpartial,
)
from ckptfx.policies.names import NameScope, name_scopes
from ckptfx.policies.protocol import (
    Policy,
    referenced_names,
)

__all__ = ["NameCheck", "UnusedNameWarning", "describe_policy", "is_policy_like",
           "name_check", "positional_policy_message", "shared_name_check"]


def is_policy_like(p: Any) -> bool:
    """True for a ckptfx policy, a policy class or an un-called policy factory: what
    ``remat(p)`` receives when the policy is passed where the function goes."""
    return (isinstance(p, Policy) or factory_call(p) is not None
            or (isinstance(p, type) and issubclass(p, Policy)))


def positional_policy_message(p: Any) -> str:
    """What ``remat(p)`` says when ``p`` (policy-like) is passed where the function goes."""
    head = "remat's first argument is the function to rematerialize, got the policy"
    hint = factory_call(p)
    if hint is not None:
        return (f"{head} factory checkpoint_policies.{p.__name__}; call it and pass the "
                f"result by keyword: @remat(policy=checkpoint_policies.{hint}), or "
                f"remat(fun, policy=checkpoint_policies.{hint})")
    if isinstance(p, type):
        return (f"{head} class {p.__name__}; pass an instance by keyword: "
                f"remat(fun, policy={p.__name__}(...))")
    shown = describe_policy(p)
    return (f"{head} {shown}; pass the policy by keyword: @remat(policy={shown}), or "
            f"remat(fun, policy={shown})")


def describe_policy(p: Any) -> str:
    """How a user wrote ``p``: ``checkpoint_policies.dots_saveable``,
    ``save_only_these_names('attn')``; else its ``__name__`` or repr."""
    for name, value in vars(checkpoint_policies).items():
        if value is p:
            return f"checkpoint_policies.{name}"
    if isinstance(p, (SaveOnlyTheseNames, SaveAnyNamesButThese)):
        factory = ("save_only_these_names" if isinstance(p, SaveOnlyTheseNames)
                   else "save_any_names_but_these")
        return f"{factory}({', '.join(map(repr, sorted(p.names)))})"
    if isinstance(p, SaveAndOffloadOnlyTheseNames):
        return ("save_and_offload_only_these_names(names_which_can_be_saved="
                f"{sorted(p.names_which_can_be_saved)}, names_which_can_be_offloaded="
                f"{sorted(p.names_which_can_be_offloaded)})")
    if isinstance(p, SaveFromBothPolicies):
        return (f"save_from_both_policies({describe_policy(p.first)}, "
                f"{describe_policy(p.second)})")
    return getattr(p, "__name__", None) or repr(p)


# -- names no checkpoint_name uses (UnusedNameWarning) -----------------------------------------


class UnusedNameWarning(UserWarning):
    """A name-based policy of a ``remat``'d block names values that no ``checkpoint_name``
    in the block's forward uses, so those names save nothing (a typo, or a name from another
    block). Issued once per remat'd function.

    Example::

        import warnings
        warnings.simplefilter("error", ckptfx.UnusedNameWarning)   # make a typo fail loudly
    """


class NameCheck:
    """Per remat'd function: warn once if a forward leaves some policy names unused."""

    __slots__ = ("names", "policy", "done")

    def __init__(self, names: frozenset[str], policy: Any) -> None:
        self.names = names
        self.policy = policy
        self.done = False

    def open(self) -> NameScope:
        scope = NameScope()
        name_scopes.stack.append(scope)
        return scope

    def close(self, scope: NameScope) -> None:
        stack = name_scopes.stack
        if stack and stack[-1] is scope:
            stack.pop()
        elif scope in stack:  # never expected; leave the stack consistent regardless
            stack.remove(scope)

    def finish(self, scope: NameScope, fun: Callable[..., Any]) -> None:
        """After the first forward that completed: warn about the names it did not use."""
        if self.done:
            return
        self.done = True
        unused = self.names - scope.seen
        if not unused:
            return
        block, code = _block_of(fun)
        where = f" ({code.co_filename}:{code.co_firstlineno})" if code is not None else ""
        used = f"; the names it used: {sorted(scope.seen)}" if scope.seen else (
            "; it used no checkpoint_name at all")
        warnings.warn(
            f"ckptfx.remat: the policy {describe_policy(self.policy)} of block {block}{where} "
            f"names {sorted(unused)}, but no ckptfx.checkpoint_name in the block's forward "
            f"used {'this name' if len(unused) == 1 else 'these names'}, so "
            f"{'it has' if len(unused) == 1 else 'they have'} no effect{used}. Check the "
            "spelling, or tag the value: ckptfx.checkpoint_name(x, name). "
            "(Warned once per remat'd function or block.)",
            UnusedNameWarning,
            stacklevel=user_stacklevel(),
        )


def _block_of(fun: Callable[..., Any]) -> tuple[str, Any]:
    """The block's name and the code object of its forward (see ``_unwrap_block``)."""
    fun, module_class = _unwrap_block(fun)
    if module_class is not None:
        forward = getattr(module_class, "forward", None)
        return module_class.__name__, getattr(forward, "__code__", None)
    return (getattr(fun, "__qualname__", None) or type(fun).__name__,
            getattr(fun, "__code__", None))


# The methods through which a call of a module runs its forward
_MODULE_CALLS = frozenset({"forward", "__call__", "_call_impl", "_wrapped_call_impl"})


def _unwrap_block(fun: Any) -> tuple[Any, type | None]:
    """What a checkpointed call runs, for naming it and keying its name check: a module
    (itself, or its ``forward`` / ``__call__`` bound, under any ``functools.partial``, as
    Hugging Face passes ``partial(layer.__call__, ...)``) gives its class, as it was before
    ``checkpoint_wrapper``; anything else gives the function itself: a bound method's
    function, a decorated function's original (``__wrapped__``)."""
    fun = unpartial(fun)
    if isinstance(fun, nn.Module):
        return fun, getattr(fun, "_ckptfx_original_class", type(fun))
    owner = getattr(fun, "__self__", None)
    if isinstance(owner, nn.Module) and getattr(fun, "__name__", None) in _MODULE_CALLS:
        return fun, getattr(owner, "_ckptfx_original_class", type(owner))
    fun = getattr(fun, "__func__", fun)  # another method: its function
    try:
        fun = inspect.unwrap(fun)
    except ValueError:  # a __wrapped__ cycle: keep the outer function
        pass
    return fun, None


# The unused-name checks of checkpoint(fn, policy=...) calls, by block, then by names: such
# a call may pass a new function each time (Hugging Face passes a new partial of the layer's
# __call__ per call), so the check is the block's (``_unwrap_block``). Held weakly: a block
# that is gone takes its checks with it.
_SHARED_CHECKS: "weakref.WeakKeyDictionary[Any, dict[frozenset[str], NameCheck]]" = (
    weakref.WeakKeyDictionary())


def name_check(policy: Any) -> NameCheck | None:
    """A ``NameCheck`` for a policy that refers to names, else None (nothing to check)."""
    names = referenced_names(policy)
    return NameCheck(names, policy) if names else None


def shared_name_check(fun: Callable[..., Any], policy: Any) -> NameCheck | None:
    """The ``NameCheck`` of a ``checkpoint(fun, policy=...)`` call: one per block (its
    module class, else its function: ``_unwrap_block``) and set of names, so the warning
    comes once for a block however it is passed. None for a policy that names nothing."""
    names = referenced_names(policy)
    if not names:
        return None
    f, module_class = _unwrap_block(fun)
    block = module_class if module_class is not None else f
    try:
        checks = _SHARED_CHECKS.get(block)
    except TypeError:  # no weak reference to it (a callable object of a __slots__ class)
        block = type(block)
        checks = _SHARED_CHECKS.get(block)
    if checks is None:
        checks = _SHARED_CHECKS[block] = {}
    check = checks.get(names)
    if check is None:
        check = checks[names] = NameCheck(names, policy)
    return check
