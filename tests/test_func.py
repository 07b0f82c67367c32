"""``ckptfx.remat`` under torch.func: grad, grad_and_value, vjp, jacrev, jacfwd, hessian, vmap,
functional_call; the torch.func path against the same transform of the un-remat'd function,
bitwise, with a replay counter inside the block; transform detection; the errors."""

from __future__ import annotations

import gc
import weakref
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, grad_and_value, hessian, jacfwd, jacrev, vjp, vmap
from torch.utils._python_dispatch import TorchDispatchMode

import ckptfx
import ckptfx.func_path.call as cfunc
from ckptfx import checkpoint_policies as cp
from conftest import Counted, assert_tree_bitwise, maybe_autocast

pytestmark = pytest.mark.usefixtures("no_hooks_left_behind")

POLICIES = {"none": None, "nothing": cp.nothing_saveable, "dots": cp.dots_saveable,
            "everything": cp.everything_saveable}


# -- helpers ---------------------------------------------------------------------------------


@pytest.fixture
def blocks(monkeypatch: pytest.MonkeyPatch) -> list[cfunc.FuncBlock]:
    """Every ``FuncBlock`` (one remat call on the torch.func path) made during the test."""
    made: list[cfunc.FuncBlock] = []
    init = cfunc.FuncBlock.__init__

    def recording_init(self: cfunc.FuncBlock, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(cfunc.FuncBlock, "__init__", recording_init)
    return made


class MatmulCounter(TorchDispatchMode):
    """Counts the matrix products (mm, addmm, bmm) that actually run."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in ("mm", "addmm", "bmm"):
            self.n += 1
        return func(*args, **(kwargs or {}))


def mlp(p: dict[str, torch.Tensor], x: torch.Tensor, drop: float = 0.0) -> torch.Tensor:
    h = torch.tanh(x @ p["w1"] + p["b1"])
    h = F.dropout(h, drop, drop > 0)
    return F.gelu(h @ p["w2"])


def mlp_params(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w1": torch.randn(6, 8, generator=g), "b1": torch.randn(8, generator=g),
            "w2": torch.randn(8, 6, generator=g)}


def loss_of(block: Callable[..., Any], drop: float = 0.0) -> Callable[..., torch.Tensor]:
    weights = torch.linspace(-1, 1, 6)
    return lambda p, x: (block(p, x, drop).float() * weights).sum()


def remat_mlp(policy: Any = None) -> tuple[Counted, Callable[..., Any]]:
    counted = Counted(mlp)
    return counted, ckptfx.remat(counted, policy=policy, static_argnums=2)


# -- each transform against the un-remat'd function ------------------------------------------

TRANSFORMS: dict[str, Callable[[Callable[..., Any], Any, torch.Tensor], Any]] = {
    "grad": lambda f, p, x: grad(f)(p, x),
    "grad_and_value": lambda f, p, x: grad_and_value(f, argnums=(0, 1))(p, x),
    "vjp": lambda f, p, x: vjp(f, p, x)[1](torch.tensor(1.5)),
    "jacrev": lambda f, p, x: jacrev(f, argnums=(0, 1))(p, x),
    "jacfwd": lambda f, p, x: jacfwd(f, argnums=(0, 1))(p, x),
}


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_transform_bitwise_with_one_replay(transform: str, policy: str, autocast: bool,
                                           blocks: list) -> None:
    p, x = mlp_params(), torch.randn(4, 6)
    run = TRANSFORMS[transform]
    # jacfwd vmaps the forward: dropout fails there without remat too.
    drop = 0.0 if transform == "jacfwd" else 0.25
    with maybe_autocast(autocast):
        torch.manual_seed(3)
        expected = run(loss_of(mlp, drop), p, x)
        counted, block = remat_mlp(POLICIES[policy])
        torch.manual_seed(3)
        actual = run(loss_of(block, drop), p, x)
    assert_tree_bitwise(actual, expected)
    # forward + one replay: the backward's (jacrev: one vmapped backward); forward mode
    # (jacfwd) saves nothing for a backward, so the block runs once, op by op
    runs = 1 if transform == "jacfwd" else 2
    assert counted.calls == runs
    assert len(blocks) == 1 and blocks[0].runs == runs


def test_each_backward_call_replays_once() -> None:
    p, x = mlp_params(), torch.randn(4, 6)
    counted, block = remat_mlp(cp.dots_saveable)
    out, vjp_fn = vjp(lambda p: block(p, x, 0.0), p)
    expected_out, expected_fn = vjp(lambda p: mlp(p, x), p)
    cot = torch.randn_like(out)
    assert_tree_bitwise(out, expected_out)
    for n in (2, 3):
        assert_tree_bitwise(vjp_fn(cot), expected_fn(cot))
        assert counted.calls == n


@pytest.mark.parametrize("wrt", ["x", "params"])
def test_hessian_second_order_bitwise(wrt: str) -> None:
    p, x = mlp_params(), torch.randn(2, 6)
    counted, block = remat_mlp(cp.dots_saveable)
    if wrt == "x":
        def second(f):
            return hessian(lambda x: f(p, x, 0.0).sum())(x)
    else:
        def second(f):
            return hessian(lambda p: f(p, x, 0.0).sum())(p)
    assert_tree_bitwise(second(block), second(mlp))
    # the forward (forward mode runs op by op through it) and one backward replay
    assert counted.calls == 2


def test_reverse_over_reverse_with_constant_cotangent_bitwise() -> None:
    p, x = mlp_params(), torch.randn(4, 6)
    c, v = torch.randn(4, 6), torch.randn(4, 6)
    counted, block = remat_mlp()

    def second(f):
        inner = grad(lambda x, p: (f(p, x, 0.0) * c).sum())
        return grad(lambda p: (inner(x, p) * v).sum())(p)

    assert_tree_bitwise(second(block), second(mlp))
    # forward + the first backward's replay; the outer backward differentiates that replay
    assert counted.calls == 2


# -- the policy on the torch.func path --------------------------------------------------------


def _three_mm(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return torch.relu(torch.relu(x @ p["w1"]) @ p["w2"]) @ p["w1"].T


def test_dots_saveable_injects_matmuls_and_the_backward_skips_them(blocks: list) -> None:
    p = {"w1": torch.randn(6, 8), "w2": torch.randn(8, 8)}
    x = torch.randn(4, 6)
    loss = lambda f: lambda p: f(p, x).sum()  # noqa: E731
    with MatmulCounter() as plain:
        expected = grad(loss(_three_mm))(p)
    counts = {}
    for name in ("nothing", "dots"):
        with MatmulCounter() as counter:
            actual = grad(loss(ckptfx.remat(_three_mm, policy=POLICIES[name])))(p)
        assert_tree_bitwise(actual, expected)
        counts[name] = counter.n
    nothing, dots = blocks
    assert (nothing.injected, dots.injected) == (0, 3)
    assert counts["dots"] == plain.n  # the replay took the three kept products
    assert counts["nothing"] == plain.n + 3  # the replay recomputed them
    assert nothing.runs == dots.runs == 2


def test_offload_policy_keeps_products_in_host_memory(blocks: list) -> None:
    p, x = mlp_params(), torch.randn(4, 6)
    policy = cp.offload_dot_with_no_batch_dims(offload_src="device", offload_dst="cpu")
    counted, block = remat_mlp(policy)
    assert_tree_bitwise(grad(loss_of(block))(p, x), grad(loss_of(mlp))(p, x))
    (b,) = blocks
    assert b.injected == 2 and len(b.kept_ops) == 2
    assert counted.calls == 2


def _named(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    h = ckptfx.checkpoint_name(torch.tanh(x @ p["w1"] + p["b1"]), "h")
    return F.gelu(h @ p["w2"])


@pytest.mark.parametrize("policy", [
    cp.save_only_these_names("h"),
    cp.save_and_offload_only_these_names(names_which_can_be_saved=(),
                                         names_which_can_be_offloaded=("h",),
                                         offload_src="device", offload_dst="cpu"),
], ids=["save", "offload"])
def test_checkpoint_name_policies_on_the_func_path(policy: Any, blocks: list) -> None:
    p, x = mlp_params(), torch.randn(4, 6)
    loss = lambda f: lambda p: f(p, x).sum()  # noqa: E731
    assert_tree_bitwise(grad(loss(ckptfx.remat(_named, policy=policy)))(p), grad(loss(_named))(p))
    (b,) = blocks
    assert [op for _, op, _, _ in b.kept_ops] == [torch.ops.aten.tanh.default]
    assert b.injected == 1


# Kept outputs matched to the right op, and not rewritten through an alias.
X2 = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
X3 = torch.randn(2, 4, 6, generator=torch.Generator().manual_seed(1))
W = torch.randn(6, 6, generator=torch.Generator().manual_seed(2))


def _func_grads(fn: Callable[..., torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch.func.grad(lambda a, b: fn(a, b).pow(2).sum(), argnums=(0, 1))(x, W)


# Found in review of the torch.func path's kept outputs (was test_review_regressions_2.py).
def test_func_path_keep_not_matched_to_an_earlier_call_after_inplace_op() -> None:
    # Under grad tracking, autograd copies ``self`` before ``mul_`` in the replay: the op
    # indices shift by one, and the kept position of ``v``'s mm then holds ``u``'s mm.
    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        a = x.clone()
        a.mul_(w[0])
        u = a @ w
        v = ckptfx.checkpoint_name(u.tanh() @ w, "v")
        return (u + v).tanh()

    r = ckptfx.remat(block, policy=cp.save_only_these_names("v"))
    ref = _func_grads(block, X2)
    got = _func_grads(r, X2)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


# Found in review of the torch.func path's kept outputs (was test_review_regressions_2.py).
@pytest.mark.parametrize("policy", ["dots_saveable", "everything_saveable"])
def test_func_path_kept_mm_rewritten_through_matmul_alias(policy: str) -> None:
    # A 3-D matmul is mm + _unsafe_view: the view shares the mm's storage but not its version
    # counter, so an in-place write to the result used to leave the kept mm looking intact.
    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        a = x @ w
        a.add_(w[0])
        return (a @ w).tanh()

    r = ckptfx.remat(block, policy=getattr(cp, policy))
    ref = _func_grads(block, X3)
    got = _func_grads(r, X3)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


# -- modules through functional_call ----------------------------------------------------------


class Net(nn.Module):
    def __init__(self, remat: bool, policy: Any = None) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(6)
        self.fc1, self.fc2 = nn.Linear(6, 12), nn.Linear(12, 6)
        self.runs = 0
        self.block = ckptfx.remat(self._block, policy=policy) if remat else self._block

    def _block(self, x: torch.Tensor) -> torch.Tensor:
        self.runs += 1
        return self.fc2(F.dropout(F.gelu(self.fc1(self.ln(x))), 0.2, self.training))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(x)


def _nets(policy: Any = cp.dots_saveable) -> tuple[Net, Net, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    plain = Net(False)
    net = Net(True, policy)
    net.load_state_dict(plain.state_dict())
    params = {k: v.detach().clone() for k, v in plain.named_parameters()}
    return plain, net, params


def _module_loss(m: nn.Module) -> Callable[..., torch.Tensor]:
    return lambda params, x: functional_call(m, params, (x,)).square().mean()


def test_functional_call_grad_of_module_block() -> None:
    plain, net, params = _nets()
    x = torch.randn(3, 5, 6)
    torch.manual_seed(1)
    expected = grad(_module_loss(plain))(params, x)
    torch.manual_seed(1)
    actual = grad(_module_loss(net))(params, x)
    assert_tree_bitwise(actual, expected)
    assert set(actual) == set(params)
    assert net.runs == 2
    # the module's own parameters were swapped for the call only
    assert all(v.requires_grad for v in net.parameters())


def test_per_sample_gradients_of_module_block() -> None:
    plain, net, params = _nets()
    plain.eval(), net.eval()
    x = torch.randn(4, 5, 6)
    per_sample = lambda m: vmap(grad(_module_loss(m)), in_dims=(None, 0))(params, x)  # noqa: E731
    assert_tree_bitwise(per_sample(net), per_sample(plain))
    assert net.runs == 2  # one vmapped forward, one vmapped replay


# -- vmap -------------------------------------------------------------------------------------


def test_vmap_forward_bitwise() -> None:
    p, x = mlp_params(), torch.randn(5, 4, 6)
    counted, block = remat_mlp()
    run = lambda f: vmap(f, in_dims=(None, 0, None))(p, x, 0.0)  # noqa: E731
    assert_tree_bitwise(run(block), run(mlp))
    assert counted.calls == 1


@pytest.mark.parametrize("randomness", ["different", "same"])
def test_per_sample_gradients_with_dropout(randomness: str, blocks: list) -> None:
    p, x = mlp_params(), torch.randn(5, 4, 6)
    counted, block = remat_mlp(cp.dots_saveable)

    def per_sample(f):
        torch.manual_seed(11)
        return vmap(grad(loss_of(f, 0.3)), in_dims=(None, 0), randomness=randomness)(p, x)

    expected = per_sample(mlp)
    actual = per_sample(block)
    assert_tree_bitwise(actual, expected)
    assert counted.calls == 2 and blocks[0].injected == 2


def _transforms_inside(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    g = grad(lambda x: torch.tanh(x @ p["w1"]).sum())(x)
    v = vmap(lambda row: row @ p["w1"])(x)
    return (g * x).sum(-1, keepdim=True) * v


def test_grad_and_vmap_inside_a_block_under_torch_func(blocks: list) -> None:
    p, x = {"w1": torch.randn(6, 8)}, torch.randn(4, 6)
    block = ckptfx.remat(_transforms_inside, policy=cp.dots_saveable)
    loss = lambda f: lambda p: f(p, x).sum()  # noqa: E731
    assert_tree_bitwise(grad(loss(block))(p), grad(loss(_transforms_inside))(p))
    assert blocks[0].runs == 2


def test_grad_and_vmap_inside_a_block_under_plain_autograd(blocks: list) -> None:
    w = torch.randn(6, 8, requires_grad=True)
    x = torch.randn(4, 6, requires_grad=True)
    expected = torch.autograd.grad(_transforms_inside({"w1": w}, x).sum(), [w, x])
    block = ckptfx.remat(_transforms_inside)
    with ckptfx.recompute_handle_collector_ctx() as handles:
        out = block({"w1": w}, x)
    assert_tree_bitwise(torch.autograd.grad(out.sum(), [w, x]), expected)
    # torch.func inside refuses saved-tensor hooks: the call ran as one autograd.Function,
    # which has no kernel frame for a collector
    assert handles == [] and len(blocks) == 1 and blocks[0].runs == 2


# -- detection: one decorated function under autograd and torch.func --------------------------


def test_same_function_alternates_between_autograd_and_torch_func(blocks: list) -> None:
    p, x = mlp_params(), torch.randn(4, 6)
    counted, block = remat_mlp(cp.dots_saveable)
    expected_func = grad(loss_of(mlp))(p, x)
    leaves = {k: v.clone().requires_grad_() for k, v in p.items()}
    expected_autograd = torch.autograd.grad(loss_of(mlp)(leaves, x), list(leaves.values()))
    for round_ in range(2):
        # plain autograd: a kernel frame, seen by a collector, prefire + session replay once
        with ckptfx.recompute_handle_collector_ctx() as handles:
            loss = loss_of(block)(leaves, x)
        assert len(handles) == 1
        sid = ("alternate", round_)
        try:
            ckptfx.recompute_handle(handles[0], sid)
            assert ckptfx.recompute_session_stats()[sid].replayed == 1
            with ckptfx.recompute_session_ctx(sid):
                actual = torch.autograd.grad(loss, list(leaves.values()))
        finally:
            ckptfx.clear_recompute_session(sid)
        assert_tree_bitwise(list(actual), list(expected_autograd))
        # torch.func: the autograd.Function path, no frame for the collector
        with ckptfx.recompute_handle_collector_ctx() as handles:
            actual = grad(loss_of(block))(p, x)
        assert handles == []
        assert_tree_bitwise(actual, expected_func)
    assert len(blocks) == 2 and all(b.runs == 2 and b.injected == 2 for b in blocks)


# -- nesting, dropout, bf16 -------------------------------------------------------------------


def test_nested_remat_under_grad() -> None:
    p, x = mlp_params(), torch.randn(4, 6)
    inner = Counted(lambda p, h: torch.tanh(h @ p["w2"]))
    outer_calls = [0]

    def outer(p, x, inner_fn):
        outer_calls[0] += 1
        return inner_fn(p, torch.relu(x @ p["w1"] + p["b1"])) @ p["w2"].T

    loss = lambda o, i: lambda p: o(p, x, i).sum()  # noqa: E731
    expected = grad(loss(outer, inner.fn))(p)
    outer_calls[0] = 0
    r_inner = ckptfx.remat(inner, policy=cp.dots_saveable)
    r_outer = ckptfx.remat(outer, static_argnums=2)
    assert_tree_bitwise(grad(loss(r_outer, r_inner))(p), expected)
    # torch's nesting rule: outer forward + replay; inner in both and once more for its own
    assert (outer_calls[0], inner.calls) == (2, 3)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_dropout_masks_match_the_plain_function_under_grad(autocast: bool) -> None:
    p, x = mlp_params(), torch.randn(4, 6)
    counted, block = remat_mlp()
    results = []
    for f in (mlp, block, mlp):
        with maybe_autocast(autocast):
            torch.manual_seed(5)
            results.append(grad_and_value(loss_of(f, 0.5))(p, x))
        results.append(torch.rand(3))  # the caller's RNG moved on exactly as without remat
    assert_tree_bitwise(results[2:4], results[0:2])
    torch.manual_seed(6)
    other = grad(loss_of(block, 0.5))(p, x)
    assert not torch.equal(other["w2"], results[2][0]["w2"])  # a new seed, new masks


# -- what cannot work raises ------------------------------------------------------------------


def test_closure_tensor_tracked_by_the_transform_is_an_error() -> None:
    x = torch.randn(4, 6)

    def loss(w: torch.Tensor) -> torch.Tensor:
        return ckptfx.remat(lambda x: torch.tanh(x @ w))(x).sum()  # w from the closure

    with pytest.raises(ckptfx.CheckpointError, match="outside the block's arguments"):
        grad(loss)(torch.randn(6, 6))
    with pytest.raises(ckptfx.CheckpointError, match="transform around the call tracks"):
        grad(lambda w, x: ckptfx.remat(lambda x: torch.tanh(x @ w))(x).sum())(
            torch.randn(6, 6), x.clone())
    # forward mode saves nothing for a backward: the block runs op by op there, so a closure
    # tensor gets its tangent exactly as in the plain function
    w = torch.randn(6, 6)
    assert_tree_bitwise(jacfwd(loss)(w), jacfwd(lambda w: torch.tanh(x @ w).sum())(w))


def test_closure_constant_is_fine_under_grad() -> None:
    c = torch.randn(6, 6)
    x = torch.randn(4, 6)
    f = lambda x: torch.tanh(x @ c)  # noqa: E731
    assert_tree_bitwise(grad(lambda x: ckptfx.remat(f)(x).sum())(x),
                        grad(lambda x: f(x).sum())(x))


def test_closure_parameter_under_autograd_with_torch_func_inside_is_an_error() -> None:
    w = torch.randn(6, 6, requires_grad=True)

    def block(x: torch.Tensor) -> torch.Tensor:
        return grad(lambda x: torch.tanh(x @ w).sum())(x) * x

    with pytest.raises(ckptfx.CheckpointError, match="requires grad"):
        ckptfx.remat(block)(torch.randn(4, 6, requires_grad=True))


def test_session_opened_inside_torch_func_grad_is_an_error() -> None:
    p, x = mlp_params(), torch.randn(4, 6)
    counted, block = remat_mlp()

    def loss(p):
        with ckptfx.recompute_session_ctx("inside-grad"):
            return loss_of(block)(p, x)

    with pytest.raises(ckptfx.CheckpointError, match="sessions need plain autograd"):
        grad(loss)(p)
    with ckptfx.recompute_session_ctx("around-grad"):
        with pytest.raises(ckptfx.CheckpointError, match="recompute_session_ctx\\('around-grad'\\)"):
            grad(loss_of(block))(p, x)
    assert "inside-grad" not in ckptfx.recompute_session_stats()
    assert counted.calls == 0  # refused before the block ran
    # nothing left behind: the function works under grad afterwards
    assert_tree_bitwise(grad(loss_of(block))(p, x), grad(loss_of(mlp))(p, x))


# -- nothing leaks ----------------------------------------------------------------------------


def test_block_and_kept_tensors_freed_after_grad(blocks: list) -> None:
    p, x = mlp_params(), torch.randn(4, 6)
    _, block = remat_mlp(cp.dots_saveable)
    out, vjp_fn = vjp(lambda p: block(p, x, 0.0), p)
    vjp_fn(torch.ones_like(out))
    ref = weakref.ref(blocks[0])
    blocks.clear()
    assert ref() is not None  # the graph still holds it
    del out, vjp_fn
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("policy", [None, cp.dots_saveable], ids=["default", "dots"])
def test_jacrev_of_a_block_with_random_ops_is_bitwise(policy) -> None:
    """jacrev vmaps the backward in randomness='error' mode; the replay's forward runs outside
    that vmap (as the plain function's forward did), so its dropout draws the forward's mask
    once and only the backward is batched."""
    w = torch.randn(4, 4) / 2
    x = torch.randn(3, 4)

    def f(x, w):
        return torch.nn.functional.dropout(torch.tanh(x @ w).t(), 0.5, True).t() @ w

    block = ckptfx.remat(f, policy=policy)
    results = []
    for fn in (f, block):
        torch.manual_seed(0)
        results.append((torch.func.jacrev(lambda x, w: fn(x, w).square(), argnums=(0, 1))(x, w),
                        torch.rand(2)))
    assert_tree_bitwise(results[1], results[0])


# -- ckptfx.checkpoint without a policy under torch.func --------------------------------------


@pytest.mark.parametrize("bf16", [False, True])
def test_checkpoint_without_policy_runs_under_torch_func_bitwise(bf16: bool) -> None:
    """Saved-tensor hooks cannot run inside torch.func transforms, so torch's checkpoint
    fails there; ckptfx.checkpoint without a policy takes remat's torch.func path with
    nothing_saveable (it recomputes everything, as the plain checkpoint does): gradients
    and values bitwise the plain computation's, dropout included."""
    p, x = mlp_params(), torch.randn(4, 6)
    ckpt = loss_of(lambda p, x, drop: ckptfx.checkpoint(mlp, p, x, drop), drop=0.3)
    plain = loss_of(mlp, drop=0.3)
    results = []
    for fn in (plain, ckpt):
        torch.manual_seed(5)
        with maybe_autocast(bf16):
            results.append(grad_and_value(fn)(p, x))
    assert_tree_bitwise(results[1], results[0])
    torch.manual_seed(5)
    with pytest.raises(RuntimeError, match="saved tensor hooks"):  # torch's own checkpoint
        grad(loss_of(lambda p, x, drop: torch.utils.checkpoint.checkpoint(
            mlp, p, x, drop, use_reentrant=False)))(p, x)


def test_checkpoint_wrapper_without_policy_runs_under_functional_call_grad() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 3))
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = torch.randn(5, 6)

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return functional_call(model, p, (x,)).square().sum()

    per_sample = vmap(grad(loss), in_dims=(None, 0))
    expected = grad(loss)(params, x), per_sample(params, x[:, None])
    ckptfx.checkpoint_wrapper(model)
    assert_tree_bitwise((grad(loss)(params, x), per_sample(params, x[:, None])), expected)


