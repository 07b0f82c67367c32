"""Residual reports name what a block reads: parameters by qualified name, arguments by the
forward's parameter names, partial-bound and closure tensors by their names."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import ckptfx
from ckptfx import checkpoint_policies as cp


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(8, 8)
        self.o_proj = nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(torch.relu(self.q_proj(x)))


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = Attention()
        self.norm = nn.LayerNorm(8)
        self.register_buffer("scale", torch.full((8,), 0.5))

    def forward(self, hidden_states: torch.Tensor, mask: torch.Tensor | None = None
                ) -> torch.Tensor:
        h = self.self_attn(self.norm(hidden_states)) * self.scale
        return h + hidden_states if mask is None else h * mask + hidden_states


ARGUMENT_SOURCES = {
    "from the argument hidden_states",
    "from the parameter norm.weight",
    "from the parameter norm.bias",
    "from the parameter self_attn.q_proj.weight",
    "from the parameter self_attn.o_proj.weight",
    "from the buffer scale",
}


def _argument_sources(fun, *args, **kwargs) -> set[str]:
    return {r.source for r in ckptfx.saved_residuals(fun, *args, **kwargs)
            if r.kind == "argument"}


@pytest.mark.parametrize("how", ["module", "bound_method", "partial"])
def test_remat_of_a_module_names_parameters_and_arguments(how: str) -> None:
    torch.manual_seed(0)
    layer = Layer()
    x = torch.randn(2, 8)
    fun = {"module": layer, "bound_method": layer.forward,
           "partial": functools.partial(Layer.forward, layer)}[how]
    got = _argument_sources(ckptfx.remat(fun, policy=cp.dots_saveable), x)
    assert ARGUMENT_SOURCES == got
    assert not any("outside its arguments" in s for s in got), got


def test_partial_keywords_and_closures_are_named() -> None:
    torch.manual_seed(0)
    layer = Layer()
    x, mask = torch.randn(2, 8), torch.rand(2, 8)
    got = _argument_sources(ckptfx.remat(functools.partial(Layer.forward, layer, mask=mask)), x)
    assert "from the argument mask" in got

    w = {"w": torch.randn(8, 8, requires_grad=True)}

    def block(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ w["w"])

    got = _argument_sources(ckptfx.remat(block), x)
    assert got == {"from the argument x", "from the closure variable w['w']"}


def test_hf_llama_layer_report_names_every_parameter() -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    layer = model.model.layers[0]
    h = torch.randn(2, 8, 32)
    pe = model.model.rotary_emb(h, torch.arange(8)[None])
    got = _argument_sources(ckptfx.remat(layer, policy=cp.dots_saveable), h,
                            position_embeddings=pe, attention_mask=None)
    expected = {"from the argument hidden_states", "from the argument position_embeddings[0]",
                "from the argument position_embeddings[1]"}
    expected |= {f"from the parameter {n}" for n, _ in layer.named_parameters()}
    assert got == expected
