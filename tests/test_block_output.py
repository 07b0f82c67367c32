"""No block output stored twice, measured: where a checkpointed block ends in an op that saves
its own output and the op after the block saves that output too, the bytes the forward
leaves allocated (the CPU allocator's own accounting, through the profiler) show one copy."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as tcp
from torch import nn
from torch.profiler import profile

import ckptfx
from ckptfx import checkpoint_policies as cp

pytestmark = pytest.mark.usefixtures("no_hooks_left_behind")

D, ROWS, BLOCKS = 32, 128, 3
OUT_BYTES = ROWS * D * 4  # one block output


class TanhOutputBlock(nn.Module):
    """A residual MLP ending in tanh, an op that saves its own output (the block's)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # tanh saves its output, the block's output; the next block's (or the head's)
        # Linear saves it as its input
        return torch.tanh(x + self.down(torch.relu(self.up(x))))


def held_after_forward(variant: Any, blocks: list[TanhOutputBlock], head: nn.Linear) -> int:
    """Net bytes allocated by one forward and still allocated at its end."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        for b in blocks:
            if variant == "plain":
                x = b(x)
            elif variant == "torch":
                x = tcp.checkpoint(b, x, use_reentrant=False)
            elif variant == "ckptfx":
                x = ckptfx.checkpoint(b, x)
            else:
                x = ckptfx.remat(b.forward, policy=variant)(x)
        return head(x)

    x = torch.randn(ROWS, D, requires_grad=True)
    forward(x).sum().backward()  # warm up (a memory budget plans here)
    gc.collect()
    with profile(profile_memory=True) as prof:
        out = forward(x)
    held = sum(e.self_cpu_memory_usage for e in prof.key_averages())
    out.sum().backward()
    return held


def test_block_outputs_are_held_once() -> None:
    torch.manual_seed(0)
    blocks = [TanhOutputBlock() for _ in range(BLOCKS)]
    head = nn.Linear(D, D)
    held = {str(v): held_after_forward(v, blocks, head)
            for v in ("plain", "torch", "ckptfx", cp.everything_saveable,
                      cp.nothing_saveable)}
    # ckptfx's checkpoint holds exactly what torch's holds: each block's input (the previous
    # output, once), its RNG state, the head's input and the output
    assert held["ckptfx"] == held["torch"]
    assert held["torch"] < (BLOCKS + 2) * OUT_BYTES
    # remat keeping everything holds plain autograd's bytes plus one CPU RNG state per
    # block (5 KiB each), less than a block output: the tanh output it keeps is the tensor
    # the next Linear saved, not a copy
    rng = held[str(cp.everything_saveable)] - held["plain"]
    assert 0 <= rng < OUT_BYTES
    assert held[str(cp.nothing_saveable)] == held["ckptfx"]
