"""The ``ckptfx bench`` run: measuring subprocesses, split replay counts, results.

Order of one run (every figure in its results comes from it):

1. memory: ``repeats`` fresh subprocesses per variant (measure.py, ``memory``), the variants'
   order reversed every other repeat; the reading is the median over steps and repeats;
2. time: one subprocess times every variant, alternated (measure.py, ``time``), and checks
   each variant's gradients bitwise against the plain step's;
3. split: replays per micro-batch of dx + k dw calls (split.py), counted in this process;
4. derived: per variant, memory saved and tokens/s against ``none`` from the same run.

Subprocesses import the same ckptfx as this process (its directory leads ``PYTHONPATH``), so
a source checkout, an editable and a regular install all measure the code that started them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
from typing import Any, Callable, Sequence

import torch

from ckptfx.bench.child import BenchError, last_json, run_json
from ckptfx.bench.measure import BenchConfig
from ckptfx.bench.memory import MMAP_ENV, child_env

__all__ = ["BenchError", "FULL", "MODES", "QUICK", "SPLIT_KS", "TINY", "run"]

# --quick must finish in under two minutes on 2 loaded CPU cores; --tiny is the tests' smoke.
FULL = BenchConfig(dim=256, layers=4, batch=8, seq=256, steps=2, repeats=2, rounds=7)
QUICK = BenchConfig(dim=128, layers=2, batch=4, seq=128, steps=2, repeats=1, rounds=9)
TINY = BenchConfig(dim=32, layers=1, heads=2, kv_heads=1, vocab=64, batch=1, seq=16, steps=1,
                   repeats=1, rounds=1)
MODES = {"full": FULL, "quick": QUICK, "tiny": TINY}
SPLIT_KS = (1, 2, 4, 8)

Advance = Callable[[str], None]


def _env(cfg: BenchConfig, memory: bool) -> dict[str, str]:
    """A child's environment. Only the memory children get the small mmap threshold: it
    makes every large allocation a fresh mmap (page faults), which would charge the timed
    steps in proportion to the memory they use."""
    env = child_env(cfg.threads)
    if not memory:
        env.pop(MMAP_ENV, None)
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    return env


def _command(kind: str, cfg: BenchConfig, args: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "ckptfx.bench.measure", kind,
            json.dumps(dataclasses.asdict(cfg)), *args]


def _memory(cfg: BenchConfig, variant: str) -> dict[str, Any]:
    return run_json(_command("memory", cfg, [variant]), _env(cfg, memory=True),
                    f"memory subprocess of variant {variant!r}")


def _time(cfg: BenchConfig, variants: list[str], advance: Advance) -> dict[str, Any]:
    proc = subprocess.Popen(_command("time", cfg, variants), env=_env(cfg, memory=False),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    lines = []
    for line in proc.stdout:
        if line.startswith("progress "):
            advance(f"time {line.split(' ', 1)[1].strip()}")
        else:
            lines.append(line)
    stderr = proc.stderr.read()
    if proc.wait() != 0:
        raise BenchError(f"the timing subprocess failed; its stderr ends:\n{stderr[-3000:]}")
    return last_json("".join(lines), "timing subprocess", stderr)


def _split(cfg: BenchConfig, ks: Sequence[int], advance: Advance) -> dict[str, Any]:
    from ckptfx.bench.llama import DecoderLayer, rotary_tables
    from ckptfx.bench.split import count_split_replays

    # Counts do not depend on the shape: a short sequence keeps the 1 + k torch replays cheap.
    lcfg = cfg.model_config()
    torch.manual_seed(0)
    layers = [DecoderLayer(lcfg) for _ in range(cfg.layers)]
    seq = min(cfg.seq, 32)
    cos, sin = rotary_tables(lcfg, seq)
    blocks = [lambda h, layer=layer: layer(h, cos, sin) for layer in layers]
    params = [p for layer in layers for p in layer.parameters()]
    x = torch.randn(min(cfg.batch, 2), seq, cfg.dim)
    counts = []
    for k in ks:
        counts.append(count_split_replays(blocks, params, x, k))
        advance(f"split k={k}")
    return {"k": [c.k for c in counts],
            "torch_checkpoint": [c.torch_replays for c in counts],
            "ckptfx_session": [c.ckptfx_replays for c in counts],
            "bitwise_equal": all(c.bitwise_equal for c in counts),
            "blocks": cfg.layers, "shape": [x.shape[0], seq, cfg.dim]}


def steps_of(cfg: BenchConfig, variants: Sequence[str], ks: Sequence[int]) -> int:
    """How many progress steps ``run`` reports."""
    return cfg.repeats * len(variants) + cfg.rounds * len(variants) + len(ks)


def run(cfg: BenchConfig, variants: Sequence[str], ks: Sequence[int] = SPLIT_KS,
        advance: Advance = lambda label: None, mode: str = "custom",
        memory_jobs: int = 1) -> dict[str, Any]:
    """Measure ``variants`` (registry names; ``"none"`` first, it is the reference), with up
    to ``memory_jobs`` memory subprocesses at a time."""
    from ckptfx import __version__
    from ckptfx.bench.variants import get

    names = list(variants)
    if not names or names[0] != "none":
        raise ValueError("variants must start with 'none', the reference of every ratio")
    started = datetime.datetime.now(datetime.timezone.utc)
    samples: dict[str, dict[str, list[int]]] = {n: {"peak": [], "held": []} for n in names}
    jobs = [name for r in range(cfg.repeats) for name in (names if r % 2 == 0 else names[::-1])]
    # Memory subprocesses may run side by side: each reads its own process's peak, which
    # another process cannot move (one thread each, no timing involved). Timing runs alone.
    with concurrent.futures.ThreadPoolExecutor(max_workers=memory_jobs) as pool:
        futures = {pool.submit(_memory, cfg, name): name for name in jobs}
        for future in concurrent.futures.as_completed(futures):
            res = future.result()
            samples[res["variant"]]["peak"] += res["peak_bytes"]
            samples[res["variant"]]["held"] += res["held_bytes"]
            advance(f"memory {res['variant']}")
    timing = _time(cfg, names, advance)
    split = _split(cfg, ks, advance)

    tokens = cfg.tokens_per_step()
    rows = []
    for name in names:
        v = get(name)
        peak = statistics.median(samples[name]["peak"])
        step = timing["step_s"][name]
        rows.append({"name": name, "label": v.label, "family": v.family, "budget": v.budget,
                     "peak_bytes": peak, "held_bytes": statistics.median(samples[name]["held"]),
                     "peak_samples": samples[name]["peak"], "step_s": step,
                     "step_s_samples": timing["step_s_all"][name],
                     "wall_s": timing["wall_s"][name],
                     "wall_s_samples": timing["wall_s_all"][name],
                     "tokens_per_s": tokens / step,
                     "bitwise_equal": timing["bitwise_equal"][name]})
    ref = rows[0]
    for row in rows:
        # None when the reference rose by nothing (shapes so small that they fit in pages
        # already resident): there is no ratio to report.
        row["memory_saved"] = (1 - row["peak_bytes"] / ref["peak_bytes"]
                               if ref["peak_bytes"] > 0 else None)
        row["tokens_per_s_change"] = row["tokens_per_s"] / ref["tokens_per_s"] - 1
    return {
        "ckptfx": __version__, "torch": torch.__version__,
        "date": started.strftime("%Y-%m-%d"), "started_utc": started.isoformat(timespec="seconds"),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                    "processor": platform.processor() or platform.machine()},
        "mode": mode, "config": dataclasses.asdict(cfg), "tokens_per_step": tokens,
        "clock": timing["clock"],
        "method": {
            "memory": ("peak above the step's start over forward + backward, after one "
                       "warm-up step, in a fresh subprocess per variant: the resident set "
                       "(VmHWM, MALLOC_MMAP_THRESHOLD_=65536) on CPU, max_memory_allocated on "
                       "an accelerator; median over steps and subprocesses"),
            "time": ("median step time (forward + backward) after one warm-up step per "
                     "variant, variants alternated in one subprocess, "
                     f"{cfg.threads} thread(s); clock: " + (
                         "the thread's CPU time (one CPU thread: other processes' load "
                         "cannot stretch it; wall times in wall_s)"
                         if timing["clock"] == "thread_cpu" else "wall time")),
            "split": ("replays per block per micro-batch for dx + k dw autograd calls, "
                      "counted inside the blocks"),
        },
        "variants": rows, "split": split,
    }
