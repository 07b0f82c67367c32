"""``ckptfx::checkpoint_name``: the op that carries a ``checkpoint_name`` into a compiled graph.

Eager remat sees names through its recorder; a compiled graph has no recorder, only ops. So
under ``torch.compile`` ``checkpoint_name(x, name)`` becomes this op: a copy of ``x`` (an op
may not return its own input) whose ``name`` argument the compiled policy
(``ckptfx.lowering``) reads, so ``save_only_these_names("h")`` keeps the op's output and
recomputes what made it. Its gradient is the incoming gradient, so values and gradients are
bitwise those of the untagged program. Inductor fuses the copy into its producer; the eager
and aot_eager backends run it (one copy of each named tensor).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["NAME_OP", "tag"]


@torch.library.custom_op("ckptfx::checkpoint_name", mutates_args=())
def _checkpoint_name(x: torch.Tensor, name: str) -> torch.Tensor:
    return x.clone()


@_checkpoint_name.register_fake
def _(x: torch.Tensor, name: str) -> torch.Tensor:
    return torch.empty_like(x)


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return grad, None


_checkpoint_name.register_autograd(_backward)

NAME_OP = torch.ops.ckptfx.checkpoint_name.default


def tag(x: torch.Tensor, name: str) -> torch.Tensor:
    """``x`` tagged with ``name`` in the graph being compiled."""
    return torch.ops.ckptfx.checkpoint_name(x, name)
