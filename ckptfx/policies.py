"""Checkpoint policies: which intermediates a remat'd block keeps for its backward.

A policy is called once per ATen op of the block's forward, as
``policy(ctx, op, *args, **kwargs)``: the same signature as torch's selective-checkpoint
policy functions, which ckptfx accepts unchanged. It answers for the op's outputs:

- ``True`` / ``CheckpointPolicy.PREFER_SAVE``: keep them (a permission, as in JAX);
- ``CheckpointPolicy.MUST_SAVE``: keep them, and never run the op again (for ops with side
  effects, such as collectives): where ``True`` lets a later replay recompute a value kept
  only for the replay (the recording's Rule 2b), ``MUST_SAVE`` keeps it for the graph's life;
- ``False`` / ``MUST_RECOMPUTE`` / ``PREFER_RECOMPUTE``: recompute them in the backward;
- an ``Offload`` (or ``MUST_CPU_OFFLOAD`` / ``PREFER_CPU_OFFLOAD``): keep them in host memory.

A policy only *permits* saving: an output the backward never reads is never kept. Values
tagged with ``checkpoint_name(x, name)`` reach ckptfx's own policies as the op
``checkpoint_name`` with ``name=`` in kwargs; foreign (torch) policies never see that op.

Bad input fails where it is written, in the style of torch's messages (what, which argument,
what to write instead): a bare string or a non-string where names go (a ``TypeError``: the
string would be read as the names of its letters), an un-called factory or a policy class
where a policy goes. A name-based policy whose names a block never uses warns once per
remat'd function (``UnusedNameWarning``), as JAX users asked for.

The names and meanings follow ``jax.checkpoint_policies``. "Dots" are the matrix products:
``mm``, ``addmm``, ``mv``, ``addmv``, ``dot`` and ``vdot`` (no batch dimensions), ``bmm``,
``baddbmm`` and ``addbmm`` (batch dimensions), and convolutions. ``matmul``, ``linear`` and
``einsum`` reach the dispatcher as these, so a ``matmul`` of 3-D by 2-D is a dot without batch
dimensions (as in JAX) and a batched ``matmul`` is a ``bmm``. Fused attention kernels are not
dots.
"""

from __future__ import annotations

import dataclasses
import threading
import types
import warnings
from typing import Any, Callable, Iterable, Union

import torch
from torch.utils.checkpoint import CheckpointPolicy

from . import _name_op
from ._tracers import active_tracer, tracer_stack as _stack

__all__ = [
    "Offload",
    "Policy",
    "UnusedNameWarning",
    "checkpoint_name",
    "checkpoint_policies",
    "decide",
]

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
class Offload:
    """Keep the output, moved from ``src`` (device memory) to ``dst`` (host memory) in the
    forward and back for the backward. ``dst`` is ``"pinned_host"`` (pinned when an
    accelerator is present) or ``"cpu"``. A policy returns one to offload an op's outputs.

    Example::

        def offload_matmuls(ctx, op, *args, **kwargs):
            return ckptfx.Offload() if op is torch.ops.aten.mm.default else False

        block = ckptfx.remat(f, policy=offload_matmuls)
    """

    src: str = "device"
    dst: str = "pinned_host"

    def __post_init__(self) -> None:
        if self.src != "device":
            raise ValueError(f"offload_src must be 'device', got {self.src!r}")
        if self.dst not in ("pinned_host", "cpu"):
            raise ValueError(f"offload_dst must be 'pinned_host' or 'cpu', got {self.dst!r}")


SAVE, RECOMPUTE = True, False
# The normalised answer: False, True, CheckpointPolicy.MUST_SAVE (a keep that is never
# recomputed) or an Offload. Only ``is False`` means recompute.
MUST_SAVE = CheckpointPolicy.MUST_SAVE
Decision = Union[bool, CheckpointPolicy, Offload]

_ENUM_DECISIONS: dict[Any, Decision] = {
    CheckpointPolicy.MUST_SAVE: MUST_SAVE,
    CheckpointPolicy.PREFER_SAVE: SAVE,
    CheckpointPolicy.MUST_RECOMPUTE: RECOMPUTE,
    CheckpointPolicy.PREFER_RECOMPUTE: RECOMPUTE,
}
for _name in ("MUST_CPU_OFFLOAD", "PREFER_CPU_OFFLOAD"):
    if hasattr(CheckpointPolicy, _name):
        _ENUM_DECISIONS[getattr(CheckpointPolicy, _name)] = Offload()


