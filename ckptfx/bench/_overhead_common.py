"""What the overhead benchmark's parts share (``ckptfx.bench.overhead``): the blocks they
time, the alternating rounds and their ratios, and issue 17's targets with the verdict on them."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["Block", "MLPBlock", "TARGETS", "fmt", "ratio", "rounds_of", "target_note",
           "verdict"]


class Block(nn.Module):
    """A pre-norm transformer block (no dropout: bench_remat.py's)."""

    def __init__(self, d: int, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(
            2, 0, 3, 1, 4).reshape(3, b * self.heads, t, d // self.heads)
        a = torch.softmax(torch.bmm(q, k.transpose(1, 2)) / (d // self.heads) ** 0.5, -1)
        o = torch.bmm(a, v).view(b, self.heads, t, -1).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(o)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class MLPBlock(nn.Module):
    """x + fc2(gelu(fc1(x))) (bench_sessions.py's small block)."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


def rounds_of(fns: dict[str, Callable[[], Any]], rounds: int, inner: int = 1
              ) -> dict[str, list[float]]:
    """Seconds per call of each variant, one entry per round, variants alternated."""
    for fn in fns.values():  # warm up
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for r in range(rounds):
        for k in (names if r % 2 == 0 else names[::-1]):
            fn = fns[k]
            t0 = time.thread_time()
            for _ in range(inner):
                fn()
            times[k].append((time.thread_time() - t0) / inner)
    return times


def ratio(times: dict[str, list[float]], a: str, b: str
          ) -> tuple[float, float, float, float]:
    """The median of the per-round ratios a/b (the figure), their quartiles, and the median
    of a over the median of b. Each round times a and b next to each other, so a round's
    ratio is free of the machine's speed, which drifts during a run (on a shared 2-core VM
    by tens of percent within a minute); the ratio of the two medians is not, and can fall
    outside the per-round quartiles. Both are printed; the verdict reads the figure."""
    per_round = sorted(x / y for x, y in zip(times[a], times[b]))
    n = len(per_round)
    return (statistics.median(per_round), per_round[n // 4], per_round[(3 * n) // 4],
            statistics.median(times[a]) / statistics.median(times[b]))


def fmt(r: tuple[float, float, float, float]) -> str:
    """A ``ratio`` as printed: the figure and its quartiles, then the ratio of medians."""
    return f"{r[0]:.3f}x (per-round IQR {r[1]:.3f}-{r[2]:.3f}; medians' ratio {r[3]:.3f})"


def target_note(key: str) -> str:
    """The printed target of figure ``key``, from ``TARGETS`` (issue 17's, below)."""
    limit = next(t[1] for t in TARGETS if t[0] == key)
    return f"   (target <= {limit})"


# Issue 17's targets: (figure, at most, what it is, the figure of its floor or None).
TARGETS: tuple[tuple[str, float, str, str | None], ...] = (
    ("remat64_nothing_vs_torch", 1.1, "remat nothing_saveable forward / torch checkpoint, d=64",
     None),
    ("remat256_nothing_vs_torch", 1.1, "remat nothing_saveable forward / torch checkpoint, d=256",
     None),
    ("remat64_dots_vs_sac", 1.0, "remat dots_saveable forward / torch SAC, d=64", None),
    ("remat256_dots_vs_sac", 1.0, "remat dots_saveable forward / torch SAC, d=256", None),
    ("split_sessions_vs_none", 1.3, "split step with sessions / no checkpointing, d=64",
     "split_hook_floor_vs_none"),
    ("split_vjp_vs_fused", 1.5, "vjp_split step / a fused step without checkpointing, d=64",
     "split_vjp_floor_vs_fused"),
    ("split_vjp_vs_ckptfx_fused", 1.5,
     "vjp_split step / ckptfx's checkpointed fused step, d=64 (the same blocks, not split)",
     None),
    ("vjp256_vs_fused", 1.05, "dx + dw / one fused backward, d=256",
     "vjp256_torch_plain_split_vs_fused"),
    ("vjp256_kept_vs_fused", 1.05,
     "dx + dw / one fused backward, d=256, glibc keeping freed memory (as a caching allocator)",
     "vjp256_kept_torch_plain_split_vs_fused"),
)


def verdict(figures: dict[str, float]) -> list[str]:
    """One line per target whose figure is in ``figures``: met or not, and whether its floor
    (what any implementation of that step pays, measured in the same run) is above it.

    Example::

        >>> figures = {"split_vjp_vs_fused": 2.8, "split_vjp_floor_vs_fused": 1.9}
        >>> print(verdict(figures)[0])  # doctest: +ELLIPSIS
        NOT met  2.800x <= 1.5  vjp_split step / ... (floor 1.900x: the target is below it)
    """
    lines = []
    for key, limit, what, floor_key in TARGETS:
        if key not in figures:
            continue
        value = figures[key]
        line = f"{'met' if value <= limit else 'NOT met':8s} {value:.3f}x <= {limit:<4} {what}"
        if floor_key is not None and floor_key in figures:
            floor = figures[floor_key]
            line += f" (floor {floor:.3f}x" + (": the target is below it)" if floor > limit
                                                 else ")")
        lines.append(line)
    return lines

