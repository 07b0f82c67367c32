"""The policy protocol: what a checkpoint policy is asked, and what it may answer.

A policy is called once per ATen op of the block's forward, as
``policy(ctx, op, *args, **kwargs)``: the same signature as torch's selective-checkpoint
policy functions, which ckptfx accepts unchanged. It answers for the op's outputs:

- ``True`` / ``CheckpointPolicy.PREFER_SAVE``: keep them (a permission, as in JAX);
- ``CheckpointPolicy.MUST_SAVE``: keep them, and never run the op again (for ops with side
  effects, such as collectives): where ``True`` lets a later replay recompute a value kept
  only for the replay (the recording's Rule 2b), ``MUST_SAVE`` keeps it for the graph's life;
- ``False`` / ``MUST_RECOMPUTE`` / ``PREFER_RECOMPUTE``: recompute them in the backward;
- an ``Offload`` (or ``MUST_CPU_OFFLOAD`` / ``PREFER_CPU_OFFLOAD``): keep them in host memory.

Rules:

1. **One normal form.** Every recorder asks through ``call_policy``, which hands back a
   ``Decision`` (``decide``): ``False``, ``True``, ``MUST_SAVE`` or an ``Offload``; only
   ``is False`` means recompute. Any other answer is a ``TypeError`` naming the op.
2. **Only ckptfx's own policies see names.** Values tagged with ``checkpoint_name(x, name)``
   reach subclasses of ``Policy`` as the op ``checkpoint_name`` with ``name=`` in kwargs;
   foreign (torch) policies are never asked about that op.
3. A policy only *permits* saving: an output the backward never reads is never kept.

The named policies built on this (``checkpoint_policies``) are in ``policies.named``;
``policies`` is the public entry to both.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Union

from torch.utils.checkpoint import CheckpointPolicy

from ckptfx.kernel.frame import CheckpointError
from ckptfx.policies.names import checkpoint_name

__all__ = ["Decision", "MUST_SAVE", "Offload", "Policy", "call_policy", "decide",
           "referenced_names"]


@dataclasses.dataclass(frozen=True)
class Offload:
    """Keep the output, moved from ``src`` (device memory) to ``dst`` (host memory) in the
    forward and back for the backward. ``dst`` is ``"pinned_host"`` (pinned when an
    accelerator is present) or ``"cpu"``. A policy returns one to offload an op's outputs.

    The copies overlap the computation (``ckptfx.offload``): out on a side stream in the
    forward, back ahead of the backward that reads them. ``min_bytes``: a smaller value stays
    in device memory (its copy would cost more than it frees). ``prefetch``: when the backward
    first reads a block's offloaded values, the values of this many blocks before it (in
    forward order) start coming back too. On the CPU an ``Offload`` keeps the value as it is.

    Example::

        def offload_matmuls(ctx, op, *args, **kwargs):
            return ckptfx.Offload() if op is torch.ops.aten.mm.default else False

        block = ckptfx.remat(f, policy=offload_matmuls)
    """

    src: str = "device"
    dst: str = "pinned_host"
    min_bytes: int = 1024
    prefetch: int = 1

    def __post_init__(self) -> None:
        for name in ("min_bytes", "prefetch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"Offload: {name} must be an int >= 0, got "
                                f"{type(value).__name__} {value!r}")
            if value < 0:
                raise ValueError(f"Offload: {name} must be an int >= 0, got {value!r}")
        if self.src != "device":
            hint = (f" (the host memory is dst, the second argument: Offload(dst={self.src!r}))"
                    if self.src in ("pinned_host", "cpu") else "")
            raise ValueError(f"src (offload_src in the policy factories) must be 'device', "
                             f"got {self.src!r}{hint}")
        if self.dst not in ("pinned_host", "cpu"):
            raise ValueError(f"dst (offload_dst in the policy factories) must be "
                             f"'pinned_host' or 'cpu', got {self.dst!r}")


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
    """Normalise a policy's answer for ``op``; anything else is a ``CheckpointError``. (Not
    a ``TypeError``: asked inside ``a @ b``, one would turn into Python's "unsupported
    operand type(s) for @", which names neither the policy nor the fix.)"""
    if result is True or result is False:
        return result
    if isinstance(result, Offload):
        return result
    decision = _ENUM_DECISIONS.get(result) if isinstance(result, CheckpointPolicy) else None
    if decision is None:
        hint = " (call it: ckptfx.Offload())" if result is Offload else ""
        raise CheckpointError(
            f"checkpoint policy returned {result!r} ({type(result).__name__}) for op {op}; "
            f"expected a bool, a torch.utils.checkpoint.CheckpointPolicy or ckptfx Offload"
            f"{hint}"
        )
    return decision


class Policy:
    """Base of ckptfx's own policies: they also see ``checkpoint_name`` values."""

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Decision:
        raise NotImplementedError

    def referenced_names(self) -> frozenset[str]:
        """The ``checkpoint_name`` names this policy decides about (empty for policies that
        do not look at names); ``remat`` warns once per block about those it never sees."""
        return frozenset()


def name_of(op: Any, kwargs: dict[str, Any]) -> str | None:
    return kwargs.get("name") if op is checkpoint_name else None


def call_policy(policy: Callable[..., Any], ctx: Any, op: Any, args: tuple,
                kwargs: dict[str, Any]) -> Decision:
    """Ask ``policy`` about ``op``; foreign policies are not asked about names."""
    if op is checkpoint_name and not isinstance(policy, Policy):
        return False
    try:
        result = policy(ctx, op, *args, **kwargs)
    except TypeError as err:  # as decide's: it would leave ``a @ b`` as a bare TypeError
        raise CheckpointError(
            f"the checkpoint policy {getattr(policy, '__name__', policy)!r} raised a "
            f"TypeError when asked about op {op}: {err}") from err
    return decide(result, op)


def referenced_names(policy: Any) -> frozenset[str]:
    """The names a policy decides about (empty for foreign policies and ``None``)."""
    if isinstance(policy, Policy):
        return policy.referenced_names()
    return frozenset()
