"""``MemoryBudget``: the policy ``checkpoint_policies.memory_budget(fraction, offload=...)`` makes.

The policy is a value (two fractions); how a budget plans, from a recording of the block, is
``ckptfx.budget``'s (``remat`` asks ``ckptfx.budget.planner.tracer_for`` for the recorder of
a call under this policy; ``ckptfx.budget.place`` splits a plan between device and host).
Asked op by op, as on the ``torch.func`` path, it recomputes.

Rules

1. ``offload`` defaults to ``0.0``, which is the budget without offload exactly; a pickle of
   a budget made before ``offload`` existed has no such field and loads with the default
   (the dataclass default is a class attribute, read where the instance has none).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ckptfx.policies.protocol import Decision, Policy

__all__ = ["MemoryBudget", "memory_budget"]


@dataclasses.dataclass(frozen=True)
class MemoryBudget(Policy):
    """Keep at most ``fraction`` of the bytes ``everything_saveable`` would keep beyond the
    block's arguments on the device, and at most ``offload`` of them in host memory,
    choosing what to keep to recompute the fewest FLOPs.

    Made by ``checkpoint_policies.memory_budget(fraction, offload=...)``; how it plans is
    ``ckptfx.budget``'s Rules. Pickled as ``ckptfx.budget.MemoryBudget``, its public home.
    """

    fraction: float
    offload: float = 0.0

    def __post_init__(self) -> None:
        f = self.fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)):
            raise TypeError(f"memory_budget: fraction must be a float in [0, 1], got "
                            f"{type(f).__name__} {f!r}")
        if not (0.0 <= f <= 1.0):  # also refuses NaN
            raise ValueError(f"memory_budget: fraction must be in [0, 1] (0.0 keeps nothing, "
                             f"1.0 keeps what everything_saveable keeps), got {f!r}")
        o = self.offload
        if isinstance(o, bool) or not isinstance(o, (int, float)):
            raise TypeError(f"memory_budget: offload must be a float in [0, 1], got "
                            f"{type(o).__name__} {o!r}")
        if not (0.0 <= o <= 1.0):
            raise ValueError(f"memory_budget: offload must be in [0, 1] (the fraction of "
                             f"everything_saveable's bytes that may be kept in host memory; "
                             f"0.0 offloads nothing), got {o!r}")
        object.__setattr__(self, "fraction", float(f))
        object.__setattr__(self, "offload", float(o))

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Decision:
        # Asked op by op (the torch.func path, Rule 4): without a plan, recompute.
        return False

    def label(self) -> str:
        """How the budget is written in reports: ``memory_budget(0.3)``,
        ``memory_budget(0.3, offload=0.2)``."""
        if self.offload:
            return f"memory_budget({self.fraction:g}, offload={self.offload:g})"
        return f"memory_budget({self.fraction:g})"


def memory_budget(fraction: float, offload: float = 0.0) -> MemoryBudget:
    """A policy keeping at most ``fraction`` of what ``everything_saveable`` keeps (bytes
    beyond the block's arguments) on the device, and at most ``offload`` of it in host memory
    (``ckptfx.Offload``), chosen to recompute the fewest FLOPs.

    ``0.0`` is ``nothing_saveable``, ``1.0`` is ``everything_saveable``. The first call of a
    block with a new input signature runs as ``nothing_saveable`` and plans; later calls use
    the plan (``print_saved_residuals`` shows it). A fraction or offload outside ``[0, 1]``
    is a ``ValueError``, a non-number a ``TypeError``.

    Offloading costs host transfers (overlapped with compute), not FLOPs: with ``offload``
    the budget keeps the point that recomputes fewest FLOPs within ``fraction + offload``
    of everything_saveable's bytes whose values split with at most ``fraction`` on the
    device and ``offload`` on the host, offloading the largest values first and as few
    bytes as it can; values under 64 KiB (``ckptfx.budget.place.MIN_OFFLOAD_BYTES``) stay
    on the device. It never recomputes more than ``memory_budget(fraction)``, and
    ``offload=0.0`` is exactly that. ``fraction + offload`` may exceed 1: everything is then
    kept, split between the memories.

    Example::

        from ckptfx import checkpoint_policies as cp

        @ckptfx.remat(policy=cp.memory_budget(0.3))
        def block(x):
            return mlp(attention(x))

        block(x).sum().backward()    # plans, recomputes everything this once
        block(x).sum().backward()    # keeps at most 30% of everything_saveable's bytes

        # at most 20% on the device, 40% more in host memory
        offloading = ckptfx.remat(block_fn, policy=cp.memory_budget(0.2, offload=0.4))
    """
    return MemoryBudget(fraction, offload)
