"""PNG plots of a ``ckptfx bench`` result (matplotlib: the ``plot`` extra).

- ``memory_vs_time.png``: peak memory against step time, one point per variant, coloured by
  family; ``memory_budget`` variants (family ``budget``), when present, are joined in budget
  order as the Pareto curve they trace; the lower-left frontier over all points is dashed.
- ``split_replays.png``: replays per block per micro-batch against the number of dw calls,
  torch's checkpoint against ckptfx under one session.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

__all__ = ["PLOT_HINT", "have_matplotlib", "write_plots"]

PLOT_HINT = 'pip install "ckptfx[plot]"'
MIB = 2**20
_COLOURS = {"none": "black", "torch": "tab:red", "ckptfx": "tab:blue", "remat": "tab:green",
            "budget": "tab:purple"}


def have_matplotlib() -> bool:
    """True when matplotlib is importable."""
    return importlib.util.find_spec("matplotlib") is not None


def _frontier(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other point beats on both time and memory, by time."""
    best: list[tuple[float, float]] = []
    for t, m in sorted(points):
        if not best or m < best[-1][1]:
            best.append((t, m))
    return best


def write_plots(results: dict[str, Any], out_dir: str) -> list[str]:
    """Write the two PNGs into ``out_dir``; return their paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    rows = results["variants"]
    paths = []

    fig, ax = plt.subplots(figsize=(8, 5.5))
    for r in rows:
        t, m = r["step_s"] * 1e3, r["peak_bytes"] / MIB
        ax.scatter([t], [m], color=_COLOURS.get(r["family"], "gray"), zorder=3)
        ax.annotate(r["label"], (t, m), textcoords="offset points", xytext=(5, 4), fontsize=7)
    budget = sorted((r for r in rows if r["family"] == "budget"), key=lambda r: r["budget"])
    if budget:
        ax.plot([r["step_s"] * 1e3 for r in budget], [r["peak_bytes"] / MIB for r in budget],
                color=_COLOURS["budget"], label="memory_budget(0..1)", zorder=2)
    front = _frontier([(r["step_s"] * 1e3, r["peak_bytes"] / MIB) for r in rows])
    ax.plot([p[0] for p in front], [p[1] for p in front], linestyle="--", color="gray",
            linewidth=0.8, label="frontier (no point better on both)", zorder=1)
    for family, colour in _COLOURS.items():
        if family != "budget" and any(r["family"] == family for r in rows):
            ax.scatter([], [], color=colour, label=family)
    c = results["config"]
    clock = "CPU time" if results.get("clock") == "thread_cpu" else "time"
    ax.set_xlabel(f"step {clock}, ms (median; forward + backward)")
    ax.set_ylabel("peak memory above the step's start, MiB")
    ax.set_title(f"Llama-style, {c['layers']} layers, dim {c['dim']}, batch {c['batch']} x seq "
                 f"{c['seq']}, {c['device']} ({results['date']})", fontsize=9)
    paths.append(_finish(plt, fig, ax, os.path.join(out_dir, "memory_vs_time.png"), 7))

    s = results["split"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(s["k"], s["torch_checkpoint"], marker="o", color=_COLOURS["torch"],
            label="torch.utils.checkpoint")
    ax.plot(s["k"], s["ckptfx_session"], marker="o", color=_COLOURS["ckptfx"],
            label="ckptfx.checkpoint, one session")
    ax.set_xlabel("dw calls after dx (k)")
    ax.set_ylabel("replays per block per micro-batch")
    ax.set_xticks(s["k"])
    ax.set_ylim(bottom=0)
    ax.set_title("split backward: dx + k dw calls (counted)", fontsize=9)
    paths.append(_finish(plt, fig, ax, os.path.join(out_dir, "split_replays.png"), 8))
    return paths


def _finish(plt: Any, fig: Any, ax: Any, path: str, legend_size: int) -> str:
    """Legend and grid on ``ax``, ``fig`` written to ``path`` (PNG) and closed; ``path``."""
    ax.legend(fontsize=legend_size)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
