"""Small models shared by the tests (``from models import Block``; tests/ is on sys.path).

``Block`` is the residual MLP block the tests checkpoint, with a counter of its runs;
``TransformerBlock`` a functional transformer block (weights in a dict) for the memory-budget
tests. Test files whose block needs a special forward keep their own class, named by what is
special (``TanhOutputBlock``, ``GatedBlock``, ``ModeNotingBlock``, ``FallibleKeepMaskBlock``), or
subclass ``Block`` and change how it counts (``note_run``) or what its input goes through.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

D, H = 8, 16  # the default width and hidden width


class Block(nn.Module):
    """A residual MLP block, ``x + fc2(dropout(act(fc1(ln(x)))))``, that counts its runs.

    What the tests need of a checkpointed block: parameters (the weight gradients compared
    bitwise), a random op (dropout, so a replay must reproduce the forward's mask), and a
    counter of the Python runs of ``forward`` (the forward itself and every replay that
    re-runs it), ``runs``, counted by ``note_run``, which subclasses override to count
    elsewhere (class-wide, per thread, or not in Python at all).

    ``act`` is the activation (``F.gelu`` or ``torch.tanh``); ``p`` the dropout probability
    (``0``: no dropout op at all), applied while ``self.training`` (nn.Module's default);
    ``dropout_on_output=True`` moves the dropout onto fc2's output, ``x + dropout(fc2(...))``
    (its mask then comes after both matmuls, so a replay that needs the mask runs both);
    ``norm=True`` puts a pre-norm ``LayerNorm`` (``ln``) first, created before the Linears.
    Parameters are created in the order ``ln``, ``fc1``, ``fc2``.

    Example::

        block = Block(act=torch.tanh, p=0.2)
        ckptfx.checkpoint(block, torch.randn(4, 8)).sum().backward()
        assert block.runs == 2  # the forward and one replay
    """

    def __init__(self, d: int = D, h: int = H, p: float = 0.25, *,
                 act: Callable[[torch.Tensor], torch.Tensor] = F.gelu,
                 dropout_on_output: bool = False, norm: bool = False) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d) if norm else None
        self.fc1, self.fc2 = nn.Linear(d, h), nn.Linear(h, d)
        self.act = act
        self.p = p
        self.dropout_on_output = dropout_on_output
        self.runs = 0

    def note_run(self) -> None:
        """Count one run of ``forward`` (called first thing in it)."""
        self.runs += 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.note_run()
        h = self.act(self.fc1(x if self.ln is None else self.ln(x)))
        if self.p and not self.dropout_on_output:
            h = F.dropout(h, self.p, self.training)
        y = self.fc2(h)
        if self.p and self.dropout_on_output:
            y = F.dropout(y, self.p, self.training)
        return x + y


class TransformerBlock:
    """A functional pre-norm transformer block (attention and MLP, dropout on), its weights
    in ``w``: what the memory-budget tests plan over. At d=128 the hidden values are 64 KiB
    in fp32 (32 KiB under bf16 autocast, below the budget's 64 KiB offload minimum),
    attention scores and the MLP's activations 128-256 KiB, norm statistics 512 bytes."""

    def __init__(self, device: torch.device, seed: int = 0, d: int = 128, heads: int = 4
                 ) -> None:
        g = torch.Generator().manual_seed(seed)
        shapes = {"qkv": (d, 3 * d), "o": (d, d), "up": (d, 4 * d), "down": (4 * d, d)}
        self.w = {k: (torch.randn(*s, generator=g) / s[0] ** 0.5).to(device).requires_grad_()
                  for k, s in shapes.items()}
        self.d, self.heads = d, heads

    @property
    def params(self) -> list[torch.Tensor]:
        return list(self.w.values())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w, d, heads = self.w, self.d, self.heads
        b, s, _ = x.shape
        h = F.layer_norm(x, (d,))
        q, k, v = (h @ w["qkv"]).view(b, s, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
        a = torch.softmax(q @ k.transpose(-1, -2) / (d // heads) ** 0.5, -1)
        a = F.dropout(a, 0.1, training=True)
        x = x + ((a @ v).transpose(1, 2).reshape(b, s, d) @ w["o"])
        h = F.layer_norm(x, (d,))
        return x + F.dropout(F.gelu(h @ w["up"]) @ w["down"], 0.1, training=True)
