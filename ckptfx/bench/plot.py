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

    paths = []
    fig, ax, _ = memory_figure(plt, results)
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

def memory_figure(plt: Any, results: dict[str, Any]) -> tuple[Any, Any, list[Any]]:
    """The memory-against-time figure, its axes and its point labels (placed apart)."""
    rows = results["variants"]
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for r in rows:
        ax.scatter([r["step_s"] * 1e3], [r["peak_bytes"] / MIB],
                   color=_COLOURS.get(r["family"], "gray"), zorder=3)
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
    labels = _place_labels(fig, ax, [(r["label"], r["step_s"] * 1e3, r["peak_bytes"] / MIB)
                                      for r in rows])
    return fig, ax, labels


# Where a label may go, in points from its point, nearest first: right, left, above, below,
# then further out (with a line back to the point).
_OFFSETS = [(5, 4), (5, -10), (-5, 4), (-5, -10), (5, 14), (5, -20), (-5, 14), (-5, -20),
            (15, 26), (15, -32), (-15, 26), (-15, -32), (25, 40), (25, -46), (-25, 40),
            (-25, -46)]


def _place_labels(fig: Any, ax: Any, points: list[tuple[str, float, float]]) -> list[Any]:
    """Annotate each point with its label at the first offset whose text overlaps no label
    placed before it (measured by the renderer: variants close on both axes, such as
    ckptfx's and torch's checkpoint, would otherwise print on top of each other)."""
    ax.legend(fontsize=7)  # as _finish lays the figure out, so positions in pixels stay
    fig.tight_layout()
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    placed: list[Any] = []
    boxes: list[Any] = []
    for label, t, m in sorted(points, key=lambda p: (p[1], p[2])):
        for dx, dy in _OFFSETS:
            far = abs(dy) > 14
            text = ax.annotate(
                label, (t, m), textcoords="offset points", xytext=(dx, dy), fontsize=7,
                ha="left" if dx > 0 else "right",
                arrowprops={"arrowstyle": "-", "color": "gray", "lw": 0.5} if far else None)
            box = text.get_window_extent(renderer)
            if not any(box.overlaps(b) for b in boxes):
                break
            text.remove()
        else:  # nowhere free: the first place, overlapping
            text = ax.annotate(label, (t, m), textcoords="offset points", xytext=_OFFSETS[0],
                               fontsize=7)
            box = text.get_window_extent(renderer)
        placed.append(text)
        boxes.append(box)
    return placed
