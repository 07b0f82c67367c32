"""Generator states held by remat, against torch's checkpoint and ckptfx.checkpoint.

remat replays random ops from the generator states they drew from in the forward (segment.py,
Rule 3). It used to store the CPU state (5,056 bytes of mt19937) before every random op, 4
per encoder block, 118.5 KiB over 6 blocks above torch's checkpoint, which keeps one state per
block. Now the block's first CPU draw starts from the frame's start state and later draws
continue from the random op before them (Rule 3b), so remat stores none of its own.

Deterministic figures (states stored, and the peak of allocated CPU bytes from torch's
profiler, not resident memory):

    python benchmarks/repro_remat_rng_states.py
"""

from __future__ import annotations

import sys

import torch
import torch.utils.checkpoint as tcp
from torch.profiler import ProfilerActivity, profile
from torch._C._profiler import _EventType

import ckptfx
from ckptfx.bench.blocks import encoder_stack


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
    torch.set_num_threads(1)
    blocks, d = 6, 256
    stack = list(encoder_stack(blocks, d))  # seeded (0), 4 heads at d=256, training mode
    x = torch.randn(8, 128, d, requires_grad=True)
    remats = [ckptfx.remat(b) for b in stack]

    with ckptfx.recompute_handle_collector_ctx() as handles:
        h = x
        for r in remats:
            h = r(h)
    segments = [hd.frame.rerun.__self__ for hd in handles]
    random_ops = [op for seg in segments for op in seg.ops if op.func.is_view is False
                  and torch.Tag.nondeterministic_seeded in op.func.tags]
    states = [op.rng[0] for op in random_ops
              if op.rng is not None and isinstance(op.rng[0], torch.Tensor)]
    print(f"{blocks} remat'd encoder blocks: {len(random_ops)} random ops, "
          f"{len(states)} generator states stored "
          f"({sum(s.numel() for s in states) / 1024:.1f} KiB held until each block's backward; "
          "the others replay from the block's start state or the op before them)")
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