def decide(result: Any, op: Any) -> Decision:
    """Normalise a policy's answer for ``op``; anything else is a ``TypeError``."""
    if result is True or result is False:
        return result
    if isinstance(result, Offload):
        return result
    decision = _ENUM_DECISIONS.get(result) if isinstance(result, CheckpointPolicy) else None
    if decision is None:
        raise TypeError(
            f"checkpoint policy returned {result!r} ({type(result).__name__}) for op {op}; "
            "expected a bool, a torch.utils.checkpoint.CheckpointPolicy or ckptfx Offload"
        )
    return decision


def checkpoint_name(x: Any, name: str) -> Any:
    """Tag ``x`` with ``name`` for the name-based policies and the residual report.

    An identity: outside a ``remat`` forward it returns ``x`` itself. Inside one, the
    value becomes visible to ``save_only_these_names`` and friends, and a saved residual
    is reported as ``named 'name' at file:line``. A name-based policy naming a value that
    no ``checkpoint_name`` of the block's forward uses gets one ``ckptfx.UnusedNameWarning``
    per remat'd function (see ``remat``). Under ``torch.compile`` it is an op of the graph
    (a copy of ``x``) that the compiled policy reads the name from.

    Example::

        @ckptfx.remat(policy=ckptfx.checkpoint_policies.save_only_these_names("attn"))
        def block(x):
            a = ckptfx.checkpoint_name(attention(x), "attn")
            return mlp(a)
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    if torch.compiler.is_compiling():  # an op the compiled policy sees (_name_op.py)
        return _name_op.tag(x, name) if isinstance(x, torch.Tensor) else x
    tracer = active_tracer()
    if tracer is None:
        return x
    scopes = _name_scopes.stack
    if scopes:
        scopes[-1].saw(name)
    if not isinstance(x, torch.Tensor):
        return x
    return tracer.name(x, name)


class Policy:
    """Base of ckptfx's own policies: they also see ``checkpoint_name`` values."""

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Decision:
        raise NotImplementedError

    def referenced_names(self) -> frozenset[str]:
        """The ``checkpoint_name`` names this policy decides about (empty for policies that
        do not look at names); ``remat`` warns once per block about those it never sees."""
        return frozenset()


def _name_of(op: Any, kwargs: dict[str, Any]) -> str | None:
    return kwargs.get("name") if op is checkpoint_name else None


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
        return _name_of(op, kwargs) in self.names

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
        name = _name_of(op, kwargs)
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
        _check_policy(self.first, "policy_1")
        _check_policy(self.second, "policy_2")

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
        name = _name_of(op, kwargs)
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


def call_policy(policy: Callable[..., Any], ctx: Any, op: Any, args: tuple,
                kwargs: dict[str, Any]) -> Decision:
    """Ask ``policy`` about ``op``; foreign policies are not asked about names."""
    if op is checkpoint_name and not isinstance(policy, Policy):
        return False
    return decide(policy(ctx, op, *args, **kwargs), op)


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


def _check_policy(p: Any, arg: str) -> Callable[..., Any]:
    """``p`` if it is a policy; otherwise a ``TypeError`` saying what to write instead."""
    hint = _factory_call(p)
    if hint is not None:
        raise TypeError(
            f"{arg}=checkpoint_policies.{p.__name__} is a policy factory, not a policy: call "
            f"it, e.g. {arg}=checkpoint_policies.{hint}"
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
    return p


def check_policy(p: Any, arg: str = "policy") -> Callable[..., Any]:
    """Validate a policy argument (used by ``remat``): ``TypeError`` for an un-called
    factory, a policy class, or something not callable."""
    return _check_policy(p, arg)


def is_policy_like(p: Any) -> bool:
    """True for a ckptfx policy, a policy class or an un-called policy factory: what
    ``remat(p)`` receives when the policy is passed where the function goes."""
    return (isinstance(p, Policy) or _factory_call(p) is not None
            or (isinstance(p, type) and issubclass(p, Policy)))


def positional_policy_message(p: Any) -> str:
    """What ``remat(p)`` says when ``p`` (policy-like) is passed where the function goes."""
    head = "remat's first argument is the function to rematerialize, got the policy"
    hint = _factory_call(p)
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


def referenced_names(policy: Any) -> frozenset[str]:
    """The names a policy decides about (empty for foreign policies and ``None``)."""
    if isinstance(policy, Policy):
        return policy.referenced_names()
    return frozenset()


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
    return SaveFromBothPolicies(_check_policy(policy_1, "policy_1"),
                                _check_policy(policy_2, "policy_2"))


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
}


