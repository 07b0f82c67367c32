"""Checkpoint policies: which intermediates a remat'd block keeps for its backward.

A policy is called once per ATen op of the block's forward, as
``policy(ctx, op, *args, **kwargs)``: the same signature as torch's selective-checkpoint
policy functions, which ckptfx accepts unchanged. It answers for the op's outputs:

- ``True`` / ``CheckpointPolicy.PREFER_SAVE``: keep them (a permission, as in JAX);
- ``CheckpointPolicy.MUST_SAVE``: keep them, and never run the op again (for ops with side
  effects, such as collectives): where ``True`` lets a later replay recompute a value kept
  only for the replay (see trace.py, Rule 2b), ``MUST_SAVE`` keeps it for the graph's life;
- ``False`` / ``MUST_RECOMPUTE`` / ``PREFER_RECOMPUTE``: recompute them in the backward;
- an ``Offload`` (or ``MUST_CPU_OFFLOAD`` / ``PREFER_CPU_OFFLOAD``): keep them in host memory.

A policy only *permits* saving: an output the backward never reads is never kept. Values
tagged with ``checkpoint_name(x, name)`` reach ckptfx's own policies as the op
``checkpoint_name`` with ``name=`` in kwargs; foreign (torch) policies never see that op.

The names and meanings follow ``jax.checkpoint_policies``. "Dots" are the matrix products:
``mm``, ``addmm``, ``mv``, ``addmv``, ``dot`` and ``vdot`` (no batch dimensions), ``bmm``,
``baddbmm`` and ``addbmm`` (batch dimensions), and convolutions. ``matmul``, ``linear`` and
``einsum`` reach the dispatcher as these, so a ``matmul`` of 3-D by 2-D is a dot without batch
dimensions (as in JAX) and a batched ``matmul`` is a ``bmm``. Fused attention kernels are not
dots.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Callable, Union

import torch
from torch.utils.checkpoint import CheckpointPolicy

__all__ = [
    "Offload",
    "Policy",
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
    accelerator is present) or ``"cpu"``."""

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
    is reported as ``named 'name' at file:line``.

    Example::

        @ckptfx.remat(policy=ckptfx.checkpoint_policies.save_only_these_names("attn"))
        def block(x):
            a = ckptfx.checkpoint_name(attention(x), "attn")
            return mlp(a)
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    from .trace import active_tracer  # the kernel-free tracer; imported late to avoid a cycle

    tracer = active_tracer()
    if tracer is None or not isinstance(x, torch.Tensor):
        return x
    return tracer.name(x, name)


class Policy:
    """Base of ckptfx's own policies: they also see ``checkpoint_name`` values."""

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Decision:
        raise NotImplementedError


def _name_of(op: Any, kwargs: dict[str, Any]) -> str | None:
    return kwargs.get("name") if op is checkpoint_name else None


@dataclasses.dataclass(frozen=True)
class EverythingSaveable(Policy):
    """Save every value the backward needs: no recomputation (plain autograd's memory)."""

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Decision:
        return True


@dataclasses.dataclass(frozen=True)
class NothingSaveable(Policy):
    """Save only the block's inputs; recompute everything else (the default)."""

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Decision:
        return False


@dataclasses.dataclass(frozen=True)
class DotsSaveable(Policy):
    """Save the outputs of matrix products (and convolutions unless ``only_if_no_batch_dims``,
    which keeps only products without batch dimensions); recompute the cheap elementwise ops."""

    only_if_no_batch_dims: bool = False

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Decision:
        if self.only_if_no_batch_dims:
            return op in _DOTS_NO_BATCH
        return op in DOTS


@dataclasses.dataclass(frozen=True)
class SaveOnlyTheseNames(Policy):
    """Save only values tagged with one of ``names`` by ``checkpoint_name``."""

    names: frozenset[str]

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Decision:
        return _name_of(op, kwargs) in self.names


@dataclasses.dataclass(frozen=True)
class SaveAnyNamesButThese(Policy):
    """Save every named value except those in ``names``; unnamed values are recomputed."""

    names: frozenset[str]

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Decision:
        name = _name_of(op, kwargs)
        return name is not None and name not in self.names


@dataclasses.dataclass(frozen=True)
class SaveFromBothPolicies(Policy):
    """Save what either policy saves (offload if one offloads and neither saves)."""

    first: Callable[..., Any]
    second: Callable[..., Any]

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
    ``names_which_can_be_offloaded``, recompute the rest."""

    names_which_can_be_saved: frozenset[str]
    names_which_can_be_offloaded: frozenset[str]
    offload: Offload

    def __post_init__(self) -> None:
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


@dataclasses.dataclass(frozen=True)
class OffloadDotWithNoBatchDims(Policy):
    """Offload the outputs of matrix products without batch dimensions to host memory."""

    offload: Offload

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Decision:
        return self.offload if op in _DOTS_NO_BATCH else False


def call_policy(policy: Callable[..., Any], ctx: Any, op: Any, args: tuple,
                kwargs: dict[str, Any]) -> Decision:
    """Ask ``policy`` about ``op``; foreign policies are not asked about names."""
    if op is checkpoint_name and not isinstance(policy, Policy):
        return False
    return decide(policy(ctx, op, *args, **kwargs), op)


def _names(names: tuple[Any, ...], arg: str) -> frozenset[str]:
    for n in names:
        if not isinstance(n, str):
            raise TypeError(f"{arg} must be strings, got {type(n).__name__} {n!r}")
    return frozenset(names)


def _check_policy(p: Any, arg: str) -> Callable[..., Any]:
    if not callable(p):
        raise TypeError(f"{arg} must be a policy (callable), got {type(p).__name__}")
    return p


def save_only_these_names(*names: str) -> Policy:
    return SaveOnlyTheseNames(_names(names, "names"))


def save_any_names_but_these(*names: str) -> Policy:
    return SaveAnyNamesButThese(_names(names, "names"))


def save_from_both_policies(policy_1: Callable[..., Any], policy_2: Callable[..., Any]) -> Policy:
    return SaveFromBothPolicies(_check_policy(policy_1, "policy_1"),
                                _check_policy(policy_2, "policy_2"))


def save_and_offload_only_these_names(
    *,
    names_which_can_be_saved: Any,
    names_which_can_be_offloaded: Any,
    offload_src: str = "device",
    offload_dst: str = "pinned_host",
) -> Policy:
    return SaveAndOffloadOnlyTheseNames(
        _names(tuple(names_which_can_be_saved), "names_which_can_be_saved"),
        _names(tuple(names_which_can_be_offloaded), "names_which_can_be_offloaded"),
        Offload(offload_src, offload_dst),
    )


def offload_dot_with_no_batch_dims(offload_src: str = "device",
                                   offload_dst: str = "pinned_host") -> Policy:
    return OffloadDotWithNoBatchDims(Offload(offload_src, offload_dst))


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
