"""torch.compile: remat lowered into compiled graphs, ckptfx around compiled code, sessions.

Backends eager and aot_eager (inductor: tests/test_compile_inductor.py). Every gradient is
compared bitwise with the same backend compiling the same model without remat/checkpoint,
and with plain eager (eager and aot_eager match it bit for bit). Block runs are counted by
``ckptfx_test::tick``, an opaque op inside the block that every compiled graph calls (a
Python counter in compiled code is not re-run by a replay); recompilations by a backend
that counts its calls; what a compiled backward recomputes by the matmuls of its graph.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.backends.common import aot_autograd
from torch.utils.checkpoint import CheckpointPolicy

import ckptfx
from ckptfx import lowering
from ckptfx import checkpoint_policies as cp

from conftest import assert_bitwise, maybe_autocast
from models import D, Block

pytestmark = pytest.mark.usefixtures("no_sessions_left", "no_hooks_left_behind")

BACKENDS = ["eager", "aot_eager"]
aten = torch.ops.aten

TICKS = [0]


@torch.library.custom_op("ckptfx_test::tick", mutates_args=())
def tick(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` that counts its runs (forward, replays, recomputations)."""
    TICKS[0] += 1
    return x.clone()


@tick.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


tick.register_autograd(lambda ctx, g: g)


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    lowering._replay_warned.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture
def no_donated_buffers() -> Iterator[None]:
    # A split backward runs a compiled block's backward with retain_graph=True (dx), which
    # AOT autograd refuses once it compiled the backward with donated buffers (README).
    # torch's own patch: monkeypatch's undo deletes the config key (pytest 9), which breaks
    # every later compile in the process.
    with torch._functorch.config.patch(donated_buffer=False):
        yield


class Counting:
    """A dynamo backend that counts compilations and the matmuls of each backward graph."""

    MATMULS = (aten.mm.default, aten.addmm.default, aten.bmm.default)

    def __init__(self, backend: str = "aot_eager") -> None:
        self.compiles = 0
        self.backward_matmuls: list[int] = []
        self.inner = backend

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.compiles += 1
        if self.inner == "eager":
            return gm.forward

        def bw(g: torch.fx.GraphModule, ex: Any) -> Any:
            self.backward_matmuls.append(sum(
                n.op == "call_function" and n.target in self.MATMULS for n in g.graph.nodes))
            return torch._functorch.aot_autograd.make_boxed_func(g.forward)

        def fw(g: torch.fx.GraphModule, ex: Any) -> Any:
            return torch._functorch.aot_autograd.make_boxed_func(g.forward)

        return aot_autograd(fw_compiler=fw, bw_compiler=bw)(gm, example_inputs)


# -- the block: two Linears, dropout, a named value; dict params ----------------------------


def make_params(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w1": torch.randn(2 * D, D, generator=g).requires_grad_(),
            "w2": torch.randn(D, 2 * D, generator=g).requires_grad_()}


