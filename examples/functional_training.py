"""Functional training with ckptfx.remat: functional_call + torch.func.grad + AdamW in torch ops.

A small transformer language model (random tokens) is trained twice from the same start:
once with every block remat'd (policy ``dots_saveable``: the backward keeps the matrix
products and recomputes the rest) and once without. It prints the loss and step time per
step, the residuals one block keeps for its backward with and without remat, and checks the
two runs' losses are bitwise equal (dropout included).

    python examples/functional_training.py --steps 8
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, grad_and_value

import ckptfx
from ckptfx import checkpoint_policies as cp

VOCAB, D, HEADS, LAYERS, SEQ, BATCH = 256, 64, 4, 3, 64, 8


class Block(nn.Module):
    def __init__(self, remat: bool) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        # remat'd as a bound method: under torch.func the module's parameters (swapped in by
        # functional_call) become explicit inputs of the block, so they get gradients.
        self.body = ckptfx.remat(self._body, policy=cp.dots_saveable) if remat else self._body

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-1, -2)) / (d // HEADS) ** 0.5
        att = att.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        att = F.dropout(att.softmax(-1), 0.1, self.training)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.dropout(F.gelu(self.fc1(self.ln2(x))), 0.1, self.training))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class LM(nn.Module):
    def __init__(self, remat: bool) -> None:
        super().__init__()
        self.emb, self.pos = nn.Embedding(VOCAB, D), nn.Parameter(torch.zeros(SEQ, D))
        self.blocks = nn.ModuleList(Block(remat) for _ in range(LAYERS))
        self.ln, self.head = nn.LayerNorm(D), nn.Linear(D, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def adamw(params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor],
          state: dict[str, list[torch.Tensor]], step: int, lr: float = 3e-3,
          betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, wd: float = 0.01
          ) -> dict[str, torch.Tensor]:
    """One AdamW step written with torch ops; returns the new parameters."""
    out = {}
    for name, p in params.items():
        m, v = state.setdefault(name, [torch.zeros_like(p), torch.zeros_like(p)])
        g = grads[name]
        m.mul_(betas[0]).add_(g, alpha=1 - betas[0])
        v.mul_(betas[1]).addcmul_(g, g, value=1 - betas[1])
        m_hat = m / (1 - betas[0] ** step)
        v_hat = v / (1 - betas[1] ** step)
        out[name] = p * (1 - lr * wd) - lr * m_hat / (v_hat.sqrt() + eps)
    return out


def train(remat: bool, steps: int, data: torch.Tensor) -> tuple[list[float], list[float]]:
    torch.manual_seed(0)
    model = LM(remat).train()
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_fn(params: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
        logits = functional_call(model, params, (tokens[:, :-1],))
        return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))

    step_fn = grad_and_value(loss_fn)
    state: dict[str, list[torch.Tensor]] = {}
    losses, times = [], []
    for step in range(1, steps + 1):
        tokens = data[(step - 1) % len(data)]
        torch.manual_seed(1000 + step)  # the same dropout masks in both runs
        start = time.perf_counter()
        grads, loss = step_fn(params, tokens)
        params = adamw(params, grads, state, step)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
        print(f"  {'remat' if remat else 'plain'} step {step:3d}  loss {loss.item():.6f}  "
              f"{times[-1] * 1e3:7.1f} ms")
    return losses, times


def residual_report() -> None:
    """What one block keeps for its backward, under plain autograd, with and without remat."""
    torch.manual_seed(0)
    x = torch.randn(BATCH, SEQ - 1, D)
    for remat in (False, True):
        block = Block(remat).eval()
        residuals = ckptfx.saved_residuals(block.body, x)
        total = sum(r.nbytes for r in residuals)
        beyond = sum(r.nbytes for r in residuals if r.kind != "argument")
        print(f"  {'remat (dots_saveable)' if remat else 'no remat':22s} {len(residuals):3d} "
              f"residuals, {total / 2**10:8.1f} KiB ({beyond / 2**10:8.1f} KiB beyond the "
              "arguments)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="training steps per run")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    torch.set_num_threads(1)  # steadier step times on a small shared machine
    g = torch.Generator().manual_seed(42)
    data = torch.randint(0, VOCAB, (4, BATCH, SEQ), generator=g)

    print(f"transformer LM: {LAYERS} blocks, d={D}, vocab={VOCAB}, seq={SEQ}, batch={BATCH}")
    remat_losses, remat_times = train(True, args.steps, data)
    plain_losses, plain_times = train(False, args.steps, data)

    print("saved residuals of one block (ckptfx.saved_residuals, plain autograd):")
    residual_report()
    same = remat_losses == plain_losses  # floats from .item(): equal iff bitwise equal
    # the first step includes one-time warm-up; medians of the rest when there are any
    skip = 1 if args.steps > 2 else 0
    ratio = statistics.median(remat_times[skip:]) / statistics.median(plain_times[skip:])
    print(f"losses bitwise equal with and without remat: {same}")
    print(f"median step time, remat / plain: {ratio:.2f}x")
    if not same:
        raise SystemExit("losses differ")


if __name__ == "__main__":
    main()
