"""Documented ckptfx limits the fuzzer runs into, and the programs of fixed failures.

A finding that ``matches`` a KNOWN entry is reported as known, not as new: each is a
``CheckpointError`` that names its cause and the fix (never a wrong gradient); test_fuzz.py
runs each entry's shrunk program and checks that it still gets that error. FIXED holds the
shrunk programs of failures since fixed: each must stay exact.
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
        "CPU bf16 autocast region: autocast's cast cache hands call 2 the weight's cast made "
        "in call 1, and the plain function adds both calls' gradients into that one cast "
        "before converting them; a remat'd call cannot feed a cast outside it, so ckptfx "
        "refuses with a CheckpointError naming the cache and the fix "
        "(autocast(cache_enabled=False), which is bitwise). A documented limit, not a wrong "
        "gradient",
        "torch.func.grad remat(default)",
        Program([Step("linear", (0,), "w2")], [], ncalls=2, bf16=True, seed=1091943349),
        lambda prog, v, cat, detail: _func_grad_bf16_twice(prog, v) and cat == "error"
        and "autocast's cast cache" in detail,
    ),
]

# Programs of fixed failures: each must now be exact under its variant.
FIXED: list[tuple[str, str, Program]] = [
    ("B: a kept value handed to another op after autocast's cache shifted the replay",
     "torch.func.grad remat(everything_saveable)",
     Program([Step("matmul", (0,), "w1"), Step("masked_fill_", (0, 0))], [], ncalls=2,
             bf16=True, seed=1958272647)),
    ("B2: as B, through a batched matmul", "torch.func.grad remat(everything_saveable)",
     Program([Step("matmul3d", (0,), "w1"), Step("t_noncontig", (0,))], [], ncalls=2,
             bf16=True, seed=1394663408)),
]


def known_failure(prog: Program, variant: str, category: str, detail: str) -> str | None:
    for k in KNOWN:
        if k.matches(prog, variant, category, detail):
            return k.id
    return None
