"""``ckptfx bench``: what checkpointing costs and saves on a Llama-style decoder, measured.

For each variant (variants.py: no checkpoint, torch's checkpoint and selective checkpoint,
``ckptfx.checkpoint``, ``remat`` under each policy, ``memory_budget`` fractions when ckptfx
has them) one run measures the peak memory of a training step (a fresh subprocess per
variant), the median step time (all variants alternated in one subprocess) and whether the
gradients are bitwise those of the plain step; then it counts the replays per micro-batch of
a split backward (dx + k dw calls), ckptfx against torch. Ratios are against no checkpoint,
from the same run.

Modules: ``llama`` (the model), ``variants`` (the registry), ``memory`` (how peaks are read),
``measure`` (a measuring subprocess), ``split`` (replay counts), ``sweep`` (one run),
``overhead`` (``--overhead``: per-call costs where blocks are small, against torch; its split
parts in ``overhead_split``, what its parts share in ``_overhead_common``),
``report`` (tables), ``plot`` (PNGs).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Sequence

from .._term import note, progress
from . import report, sweep
from .plot import PLOT_HINT, have_matplotlib, write_plots
from .variants import VARIANTS, available

__all__ = ["MODES", "bench", "default_variants", "write_outputs"]

MODES = {"full": sweep.FULL, "quick": sweep.QUICK, "tiny": sweep.TINY}
# --quick keeps three budget points (the ends and the middle): each variant costs a fresh
# subprocess, and the quick run must stay under two minutes on 2 cores.
_QUICK_BUDGETS = (0.0, 0.5, 1.0)


def default_variants(mode: str, device: str) -> list[str]:
    """The registry's variants that mean something on ``device``, thinned for quick runs."""
    names = [v.name for v in available(device)]
    if mode != "full":
        names = [n for n in names if VARIANTS[n].budget is None
                 or VARIANTS[n].budget in _QUICK_BUDGETS]
    return names


def bench(mode: str = "quick", out: str | None = None, device: str = "cpu",
          variants: Sequence[str] | None = None, threads: int = 1,
          markdown: bool = False, jobs: int = 0) -> dict:
    """Run the bench, print its tables, write ``results.json`` (and plots) into ``out``.

    ``jobs``: memory subprocesses at a time (0: one per CPU core, at most 4)."""
    cfg = dataclasses.replace(MODES[mode], device=device, threads=threads)
    names = list(variants) if variants else default_variants(mode, device)
    if "none" in names:
        names.remove("none")
    names.insert(0, "none")
    ks = sweep.SPLIT_KS if mode != "tiny" else sweep.SPLIT_KS[:2]
    note(f"ckptfx bench ({mode}): {len(names)} variants on a Llama-style decoder, "
         f"{cfg.layers} layers, dim {cfg.dim}, batch {cfg.batch} x seq {cfg.seq}, {device}, "
         f"{threads} thread(s)")
    with progress("measuring", sweep.steps_of(cfg, names, ks)) as bar:
        results = sweep.run(cfg, names, ks, advance=bar.advance, mode=mode,
                            memory_jobs=jobs if jobs else min(4, os.cpu_count() or 1))
    report.print_results(results)
    if markdown:
        print(report.markdown(results))
    if out is not None:
        write_outputs(results, out)
    return results


def write_outputs(results: dict, out: str) -> list[str]:
    """Write ``results.json``, ``table.md`` and (with matplotlib) the PNG plots into ``out``;
    say what was written, and how to get the plots when matplotlib is missing."""
    os.makedirs(out, exist_ok=True)
    written = [os.path.join(out, "results.json"), os.path.join(out, "table.md")]
    with open(written[0], "w") as f:
        json.dump(results, f, indent=1)
    with open(written[1], "w") as f:
        f.write(report.markdown(results))
    if have_matplotlib():
        written += write_plots(results, out)
        note("wrote " + ", ".join(written))
    else:
        note("wrote " + ", ".join(written) + f"; the PNG plots need matplotlib: {PLOT_HINT}")
    return written
