"""Benchmark: peak resident memory of a training step, ckptfx against torch's checkpoint.

Variants, per model: ``none`` (no checkpoint), ``torch`` (``torch.utils.checkpoint``,
``use_reentrant=False``), ``ckptfx`` (``ckptfx.checkpoint``) and ``remat`` (``ckptfx.remat``,
default policy: keep nothing but the inputs). Models:

- ``encoder``: ``ckptfx.bench.blocks.encoder_stack``, ``nn.TransformerEncoderLayer`` blocks
  (pre-norm, dropout 0.1), as bench_checkpoint.py measures;
- ``block``: ``ckptfx.bench.blocks.Block`` (pre-norm, dropout 0.1 on attention and MLP);
- ``llama``: ``transformers``' ``LlamaDecoderLayer`` from a small ``LlamaConfig`` built here
  (no download), rotary embeddings from ``LlamaRotaryEmbedding``, computed once outside the
  layers as ``LlamaModel`` does. Skipped with a note when transformers is not importable.
- ``llama_style``: ``ckptfx.bench.llama.DecoderLayer``, the Llama-style layer ``ckptfx bench``
  measures (no transformers needed), rotary tables computed once outside the layers.

Each (model, variant, repeat) runs in a fresh subprocess started with
``MALLOC_MMAP_THRESHOLD_=65536`` (freed tensors go back to the OS, so ``VmHWM`` means
something) and ``torch.set_num_threads(1)``. The subprocess runs one warm-up step, then
measures a few steps: the peak resident memory above the start of the step (``VmHWM`` after
resetting it through ``/proc/self/clear_refs``), over the forward alone and over forward +
backward, and the memory the forward leaves held for the backward (``VmRSS``). The table
shows medians over steps and subprocesses; the variants' subprocesses are alternated.

Usage::

    python benchmarks/bench_memory.py            # d=256, seq 128, batch 8: 6 blocks; llama 4
    python benchmarks/bench_memory.py --quick    # small shapes, one repeat

Conditions for hunting differences (all off by default): ``--threads N``, ``--retain-graph``
(backward with ``retain_graph=True``, graph freed afterwards), ``--no-warmup`` (measure the
first step of a fresh process), ``--no-early-stop`` (``early_stop=False`` for ckptfx and
remat), ``--busy`` (a busy-looping process beside the measurements), ``--blocks N``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from ckptfx.bench.figures import verdict
from ckptfx.bench.memory import MMAP_ENV, MMAP_VALUE, child_env
from ckptfx.bench.child import answer, run_json, script_parser

VARIANTS = ("none", "torch", "ckptfx", "remat")
MODELS = ("encoder", "block", "llama", "llama_style")
MIB = 2**20


# -- the subprocess: one model, one variant ------------------------------------------------


def _child(cfg: dict) -> dict:
    import gc

    import torch
    import torch.utils.checkpoint as tcp

    import ckptfx
    from ckptfx.bench.blocks import Block, encoder_stack
    from ckptfx.bench.memory import Meter, small_mmap_threshold

    assert small_mmap_threshold(), "the subprocess must start with the small mmap threshold"
    torch.set_num_threads(cfg["threads"])
    model, variant, early_stop = cfg["model"], cfg["variant"], cfg["early_stop"]
    d, seq, batch = cfg["d"], cfg["seq"], cfg["batch"]
    torch.manual_seed(0)

    # Each model is a list of blocks ``fn(h, *extra) -> h`` and the extra tensors they read.
    extra: tuple = ()
    if model == "encoder":
        mods = list(encoder_stack(cfg["blocks"], d))
        fns = mods
    elif model == "block":
        mods = [Block(d, dropout=0.1, attention="matmul") for _ in range(cfg["blocks"])]
        fns = mods
    elif model == "llama":
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import (LlamaDecoderLayer,
                                                              LlamaRotaryEmbedding)

        conf = LlamaConfig(hidden_size=d, intermediate_size=4 * d, num_attention_heads=4,
                           num_key_value_heads=2, num_hidden_layers=cfg["layers"],
                           vocab_size=256, max_position_embeddings=max(seq, 128),
                           attn_implementation=cfg["attn"])
        mods = [LlamaDecoderLayer(conf, layer_idx=i) for i in range(cfg["layers"])]
        rope = LlamaRotaryEmbedding(conf)
        probe = torch.zeros(batch, seq, d)
        with torch.no_grad():
            extra = tuple(rope(probe, torch.arange(seq).unsqueeze(0).expand(batch, -1)))

        def layer_fn(layer):
            def fn(h, cos, sin):
                out = layer(h, position_embeddings=(cos, sin))
                return out[0] if isinstance(out, tuple) else out
            return fn

        fns = [layer_fn(m) for m in mods]
    elif model == "llama_style":
        from ckptfx.bench.llama import DecoderLayer, LlamaConfig, rotary_tables

        lconf = LlamaConfig(dim=d, layers=cfg["layers"])
        mods = [DecoderLayer(lconf) for _ in range(cfg["layers"])]
        extra = rotary_tables(lconf, seq)
        fns = mods
    else:
        raise ValueError(model)
    for m in mods:
        m.train()
    params = [p for m in mods for p in m.parameters()]

    if variant == "none":
        calls = [lambda h, *e, f=f: f(h, *e) for f in fns]
    elif variant == "torch":
        calls = [lambda h, *e, f=f: tcp.checkpoint(f, h, *e, use_reentrant=False) for f in fns]
    elif variant == "ckptfx":
        calls = [lambda h, *e, f=f: ckptfx.checkpoint(f, h, *e, early_stop=early_stop)
                 for f in fns]
    elif variant == "remat":
        calls = [ckptfx.remat(f, early_stop=early_stop) for f in fns]
    else:
        raise ValueError(variant)

    x = torch.randn(batch, seq, d, requires_grad=True)

    def forward():
        h = x
        for c in calls:
            h = c(h, *extra)
        return h.sum()

    def backward(loss):
        if cfg["retain_graph"]:
            loss.backward(retain_graph=True)
        else:
            loss.backward()

    def clear_grads():
        for p in params:
            p.grad = None
        x.grad = None

    if cfg["warmup"]:
        backward(forward())
        clear_grads()
    result = {"forward": [], "held": [], "step": []}
    meter = Meter(torch.device("cpu"))
    for _ in range(cfg["steps"]):
        gc.collect()
        meter.start()
        loss = forward()
        result["forward"].append(meter.peak())
        result["held"].append(meter.now())
        backward(loss)
        result["step"].append(meter.peak())
        del loss
        clear_grads()
    return result


# -- the parent: subprocesses, table, verdict ----------------------------------------------


def _run_child(cfg: dict) -> dict:
    return run_json([sys.executable, os.path.abspath(__file__), "--child", json.dumps(cfg)],
                    child_env(cfg["threads"]),
                    f"subprocess for {cfg['model']}/{cfg['variant']}")


def _have_transformers() -> str | None:
    try:
        import transformers  # noqa: F401
        from transformers.models.llama import modeling_llama  # noqa: F401
    except Exception as err:  # noqa: BLE001  (any import failure means: skip the rows)
        return f"{type(err).__name__}: {err}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__, d=256, seq=128, batch=8, steps=2)
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated, from {','.join(MODELS)}")
    parser.add_argument("--blocks", type=int, default=6, help="encoder/block stack depth")
    parser.add_argument("--layers", type=int, default=4, help="llama decoder layers")
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"],
                        help="llama attention implementation")
    parser.add_argument("--repeats", type=int, default=2,
                        help="subprocesses per checkpoint variant (none: one)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--retain-graph", action="store_true")
    parser.add_argument("--no-warmup", action="store_true",
                        help="measure the first step of each fresh process")
    parser.add_argument("--no-early-stop", action="store_true",
                        help="early_stop=False for ckptfx and remat")
    parser.add_argument("--busy", action="store_true",
                        help="run a busy-looping process beside the measurements")
    args = parser.parse_args(argv)
    if args.child is not None:
        return answer(_child, args.child)
    if args.quick:
        # A smoke run: at these sizes a few pages of noise move the ratios by percents.
        args.blocks, args.layers, args.d, args.seq, args.batch = 3, 2, 128, 64, 4
        args.repeats, args.steps = 1, 2
    models = [m for m in args.models.split(",") if m]
    for m in models:
        if m not in MODELS:
            parser.error(f"unknown model {m!r}")
    if "llama" in models:
        why = _have_transformers()
        if why is not None:
            print(f"note: llama rows skipped, transformers is not importable ({why})")
            models.remove("llama")

    base = dict(d=args.d, seq=args.seq, batch=args.batch, blocks=args.blocks,
                layers=args.layers, attn=args.attn, threads=args.threads,
                retain_graph=args.retain_graph, warmup=not args.no_warmup,
                early_stop=not args.no_early_stop,
                steps=1 if args.no_warmup else args.steps)
    print(f"{MMAP_ENV}={MMAP_VALUE} in each subprocess, {args.threads} thread(s); "
          f"d={args.d} seq={args.seq} batch={args.batch}; {args.repeats} fresh subprocess(es) "
          f"per checkpoint variant (none: 1) x {base['steps']} measured step(s)"
          f"{'' if base['warmup'] else ' (the first step, no warm-up)'}"
          f"{', retain_graph=True' if args.retain_graph else ''}"
          f"{', early_stop=False' if args.no_early_stop else ''}"
          f"{', busy process beside' if args.busy else ''}; medians")

    busy = None
    if args.busy:
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    t0 = time.perf_counter()
    rows = []
    try:
        for model in models:
            samples = {v: {"forward": [], "held": [], "step": []} for v in VARIANTS}
            for r in range(args.repeats):
                for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
                    if variant == "none" and r > 0:
                        continue  # the reference without checkpoint: one subprocess is enough
                    res = _run_child({**base, "model": model, "variant": variant})
                    for k in samples[variant]:
                        samples[variant][k].extend(res[k])
            med = {v: {k: statistics.median(s) / MIB for k, s in kinds.items()}
                   for v, kinds in samples.items()}
            rows.append((model, med))
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()

    names = {"encoder": f"encoder x{args.blocks}", "block": f"Block x{args.blocks}",
             "llama": f"llama x{args.layers} ({args.attn})",
             "llama_style": f"llama-style x{args.layers}"}
    print("\npeak resident memory above the step's start, MiB (fwd: forward only; held: left "
          "after the forward; step: forward + backward)")
    head = f"  {'model':22s} {'kind':5s}" + "".join(f" {v:>7s}" for v in VARIANTS)
    print(head + f" {'ckptfx/torch':>13s} {'remat/torch':>12s}")
    figures: dict[str, float] = {}
    targets: list[Any] = []
    for model, med in rows:
        for kind, label in (("forward", "fwd"), ("held", "held"), ("step", "step")):
            vals = "".join(f" {med[v][kind]:7.1f}" for v in VARIANTS)
            ref = med["torch"][kind]
            ratios = (f" {med['ckptfx'][kind] / ref:13.3f} {med['remat'][kind] / ref:12.3f}"
                      if ref > 0 else "")
            print(f"  {names[model]:22s} {label:5s}{vals}{ratios}")
        # At the target's precision, two decimals: a reading moves by a few pages (under
        # 0.5% of these peaks) between processes.
        for v in ("ckptfx", "remat"):
            key = f"{model} {v}"
            figures[key] = round(med[v]["step"] / med["torch"]["step"], 2)
            targets.append((key, 1.0, f"{names[model]}: {v} step peak / torch's checkpoint, "
                            "two decimals", None))
    print(f"\nverdict (peak <= 1.00x torch's checkpoint); {time.perf_counter() - t0:.0f} s")
    for line in verdict(figures, tuple(targets)):
        print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
