"""Known ckptfx failures the fuzzer found, each with its shrunk program.

A finding that ``matches`` an entry is reported as known, not as new. test_fuzz.py runs each
entry's shrunk program under its variant and expects it still to fail (xfail strict): a fix
shows up as an XPASS, and the entry is then removed here.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from .program import Program, Step


@dataclasses.dataclass(frozen=True)
class Known:
    id: str
    reason: str
    variant: str  # the variant the shrunk program fails under
    program: Program
    matches: Callable[[Program, str, str, str], bool]  # (program, variant, category, detail)


def _func_grad_bf16_twice(prog: Program, variant: str) -> bool:
    return variant.startswith("torch.func.grad") and prog.bf16 and prog.ncalls > 1


KNOWN: list[Known] = [
    Known(
        "A",
        "torch.func.grad over a remat'd block called twice with the same weights inside one "
        "CPU bf16 autocast region: autocast caches the bf16 cast of a leaf weight for the "
        "whole region, so call 2 reads the cast made inside call 1, and the torch.func path "
        "refuses it as a tensor from outside the block's arguments (CheckpointError); the "
        "plain function and the autograd path are fine",
        "torch.func.grad remat(default)",
        Program([Step("linear", (0,), "w2")], [], ncalls=2, bf16=True, seed=1091943349),
        lambda prog, v, cat, detail: _func_grad_bf16_twice(prog, v) and cat == "error"
        and "the block read a tensor that the torch.func transform" in detail,
    ),
    Known(
        "B",
        "same setting under everything_saveable: the backward feeds a wrongly shaped tensor "
        "to an op (RuntimeError 'mat1 and mat2 shapes cannot be multiplied (4x8 and 4x8)')",
        "torch.func.grad remat(everything_saveable)",
        Program([Step("matmul", (0,), "w1"), Step("masked_fill_", (0, 0))], [], ncalls=2,
                bf16=True, seed=1958272647),
        lambda prog, v, cat, detail: _func_grad_bf16_twice(prog, v) and cat == "error"
        and detail.startswith("RuntimeError"),
    ),
    Known(
        "B2",
        "as B, through a batched matmul ('Expected size for first two dimensions of batch2 "
        "tensor to be: [2, 8] but got: [2, 2]')",
        "torch.func.grad remat(everything_saveable)",
        Program([Step("matmul3d", (0,), "w1"), Step("t_noncontig", (0,))], [], ncalls=2,
                bf16=True, seed=1394663408),
        lambda prog, v, cat, detail: False,  # B matches these in runs
    ),
]


def known_failure(prog: Program, variant: str, category: str, detail: str) -> str | None:
    for k in KNOWN:
        if k.matches(prog, variant, category, detail):
            return k.id
    return None