def test_checkpoint_options_without_meaning_under_torch_func_say_what_to_pass() -> None:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    p, x = mlp_params(), torch.randn(4, 6)
    sac = lambda: create_selective_checkpoint_contexts([torch.ops.aten.mm.default])  # noqa: E731
    with pytest.raises(ckptfx.CheckpointError, match="as policy= instead"):
        grad(loss_of(lambda p, x, drop: ckptfx.checkpoint(mlp, p, x, context_fn=sac)))(p, x)
    with pytest.raises(ckptfx.CheckpointError, match="Drop debug=True"):
        grad(loss_of(lambda p, x, drop: ckptfx.checkpoint(mlp, p, x, debug=True)))(p, x)


def test_checkpoint_options_run_as_a_plain_checkpoint_where_saved_tensor_hooks_are_on() -> None:
    """vmap and jvp leave saved-tensor hooks on, and without grad nothing is saved: there a
    context_fn or debug=True checkpoint runs as it always did (no CheckpointError)."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    torch.manual_seed(0)
    blk = nn.Linear(4, 4)
    sac = lambda: create_selective_checkpoint_contexts([torch.ops.aten.mm.default])  # noqa: E731
    x = torch.randn(3, 4)
    for options in ({"context_fn": sac}, {"debug": True}):
        for grad_mode in (torch.no_grad, torch.enable_grad):
            with grad_mode():
                out = vmap(lambda v: ckptfx.checkpoint(blk, v, **options))(x)
            assert torch.equal(out, vmap(blk)(x))
    p = mlp_params()

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():  # inside grad, but no grad: the function just runs
            h = ckptfx.checkpoint(mlp, p, x, context_fn=sac)
        return (mlp(p, x) * h).sum()

    x6 = torch.randn(3, 6)
    assert_tree_bitwise(grad(loss)(p, x6),
                        grad(lambda p, x: (mlp(p, x) * mlp(p, x).detach()).sum())(p, x6))
