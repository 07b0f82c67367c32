"""Benchmark: offload as a memory budget, on a Llama decoder layer on the CPU.

For ``memory_budget(f)`` and ``memory_budget(f, offload=o)``, measured on one
``ckptfx.bench.llama.DecoderLayer`` (dim 512, 8 heads, 4 key/value heads, SwiGLU 1376, batch 2,
sequence 256, fp32): the FLOPs the backward recomputes (``FlopCounterMode``, minus
``everything_saveable``'s backward) and the bytes kept between forward and backward beyond the
layer's arguments, on the device and in host memory (from the residual report, by storage;
an offloaded tensor under ``MIN_OFFLOAD_BYTES`` stays on the device, as on an accelerator).
On the CPU an offloaded value is kept as it is: the bytes are where an accelerator would hold
them, the FLOPs are what any device recomputes (offloading costs transfers, not FLOPs).

Usage::

    python benchmarks/bench_budget_offload.py
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils.flop_counter import FlopCounterMode

import ckptfx
from ckptfx import checkpoint_policies as cp
from ckptfx.bench.llama import DecoderLayer, LlamaConfig, rotary_tables
from ckptfx.budget.place import MIN_OFFLOAD_BYTES
from ckptfx.policies.tracer_stack import tracer_stack

POINTS = [(0.1, 0.0), (0.1, 0.2), (0.1, 0.4), (0.2, 0.0), (0.2, 0.2), (0.2, 0.4), (0.3, 0.0),
          (0.3, 0.3), (0.5, 0.0), (0.5, 0.5)]
MIB = 2**20


def _kept(fn: Callable[..., Any], args: tuple) -> tuple[int, int]:
    report: list[Any] = []
    outer, tracer_stack.report = tracer_stack.report, report
    try:
        fn(*args)
    finally:
        tracer_stack.report = outer
    device: dict[int, int] = {}
    host: dict[int, int] = {}
    for _, kind, t, _, _ in report:
        storage = t.untyped_storage()
        if kind == "saved" or kind == "offloaded" and (
                t.numel() * t.element_size() < MIN_OFFLOAD_BYTES):
            device[storage._cdata] = storage.nbytes()
        elif kind == "offloaded":
            host[storage._cdata] = storage.nbytes()
    return sum(device.values()), sum(host.values())


def _backward_flops(fn: Callable[..., Any], args: tuple) -> int:
    out = fn(*args)
    with FlopCounterMode(display=False) as counter:
        out.sum().backward()
    return counter.get_total_flops()


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = LlamaConfig(dim=512, heads=8, kv_heads=4)
    layer = DecoderLayer(cfg)
    cos, sin = rotary_tables(cfg, 256)
    h = torch.randn(2, 256, cfg.dim, requires_grad=True)
    args = (h, cos, sin)
    every = ckptfx.remat(layer.forward, policy=cp.everything_saveable)
    base = _backward_flops(every, args)
    every_bytes = _kept(every, args)[0]
    print(f"Llama layer dim {cfg.dim}, ffn {cfg.hidden}, batch 2, seq 256, fp32, CPU; "
          f"everything_saveable keeps {every_bytes / MIB:.2f} MiB")
    print(f"{'policy':34} {'recomputed GFLOP':>16} {'device MiB':>11} {'host MiB':>9}")
    for fraction, offload in POINTS:
        policy = cp.memory_budget(fraction, offload=offload)
        fn = ckptfx.remat(layer.forward, policy=policy)
        fn(*args).sum().backward()  # the first call of a signature plans
        flops = _backward_flops(fn, args) - base
        device, host = _kept(fn, args)
        print(f"{policy.label():34} {flops / 1e9:16.3f} {device / MIB:11.2f} {host / MIB:9.2f}")


if __name__ == "__main__":
    main()
