"""saved_residuals / print_saved_residuals: what remat keeps, checked against what
jax.checkpoint keeps for the same block and policy (arguments, matmul outputs, named values).

The expected sets are derived from JAX's semantics (jax is not installed here): a policy only
permits saving; JAX keeps an allowed value when the backward or the recomputation reads it,
and recomputes everything else from the arguments. Elementwise residuals may differ from JAX
(torch's derivative formulas save other things), so only dots, names and arguments are
compared, except for the plain function, which is compared with autograd's own saves.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import pytest
import torch

import ckptfx
from ckptfx import checkpoint_policies as cp
from ckptfx.policies import checkpoint_name

pytestmark = pytest.mark.usefixtures("no_hooks_left_behind")


def mlp(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(x @ p["w1"])  # L_H
    h = ckptfx.checkpoint_name(h, "h")  # L_NAME
    return torch.relu(h @ p["w2"])  # L_OUT


def attention(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    q = x @ p["wq"]  # L_Q
    k = x @ p["wk"]  # L_K
    v = x @ p["wv"]  # L_V
    s = torch.matmul(q, k.transpose(-1, -2))  # L_S (batch dims)
    a = ckptfx.checkpoint_name(torch.softmax(s, -1), "attn")  # L_A
    o = torch.matmul(a, v)  # L_O (batch dims)
    return torch.tanh(o @ p["wo"])  # L_Y


def site(fn: Any, tag: str) -> str:
    """``file:line (fn)`` of the line of ``fn`` marked with ``# tag``."""
    lines, first = inspect.getsourcelines(fn)
    (n,) = [i for i, line in enumerate(lines) if line.rstrip().endswith(f"# {tag}")
            or f"# {tag} " in line]
    return f"{os.path.basename(inspect.getsourcefile(fn))}:{first + n} ({fn.__name__})"


def mlp_args() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    return {"w1": torch.randn(6, 8), "w2": torch.randn(8, 5)}, torch.randn(4, 6)


def attention_args() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    return {k: torch.randn(8, 8) for k in ("wq", "wk", "wv", "wo")}, torch.randn(2, 5, 8)


def mm(fn: Any, tag: str, op: str = "mm") -> str:
    return f"output of aten.{op} at {site(fn, tag)}"


def named(fn: Any, name: str, tag: str, suffix: str = "") -> str:
    return f"named {name!r} at {site(fn, tag)}{suffix}"


MLP_ARGS = {"from the argument p['w1']", "from the argument p['w2']", "from the argument x"}
ATTN_ARGS = {f"from the argument p['{k}']" for k in ("wq", "wk", "wv", "wo")} | {
    "from the argument x"}

# policy -> the non-argument residuals jax.checkpoint keeps for the block.
MLP_EXPECTED = {
    "none": lambda: set(),
    "nothing": lambda: set(),
    # tanh and relu are recomputed from the kept matmul outputs
    "dots": lambda: {mm(mlp, "L_H"), mm(mlp, "L_OUT")},
    "dots_no_batch": lambda: {mm(mlp, "L_H"), mm(mlp, "L_OUT")},
    "only_h": lambda: {named(mlp, "h", "L_NAME")},
    "any_but_h": lambda: set(),
    "offload_h": lambda: {named(mlp, "h", "L_NAME", " (offloaded to host)")},
}
ATTN_EXPECTED = {
    "none": lambda: set(),
    "nothing": lambda: set(),
    "dots": lambda: {mm(attention, t) for t in ("L_Q", "L_K", "L_V", "L_Y")}
    | {mm(attention, t, "bmm") for t in ("L_S", "L_O")},
    # products with batch dimensions (q k^T, a v) are recomputed from the kept q, k, v
    "dots_no_batch": lambda: {mm(attention, t) for t in ("L_Q", "L_K", "L_V", "L_Y")},
    "only_attn": lambda: {named(attention, "attn", "L_A")},
    "any_but_h": lambda: {named(attention, "attn", "L_A")},
    "offload_dots": lambda: {mm(attention, t) + " (offloaded to host)"
                             for t in ("L_Q", "L_K", "L_V", "L_Y")},
}
POLICIES = {
    "none": None,
    "nothing": cp.nothing_saveable,
    "dots": cp.dots_saveable,
    "dots_no_batch": cp.dots_with_no_batch_dims_saveable,
    "only_h": cp.save_only_these_names("h"),
    "only_attn": cp.save_only_these_names("attn"),
    "any_but_h": cp.save_any_names_but_these("h"),
    "offload_h": cp.save_and_offload_only_these_names(
        names_which_can_be_saved=(), names_which_can_be_offloaded=("h",)),
    "offload_dots": cp.offload_dot_with_no_batch_dims(),
}


