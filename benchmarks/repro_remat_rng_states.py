"""Repro: remat keeps one CPU generator state per random op of a block; torch's checkpoint
(and ckptfx.checkpoint) keep one per block.

The recorded segment (trace.py, Rule 3) stores, for every seeded op (dropout's
``native_dropout``, ``bernoulli_``, ...), the generator states right before it
(``_Op.rng``: ``torch.get_rng_state()`` always, 5056 bytes for CPU's mt19937, plus the
device's and any explicit generator's), so that a replay that skips ops still draws the
forward's numbers. They live as long as the frame, i.e. until the block's backward freed its
graph. A block with k dropouts therefore holds k states beside the frame's own one.

Deterministic figures (bytes held, and the peak of allocated CPU bytes from torch's
profiler, not resident memory):

    python benchmarks/repro_remat_rng_states.py
"""

from __future__ import annotations

import sys

import torch
import torch.utils.checkpoint as tcp
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch._C._profiler import _EventType

import ckptfx


def allocated_peak(fn) -> int:
    """Peak of live CPU allocations during ``fn()``, from the profiler's allocation events."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    cur = peak = 0
    for _, size in sorted(events):
        cur += size
        peak = max(peak, cur)
    return peak


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    blocks, d = 6, 256
    stack = [nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.1, batch_first=True,
                                        norm_first=True).train() for _ in range(blocks)]
    x = torch.randn(8, 128, d, requires_grad=True)
    remats = [ckptfx.remat(b) for b in stack]

    with ckptfx.recompute_handle_collector_ctx() as handles:
        h = x
        for r in remats:
            h = r(h)
    segments = [hd.frame.rerun.__self__ for hd in handles]
    states = [op.rng[0] for seg in segments for op in seg.ops if op.rng is not None]
    print(f"{blocks} remat'd encoder blocks: {len(states)} generator states recorded "
          f"({len(states) // blocks} per block, {states[0].numel()} bytes each): "
          f"{sum(s.numel() for s in states) / 1024:.1f} KiB held until each block's backward")
    del h, handles, segments, states

    def step(call, retain: bool):
        def run():
            h = x
            for b, r in zip(stack, remats):
                h = call(b, r, h)
            h.sum().backward(retain_graph=retain)
        return run

    variants = {
        "torch": lambda b, r, h: tcp.checkpoint(b, h, use_reentrant=False),
        "ckptfx": lambda b, r, h: ckptfx.checkpoint(b, h),
        "remat": lambda b, r, h: r(h),
    }
    for retain in (False, True):
        peaks = {}
        for name, call in variants.items():
            step(call, retain)()  # warm-up
            peaks[name] = allocated_peak(step(call, retain))
            for p in (q for b in stack for q in b.parameters()):
                p.grad = None
            x.grad = None
        t = peaks["torch"]
        print(f"retain_graph={retain}: allocated peak torch {t / 2**20:.3f} MiB, ckptfx "
              f"{peaks['ckptfx'] / 2**20:.3f} (+{(peaks['ckptfx'] - t) / 1024:.1f} KiB), "
              f"remat {peaks['remat'] / 2**20:.3f} (+{(peaks['remat'] - t) / 1024:.1f} KiB)")


if __name__ == "__main__":
    sys.exit(main())
