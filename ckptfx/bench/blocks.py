"""The small models the benchmarks time and measure, each defined once.

- ``Block``: a pre-norm transformer block (GELU MLP), with optional dropout. Without dropout
  and with attention through ``bmm`` it is the block of ``ckptfx bench --overhead``'s remat
  and vjp256 parts; the developer scripts in ``benchmarks/`` use ``dropout=0.1`` and 4-D
  ``@`` attention (``attention="matmul"``), the form their README figures were measured on.
- ``MLPBlock``: ``x + fc2(gelu(fc1(x)))``, the split step's small block.
- ``encoder_stack``: ``nn.TransformerEncoderLayer`` blocks (pre-norm, dropout 0.1), torch's
  own layer, for the scripts that compare against it.
- ``chain``: the blocks run in sequence, plainly or each under a checkpoint.
- ``count_runs``: how many times blocks ran (forward and replays) during one call, counted
  by hooks that exist only for that call, so timed steps run the blocks without them.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["Block", "MLPBlock", "chain", "count_runs", "encoder_stack"]

Step = Callable[[torch.Tensor], torch.Tensor]
# How ``chain`` runs one block: ``wrap(block, h)``, e.g. ``ckptfx.checkpoint``.
Wrap = Callable[[Any, torch.Tensor], torch.Tensor]


class Block(nn.Module):
    """A pre-norm transformer block: ``x + proj(attention(ln1(x)))``, then
    ``x + fc2(gelu(fc1(ln2(x))))``; ``dropout`` > 0 drops out the attention probabilities and
    the MLP's hidden values (always, as ``F.dropout`` does by default). ``attention``:
    ``"bmm"`` (heads folded into the batch, two ``bmm``) or ``"matmul"`` (4-D ``@`` on
    ``(batch, heads, seq, head_dim)`` views: the same values through more view ops, which a
    memory budget's planner counts as more candidate ops)."""

    def __init__(self, d: int, heads: int = 4, dropout: float = 0.0,
                 attention: str = "bmm") -> None:
        super().__init__()
        if attention not in ("bmm", "matmul"):
            raise ValueError(f"attention must be 'bmm' or 'matmul', got {attention!r}")
        self.heads, self.dropout, self.attention = heads, dropout, attention
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.attention == "matmul":
            return self._forward_4d(x)
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(
            2, 0, 3, 1, 4).reshape(3, b * self.heads, t, d // self.heads)
        a = torch.softmax(torch.bmm(q, k.transpose(1, 2)) / (d // self.heads) ** 0.5, -1)
        # No dropout op at all when it is 0: the overhead bench's block runs exactly these ops.
        if self.dropout:
            a = F.dropout(a, self.dropout)
        o = torch.bmm(a, v).view(b, self.heads, t, -1).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(o)
        m = F.gelu(self.fc1(self.ln2(x)))
        if self.dropout:
            m = F.dropout(m, self.dropout)
        return x + self.fc2(m)

    def _forward_4d(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        a = (q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5).softmax(-1)
        if self.dropout:
            a = F.dropout(a, self.dropout)
        x = x + self.proj((a @ v).transpose(1, 2).reshape(b, t, d))
        m = F.gelu(self.fc1(self.ln2(x)))
        if self.dropout:
            m = F.dropout(m, self.dropout)
        return x + self.fc2(m)


class MLPBlock(nn.Module):
    """``x + fc2(gelu(fc1(x)))``: a block small enough that a checkpoint's per-call cost shows."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


def encoder_stack(blocks: int, d: int, device: str | torch.device = "cpu") -> nn.ModuleList:
    """``blocks`` of torch's ``nn.TransformerEncoderLayer`` (pre-norm, dropout 0.1, one head
    per 64 channels), seeded (0), in training mode."""
    torch.manual_seed(0)
    return nn.ModuleList(
        nn.TransformerEncoderLayer(d, nhead=max(1, d // 64), dim_feedforward=4 * d,
                                   dropout=0.1, batch_first=True, norm_first=True)
        for _ in range(blocks)
    ).to(device).train()


def chain(blocks: Sequence[Step], wrap: Wrap | None = None) -> Step:
    """``h -> blocks[-1](...blocks[0](h))``, each block called as ``wrap(block, h)`` when
    ``wrap`` is given. Two closures rather than one with a test, so the plain chain, the
    baseline of most ratios, runs nothing but the blocks."""
    def plain(h: torch.Tensor) -> torch.Tensor:
        for b in blocks:
            h = b(h)
        return h

    if wrap is None:
        return plain
    call = wrap

    def wrapped(h: torch.Tensor) -> torch.Tensor:
        for b in blocks:
            h = call(b, h)
        return h

    return wrapped


def count_runs(modules: Iterable[nn.Module], fn: Callable[[], object]) -> int:
    """How many times ``modules`` were called (forward and replays) during ``fn()``."""
    runs = [0]

    def hook(module: nn.Module, args: Any) -> None:
        runs[0] += 1

    handles = [m.register_forward_pre_hook(hook) for m in modules]
    try:
        fn()
    finally:
        for h in handles:
            h.remove()
    return runs[0]
