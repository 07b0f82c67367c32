"""checkpoint_policies: meanings, torch SAC parity, offloading, bad input."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

import ckptfx
from ckptfx import checkpoint_policies as cp
from ckptfx.policies import Offload, checkpoint_name

from conftest import assert_bitwise, grads

pytestmark = pytest.mark.usefixtures("no_hooks_left_behind")
aten = torch.ops.aten
CTX = None


def test_dot_policies_classify_aten_ops() -> None:
    for op in (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
               aten.convolution.default):
        assert cp.dots_saveable(CTX, op) is True
        assert cp.checkpoint_dots(CTX, op) is True
    assert cp.dots_with_no_batch_dims_saveable(CTX, aten.mm.default) is True
    assert cp.dots_with_no_batch_dims_saveable(CTX, aten.addmm.default) is True
    for op in (aten.bmm.default, aten.baddbmm.default, aten.convolution.default):
        assert cp.dots_with_no_batch_dims_saveable(CTX, op) is False
    for policy in (cp.dots_saveable, cp.dots_with_no_batch_dims_saveable):
        assert policy(CTX, aten.relu.default) is False
    assert cp.everything_saveable(CTX, aten.relu.default) is True
    assert cp.nothing_saveable(CTX, aten.mm.default) is False


def test_name_policies() -> None:
    def ask(policy: Any, name: str | None) -> Any:
        if name is None:
            return policy(CTX, aten.mm.default)
        return policy(CTX, checkpoint_name, name=name)

    only = cp.save_only_these_names("a", "b")
    assert (ask(only, "a"), ask(only, "c"), ask(only, None)) == (True, False, False)
    but = cp.save_any_names_but_these("a")
    assert (ask(but, "a"), ask(but, "c"), ask(but, None)) == (False, True, False)
    both = cp.save_from_both_policies(cp.dots_saveable, only)
    assert (ask(both, "a"), ask(both, None), both(CTX, aten.relu.default)) == (True, True, False)
    off = cp.save_and_offload_only_these_names(names_which_can_be_saved=["a"],
                                               names_which_can_be_offloaded=["b"])
    assert ask(off, "a") is True and isinstance(ask(off, "b"), Offload)
    assert ask(off, "c") is False
    odot = cp.offload_dot_with_no_batch_dims(offload_dst="cpu")
    assert odot(CTX, aten.mm.default) == Offload("device", "cpu")
    assert odot(CTX, aten.bmm.default) is False


def test_torch_policy_answers_and_their_combination() -> None:
    """MUST_SAVE stays distinct from a plain keep (it is never recomputed, not even by a later
    replay); combined with another policy, the stronger keep wins."""
    def torch_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return {aten.mm.default: CheckpointPolicy.MUST_SAVE,
                aten.bmm.default: CheckpointPolicy.PREFER_SAVE}.get(
                    op, CheckpointPolicy.PREFER_RECOMPUTE)

    decide = ckptfx.policies.call_policy
    assert decide(torch_policy, CTX, aten.mm.default, (), {}) is CheckpointPolicy.MUST_SAVE
    assert decide(torch_policy, CTX, aten.bmm.default, (), {}) is True
    assert decide(torch_policy, CTX, aten.relu.default, (), {}) is False
    both = cp.save_from_both_policies(cp.dots_saveable, torch_policy)
    assert both(CTX, aten.mm.default) is CheckpointPolicy.MUST_SAVE
    assert both(CTX, aten.bmm.default) is True
    assert both(CTX, aten.relu.default) is False
    assert cp.save_from_both_policies(torch_policy, cp.offload_dot_with_no_batch_dims())(
        CTX, aten.mm.default) is CheckpointPolicy.MUST_SAVE


def test_checkpoint_name_is_an_identity_outside_remat() -> None:
    x = torch.randn(3)
    assert ckptfx.checkpoint_name(x, "x") is x


def test_bad_policy_arguments() -> None:
    with pytest.raises(ValueError, match=r"\['a'\].*both"):
        cp.save_and_offload_only_these_names(names_which_can_be_saved=["a", "b"],
                                             names_which_can_be_offloaded=["a"])
    with pytest.raises(ValueError, match="offload_dst"):
        cp.offload_dot_with_no_batch_dims(offload_dst="disk")
    with pytest.raises(TypeError, match="names"):
        cp.save_only_these_names(3)
    with pytest.raises(TypeError, match="policy_2"):
        cp.save_from_both_policies(cp.dots_saveable, "dots")
    with pytest.raises(TypeError, match="name must be a str"):
        ckptfx.checkpoint_name(torch.randn(2), 3)
    # A policy function that cannot take (ctx, op): said up front, not at its first op
    x = torch.randn(2, requires_grad=True)
    for bad in (lambda prim: True, lambda: True, lambda a, b, c: True):
        with pytest.raises(TypeError, match=r"called as policy\(ctx, op, \*args, \*\*kwargs\)"):
            ckptfx.remat(torch.sin, policy=bad)(x)
        with pytest.raises(TypeError, match="cannot take"):
            ckptfx.checkpoint(torch.sin, x, policy=bad)
    ckptfx.remat(torch.sin, policy=lambda ctx, op, *args, **kwargs: False)(x)  # accepted
    import dataclasses
    import functools

    @dataclasses.dataclass(frozen=True, slots=True)  # no weakref: checked per class
    class Keep:
        def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> bool:
            return False

    ckptfx.checkpoint(torch.sin, x, policy=Keep())
    ckptfx.checkpoint(torch.sin, x, policy=functools.partial(
        lambda ctx, op, *args, flag=1, **kwargs: False, flag=2))


# -- torch SAC parity ------------------------------------------------------------------------

DOT_OPS = (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default)


def sac_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in DOT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


class OpLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return F.gelu(F.gelu(x @ w1) @ w2)


def attention(x: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor,
              wv: torch.Tensor) -> torch.Tensor:
    q, k, v = x @ wq, x @ wk, x @ wv
    a = torch.softmax(torch.matmul(q, k.transpose(-1, -2)), -1)
    return F.gelu(torch.matmul(a, v))


@pytest.mark.parametrize("block,shapes", [
    (mlp, [(4, 6), (6, 8), (8, 6)]),
    (attention, [(2, 5, 8), (8, 8), (8, 8), (8, 8)]),
])
def test_sac_policy_function_saves_what_torch_sac_saves(block: Any, shapes: list) -> None:
    torch.manual_seed(0)
    leaves = [torch.randn(*s, requires_grad=True) for s in shapes]
    saved_by_torch: Counter[str] = Counter()

    def spy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        decision = sac_policy(ctx, op, *args, **kwargs)
        if not ctx.is_recompute and decision == CheckpointPolicy.MUST_SAVE:
            saved_by_torch[op.overloadpacket.__name__] += 1
        return decision

    block(*leaves).sum().backward()
    expected = grads(leaves)
    results = {}
    for name in ("torch", "ckptfx"):
        for t in leaves:
            t.grad = None
        if name == "torch":
            out = checkpoint(block, *leaves, use_reentrant=False,
                             context_fn=lambda: create_selective_checkpoint_contexts(spy))
        else:
            out = ckptfx.remat(block, policy=sac_policy)(*leaves)
        with OpLog() as log:
            out.sum().backward()
        assert_bitwise(grads(leaves), expected)
        results[name] = Counter({k: n for k, n in log.ops.items() if k in ("mm", "bmm")})
    # The same matmuls are kept: neither backward recomputes one.
    assert results["torch"] == results["ckptfx"]
    residuals = ckptfx.saved_residuals(ckptfx.remat(block, policy=sac_policy), *leaves)
    saved_by_ckptfx = Counter(r.source.split()[2].removeprefix("aten.")
                              for r in residuals if r.kind == "saved")
    assert saved_by_ckptfx == saved_by_torch


# -- offloading ------------------------------------------------------------------------------


def test_offloaded_residuals_live_on_the_host_and_are_not_recomputed() -> None:
    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = ckptfx.checkpoint_name(torch.tanh(x @ w), "h")
        return torch.relu(h @ w.T)

    x = torch.randn(4, 6, requires_grad=True)
    w = torch.randn(6, 6, requires_grad=True)
    out = block(x, w)
    with OpLog() as plain_bwd_log:
        out.sum().backward()
    expected = grads([x, w])
    x.grad = w.grad = None
    policy = cp.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=["h"], offload_dst="cpu")
    packed: list[Any] = []
    from ckptfx.recording.tracer import Tracer

    original = Tracer.pack

    def spy(self: Tracer, t: torch.Tensor) -> Any:
        p = original(self, t)
        packed.append(p)
        return p

    Tracer.pack = spy  # type: ignore[method-assign]
    try:
        out = ckptfx.remat(block, policy=policy)(x, w)
    finally:
        Tracer.pack = original  # type: ignore[method-assign]
    # On the CPU an offloaded value is kept as it is (host memory already): kept, not a
    # kernel holder that the replay fills.
    kept = [p for p in packed if type(p).__name__ == "_Kept"]
    assert kept and all(p.tensor.device.type == "cpu" for p in kept)
    with OpLog() as bwd_log:
        out.sum().backward()
    assert_bitwise(grads([x, w]), expected)
    # h is not recomputed (no tanh, not x @ w); only relu's input h @ w.T is, which this
    # policy does not keep.
    assert bwd_log.ops["tanh"] == 0 and bwd_log.ops["mm"] == plain_bwd_log.ops["mm"] + 1


def test_policies_pickle_under_their_public_path() -> None:
    """A saved model carries its blocks' policies; the pickle names ``ckptfx.policies``, so
    moving a class between ckptfx's private modules never breaks a saved model."""
    import pickle

    for p in (cp.dots_saveable, cp.nothing_saveable, cp.everything_saveable,
              cp.save_only_these_names("a"), cp.save_any_names_but_these("a"),
              cp.save_from_both_policies(cp.dots_saveable, cp.save_only_these_names("a")),
              cp.save_and_offload_only_these_names(
                  names_which_can_be_saved=[], names_which_can_be_offloaded=["h"],
                  offload_dst="cpu"),
              cp.offload_dot_with_no_batch_dims()):
        data = pickle.dumps(p)
        assert b"ckptfx.policies" in data and b"_policy_factories" not in data
        assert pickle.loads(data) == p


