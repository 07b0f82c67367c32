"""``ckptfx bench``: what checkpointing costs and saves on a Llama-style decoder, measured.

For each variant (variants.py: no checkpoint, torch's checkpoint and selective checkpoint,
``ckptfx.checkpoint``, ``remat`` under each policy, ``memory_budget`` fractions when ckptfx
has them) one run measures the peak memory of a training step (a fresh subprocess per
variant), the median step time (all variants alternated in one subprocess) and whether the
gradients are bitwise those of the plain step; then it counts the replays per micro-batch of
a split backward (dx + k dw calls), ckptfx against torch. Ratios are against no checkpoint,
from the same run. ``ckptfx bench --overhead`` (overhead.py) measures per-call costs where
blocks are small, against torch.

Rules

1. A ratio is against its alternative measured in the same run (no checkpoint, torch's
   checkpoint, a floor), never against a figure from another run or a stored one.
2. Times are medians of paired rounds: the variants alternate in one process (the order
   reversed every other round), one thread, timed by that thread's CPU time where the work
   is all on it; a ratio is the median of the per-round ratios (figures.py), which the
   machine's drifting speed cannot move as it moves the medians.
3. Memory is measured, never estimated: the resident set's peak in a fresh process started
   with a small mmap threshold on CPU, the allocator's peak on an accelerator (memory.py).
4. Counts are counted, never derived: block runs by a counter called with each block run,
   instructions by callgrind. The decoder's variants and the split counts check their
   gradients bitwise against plain autograd's: a faster wrong step is never a result.
5. A verdict covers only what this run measured: one line per target whose part ran, named
   by what it measures ("split step with sessions / no checkpointing, d=64 <= 1.3x"), met or
   not, with the floor measured for it in the same run when it has one.
6. Each model, meter and timing helper is defined once, here; the scripts in ``benchmarks/``
   are developer experiments that import them. The package runs without the checkout.

Files

- ``__init__.py``: ``bench`` (one run: its tables, ``results.json``, plots), this note.
- ``blocks.py``: the small models (transformer and MLP blocks, torch's encoder stack), run
  counting.
- ``child.py``: measuring children, both sides (run one, read its JSON; answer), options.
- ``figures.py``: paired rounds, their ratios and medians, the overhead targets, the verdict.
- ``llama.py``: the Llama-style decoder (no ``transformers`` needed) and its shape.
- ``measure.py``: one measuring subprocess (``python -m ckptfx.bench.measure``), the config.
- ``memory.py``: how peaks are read (resident set, device allocator), the mmap threshold.
- ``overhead.py``: ``--overhead``: its parts, the remat part, the verdict at the end.
- ``overhead_split.py``: the overhead bench's split parts (split step, vjp256).
- ``plot.py``: the PNG plots (matplotlib).
- ``report.py``: the tables, on the terminal and as markdown.
- ``split.py``: replays of a split backward, counted.
- ``sweep.py``: one decoder run: its subprocesses, split counts, derived ratios.
- ``variants.py``: the registry of ways to run a layer.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Sequence

from ckptfx._term import note, progress
# Only plot's cheap checks are imported here: importing the run's modules eagerly would put
# ckptfx.bench.measure in sys.modules before ``python -m ckptfx.bench.measure`` executes it.
from ckptfx.bench.plot import PLOT_HINT, have_matplotlib, write_plots

__all__ = ["MODES", "bench", "default_variants", "write_outputs"]

# --quick keeps three budget points (the ends and the middle): each variant costs a fresh
# subprocess, and the quick run must stay under two minutes on 2 cores.
_QUICK_BUDGETS = (0.0, 0.5, 1.0)


def __getattr__(name: str) -> Any:
    """``MODES`` (sweep.py's), imported on first use: see the note on the imports above."""
    if name == "MODES":
        from ckptfx.bench.sweep import MODES
        return MODES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def default_variants(mode: str, device: str) -> list[str]:
    """The registry's variants that mean something on ``device``, thinned for quick runs."""
    from ckptfx.bench.variants import VARIANTS, available

    names = [v.name for v in available(device)]
    if mode != "full":
        names = [n for n in names if VARIANTS[n].budget is None
                 or VARIANTS[n].budget in _QUICK_BUDGETS]
    return names


def bench(mode: str = "quick", out: str | None = None, device: str = "cpu",
          variants: Sequence[str] | None = None, threads: int = 1,
          markdown: bool = False, jobs: int = 0) -> dict[str, Any]:
    """Run the bench, print its tables, write ``results.json`` (and plots) into ``out``.

    ``jobs``: memory subprocesses at a time (0: one per CPU core, at most 4)."""
    from ckptfx.bench import report, sweep

    cfg = dataclasses.replace(sweep.MODES[mode], device=device, threads=threads)
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


def write_outputs(results: dict[str, Any], out: str) -> list[str]:
    """Write ``results.json``, ``table.md`` and (with matplotlib) the PNG plots into ``out``;
    say what was written, and how to get the plots when matplotlib is missing."""
    from ckptfx.bench import report

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