def _factory_call(p: Any) -> str | None:
    for factory, call in _FACTORY_CALLS.items():
        if p is factory:
            return call
    return None


# -- names no checkpoint_name uses (UnusedNameWarning) -----------------------------------------


class UnusedNameWarning(UserWarning):
    """A name-based policy of a ``remat``'d block names values that no ``checkpoint_name``
    in the block's forward uses, so those names save nothing (a typo, or a name from another
    block). Issued once per remat'd function.

    Example::

        import warnings
        warnings.simplefilter("error", ckptfx.UnusedNameWarning)   # make a typo fail loudly
    """


class _NameScopes(threading.local):
    def __init__(self) -> None:
        self.stack: list[NameScope] = []


_name_scopes = _NameScopes()


class NameScope:
    """The names ``checkpoint_name`` used in one forward of one remat'd block.

    ``depth`` is the number of tracers active when the block started: the block's own
    tracer is the next one, and a ``checkpoint_name`` seen under a deeper tracer belongs to
    a block nested inside (which has its own policy).
    """

    __slots__ = ("depth", "seen")

    def __init__(self) -> None:
        self.depth = len(_stack.tracers)
        self.seen: set[str] = set()

    def saw(self, name: str) -> None:
        if len(_stack.tracers) == self.depth + 1:
            self.seen.add(name)


class NameCheck:
    """Per remat'd function: warn once if a forward leaves some policy names unused."""

    __slots__ = ("names", "policy", "done")

    def __init__(self, names: frozenset[str], policy: Any) -> None:
        self.names = names
        self.policy = policy
        self.done = False

    def open(self) -> NameScope:
        scope = NameScope()
        _name_scopes.stack.append(scope)
        return scope

    def close(self, scope: NameScope) -> None:
        stack = _name_scopes.stack
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
        code = getattr(fun, "__code__", None)
        where = f" ({code.co_filename}:{code.co_firstlineno})" if code is not None else ""
        block = getattr(fun, "__qualname__", None) or type(fun).__name__
        used = f"; the names it used: {sorted(scope.seen)}" if scope.seen else (
            "; it used no checkpoint_name at all")
        warnings.warn(
            f"ckptfx.remat: the policy {describe_policy(self.policy)} of block {block}{where} "
            f"names {sorted(unused)}, but no ckptfx.checkpoint_name in the block's forward "
            f"used {'this name' if len(unused) == 1 else 'these names'}, so "
            f"{'it has' if len(unused) == 1 else 'they have'} no effect{used}. Check the "
            "spelling, or tag the value: ckptfx.checkpoint_name(x, name). "
            "(Warned once per remat'd function.)",
            UnusedNameWarning,
            stacklevel=4,
        )


def name_check(policy: Any) -> NameCheck | None:
    """A ``NameCheck`` for a policy that refers to names, else None (nothing to check)."""
    names = referenced_names(policy)
    return NameCheck(names, policy) if names else None


everything_saveable = EverythingSaveable()
nothing_saveable = NothingSaveable()
dots_saveable = DotsSaveable()
checkpoint_dots = dots_saveable
dots_with_no_batch_dims_saveable = DotsSaveable(only_if_no_batch_dims=True)

checkpoint_policies = types.SimpleNamespace(
    everything_saveable=everything_saveable,
    nothing_saveable=nothing_saveable,
    dots_saveable=dots_saveable,
    checkpoint_dots=checkpoint_dots,
    dots_with_no_batch_dims_saveable=dots_with_no_batch_dims_saveable,
    save_only_these_names=save_only_these_names,
    save_any_names_but_these=save_any_names_but_these,
    save_from_both_policies=save_from_both_policies,
    save_and_offload_only_these_names=save_and_offload_only_these_names,
    offload_dot_with_no_batch_dims=offload_dot_with_no_batch_dims,
)
# ``memory_budget`` (budget.py, which imports this module) is added by ckptfx/__init__.py.