def test_checkpoint_policies_has_jax_names_and_says_which_it_has() -> None:
    assert cp.checkpoint_dots is cp.dots_saveable
    assert cp.checkpoint_dots_with_no_batch_dims is cp.dots_with_no_batch_dims_saveable
    with pytest.raises(AttributeError, match=r"no policy 'save_everything'. It has: "
                                             r"everything_saveable, nothing_saveable"):
        cp.save_everything  # noqa: B018
    assert "named as in" in (type(cp).__doc__ or "")
    with pytest.raises(AttributeError, match=r"no policy 'save_anything_except_these_names' "
                                             r"\(JAX's: a checkpoint_name tags a value after"):
        cp.save_anything_except_these_names  # noqa: B018


def test_context_fn_pairs_other_than_torchs_selective_ones_are_entered_as_given() -> None:
    """ckptfx.policies.contexts guards only the pair create_selective_checkpoint_contexts
    makes; any other pair of context managers comes back as it was."""
    import contextlib

    from ckptfx.policies.contexts import checked_contexts

    pair = (contextlib.nullcontext(), contextlib.ExitStack())
    forward, recompute = checked_contexts(lambda: pair)
    assert forward is pair[0] and recompute is pair[1]
    made = []

    def sac():
        made.append(create_selective_checkpoint_contexts([aten.mm.default]))
        return made[-1]

    forward, recompute = checked_contexts(sac)
    assert (forward.inner, recompute.inner) == made[0]  # torch's own modes, guarded
