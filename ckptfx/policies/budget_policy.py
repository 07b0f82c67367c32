"""``MemoryBudget``: the policy ``checkpoint_policies.memory_budget(fraction)`` makes.

The policy is a value (a fraction); how a budget plans, from a recording of the block, is
``ckptfx.budget``'s (``remat`` asks ``ckptfx.budget.planner.tracer_for`` for the recorder of
a call under this policy). Asked op by op, as on the ``torch.func`` path, it recomputes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ckptfx.policies.protocol import Decision, Policy

__all__ = ["MemoryBudget", "memory_budget"]


@dataclasses.dataclass(frozen=True)
class MemoryBudget(Policy):
    """Keep at most ``fraction`` of the bytes ``everything_saveable`` would keep beyond the
    block's arguments, choosing what to keep to recompute the fewest FLOPs.

    Made by ``checkpoint_policies.memory_budget(fraction)``; how it plans is ``ckptfx.budget``'s
    Rules. Pickled as ``ckptfx.budget.MemoryBudget``, its public home.
    """

    fraction: float

    def __post_init__(self) -> None:
        f = self.fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)):
            raise TypeError(f"memory_budget: fraction must be a float in [0, 1], got "
                            f"{type(f).__name__} {f!r}")
        if not (0.0 <= f <= 1.0):  # also refuses NaN
            raise ValueError(f"memory_budget: fraction must be in [0, 1] (0.0 keeps nothing, "
                             f"1.0 keeps what everything_saveable keeps), got {f!r}")
        object.__setattr__(self, "fraction", float(f))

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Decision:
        # Asked op by op (the torch.func path, Rule 4): without a plan, recompute.
        return False

    def choose(self, frontier: Any) -> Any:
        """The point of ``frontier`` (a ``ckptfx.budget.model.Frontier``) this policy keeps;
        a model budget's share (``ckptfx.budget.planner.BlockShare``) overrides it."""
        return frontier.choose(self.fraction)


def memory_budget(fraction: float) -> MemoryBudget:
    """A policy keeping at most ``fraction`` of what ``everything_saveable`` keeps (bytes
    beyond the block's arguments), chosen to recompute the fewest FLOPs.

    ``0.0`` is ``nothing_saveable``, ``1.0`` is ``everything_saveable``. The first call of a
    block with a new input signature runs as ``nothing_saveable`` and plans; later calls use
    the plan (``print_saved_residuals`` shows it). A fraction outside ``[0, 1]`` is a
    ``ValueError``, a non-number a ``TypeError``.

    Example::

        from ckptfx import checkpoint_policies as cp

        @ckptfx.remat(policy=cp.memory_budget(0.3))
        def block(x):
            return mlp(attention(x))

        block(x).sum().backward()    # plans, recomputes everything this once
        block(x).sum().backward()    # keeps at most 30% of everything_saveable's bytes
    """
    return MemoryBudget(fraction)
