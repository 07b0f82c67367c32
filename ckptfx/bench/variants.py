"""The variants ``ckptfx bench`` compares: how each decoder layer of the model is run.

A variant is a name, a family (what the plot groups and colours by) and a ``make()`` that
returns the layer call ``(layer, h, cos, sin) -> h``. They live in one registry,
``VARIANTS``, in the order the tables show them; ``register`` adds one, so a new policy is a
few lines here (the ``memory_budget`` block at the end is the pattern).

Families: ``none`` (no checkpointing), ``torch`` (``torch.utils.checkpoint``, plain and
selective), ``ckptfx`` (``ckptfx.checkpoint``), ``remat`` (``ckptfx.remat`` under one policy),
``budget`` (``remat`` under ``memory_budget(fraction)``: drawn as a Pareto curve).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Collection

import torch
import torch.utils.checkpoint as tcp

from ckptfx import checkpoint as cx_checkpoint
from ckptfx import checkpoint_policies, remat
from ckptfx.bench.llama import LayerCall, plain_call
from ckptfx.policies import DOTS

__all__ = ["BUDGETS", "VARIANTS", "Variant", "available", "get", "register", "sac_policy"]

SacPolicy = Callable[..., tcp.CheckpointPolicy]


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way to run the layers. ``accelerator_only``: skipped on CPU (offloading from host
    memory to host memory measures nothing)."""

    name: str
    family: str
    label: str
    make: Callable[[], LayerCall]
    budget: float | None = None
    accelerator_only: bool = False


VARIANTS: dict[str, Variant] = {}


def register(variant: Variant) -> Variant:
    """Add ``variant`` to the registry (a name already there is a ``ValueError``)."""
    if variant.name in VARIANTS:
        raise ValueError(f"a bench variant named {variant.name!r} is already registered")
    VARIANTS[variant.name] = variant
    return variant


def get(name: str) -> Variant:
    """The registered variant ``name``; an unknown name is a ``ValueError`` listing them."""
    try:
        return VARIANTS[name]
    except KeyError:
        raise ValueError(f"unknown bench variant {name!r}; registered: "
                         f"{', '.join(VARIANTS)}") from None


def available(device: str) -> list[Variant]:
    """The variants that mean something on ``device`` (``"cpu"``, ``"cuda"``...)."""
    on_cpu = torch.device(device).type == "cpu"
    return [v for v in VARIANTS.values() if not (v.accelerator_only and on_cpu)]


# -- the calls ----------------------------------------------------------------------------


def _torch_call() -> LayerCall:
    def call(layer: Any, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return tcp.checkpoint(layer, h, cos, sin, use_reentrant=False)
    return call


def sac_policy(ops: Collection[Any]) -> SacPolicy:
    """A policy of torch's selective checkpoint (SAC) saving the outputs of ``ops`` and
    recomputing the rest: with ckptfx's ``DOTS``, what ``dots_saveable`` saves (this
    registry's ``torch_sac_dots``); the overhead bench passes the four matrix products."""
    must, prefer = tcp.CheckpointPolicy.MUST_SAVE, tcp.CheckpointPolicy.PREFER_RECOMPUTE

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> tcp.CheckpointPolicy:
        return must if op in ops else prefer
    return policy


def _torch_sac_call() -> LayerCall:
    context_fn = functools.partial(tcp.create_selective_checkpoint_contexts, sac_policy(DOTS))

    def call(layer: Any, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return tcp.checkpoint(layer, h, cos, sin, use_reentrant=False, context_fn=context_fn)
    return call


def _ckptfx_call() -> LayerCall:
    def call(layer: Any, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return cx_checkpoint(layer, h, cos, sin)
    return call


def _remat_call(policy_factory: Callable[[], Any]) -> Callable[[], LayerCall]:
    """A ``make`` for ``remat`` under ``policy_factory()``: one remat'd function per layer,
    built on first use (remat keeps per-function state, such as the unused-name check)."""
    def make() -> LayerCall:
        policy = policy_factory()
        wrapped: dict[int, Callable[..., torch.Tensor]] = {}

        def call(layer: Any, h: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> torch.Tensor:
            fn = wrapped.get(id(layer))
            if fn is None:
                fn = wrapped[id(layer)] = remat(layer.forward, policy=policy)
            return fn(h, cos, sin)
        return call
    return make


cp = checkpoint_policies

register(Variant("none", "none", "no checkpoint", lambda: plain_call))
register(Variant("torch", "torch", "torch checkpoint", _torch_call))
register(Variant("torch_sac_dots", "torch", "torch SAC (dots)", _torch_sac_call))
register(Variant("ckptfx", "ckptfx", "ckptfx.checkpoint", _ckptfx_call))
register(Variant("remat:nothing_saveable", "remat", "remat nothing_saveable",
                 _remat_call(lambda: cp.nothing_saveable)))
register(Variant("remat:dots_saveable", "remat", "remat dots_saveable",
                 _remat_call(lambda: cp.dots_saveable)))
register(Variant("remat:dots_with_no_batch_dims_saveable", "remat",
                 "remat dots_with_no_batch_dims", _remat_call(
                     lambda: cp.dots_with_no_batch_dims_saveable)))
register(Variant("remat:save_only_these_names:attn,mlp", "remat",
                 "remat names attn,mlp", _remat_call(
                     lambda: cp.save_only_these_names("attn", "mlp"))))
register(Variant("remat:offload_dot_with_no_batch_dims", "remat", "remat offload dots",
                 _remat_call(lambda: cp.offload_dot_with_no_batch_dims()),
                 accelerator_only=True))

# memory_budget(fraction): 0.0 keeps what nothing_saveable keeps, 1.0 what everything does.
# Registered only when the installed ckptfx has it, so the bench runs on either.
BUDGETS = (0.0, 0.25, 0.5, 0.75, 1.0)
if hasattr(cp, "memory_budget"):
    for _fraction in BUDGETS:
        register(Variant(f"remat:memory_budget:{_fraction}", "budget",
                         f"remat memory_budget({_fraction})",
                         _remat_call(functools.partial(cp.memory_budget, _fraction)),
                         budget=_fraction))