@pytest.mark.parametrize("policy", list(MLP_EXPECTED))
def test_mlp_residuals_match_jax(policy: str) -> None:
    residuals = ckptfx.saved_residuals(ckptfx.remat(mlp, policy=POLICIES[policy]), *mlp_args())
    assert {r.source for r in residuals if r.kind == "argument"} == MLP_ARGS
    assert {r.source for r in residuals if r.kind != "argument"} == MLP_EXPECTED[policy]()
    assert len(residuals) == len({r.source for r in residuals})


@pytest.mark.filterwarnings("ignore::ckptfx.UnusedNameWarning")  # any_but_h: no 'h' here
@pytest.mark.parametrize("policy", list(ATTN_EXPECTED))
def test_attention_residuals_match_jax(policy: str) -> None:
    fn = ckptfx.remat(attention, policy=POLICIES[policy])
    residuals = ckptfx.saved_residuals(fn, *attention_args())
    assert {r.source for r in residuals if r.kind == "argument"} == ATTN_ARGS
    kept = [r.source for r in residuals if r.kind != "argument"]
    assert sorted(kept) == sorted(ATTN_EXPECTED[policy]())


def test_residual_fields() -> None:
    p, x = attention_args()
    residuals = ckptfx.saved_residuals(ckptfx.remat(attention, policy=cp.dots_saveable), p, x)
    by_source = {r.source: r for r in residuals}
    s = by_source[mm(attention, "L_S", "bmm")]
    assert (s.shape, s.dtype, s.device, s.nbytes, s.kind, s.name) == (
        (2, 5, 5), torch.float32, torch.device("cpu"), 2 * 5 * 5 * 4, "saved", None)
    assert by_source["from the argument x"].shape == (2, 5, 8)
    named_attn = ckptfx.saved_residuals(
        ckptfx.remat(attention, policy=cp.save_only_these_names("attn")), p, x)
    (attn,) = [r for r in named_attn if r.kind == "saved"]
    assert attn.name == "attn" and attn.shape == (2, 5, 5)
    assert str(attn) == f"f32[2,5,5] {named(attention, 'attn', 'L_A')}"


def test_offloaded_residual_kind() -> None:
    residuals = ckptfx.saved_residuals(
        ckptfx.remat(mlp, policy=POLICIES["offload_h"]), *mlp_args())
    (h,) = [r for r in residuals if r.kind != "argument"]
    assert h.kind == "offloaded" and h.name == "h" and h.device.type == "cpu"


def test_print_saved_residuals_one_line_each_and_total(capsys: pytest.CaptureFixture) -> None:
    fn = ckptfx.remat(mlp, policy=cp.dots_saveable)
    p, x = mlp_args()
    residuals = ckptfx.saved_residuals(fn, p, x)
    ckptfx.print_saved_residuals(fn, p, x)
    lines = capsys.readouterr().out.splitlines()
    assert lines[:-1] == [str(r) for r in residuals]
    total = sum(r.nbytes for r in residuals)
    assert lines[-1].startswith(f"total: {len(residuals)} residuals")
    assert f"{total / 1024:.1f} KiB" in lines[-1] or f"{total} B" in lines[-1]
    assert f"f32[4,8] {mm(mlp, 'L_H')}" in lines


