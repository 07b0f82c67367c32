"""A small Llama-style decoder for the benchmarks: no ``transformers`` needed.

The layer is the one Llama, Qwen2 and Mistral share: pre-norm RMSNorm, grouped-query attention
with rotary position embeddings through ``scaled_dot_product_attention`` (causal), and a
SwiGLU MLP, no biases, no dropout. The rotary tables are computed once per model, outside the
layers (as ``LlamaModel`` does), and passed to every layer, so a checkpointed layer's inputs
are ``(h, cos, sin)``.

Two values are tagged with ``ckptfx.checkpoint_name`` (an identity outside ``remat``) for the
name-based policies: ``"attn"`` (the attention output, before the output projection) and
``"mlp"`` (the SwiGLU product, before the down projection).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ckptfx import checkpoint_name

__all__ = ["DecoderLayer", "LayerCall", "LlamaConfig", "LlamaModel", "ModelShape", "RMSNorm",
           "plain_call", "rotary_tables"]

# A layer call as a variant wraps it: (layer, h, cos, sin) -> h.
LayerCall = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The decoder's size, declared once: ``LlamaConfig`` adds the layer's constants, and
    ``ckptfx bench``'s ``BenchConfig`` (measure.py) the measurement plan."""

    dim: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 512


@dataclasses.dataclass(frozen=True)
class LlamaConfig(ModelShape):
    """Shape of the model; ``ffn`` defaults to Llama's 8/3 * dim rounded up to 32."""

    ffn: int = 0
    rope_theta: float = 10000.0
    eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.dim % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"dim ({self.dim}) must be a multiple of heads ({self.heads}) and "
                             f"heads a multiple of kv_heads ({self.kv_heads})")
        if (self.dim // self.heads) % 2:
            raise ValueError(f"the head size dim/heads = {self.dim // self.heads} must be even "
                             "for rotary embeddings")

    @property
    def hidden(self) -> int:
        """The MLP's width: ``ffn``, or Llama's 8/3 * dim rounded up to 32."""
        return self.ffn or -(-(8 * self.dim // 3) // 32) * 32


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale, computed in fp32 as Llama does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotary_tables(cfg: LlamaConfig, seq: int, device: torch.device | str = "cpu"
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``, ``sin`` of shape ``(seq, head_dim)`` (the half-rotation layout)."""
    head = cfg.dim // cfg.heads
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, head, 2, device=device).float() / head)
    freqs = torch.outer(torch.arange(seq, device=device).float(), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-b, a], dim=-1) * sin


class DecoderLayer(nn.Module):
    """One Llama decoder layer: ``h + attn(norm(h))``, then ``h + mlp(norm(h))``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        head = cfg.dim // cfg.heads
        self.heads, self.kv_heads, self.head = cfg.heads, cfg.kv_heads, head
        self.attn_norm = RMSNorm(cfg.dim, cfg.eps)
        self.q_proj = nn.Linear(cfg.dim, cfg.heads * head, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.kv_heads * head, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.kv_heads * head, bias=False)
        self.o_proj = nn.Linear(cfg.heads * head, cfg.dim, bias=False)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.eps)
        self.gate_proj = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.down_proj = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = h.shape
        x = self.attn_norm(h)
        q = self.q_proj(x).view(b, s, self.heads, self.head).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        # Grouped-query attention: each key/value head serves heads // kv_heads query heads.
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        a = checkpoint_name(a.transpose(1, 2).reshape(b, s, -1), "attn")
        h = h + self.o_proj(a)
        x = self.mlp_norm(h)
        m = checkpoint_name(F.silu(self.gate_proj(x)) * self.up_proj(x), "mlp")
        return h + self.down_proj(m)


def plain_call(layer: nn.Module, h: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> torch.Tensor:
    """The layer call without checkpointing."""
    return layer(h, cos, sin)


class LlamaModel(nn.Module):
    """Embedding, ``cfg.layers`` decoder layers, final norm and LM head.

    ``call`` decides how each layer is run (plainly or under a checkpoint variant); it is
    the only thing the benchmark variants change.
    """

    def __init__(self, cfg: LlamaConfig, call: LayerCall = plain_call) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim, cfg.eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.call = call

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy loss of ``tokens`` (batch, seq)."""
        cos, sin = rotary_tables(self.cfg, tokens.shape[1], tokens.device)
        h = self.embed(tokens[:, :-1])
        cos, sin = cos[:-1], sin[:-1]
        for layer in self.layers:
            h = self.call(layer, h, cos, sin)
        logits = self.lm_head(self.norm(h))
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
