"""The torch.func path bitwise against the same transform of the plain function: grad, vjp,
jvp, jacrev, jacfwd, hessian, vmap and vmap(grad) over blocks with a weight shared within
and across calls, a tensor passed twice, ``w * w`` (two edges of one node), dropout on a
non-contiguous input, CPU bf16 autocast (sdpa, matmul), integer outputs and integer
arguments. Where the plain function itself fails under a transform, the remat'd one must
fail with the same exception type; nothing is skipped."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vjp, vmap

import ckptfx
from conftest import assert_tree_bitwise
from ckptfx import checkpoint_policies as cp

pytestmark = pytest.mark.usefixtures("no_hooks_left_behind")


# Each case: a block of (w, x) returning a tuple of outputs, how it is called inside the
# function the transform sees, and the inputs (x may be integer: then only w is differentiated).

def _shared(w: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (torch.tanh(x + w) * 1.5 + w,)


def _square(w: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (torch.sin(x * w) + w * w - w,)


def _dropout_t(w: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    h = torch.tanh(x @ w)
    return (F.dropout(h.t(), 0.5, True) * h.t() + w[:, :1],)


def _sdpa(w: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    q = x @ w
    return (F.scaled_dot_product_attention(q, q * 0.5, q) @ w.t(),)


def _int_out(w: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    h = torch.sin(x @ w)
    return h, h.argmax(-1)


def _int_arg(w: torch.Tensor, i: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (w[i].sin() * w[i].cos(),)


def _twice(r: Callable[..., Any]) -> Callable[..., Any]:
    return lambda w, x: r(w, r(w, x)[0])


def _same_tensor_twice(r: Callable[..., Any]) -> Callable[..., Any]:
    return lambda w, x: r(w, r(w, w)[0] + x)


def _once(r: Callable[..., Any]) -> Callable[..., Any]:
    return lambda w, x: r(w, x)


CASES: dict[str, tuple[Callable[..., Any], Callable[..., Any], Callable[[int], tuple]]] = {
    "shared-within-and-across": (_shared, _twice, lambda s: (torch.randn(5), torch.randn(5))),
    "same-tensor-twice": (_shared, _same_tensor_twice, lambda s: (torch.randn(5), torch.randn(5))),
    "w-times-w": (_square, _twice, lambda s: (torch.randn(5), torch.randn(5))),
    "dropout-noncontiguous": (_dropout_t, _once,
                              lambda s: (torch.randn(4, 4) / 2, torch.randn(3, 4))),
    "int-output": (_int_out, _once, lambda s: (torch.randn(4, 3), torch.randn(2, 4))),
    "int-argument": (_int_arg, _once, lambda s: (torch.randn(5, 3), torch.tensor([0, 3, 3]))),
}
AUTOCAST_CASES = {
    "sdpa-bf16": (_sdpa, _once, lambda s: (torch.randn(4, 4) / 2, torch.randn(3, 5, 4))),
    "mm-bf16": (_dropout_t, _once, lambda s: (torch.randn(4, 4) / 2, torch.randn(3, 4))),
}


def _loss(f: Callable[..., Any]) -> Callable[..., torch.Tensor]:
    def loss(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32)
        for k, o in enumerate(f(w, x)):
            total = total + (o.float() * (k + 1.5)).sum()
        return total
    return loss


def _argnums(x: torch.Tensor) -> Any:
    return (0, 1) if x.is_floating_point() else 0


def _tangents(w: torch.Tensor, x: torch.Tensor) -> tuple[Any, tuple]:
    if x.is_floating_point():
        return (lambda f: f), (torch.randn_like(w), torch.randn_like(x))
    return (lambda f: lambda w: f(w, x)), (torch.randn_like(w),)


TRANSFORMS: dict[str, Callable[[Callable[..., Any], torch.Tensor, torch.Tensor], Any]] = {
    "grad": lambda f, w, x: grad(_loss(f), argnums=_argnums(x))(w, x),
    "vjp": lambda f, w, x: (lambda out, fn: (out, fn(tuple(
        torch.ones_like(o) * 0.75 if o.is_floating_point() else None for o in out))))(
        *vjp(lambda w: tuple(o for o in f(w, x) if o.is_floating_point()), w)),
    "jvp": lambda f, w, x: (lambda wrap, ts: jvp(wrap(f), (w, x)[: len(ts)], ts))(
        *_tangents(w, x)),
    "jacrev": lambda f, w, x: jacrev(_loss(f), argnums=_argnums(x))(w, x),
    "jacfwd": lambda f, w, x: jacfwd(_loss(f), argnums=_argnums(x))(w, x),
    "hessian": lambda f, w, x: hessian(_loss(f), argnums=_argnums(x))(w, x),
    "vmap": lambda f, w, x: vmap(f, in_dims=(None, 0), randomness="different")(
        w, torch.stack([x, x.flip(0)])),
    "vmap-grad": lambda f, w, x: vmap(grad(_loss(f)), in_dims=(None, 0),
                                      randomness="same")(w, torch.stack([x, x.flip(0)])),
}


def _run(transform: str, f: Callable[..., Any], w: torch.Tensor, x: torch.Tensor,
         seed: int, autocast: bool) -> Any:
    torch.manual_seed(seed)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        try:
            return ("ok", TRANSFORMS[transform](f, w, x), torch.rand(2))
        except Exception as err:  # noqa: BLE001 - compared with the plain function's
            return ("raised", type(err), str(err))


def _compare(case: tuple, transform: str, policy: Any, seed: int, autocast: bool) -> None:
    block, call, make = case
    torch.manual_seed(1000 + seed)
    w, x = make(seed)
    expected = _run(transform, call(block), w, x, seed, autocast)
    actual = _run(transform, call(ckptfx.remat(block, policy=policy)), w, x, seed, autocast)
    if expected[0] == "raised":  # the plain function fails this transform: so must remat
        assert actual[0] == "raised" and issubclass(actual[1], expected[1]), (expected, actual)
        return
    assert actual[0] == "ok", actual
    assert_tree_bitwise(actual[1:], expected[1:])  # values and the caller's RNG afterwards


@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("case", list(CASES))
def test_func_path_bitwise(case: str, transform: str) -> None:
    seeds = range(50) if transform in ("grad", "vjp") and "dropout" not in case else range(3)
    for seed in seeds:
        _compare(CASES[case], transform, None, seed, False)


@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("case", list(AUTOCAST_CASES))
def test_func_path_bitwise_under_bf16_autocast(case: str, transform: str) -> None:
    for seed in range(3):
        _compare(AUTOCAST_CASES[case], transform, None, seed, True)


@pytest.mark.parametrize("transform", ["grad", "vjp", "jvp", "hessian", "vmap-grad"])
@pytest.mark.parametrize("case", ["shared-within-and-across", "w-times-w", "int-output"])
@pytest.mark.parametrize("policy", [cp.dots_saveable, cp.everything_saveable],
                         ids=["dots", "everything"])
def test_func_path_bitwise_with_kept_values(case: str, transform: str, policy: Any) -> None:
    for seed in range(3):
        _compare(CASES[case], transform, policy, seed, False)


def test_nested_calls_sharing_a_weight_sum_its_gradients_under_grad() -> None:
    """``r(w, r(w, x))`` under torch.func.grad: each use of w inside a call hands its own
    gradient to the outer engine, which sums them as plain autograd does (was 34/50 seeds)."""
    f = lambda w, x: torch.tanh(x + w) * 1.5 + w  # noqa: E731
    r = ckptfx.remat(f)
    wrong = 0
    for seed in range(50):
        torch.manual_seed(seed)
        w, x = torch.randn(5), torch.randn(5)
        a = grad(lambda w, x: r(w, r(w, x)).sum())(w, x)
        e = grad(lambda w, x: f(w, f(w, x)).sum())(w, x)
        wrong += not torch.equal(a, e)
    assert wrong == 0


def test_jvp_primal_and_tangent_come_from_one_computation() -> None:
    """jvp's primal and tangent come from one computation, the plain function's."""
    f = lambda h: F.dropout(h.t(), 0.5, True) * h.t()  # noqa: E731
    h, t = torch.randn(4, 6), torch.randn(4, 6)
    torch.manual_seed(0)
    expected = jvp(f, (h,), (t,))
    torch.manual_seed(0)
    assert_tree_bitwise(jvp(ckptfx.remat(f), (h,), (t,)), expected)
    q = torch.randn(3, 5, 8)
    g = lambda q: F.scaled_dot_product_attention(q, q * 0.5, q)  # noqa: E731
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert_tree_bitwise(jvp(ckptfx.remat(g), (q,), (q,)), jvp(g, (q,), (q,)))


def test_integer_outputs_and_arguments_are_non_differentiable() -> None:
    """Integer outputs and arguments are non-differentiable, under every transform."""
    x, idx = torch.randn(3, 4), torch.tensor([0, 2])
    f = lambda x: (x.sin(), x.argmax(-1))  # noqa: E731
    assert_tree_bitwise(jvp(ckptfx.remat(f), (x,), (x,)), jvp(f, (x,), (x,)))
    g = lambda x, i: x[i].sin()  # noqa: E731
    r = ckptfx.remat(g)
    for t in (lambda f: jvp(lambda x: f(x, idx), (x,), (x,)),
              lambda f: jacfwd(lambda x: f(x, idx))(x),
              lambda f: hessian(lambda x: f(x, idx).sum())(x)):
        assert_tree_bitwise(t(r), t(g))


def test_grad_replays_once_per_backward_with_per_use_gradients() -> None:
    """The per-use gradients come from one replay per call per backward."""
    calls = [0]

    def block(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        return torch.tanh(x + w) * 1.5 + w

    r = ckptfx.remat(block)
    w, x = torch.randn(5), torch.randn(5)
    grad(lambda w, x: r(w, r(w, x)).sum())(w, x)
    assert calls[0] == 4  # two forwards, two replays


# Issue 36: a block applied twice whose aux output the first call's caller ignores, on a
# non-contiguous layout (a transpose before the elementwise ops), with an in-place op.
# CPU kernels such as gelu_backward take another vectorization path when their operands'
# layouts differ, so a gradient that reaches the replay with another layout than the plain
# function's (the same values) changes the last bits downstream.

def _aux_block(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = x.transpose(1, 2).reshape(2, 24).view(2, 8, 3).transpose(1, 2)
    h = F.gelu(h)
    aux = ckptfx.checkpoint_name(h, "aux")
    h = F.gelu(h)
    t = h + 0.5
    t.relu_()
    return F.log_softmax(t, -1), aux


def _aux_loss(f: Callable[..., Any], c1: torch.Tensor, c2: torch.Tensor
              ) -> Callable[[torch.Tensor], torch.Tensor]:
    def loss(x: torch.Tensor) -> torch.Tensor:
        h, _ = f(x)  # the first call's aux output: nothing reads it
        h2, aux2 = f(h)
        return (h2 * c1).sum() + (aux2 * c2).sum()
    return loss


def _sum_loss(f: Callable[..., Any], c1: torch.Tensor, c2: torch.Tensor
              ) -> Callable[[torch.Tensor], torch.Tensor]:
    def loss(x: torch.Tensor) -> torch.Tensor:
        h, aux = f(x)  # .sum(): the block's outputs receive expanded cotangents
        return f(h)[1].sum() + h.sum() + (aux * c1).sum()
    return loss


ALL_POLICIES = {
    "default": None,
    "nothing": cp.nothing_saveable,
    "dots": cp.dots_saveable,
    "dots-no-batch": cp.dots_with_no_batch_dims_saveable,
    "checkpoint-dots": cp.checkpoint_dots,
    "everything": cp.everything_saveable,
    "budget-0": cp.memory_budget(0.0),
    "budget-half": cp.memory_budget(0.5),
    "budget-1": cp.memory_budget(1.0),
    "names": cp.save_only_these_names("aux"),
    "all-names-but": cp.save_any_names_but_these("aux"),
    "both": cp.save_from_both_policies(cp.dots_saveable, cp.save_only_these_names("aux")),
    "offload-names": cp.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=["aux"], offload_dst="cpu"),
    "offload-dots": cp.offload_dot_with_no_batch_dims(offload_dst="cpu"),
}


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("policy", list(ALL_POLICIES.values()), ids=list(ALL_POLICIES))
def test_unread_output_and_expanded_cotangent_keep_gradients_bitwise(policy: Any,
                                                                     autocast: bool) -> None:
    """An output nothing reads gets no gradient, not a materialized zero (whose contiguous
    layout the replay's sum took on), and a cotangent reaches the replay as the outer engine
    holds it, not as ``1.0 * g`` (dense where ``out.sum()`` hands an expanded one): under
    grad, vmap(grad) and jacrev, every policy, fp32 and CPU bf16 autocast (was last-bit
    different under every policy)."""
    gen = torch.Generator().manual_seed(0)
    c1, c2, x = (torch.randn(2, 3, 8, generator=gen) for _ in range(3))
    r = ckptfx.remat(_aux_block, policy=policy)
    for make in (_aux_loss, _sum_loss):
        for transform in (grad, lambda f: vmap(grad(f)), jacrev):
            inputs = torch.stack([x, x * 2]) if transform not in (grad, jacrev) else x
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                expected = transform(make(_aux_block, c1, c2))(inputs)
                actual = transform(make(r, c1, c2))(inputs)
            assert_tree_bitwise(actual, expected)
