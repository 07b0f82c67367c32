"""Benchmark: ``ckptfx.refill_outputs`` on a pre-norm transformer stack, Megatron-style
selective checkpointing (each LayerNorm, the attention core with its dropout, the MLP's
gelu): the linears after those blocks save the blocks' outputs, which the context drops
until the replay refills them.

Variants (same model, same checkpointed blocks):

- ``none``: no checkpoint;
- ``torch``: ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` per block;
- ``ckptfx``: ``ckptfx.checkpoint`` per block;
- ``refill``: ``ckptfx.checkpoint`` per block, forward inside ``ckptfx.refill_outputs()``;
- ``remat_refill``: ``ckptfx.remat`` per block (default policy), inside the context.

Memory, each variant in a fresh subprocess (``MALLOC_MMAP_THRESHOLD_=65536``, one thread):
the bytes a forward leaves allocated (the CPU allocator's own accounting, through the
profiler: exact, and reported with the bytes of the checkpointed blocks' outputs for
reference), and the step's peak resident memory above its start (``VmHWM``; weight
gradients preallocated). Time: one more subprocess runs all variants in alternating rounds
and reports median step times as ratios to ``ckptfx``. Gradients of every variant are
checked bitwise against ``none``.

Usage::

    python benchmarks/bench_refill.py              # 8 layers, d=256, seq 128, batch 8, fp32
    python benchmarks/bench_refill.py --bf16       # under CPU bf16 autocast
    python benchmarks/bench_refill.py --quick      # 2 layers, d=64
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any

from ckptfx.bench.figures import medians, rounds_of
from ckptfx.bench.memory import MMAP_ENV, MMAP_VALUE, child_env
from ckptfx.bench.child import answer, run_json, script_parser

VARIANTS = ("none", "torch", "ckptfx", "refill", "remat_refill")
MIB = 2**20


def _model(cfg: dict) -> tuple[Any, Any]:
    import torch
    import torch.nn.functional as F
    from torch import nn

    d, heads = cfg["d"], cfg["heads"]

    def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, s, _ = q.shape

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, heads, d // heads).transpose(1, 2)

        a = F.scaled_dot_product_attention(split(q), split(k), split(v), dropout_p=0.1,
                                           is_causal=True)
        return a.transpose(1, 2).reshape(b, s, d)

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x: torch.Tensor, ckpt: Any) -> torch.Tensor:
            q, k, v = self.qkv(ckpt(self.n1, x)).split(d, dim=-1)
            x = x + self.o(ckpt(core, q, k, v))
            return x + self.fc2(ckpt(F.gelu, self.fc1(ckpt(self.n2, x))))

    torch.manual_seed(0)
    return nn.ModuleList(Layer() for _ in range(cfg["layers"])), core


def _stepper(cfg: dict) -> tuple[Any, Any, Any]:
    """(step(variant) -> loss, the model, the input)."""
    import contextlib

    import torch
    import torch.utils.checkpoint as tcp

    import ckptfx

    layers, _ = _model(cfg)
    x = torch.randn(cfg["batch"], cfg["seq"], cfg["d"], requires_grad=True)
    ckpts = {
        "none": lambda f, *a: f(*a),
        "torch": lambda f, *a: tcp.checkpoint(f, *a, use_reentrant=False),
        "ckptfx": ckptfx.checkpoint,
        "refill": ckptfx.checkpoint,
        "remat_refill": lambda f, *a: ckptfx.remat(f)(*a),
    }

    def forward(variant: str) -> torch.Tensor:
        torch.manual_seed(1)
        ckpt = ckpts[variant]
        refill = ckptfx.refill_outputs() if "refill" in variant else contextlib.nullcontext()
        amp = (torch.autocast("cpu", dtype=torch.bfloat16) if cfg["bf16"]
               else contextlib.nullcontext())
        with amp, refill:
            h = x
            for layer in layers:
                h = layer(h, ckpt)
        return h.float().square().mean()

    return forward, layers, x


def _memory_child(cfg: dict) -> dict:
    import gc

    import torch
    from torch.profiler import profile

    from ckptfx.bench.memory import measured_steps, small_mmap_threshold

    assert small_mmap_threshold()
    torch.set_num_threads(1)
    forward, layers, x = _stepper(cfg)
    variant = cfg["variant"]

    def step() -> None:
        forward(variant).backward()
        layers.zero_grad(set_to_none=False)  # gradients stay allocated: the peak is
        x.grad.zero_()                       # activations and replays alone

    step()
    gc.collect()
    with profile(profile_memory=True) as prof:
        loss = forward(variant)
    held = sum(e.self_cpu_memory_usage for e in prof.key_averages())
    loss.backward()
    grads = [p.grad.clone() for p in [x, *layers.parameters()]]
    torch.save(grads, cfg["grads"])
    peaks, _ = measured_steps(step, cfg["steps"])
    return {"held": held, "peak": statistics.median(peaks)}


def _time_child(cfg: dict) -> dict:
    import torch

    torch.set_num_threads(1)
    forward, layers, x = _stepper(cfg)

    def step(variant: str) -> Any:
        def run() -> None:
            forward(variant).backward()
            layers.zero_grad(set_to_none=False)
            x.grad.zero_()
        return run

    return medians(rounds_of({v: step(v) for v in VARIANTS}, cfg["rounds"],
                             clock=time.perf_counter))


def _run_child(kind: str, cfg: dict) -> dict:
    return run_json([sys.executable, os.path.abspath(__file__), "--child", kind,
                     json.dumps(cfg)], child_env(1), f"{kind} subprocess for {cfg}")


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__, d=256, seq=128, batch=8, steps=3, child_args=2)
    parser.add_argument("--bf16", action="store_true", help="CPU bf16 autocast")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    if args.child is not None:
        kind, cfg = args.child
        return answer(_memory_child if kind == "memory" else _time_child, cfg)
    if args.quick:
        args.layers, args.d, args.rounds = 2, 64, 3
    import tempfile

    import torch

    base = dict(layers=args.layers, d=args.d, heads=args.heads, seq=args.seq,
                batch=args.batch, bf16=args.bf16, steps=args.steps, rounds=args.rounds)
    t0 = time.perf_counter()
    print(f"{MMAP_ENV}={MMAP_VALUE}, 1 thread, fresh subprocess per variant; "
          f"{args.layers} pre-norm layers d={args.d} seq={args.seq} batch={args.batch}"
          f"{' bf16 autocast' if args.bf16 else ' fp32'}; checkpointed: both LayerNorms, "
          "the attention core, the gelu")
    elem = 2 if args.bf16 else 4
    elements = args.batch * args.seq * args.d * args.layers  # one d-wide activation, all layers
    # The blocks' outputs that the next op saves as they are: under autocast the linears
    # after a norm save a bf16 copy of its float32 output instead (held with or without the
    # context); the attention core's and the gelu's bf16 outputs are saved as they are.
    saved_as_is = elements * (elem + 4 * elem + (0 if args.bf16 else 2 * 4))
    print(f"  checkpointed blocks' outputs the next ops save as they are: "
          f"{saved_as_is / MIB:.1f} MiB")
    res: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for v in VARIANTS:
            res[v] = _run_child("memory", {**base, "variant": v,
                                           "grads": os.path.join(tmp, f"{v}.pt")})
        ref = torch.load(os.path.join(tmp, "none.pt"))
        for v in VARIANTS:
            got = torch.load(os.path.join(tmp, f"{v}.pt"))
            res[v]["bitwise"] = all(torch.equal(a, b) for a, b in zip(got, ref))
    times = _run_child("time", base)
    print(f"  {'variant':14s} {'held after fw':>14s} {'vs ckptfx':>10s} {'step peak':>10s} "
          f"{'vs ckptfx':>10s} {'step time':>10s} {'vs ckptfx':>10s} {'bitwise':>8s}")
    c = res["ckptfx"]
    for v in VARIANTS:
        r = res[v]
        print(f"  {v:14s} {r['held'] / MIB:10.1f} MiB {r['held'] / c['held']:9.3f}x "
              f"{r['peak'] / MIB:6.1f} MiB {r['peak'] / c['peak']:9.3f}x "
              f"{times[v] * 1e3:7.1f} ms {times[v] / times['ckptfx']:9.3f}x "
              f"{'yes' if r['bitwise'] else 'NO':>8s}")
    print(f"  refill holds {(c['held'] - res['refill']['held']) / MIB:.2f} MiB less than "
          f"ckptfx after the forward (remat_refill: "
          f"{(c['held'] - res['remat_refill']['held']) / MIB:.2f} MiB)")
    print(f"{time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
