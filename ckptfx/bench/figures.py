"""Figures from paired rounds, and the verdict on targets: what every timing in the bench
(``ckptfx bench --overhead``, the scripts in ``benchmarks/``) reports with.

- ``rounds_of``: variants called in alternating rounds (A B C ..., then ... C B A), the
  seconds per call of each, per round.
- ``ratio``: the median of the per-round ratios a/b (the figure), its quartiles and the
  ratio of the medians; ``fmt`` prints one. ``medians``: the median seconds per variant.
- ``TARGETS``, ``target_note`` and ``verdict``: the per-call overhead targets (each named by
  what it measures) and one line per target met or not, with the floor measured for it.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

__all__ = ["TARGETS", "Target", "fmt", "medians", "ratio", "rounds_of", "target_note",
           "verdict"]

# (figure, at most, what it is, the figure of its floor or None).
Target = tuple[str, float, str, str | None]


def rounds_of(fns: dict[str, Callable[[], Any]], rounds: int, inner: int = 1,
              clock: Callable[[], float] = time.thread_time) -> dict[str, list[float]]:
    """Seconds per call of each variant, one entry per round, after one warm-up call each;
    the variants alternate (the order reversed every other round), so a slow spell of the
    machine falls on all of them. ``clock``: the benchmarking thread's CPU time by default
    (other processes' load cannot stretch it); ``time.perf_counter`` where the work is not
    all on this thread (a device, a child process)."""
    for fn in fns.values():  # warm up
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for r in range(rounds):
        for k in (names if r % 2 == 0 else names[::-1]):
            fn = fns[k]
            t0 = clock()
            for _ in range(inner):
                fn()
            times[k].append((clock() - t0) / inner)
    return times


def medians(times: dict[str, list[float]]) -> dict[str, float]:
    """The median of each variant's rounds (``rounds_of``'s result)."""
    return {k: statistics.median(v) for k, v in times.items()}


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


def target_note(key: str, targets: tuple[Target, ...] | None = None) -> str:
    """The printed target of figure ``key``, from ``targets`` (``TARGETS`` by default)."""
    limit = next(t[1] for t in (TARGETS if targets is None else targets) if t[0] == key)
    return f"   (target <= {limit})"


# The per-call overhead targets of ``ckptfx bench --overhead``.
TARGETS: tuple[Target, ...] = (
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


def verdict(figures: dict[str, float], targets: tuple[Target, ...] | None = None
            ) -> list[str]:
    """One line per target (``TARGETS`` by default) whose figure is in ``figures``: met or
    not, and whether its floor (what any implementation of that step pays, measured in the
    same run) is above it. A target whose part did not run has no line.

    Example::

        >>> figures = {"split_vjp_vs_fused": 2.8, "split_vjp_floor_vs_fused": 1.9}
        >>> print(verdict(figures)[0])  # doctest: +ELLIPSIS
        NOT met  2.800x <= 1.5  vjp_split step / ... (floor 1.900x: the target is below it)
    """
    lines = []
    for key, limit, what, floor_key in TARGETS if targets is None else targets:
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
