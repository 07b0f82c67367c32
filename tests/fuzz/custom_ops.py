"""A custom op whose kernel draws random numbers, for the fuzzer's ``fused_dropout`` op.

``ckptfx_fuzz::fused_dropout(x, p) -> (x * mask, mask)``: a fused-dropout kernel in the style
of an extension's (the draw happens inside the kernel, below the dispatcher, so a tracer sees
one opaque op); ``register_fake`` gives its shapes and ``register_autograd`` saves the mask
for the backward. Registered once, at import, in a namespace no other test uses; the
programs call it as ``torch.ops.ckptfx_fuzz.fused_dropout``.
"""

from __future__ import annotations

import torch


def _define() -> None:
    @torch.library.custom_op("ckptfx_fuzz::fused_dropout", mutates_args=())
    def fused_dropout(x: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
        mask = (torch.rand_like(x) >= p).to(x.dtype) / (1.0 - p)
        return x * mask, mask

    @fused_dropout.register_fake
    def _(x: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.empty_like(x), torch.empty_like(x)

    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(output[1])

    def backward(ctx, grad_y, grad_mask):
        (mask,) = ctx.saved_tensors
        return grad_y * mask, None

    fused_dropout.register_autograd(backward, setup_context=setup_context)


try:  # once per process, even if the package is imported under two names (tests.fuzz, fuzz)
    torch.ops.ckptfx_fuzz.fused_dropout
except (AttributeError, RuntimeError):
    _define()