def body(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    a = ckptfx.checkpoint_name(F.linear(F.layer_norm(x, (D,)), p["w1"]), "a")
    h = F.dropout(F.gelu(a), 0.25)
    b = ckptfx.checkpoint_name(F.linear(h, p["w2"]), "b")
    return x + b


def two_blocks(block: Callable[..., Any]) -> Callable[..., Any]:
    def model(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        # the second block's weights are views of the first's, not the same tensors: under
        # autocast the eager backend cannot share a weight between two blocks (lowering.py)
        q = {k: v[:] for k, v in p.items()}
        return block(q, block(p, x))
    return model


def step(fn: Callable[..., Any], p: dict[str, torch.Tensor], x: torch.Tensor,
         autocast: bool = False) -> list[torch.Tensor]:
    torch.manual_seed(7)
    with maybe_autocast(autocast):
        out = fn(p, x)
    return [out.detach(), *torch.autograd.grad(out.float().sum(), [x, p["w1"], p["w2"]])]


def x_input() -> torch.Tensor:
    return torch.randn(4, D, generator=torch.Generator().manual_seed(1)).requires_grad_()


POLICIES = {
    "none": None,
    "dots": cp.dots_saveable,
    "names": cp.save_only_these_names("a", "b"),
    "everything": cp.everything_saveable,
    "torch_fn": lambda ctx, op, *a, **k: (CheckpointPolicy.MUST_SAVE if op is aten.mm.default
                                          else CheckpointPolicy.PREFER_RECOMPUTE),
    "offload": cp.offload_dot_with_no_batch_dims(),
}


# -- remat under torch.compile ---------------------------------------------------------------


def test_compiled_remat_has_no_graph_break() -> None:
    p, x = make_params(), x_input()
    model = two_blocks(ckptfx.remat(body, policy=cp.save_from_both_policies(
        cp.dots_saveable, cp.save_only_these_names("a"))))
    explained = torch._dynamo.explain(model)(p, x)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


@pytest.mark.parametrize("backend, autocast, policy", [
    ("eager", False, "dots"), ("eager", True, "dots"), ("eager", False, "names"),
    ("aot_eager", False, "dots"), ("aot_eager", True, "dots"), ("aot_eager", False, "names"),
    ("aot_eager", True, "none"),
])
def test_compiled_remat_is_bitwise(backend: str, autocast: bool, policy: str) -> None:
    p, x = make_params(), x_input()
    expected = step(torch.compile(two_blocks(body), backend=backend), p, x, autocast)
    model = two_blocks(ckptfx.remat(body, policy=POLICIES[policy]))
    got = step(torch.compile(model, backend=backend), p, x, autocast)
    assert_bitwise(got, expected)
    if backend == "eager" or not autocast:  # aot_eager traces autocast: other bf16 roundings
        assert_bitwise(got, step(two_blocks(body), p, x, autocast))  # plain eager too


def body_in_place(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    h = F.linear(x, p["w1"])
    h.relu_()
    h = F.linear(h, p["w2"])
    h.mul_(2).sin_()
    return h.exp()


@pytest.mark.parametrize("policy", ["dots", "none", "everything"])
def test_compiled_remat_with_in_place_ops_is_bitwise(policy: str) -> None:
    # torch logs a caution about in-place ops for every context_fn under compile, and the
    # lowering passes the policy as one (README): these blocks are exact all the same.
    p, x = make_params(), x_input()
    expected = step(body_in_place, p, x)
    model = ckptfx.remat(body_in_place, policy=POLICIES[policy])
    got = step(torch.compile(model, backend="aot_eager"), p, x)
    assert_bitwise(got, expected)


def test_compiled_backward_recomputes_only_what_the_policy_drops() -> None:
    # Without remat the backward of 2 blocks x 2 Linears has 8 matmuls (dx and dw of each);
    # recomputing everything adds the first Linear of each block (gelu's backward reads its
    # output; the second Linear's output is read by nothing). A policy naming no value of
    # the block keeps nothing.
    p, x = make_params(), x_input()
    plain = Counting()
    expected = step(torch.compile(two_blocks(body), backend=plain), p, x)
    assert plain.backward_matmuls == [8]
    policies = {**POLICIES, "unused_name": cp.save_only_these_names("not_a_name")}
    wanted = {"none": 10, "dots": 8, "names": 8, "everything": 8, "torch_fn": 8,
              "offload": 8, "unused_name": 10}
    got_matmuls = {}
    for name, policy in policies.items():
        torch._dynamo.reset()
        counting = Counting()
        got = step(torch.compile(two_blocks(ckptfx.remat(body, policy=policy)),
                                 backend=counting), p, x)
        got_matmuls[name] = counting.backward_matmuls[0]
        assert_bitwise(got, expected)
    assert got_matmuls == wanted


def test_remat_with_static_and_keyword_arguments_compiles() -> None:
    @functools.partial(ckptfx.remat, policy=cp.dots_saveable, static_argnums=2)
    def block(p: dict[str, torch.Tensor], x: torch.Tensor, scale: float, *,
              debug: torch.Tensor) -> torch.Tensor:
        # ``debug`` is also a keyword of torch's checkpoint: it must reach the block
        return body(p, x) * scale + debug

    p, x = make_params(), x_input()
    bias = torch.randn(D)
    fn = lambda p, x: block(p, x, 0.5, debug=bias)  # noqa: E731
    explained = torch._dynamo.explain(fn)(p, x)
    assert explained.graph_break_count == 0, explained.break_reasons
    torch._dynamo.reset()
    plain = lambda p, x: body(p, x) * 0.5 + bias  # noqa: E731
    assert_bitwise(step(torch.compile(fn, backend="aot_eager"), p, x), step(plain, p, x))


def test_compiled_policy_answers_in_torch_terms() -> None:
    x = torch.randn(2, 2)
    ask = lambda policy, op, *a, **k: lowering.CompiledPolicy(policy)(None, op, *a, **k)  # noqa
    assert ask(cp.dots_saveable, aten.mm.default, x, x) is CheckpointPolicy.MUST_SAVE
    assert ask(cp.dots_saveable, aten.sin.default, x) is CheckpointPolicy.PREFER_RECOMPUTE
    name_op = torch.ops.ckptfx.checkpoint_name.default
    names = cp.save_only_these_names("a")
    assert ask(names, name_op, x, "a") is CheckpointPolicy.MUST_SAVE
    assert ask(names, name_op, x, "b") is CheckpointPolicy.PREFER_RECOMPUTE
    # a torch policy's own answer passes unchanged; it never sees names
    torch_fn = lambda ctx, op, *a, **k: CheckpointPolicy.PREFER_SAVE  # noqa: E731
    assert ask(torch_fn, aten.sin.default, x) is CheckpointPolicy.PREFER_SAVE
    assert ask(torch_fn, name_op, x, "a") is CheckpointPolicy.PREFER_RECOMPUTE
    # offload: kept (torch's partitioner cannot offload); CPU values need no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert (ask(cp.offload_dot_with_no_batch_dims(), aten.mm.default, x, x)
                is CheckpointPolicy.MUST_SAVE)


def test_residual_report_says_compile_keeps_offloaded_values(
        capsys: pytest.CaptureFixture) -> None:
    ckptfx.print_saved_residuals(ckptfx.remat(body, policy=cp.offload_dot_with_no_batch_dims()),
                                 make_params(), x_input())
    assert "stay in device memory when the block runs inside torch.compile" in (
        capsys.readouterr().out)


def test_checkpoint_name_is_an_identity_outside_compile_and_an_op_inside() -> None:
    x = torch.randn(3)
    assert ckptfx.checkpoint_name(x, "a") is x
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, ex: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    out = torch.compile(lambda t: ckptfx.checkpoint_name(t * 2, "a"), backend=backend)(x)
    assert torch.equal(out, x * 2)
    assert any("checkpoint_name" in str(n.target) for n in graphs[0].graph.nodes)


# -- ckptfx around compiled code --------------------------------------------------------------


class TickedBlock(Block):
    """models.Block whose input goes through ``tick`` first: its runs are counted by that op,
    which every compiled graph calls, not in Python (a Python counter in compiled code is not
    re-run by a replay)."""

    def note_run(self) -> None:
        pass  # ``tick`` counts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(tick(x))


def make_blocks(n: int = 2) -> list[TickedBlock]:
    torch.manual_seed(0)
    return [TickedBlock() for _ in range(n)]


def params_of(blocks: list[nn.Module]) -> list[torch.Tensor]:
    return [p for b in blocks for p in b.parameters()]


def module_step(blocks: list[Any], wrap: Callable[..., Any], params: list[torch.Tensor],
                autocast: bool = False) -> tuple[list[torch.Tensor], int]:
    x = x_input()
    TICKS[0] = 0
    torch.manual_seed(7)
    with maybe_autocast(autocast):
        h = x
        for b in blocks:
            h = wrap(b, h)
    gs = torch.autograd.grad(h.float().sum(), [x, *params])
    return [h.detach(), *gs], TICKS[0]


WRAPS = {
    "checkpoint": lambda b, h: ckptfx.checkpoint(b, h),
    "remat": lambda b, h: ckptfx.remat(b)(h),
    "remat_dots": lambda b, h: ckptfx.remat(b, policy=cp.dots_saveable)(h),
}


@pytest.mark.filterwarnings("ignore::ckptfx.CompiledBlockWarning")
@pytest.mark.parametrize("backend, autocast, wrap", [
    *[(b, False, w) for b in BACKENDS for w in sorted(WRAPS)],
    ("eager", True, "remat"), ("aot_eager", True, "checkpoint"),
])
def test_ckptfx_around_compiled_blocks_is_bitwise_and_never_recompiles(
        backend: str, autocast: bool, wrap: str) -> None:
    blocks = make_blocks()
    params = params_of(blocks)
    counting = Counting(backend)
    compiled = [torch.compile(b, backend=counting) for b in blocks]
    expected, _ = module_step(compiled, lambda b, h: b(h), params, autocast)
    compiles = counting.compiles
    if backend == "eager" or not autocast:  # aot_eager traces autocast: other roundings
        eager, _ = module_step(blocks, lambda b, h: b(h), params, autocast)
        assert_bitwise(eager, expected)
    for _ in range(2):
        got, ticks = module_step(compiled, WRAPS[wrap], params, autocast)
        assert_bitwise(got, expected)
        assert ticks == 4  # forward + one replay of each block (remat: checkpointed whole)
    if _IN_A_FRESH_PROCESS:
        assert counting.compiles == compiles  # the replays ran the compiled code as compiled


# Concurrent remat recordings on other threads earlier in the process can make dynamo
# recompile a compiled block in a later replay (its runtime guards fail; cause not found in
# ckptfx's state, gradients unaffected): the compile count is asserted in a fresh process.
_IN_A_FRESH_PROCESS = __name__ == "__main__"


def test_ckptfx_around_compiled_blocks_never_recompiles_in_a_fresh_process() -> None:
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(here), here, os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "never recompiled:" in proc.stdout, proc.stdout


if __name__ == "__main__":  # the fresh process of the test above
    warnings.simplefilter("ignore")
    cases = [*[(b, False, w) for b in BACKENDS for w in sorted(WRAPS)],
             ("eager", True, "remat"), ("aot_eager", True, "checkpoint")]
    for case in cases:
        test_ckptfx_around_compiled_blocks_is_bitwise_and_never_recompiles(*case)
    print(f"never recompiled: {len(cases)} cases")


def test_remat_of_a_compiled_function_warns_that_the_policy_cannot_see_inside() -> None:
    compiled = torch.compile(make_blocks(1)[0], backend="eager")
    lowering._block_warned[0] = False
    x = x_input()
    with pytest.warns(ckptfx.CompiledBlockWarning, match="remat the uncompiled function"):
        ckptfx.remat(compiled, policy=cp.dots_saveable)(x).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ckptfx.CompiledBlockWarning)
        ckptfx.remat(compiled)(x).sum().backward()  # nothing to keep: nothing to say


def test_compiled_function_inside_a_remat_block_runs_eagerly_under_the_recorder() -> None:
    blocks = make_blocks(1)
    params = params_of(blocks)
    counting = Counting("eager")
    compiled = torch.compile(blocks[0], backend=counting)

    @functools.partial(ckptfx.remat, policy=cp.dots_saveable)
    def block(x: torch.Tensor) -> torch.Tensor:
        return compiled(x) * 2

    expected, _ = module_step(blocks, lambda b, h: b(h) * 2, params)
    got, ticks = module_step([block], lambda b, h: b(h), params)
    assert_bitwise(got, expected)
    assert counting.compiles == 0  # torch does not compile under remat's dispatch mode
    assert ticks == 2  # forward, and the replay of the recording (fc1 reads the tick's copy)


@pytest.mark.parametrize("backend", BACKENDS)
def test_checkpoint_wrapper_of_a_compiled_module(backend: str) -> None:
    blocks = make_blocks()
    params = params_of(blocks)
    for b in blocks:
        b.compile(backend=backend)
    expected, _ = module_step(blocks, lambda b, h: b(h), params)
    for b in blocks:
        ckptfx.checkpoint_wrapper(b)
    for _ in range(2):
        got, ticks = module_step(blocks, lambda b, h: b(h), params)
        assert_bitwise(got, expected)
        assert ticks == 4


def test_whole_model_compiled_around_checkpoint_wrapper_is_bitwise() -> None:
    blocks = make_blocks()
    params = params_of(blocks)
    expected, _ = module_step([torch.compile(nn.Sequential(*blocks), backend="aot_eager")],
                              lambda b, h: b(h), params)
    torch._dynamo.reset()
    for b in blocks:
        ckptfx.checkpoint_wrapper(b)
    model = torch.compile(nn.Sequential(*blocks), backend="aot_eager")
    got, ticks = module_step([model], lambda b, h: b(h), params)
    assert_bitwise(got, expected)
    assert ticks == 4  # torch's compiled checkpoint: forward + one recomputation per block


# -- sessions and the split backward with compiled blocks -----------------------------------


def session_step(compiled: list[Any], params: list[torch.Tensor], sid: Any,
                 prefire: bool) -> tuple[list[torch.Tensor], int]:
    x = x_input()
    TICKS[0] = 0
    torch.manual_seed(7)
    with ckptfx.recompute_handle_collector_ctx() as handles:
        h = x
        for b in compiled:
            h = ckptfx.checkpoint(b, h)
    assert len(handles) == len(compiled)
    g = torch.ones_like(h)
    try:
        if prefire:
            for handle in handles:
                ckptfx.recompute_handle(handle, sid)
        with ckptfx.recompute_session_ctx(sid, retain_on_unpack=True):
            dx, = torch.autograd.grad(h, [x], g, retain_graph=True)
        with ckptfx.recompute_session_ctx(sid, retain_on_unpack=True):
            dw1 = torch.autograd.grad(h, params[:2], g, retain_graph=True)
        with ckptfx.recompute_session_ctx(sid, retain_on_unpack=False):
            dw2 = torch.autograd.grad(h, params[2:], g)
    finally:
        ckptfx.clear_recompute_session(sid)
    return [h.detach(), dx, *dw1, *dw2], TICKS[0]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("prefire", [True, False], ids=["prefire", "lazy"])
def test_session_replays_each_compiled_block_once(backend: str, prefire: bool,
                                                  no_donated_buffers: None) -> None:
    blocks = make_blocks()
    params = params_of(blocks)
    compiled = [torch.compile(b, backend=backend) for b in blocks]
    expected, _ = module_step(compiled, lambda b, h: b(h), params)
    for mb in range(2):
        got, ticks = session_step(compiled, params, ("mb", mb), prefire)
        assert_bitwise(got, expected)
        assert ticks == 4  # forward + one replay per block, for dx and two dw calls


@pytest.mark.parametrize("backend", BACKENDS)
def test_vjp_split_replays_each_compiled_block_once(backend: str,
                                                    no_donated_buffers: None) -> None:
    blocks = make_blocks()
    params = params_of(blocks)
    compiled = [torch.compile(b, backend=backend) for b in blocks]
    expected, _ = module_step(compiled, lambda b, h: b(h), params)

    def stage(x: torch.Tensor) -> torch.Tensor:
        for b in compiled:
            x = ckptfx.checkpoint(b, x)
        return x

    for _ in range(2):
        for p in params:
            p.grad = None
        TICKS[0] = 0
        torch.manual_seed(7)
        with warnings.catch_warnings():
            warnings.simplefilter("error", ckptfx.CompiledReplayWarning)
            out, dx_fn, dw_fn = ckptfx.vjp_split(stage, x_input(), params=params)
            dx = dx_fn(torch.ones_like(out))
            dw_fn()
        assert TICKS[0] == 4
        assert_bitwise([out, dx, *[p.grad for p in params]], expected)


def test_split_of_a_block_whose_backward_donated_buffers_says_what_to_do() -> None:
    blocks = make_blocks(1)
    params = params_of(blocks)
    compiled = torch.compile(blocks[0], backend="aot_eager")
    module_step([compiled], lambda b, h: b(h), params)  # first backward: retain_graph=False
    out, dx_fn, dw_fn = ckptfx.vjp_split(lambda x: ckptfx.checkpoint(compiled, x), x_input(),
                                         params=params)
    with pytest.raises(ckptfx.CheckpointError, match="donated_buffer = False"):
        dx_fn(torch.ones_like(out))


def test_whole_model_compiled_around_checkpoints_warns_under_sessions() -> None:
    blocks = make_blocks()
    params = params_of(blocks)

    def whole(x: torch.Tensor) -> torch.Tensor:
        for b in blocks:
            x = ckptfx.checkpoint(b, x)
        return x

    model = torch.compile(whole, backend="aot_eager")
    with pytest.warns(ckptfx.CompiledReplayWarning, match="compile each block"):
        with ckptfx.recompute_handle_collector_ctx() as handles:
            out = model(x_input())
    assert handles == []  # nothing to prefire: the checkpoints are inside the graph
    TICKS[0] = 0
    with pytest.warns(ckptfx.CompiledReplayWarning, match="one autograd node"):
        out, dx_fn, dw_fn = ckptfx.vjp_split(model, x_input(), params=params)
    dx_fn(torch.ones_like(out))
    dw_fn()
    assert TICKS[0] == 4  # the forward and one recompute, in dx: dw only hands out


def test_remat_lowered_inside_a_collector_warns_once() -> None:
    block = ckptfx.remat(body, policy=cp.dots_saveable)
    model = torch.compile(two_blocks(block), backend="eager")
    p, x = make_params(), x_input()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ckptfx.recompute_handle_collector_ctx():
            model(p, x)
        torch._dynamo.reset()
        with ckptfx.recompute_handle_collector_ctx():
            torch.compile(two_blocks(block), backend="eager")(p, x)
    ours = [w for w in caught if issubclass(w.category, ckptfx.CompiledReplayWarning)]
    assert len(ours) == 1 and "ckptfx.remat" in str(ours[0].message)
