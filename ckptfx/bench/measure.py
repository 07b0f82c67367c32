"""What one measuring subprocess of ``ckptfx bench`` does (``python -m ckptfx.bench.measure``).

Two kinds of run, each in a fresh process started by ``sweep.py``:

- ``memory``: one variant. Build the model (seed 0), run one warm-up step, then ``steps``
  measured steps, each from a collected heap: the peak memory of forward + backward above
  the step's start, and the memory the forward leaves held for the backward. A fresh process
  per variant, so no variant's allocations colour another's reading (see memory.py).
- ``time``: every variant in one process on one model (the same weights), so the ratios come
  from one run: each variant's gradients are compared bitwise (``torch.equal``) with the
  plain step's, then after one warm-up step per variant, ``rounds`` rounds time one step of
  each, the order reversed every other round (load drifts on a shared machine); the report
  is the median per variant. On CPU with one thread the clock is the thread's CPU time
  (``time.thread_time``: the work of the step, which other processes' load cannot stretch),
  else wall time after a device synchronize; the wall times are reported too. After each
  timed step a line ``progress NAME`` goes to stdout so the parent can move its progress bar.

The result is one JSON line, the last line of stdout.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import statistics
import sys
import time
from typing import Any, Callable

import torch

from ckptfx.bench.llama import LlamaConfig, LlamaModel, ModelShape

__all__ = ["BenchConfig", "measure_memory", "measure_time"]


@dataclasses.dataclass(frozen=True)
class BenchConfig(ModelShape):
    """The model shape (``ModelShape``'s fields) and the measurement plan of one bench run.
    Flat, so ``results.json``'s ``config`` and a child's argument are one JSON object."""

    batch: int = 8
    seq: int = 256
    steps: int = 2        # measured steps per memory subprocess
    repeats: int = 1      # memory subprocesses per variant
    rounds: int = 7       # timed rounds (one step of every variant each)
    threads: int = 1
    device: str = "cpu"

    def tokens_per_step(self) -> int:
        """Tokens one training step reads: batch x seq."""
        return self.batch * self.seq

    def model_config(self) -> LlamaConfig:
        """The decoder of this run: its shape, Llama's constants."""
        shape = {f.name: getattr(self, f.name) for f in dataclasses.fields(ModelShape)}
        return LlamaConfig(**shape)


def _setup(cfg: BenchConfig) -> tuple[LlamaModel, torch.Tensor, torch.device]:
    device = torch.device(cfg.device)
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(0)
    model = LlamaModel(cfg.model_config()).to(device)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=g).to(device)
    return model, tokens, device


def _step(model: Any, tokens: torch.Tensor) -> None:
    model(tokens).backward()
    for p in model.parameters():
        p.grad = None


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize()


def measure_memory(cfg: BenchConfig, variant: str) -> dict[str, Any]:
    """Peak and held bytes of ``variant``'s steps (lists, one entry per measured step)."""
    from ckptfx.bench.memory import Meter, small_mmap_threshold
    from ckptfx.bench.variants import get

    model, tokens, device = _setup(cfg)
    if device.type == "cpu" and not small_mmap_threshold():
        raise RuntimeError("the memory subprocess must start with MALLOC_MMAP_THRESHOLD_=65536 "
                           "(run it through ckptfx bench)")
    model.call = get(variant).make()
    meter = Meter(device)
    # Warm-up, two steps: lazy allocations and kernels chosen; remat's first call records
    # (and learns), its second is the first unrecorded one, whose one-time allocations (about
    # 4 MiB at --quick) must not count in a measured step.
    _step(model, tokens)
    _step(model, tokens)
    peaks, held = [], []
    for _ in range(cfg.steps):
        gc.collect()
        _sync(device)
        meter.start()
        loss = model(tokens)
        _sync(device)
        held.append(meter.now())
        loss.backward()
        _sync(device)
        peaks.append(meter.peak())
        del loss
        for p in model.parameters():
            p.grad = None
    return {"variant": variant, "peak_bytes": peaks, "held_bytes": held}


def _grads(model: Any, tokens: torch.Tensor) -> list[torch.Tensor]:
    model(tokens).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    return grads


def measure_time(cfg: BenchConfig, variants: list[str],
                 report: Callable[[str], None] = lambda name: None) -> dict[str, Any]:
    """Median step seconds and gradient parity per variant, all from this one process."""
    from ckptfx.bench.variants import get

    model, tokens, device = _setup(cfg)
    calls = {name: get(name).make() for name in variants}
    model.call = calls["none"] if "none" in calls else get("none").make()
    reference = _grads(model, tokens)
    bitwise: dict[str, bool] = {}
    for name, call in calls.items():
        model.call = call
        bitwise[name] = all(torch.equal(a, b) for a, b in zip(reference, _grads(model, tokens)))
        _step(model, tokens)  # warm-up
    wall: dict[str, list[float]] = {name: [] for name in calls}
    cpu: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls)
    for r in range(cfg.rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            model.call = calls[name]
            gc.collect()
            _sync(device)
            t0, c0 = time.perf_counter(), time.thread_time()
            _step(model, tokens)
            _sync(device)
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.thread_time() - c0)
            report(name)
    # One CPU thread: the step's own CPU time, which other processes on a shared machine
    # cannot stretch (wall time there swings 2-3x with their load). Otherwise wall time.
    clock = "thread_cpu" if device.type == "cpu" and cfg.threads == 1 else "wall"
    chosen = cpu if clock == "thread_cpu" else wall
    return {"clock": clock, "step_s": {n: statistics.median(t) for n, t in chosen.items()},
            "step_s_all": chosen, "wall_s_all": wall,
            "wall_s": {n: statistics.median(t) for n, t in wall.items()},
            "bitwise_equal": bitwise}


def main(argv: list[str]) -> int:
    """``python -m ckptfx.bench.measure memory|time CONFIG_JSON [VARIANT...]``."""
    kind, cfg = argv[0], BenchConfig(**json.loads(argv[1]))
    if kind == "memory":
        result = measure_memory(cfg, argv[2])
    elif kind == "time":
        def report(name: str) -> None:
            print(f"progress {name}", flush=True)
        result = measure_time(cfg, argv[2:], report)
    else:
        raise SystemExit(f"unknown measurement {kind!r}; expected memory or time")
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
