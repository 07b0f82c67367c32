"""ckptfx quickstart: a small transformer block under ckptfx.checkpoint.

Runs the same block with no checkpoint, with torch.utils.checkpoint and with ckptfx, and
prints whether the gradients are bitwise equal and how often the block ran; then splits the
backward into dx and dw calls under one recompute session and shows the block is replayed
once for both.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint

import ckptfx


class Block(nn.Module):
    def __init__(self, d: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.runs = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.runs += 1
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        att = (q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2)) / (d // self.heads) ** 0.5
        att = F.dropout(att.softmax(-1), 0.1, self.training)
        y = (att @ v.transpose(1, 2)).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(y)
        return x + self.fc2(F.dropout(F.gelu(self.fc1(self.ln2(x))), 0.1, self.training))


def grads(block: Block, x: torch.Tensor, run) -> tuple[list[torch.Tensor], int]:
    block.runs = 0
    torch.manual_seed(1234)  # same dropout masks in every variant
    out = run(block, x)
    g = torch.autograd.grad(out.square().sum(), [x, *block.parameters()])
    return list(g), block.runs


def main() -> None:
    torch.manual_seed(0)
    block = Block().train()
    x = torch.randn(2, 16, 64, requires_grad=True)
    variants = {
        "no checkpoint": lambda m, x: m(x),
        "torch.utils.checkpoint": lambda m, x: torch_checkpoint.checkpoint(m, x, use_reentrant=False),
        "ckptfx.checkpoint": lambda m, x: ckptfx.checkpoint(m, x),
    }
    ref, _ = grads(block, x, variants["no checkpoint"])
    for name, run in variants.items():
        g, runs = grads(block, x, run)
        same = all(torch.equal(a, b) for a, b in zip(ref, g))
        print(f"{name:24s} block runs: {runs}   gradients bitwise equal to no checkpoint: {same}")

    # Split backward: dx now, dw later (one autograd.grad per parameter), one replay.
    params = list(block.parameters())
    block.runs = 0
    torch.manual_seed(1234)
    with ckptfx.recompute_handle_collector_ctx() as handles:
        out = ckptfx.checkpoint(block, x)
    g_out = 2 * out.detach()
    sid = ("microbatch", 0)
    try:
        for h in handles:
            ckptfx.recompute_handle(h, sid)  # prefire: replay now
        with ckptfx.recompute_session_ctx(sid, retain_on_unpack=True):
            dx = torch.autograd.grad(out, x, g_out, retain_graph=True)
            held = ckptfx.recompute_session_stats()[sid].nbytes
            dw = [torch.autograd.grad(out, p, g_out, retain_graph=True)[0] for p in params[:-1]]
        with ckptfx.recompute_session_ctx(sid, retain_on_unpack=False):
            dw.append(torch.autograd.grad(out, params[-1], g_out)[0])
    finally:
        ckptfx.clear_recompute_session(sid)
    same = all(torch.equal(a, b) for a, b in zip(ref, [*dx, *dw]))
    print(f"{'ckptfx split dx + dw':24s} block runs: {block.runs}   "
          f"({len(params)} dw calls, {held / 2**10:.1f} KiB of replayed tensors held)  "
          f"bitwise equal: {same}")


if __name__ == "__main__":
    main()
