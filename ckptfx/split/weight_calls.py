"""How a split's weight pass calls the autograd engine: one call per weight group, or, where
blocks are small, one plain backward for all the weights.

Rules

1. The per-group weight pass (``ckptfx.split.weight_pass`` Rule 1) executes only weight-gradient
   work, but each group costs an engine call (a GraphTask, Python, and the nodes of the
   group; ~100 us on a loaded CPU core), and finding the groups and capturing their
   gradients costs Python in dx. Where blocks are small that is most of dx + dw.

2. The *whole* weight pass is one ``autograd.grad`` from the split's outputs, with their
   cotangents, for every weight: dx is then a plain input backward (no groups, no capture
   hooks, no trimming) and dw a plain weight backward. The input-path nodes that lead to
   weights run twice, in dx and again in dw; a built-in torch node gets the same gradient it
   got in a fused backward both times (the same graph, the same seeds, deterministic
   kernels), so the gradients are the same, bit for bit. A custom ``autograd.Function``'s
   backward may not be (a random draw, an FP8 amax/scale update, a counter): a second run
   could give dw other gradients than a fused backward, so one anywhere in the graph forces
   the per-group pass (``whole_backward_safe``). What the whole pass costs is the input-path
   work that dx already did (for matmul layers about as many FLOPs as the weight gradients)
   and the session keeps every replayed tensor until dw. The consecutive groups being
   chained is why one call cannot be rooted at the groups' captured gradients without
   either this recomputation or a pin per intermediate: the pinned variant (one call rooted
   at every intermediate, each pinned by a pre-hook) was measured no faster than per-group
   calls (it executes the same chained nodes plus a Python hook each), so it is not used.

3. The choice is made from shapes, never a clock (DESIGN invariant 7): the weight-gradient
   FLOPs are estimated as ``2 * rows * sum(w.numel())``, ``rows`` the largest row count
   (``numel / shape[-1]``) among the inputs and the cotangents, and the whole pass is taken
   when that is at most ``ENGINE_CALL_FLOPS`` per weight (``whole_backward_pays``). Never
   under DDP or FSDP2, whose hooks must run once per backward (``ckptfx.split.data_parallel``), and
   never where the graph from the outputs holds a custom Function's backward (Rule 2,
   ``whole_backward_safe``). Under the whole pass a tensor hook on the input path runs in dx
   and again in dw (a C++ node's hooks cannot be seen from Python).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ckptfx import _compat
from ckptfx.split.weight_groups import WeightGroup

__all__ = ["ENGINE_CALL_FLOPS", "whole_backward_group", "whole_backward_pays",
           "whole_backward_safe"]

# Estimated weight-gradient FLOPs per weight below which recomputing the input path in dw
# costs less than the per-group pass's calls. Measured on 6 MLP blocks (bench_overhead.py's,
# hidden = 4 d), the two passes forced and alternated in one process, dx + dw of the whole
# pass against the per-group one: 0.79x at ~130k FLOPs per weight (d=64, batch 8), 0.88x at
# ~530k (batch 32) but 1.07x at ~530k (d=128), 1.47x at 2.1M (d=256); the whole step at
# d=64: 0.90x (``bench_overhead.py --only split``). A fixed number: the choice must not
# depend on timing.
ENGINE_CALL_FLOPS = 300_000

# Tests and benchmarks force a pass: None (the rule), "per_group" or "whole". For measurement
# only: "whole" skips ``whole_backward_safe`` too, so a custom Function's backward on the input
# path runs twice and may then give other gradients (Rule 2).
_force: str | None = None


def _rows(t: torch.Tensor | None) -> int:
    if t is None or t.dim() == 0:
        return 1
    return t.numel() // max(1, t.shape[-1])


def whole_backward_pays(cotangents: Sequence[torch.Tensor | None],
                        xs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor]) -> bool:
    """True when the whole weight pass is expected to cost less than per-group calls (Rule 3).

    Example::

        >>> w = [torch.zeros(256, 64), torch.zeros(256)]
        >>> whole_backward_pays([torch.zeros(8, 64)], [torch.zeros(8, 64)], w)
        True
    """
    if _force is not None:
        return _force == "whole"
    if not weights:
        return False
    rows = max([_rows(c) for c in cotangents] + [_rows(x) for x in xs] + [1])
    flops = 2 * rows * sum(w.numel() for w in weights)
    return flops <= ENGINE_CALL_FLOPS * len(weights)


def whole_backward_safe(outputs: Sequence[torch.Tensor]) -> bool:
    """True when no node the whole pass could execute twice is a custom Function's (Rule 2).

    Walks the autograd graph from the outputs' ``grad_fn`` down to the leaves (iterative, each
    node once, stopping at ``AccumulateGrad``); any ``BackwardCFunction`` (a custom
    ``torch.autograd.Function``, including compiled regions' backward) makes it False. The
    whole reachable graph is a superset of the nodes dx and dw share: cheap and conservative.

    Example::

        >>> w = torch.zeros(2, requires_grad=True)
        >>> whole_backward_safe([(w * 2).sin()])
        True
    """
    if _force is not None:
        return _force == "whole"
    custom = torch.autograd.function.BackwardCFunction
    return not _compat.any_node(outputs, lambda node: isinstance(node, custom))


def whole_backward_group(n_outputs: int, n_weights: int) -> WeightGroup:
    """One group rooted at every output (with its cotangent), for every weight (Rule 2)."""
    g = WeightGroup()
    g.roots = list(range(n_outputs))
    g.weights = list(range(n_weights))
    return g