def test_print_saved_residuals_total_counts_a_storage_once(capsys: pytest.CaptureFixture
                                                           ) -> None:
    """Views of one kept value are listed each (each op's backward reads its own), but the
    total is memory: their storage counts once, and agrees with the byte count the
    memory-budget planner gives for the same keep-set (dots_saveable here)."""
    torch.manual_seed(0)
    w = torch.randn(64, 192, requires_grad=True)

    def qkv(x: torch.Tensor) -> torch.Tensor:
        q, k, v = (x @ w).chunk(3, -1)
        return (q.sin() * k.cos() * v.tanh()).sum()

    x = torch.randn(32, 64, requires_grad=True)
    fn = ckptfx.remat(qkv, policy=cp.dots_saveable)
    residuals = ckptfx.saved_residuals(fn, x)
    ckptfx.print_saved_residuals(fn, x)
    lines = capsys.readouterr().out.splitlines()
    kept = [r for r in residuals if r.kind != "argument"]
    assert len(kept) > 1 and sum(r.nbytes for r in kept) > 32 * 192 * 4  # views of one
    mm_line = 1 + next(i for i, r in enumerate(residuals) if r.kind != "argument")
    assert all(line.endswith(f"(same storage as line {mm_line})")
               for line in lines[mm_line:-1])
    # w (48 KiB) and x (8 KiB) are arguments; x @ w is 24 KiB, once
    assert lines[-1] == (f"total: {len(residuals)} residuals in 3 storages, 80.0 KiB "
                         "(24.0 KiB beyond the arguments)")
    planned = ckptfx.remat(qkv, policy=cp.memory_budget(0.5))
    planned(x)
    ckptfx.print_saved_residuals(planned, x)
    out = capsys.readouterr().out
    assert "dots_saveable keeps 24.0 KiB" in out and out.rstrip().endswith(
        "(24.0 KiB beyond the arguments)")


def test_print_saved_residuals_total_edge_cases(capsys: pytest.CaptureFixture) -> None:
    """An argument that slices a big tensor counts what the block reads of it, not the big
    storage; zero-size arguments are separate storages (all sit at address 0); on the CPU
    an offloaded residual is kept as it is (host memory already), so it shares the storage
    of a kept view of the same value."""
    big = torch.randn(512, 512)
    ckptfx.print_saved_residuals(lambda x: x.sin(), big[:2, :4])
    assert capsys.readouterr().out.splitlines()[-1] == (
        "total: 1 residual, 32 B (0 B beyond the arguments)")

    ckptfx.print_saved_residuals(lambda a, b: (a.sin().sum() + b.cos().sum()),
                                 torch.randn(0, 4), torch.randn(0, 5))
    out = capsys.readouterr().out
    assert "same storage" not in out and "storages" not in out

    w = torch.randn(64, 192, requires_grad=True)

    def qkv(x: torch.Tensor) -> torch.Tensor:
        q, k, v = (x @ w).chunk(3, -1)
        q, k = checkpoint_name(q, "q"), checkpoint_name(k, "k")
        return (q.sin() * k.cos() * v.tanh()).sum()

    policy = cp.save_and_offload_only_these_names(
        names_which_can_be_saved=["q"], names_which_can_be_offloaded=["k"], offload_dst="cpu")
    ckptfx.print_saved_residuals(ckptfx.remat(qkv, policy=policy),
                                 torch.randn(32, 64, requires_grad=True))
    lines = capsys.readouterr().out.splitlines()
    (offloaded,) = [line for line in lines if "offloaded" in line and "named 'k'" in line]
    assert "same storage as line" in offloaded


def test_print_saved_residuals_says_residual_for_one(capsys: pytest.CaptureFixture) -> None:
    ckptfx.print_saved_residuals(lambda x: x.sin(), torch.randn(3))
    assert capsys.readouterr().out.splitlines()[-1] == (
        "total: 1 residual, 12 B (0 B beyond the arguments)")


