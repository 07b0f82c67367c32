"""torch.compile with inductor (CPU, gcc): remat lowered into the graph, and ckptfx around a
compiled block, bitwise against the same inductor compilation without remat/checkpoint.

Inductor may fuse differently from eager, so the reference is inductor itself, never eager.
The compilations take about a minute on 2 loaded cores, so the test is marked slow and left
out of the default run: ``python -m pytest -m slow tests/test_compile_inductor.py``.
"""

from __future__ import annotations

import pytest
import torch

import ckptfx
from ckptfx import checkpoint_policies as cp

from conftest import assert_bitwise
from test_compile import (
    TICKS, make_blocks, make_params, module_step, params_of, step, two_blocks, body, x_input,
)

pytestmark = [pytest.mark.slow,
              pytest.mark.usefixtures("no_sessions_left", "no_hooks_left_behind")]


def test_inductor_remat_and_checkpoint_of_a_compiled_block_are_bitwise() -> None:
    torch._dynamo.reset()
    p, x = make_params(), x_input()
    expected = step(torch.compile(two_blocks(body), backend="inductor"), p, x)
    model = two_blocks(ckptfx.remat(body, policy=cp.dots_saveable))
    assert_bitwise(step(torch.compile(model, backend="inductor"), p, x), expected)

    blocks = make_blocks(1)
    params = params_of(blocks)
    compiled = torch.compile(blocks[0], backend="inductor")
    expected, _ = module_step([compiled], lambda b, h: b(h), params)
    for _ in range(2):  # the replay runs the compiled code: no recompilation, same numbers
        got, ticks = module_step([compiled], lambda b, h: ckptfx.checkpoint(b, h), params)
        assert_bitwise(got, expected)
        assert ticks == 2
    torch._dynamo.reset()