@pytest.mark.parametrize("block,make", [(mlp, mlp_args), (attention, attention_args)])
def test_plain_function_reports_what_autograd_keeps(block: Any, make: Any) -> None:
    p, x = make()
    p = {k: v.requires_grad_() for k, v in p.items()}
    x.requires_grad_()
    packed: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        block(p, x)
    unique = {(t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
               tuple(t.stride())): t for t in packed}
    arg_storages = {a.untyped_storage().data_ptr() for a in (*p.values(), x)}
    residuals = ckptfx.saved_residuals(block, p, x)
    assert sorted((r.shape, r.dtype) for r in residuals if r.kind != "argument") == sorted(
        (tuple(t.shape), t.dtype) for t in unique.values()
        if t.untyped_storage().data_ptr() not in arg_storages)
    assert {r.source for r in residuals if r.kind == "argument"} >= {"from the argument x"}


def test_everything_saveable_keeps_what_the_plain_function_keeps() -> None:
    p, x = attention_args()
    plain = ckptfx.saved_residuals(attention, p, x)
    every = ckptfx.saved_residuals(ckptfx.remat(attention, policy=cp.everything_saveable), p, x)
    assert [(r.shape, r.kind, r.source) for r in plain] == [
        (r.shape, r.kind, r.source) for r in every]


def test_report_warns_about_policy_names_that_match_nothing() -> None:
    """The report is where a user checks a name-based policy: a name that tags nothing is
    said there, even when the block already ran (and warned) before."""
    w = torch.randn(4, 4)

    def block(x: torch.Tensor) -> torch.Tensor:
        return ckptfx.checkpoint_name(torch.tanh(x @ w), "h").sin()

    rematted = ckptfx.remat(block, policy=ckptfx.checkpoint_policies.save_only_these_names(
        "attn", "h"))
    x = torch.randn(3, 4, requires_grad=True)
    with pytest.warns(ckptfx.UnusedNameWarning):
        rematted(x)
    for report in (ckptfx.saved_residuals, ckptfx.print_saved_residuals):
        with pytest.warns(ckptfx.UnusedNameWarning, match=r"names \['attn'\]"):
            report(rematted, x)


def test_keyword_arguments_bound_in_a_partial_are_named_as_arguments() -> None:
    """Hugging Face's layers checkpoint ``functools.partial(forward, self, **kwargs)``: a
    tensor passed by keyword (the rotary ``position_embeddings``) is an argument, not "a
    tensor from outside"."""
    import functools

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, *, position_embeddings: tuple) -> torch.Tensor:
            cos, sin = position_embeddings
            return self.proj(x) * cos + x * sin

        def __call__(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            return ckptfx.checkpoint(functools.partial(type(self).forward, self, **kwargs), x,
                                     policy=ckptfx.checkpoint_policies.dots_saveable)

    layer = Layer()
    pe = (torch.randn(2, 4), torch.randn(2, 4))
    residuals = ckptfx.saved_residuals(layer, torch.randn(2, 4, requires_grad=True),
                                       position_embeddings=pe)
    sources = {r.source for r in residuals if r.kind == "argument"}
    assert {"from the argument position_embeddings[0]",
            "from the argument position_embeddings[1]"} <= sources
    assert not any("a global?" in s for s in sources)


@pytest.mark.parametrize("policy", ["dots", "budget"])
def test_a_report_keeps_none_of_its_calls_alive(policy: str) -> None:
    """The recorders of a report's calls (and the graphs they made) are freed with it: the
    report list held the graph, whose saved-tensor hooks held the recorders."""
    import gc
    import weakref

    from ckptfx.recording.tracer import Tracer

    made: list[Any] = []
    init = Tracer.__init__

    def spy(self: Tracer, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        made.append(weakref.ref(self))

    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        q, k, v = (x @ w).chunk(3, dim=-1)
        return (q * k * v).sum(-1, keepdim=True) * x

    chosen = cp.dots_saveable if policy == "dots" else cp.memory_budget(0.5)
    Tracer.__init__ = spy  # type: ignore[method-assign]
    try:
        ckptfx.saved_residuals(ckptfx.remat(block, policy=chosen), torch.randn(4, 8),
                               torch.randn(8, 24, requires_grad=True))
    finally:
        Tracer.__init__ = init  # type: ignore[method-assign]
    gc.collect()
    assert made and all(r() is None for r in made)
