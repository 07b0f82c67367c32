"""Bad input: each misuse gets a clear error or warning, and leaves no state.

Every test here ends with ``assert_clean()``: no saved-tensor hooks pushed, no session listed,
no session bound on this thread, no name scope open.
"""

from __future__ import annotations

import gc
import threading
import warnings
import weakref

import pytest
import torch

import ckptfx
from ckptfx import checkpoint_policies as cp
from ckptfx import policies
from ckptfx.policies.names import name_scopes
from ckptfx.kernel import session as session_mod
from ckptfx.kernel.frame import Frame, tls

from conftest import assert_bitwise, saved_hooks_stack_empty

pytestmark = pytest.mark.usefixtures("no_sessions_left")


def assert_clean() -> None:
    assert saved_hooks_stack_empty(), "saved-tensor hooks left pushed"
    assert ckptfx.recompute_session_stats() == {}, "a session was left behind"
    assert tls.activation is None, "a session is still bound on this thread"
    assert name_scopes.stack == [], "a name scope was left open"


# -- names given to the name-based policy factories -------------------------------------------


def test_save_and_offload_refuses_a_bare_string_non_iterables_and_non_string_names() -> None:
    f = cp.save_and_offload_only_these_names
    with pytest.raises(TypeError, match=r"names_which_can_be_saved must be a collection of "
                       r"names.*the str 'attn'.*write names_which_can_be_saved=\['attn'\]"):
        f(names_which_can_be_saved="attn", names_which_can_be_offloaded=[])
    with pytest.raises(TypeError, match=r"names_which_can_be_offloaded must be a collection.*"
                       r"the str 'attn'"):
        f(names_which_can_be_saved=[], names_which_can_be_offloaded="attn")
    with pytest.raises(TypeError, match=r"names_which_can_be_saved must be a collection of "
                       r"names \(a list, tuple or set of strings\), got int 3"):
        f(names_which_can_be_saved=3, names_which_can_be_offloaded=[])
    with pytest.raises(TypeError, match=r"names_which_can_be_offloaded must contain only "
                       r"names.*got int 1"):
        f(names_which_can_be_saved=["a"], names_which_can_be_offloaded=["b", 1])
    with pytest.raises(TypeError, match=r"names_which_can_be_saved.*the bytes b'attn'"):
        f(names_which_can_be_saved=b"attn", names_which_can_be_offloaded=[])
    assert_clean()


def test_save_and_offload_documented_forms_keep_working() -> None:
    """Lists, tuples, sets and generators of strings; the name 'attn' is 'attn', not letters."""
    for saved in (["attn"], ("attn",), {"attn"}, frozenset({"attn"}), (n for n in ["attn"])):
        p = cp.save_and_offload_only_these_names(
            names_which_can_be_saved=saved, names_which_can_be_offloaded=["mlp"])
        assert p.names_which_can_be_saved == frozenset({"attn"})
        assert p.names_which_can_be_offloaded == frozenset({"mlp"})
        x = torch.ones(2)
        assert p(None, ckptfx.checkpoint_name, x, name="attn") is True
        assert p(None, ckptfx.checkpoint_name, x, name="a") is False
        assert isinstance(p(None, ckptfx.checkpoint_name, x, name="mlp"), ckptfx.Offload)


@pytest.mark.parametrize("factory", ["save_only_these_names", "save_any_names_but_these"])
def test_star_names_factories_refuse_lists_and_non_strings(factory: str) -> None:
    f = getattr(cp, factory)
    with pytest.raises(TypeError, match=rf"{factory} takes each name as its own argument.*"
                       rf"got a list \['a', 'b'\]; unpack it: {factory}\(\*names\)"):
        f(["a", "b"])
    with pytest.raises(TypeError, match=rf"{factory}: names must be strings.*got int 3"):
        f("a", 3)
    # The documented JAX forms.
    assert f("attn").names == frozenset({"attn"})
    assert f("attn", "mlp").names == frozenset({"attn", "mlp"})
    assert f(*["attn", "mlp"]).names == frozenset({"attn", "mlp"})
    assert f().names == frozenset()
    assert_clean()


def test_policy_classes_refuse_a_bare_string_too() -> None:
    """Built directly, ``SaveOnlyTheseNames("attn")`` would test substrings of 'attn'."""
    with pytest.raises(TypeError, match=r"SaveOnlyTheseNames: names must be a collection.*"
                       r"the str 'attn'"):
        policies.SaveOnlyTheseNames("attn")
    with pytest.raises(TypeError, match=r"SaveAnyNamesButThese: names must be a collection"):
        policies.SaveAnyNamesButThese("attn")
    with pytest.raises(TypeError, match=r"SaveAndOffloadOnlyTheseNames: "
                       r"names_which_can_be_saved must contain only names.*got int 3"):
        policies.SaveAndOffloadOnlyTheseNames([3], [], ckptfx.Offload())
    with pytest.raises(TypeError, match=r"offload must be a ckptfx Offload, got str"):
        policies.SaveAndOffloadOnlyTheseNames([], [], "cpu")
    p = policies.SaveOnlyTheseNames(["attn"])  # any iterable of strings, kept as a frozenset
    assert p.names == frozenset({"attn"}) and hash(p) == hash(policies.SaveOnlyTheseNames(
        frozenset({"attn"})))


def test_save_from_both_policies_refuses_factories_and_classes() -> None:
    with pytest.raises(TypeError, match=r"policy_1=checkpoint_policies.save_only_these_names "
                       r"is a policy factory, not a policy: call it, e\.g\. policy_1="
                       r"checkpoint_policies.save_only_these_names\('attn_out'\)"):
        cp.save_from_both_policies(cp.save_only_these_names, cp.dots_saveable)
    with pytest.raises(TypeError, match=r"policy_2=DotsSaveable is a policy class"):
        cp.save_from_both_policies(cp.dots_saveable, policies.DotsSaveable)
    with pytest.raises(TypeError, match=r"policy_2 must be a checkpoint policy.*got int"):
        cp.save_from_both_policies(cp.dots_saveable, 3)


# -- un-called factories and positional policies given to remat -------------------------------


FACTORIES = ["save_only_these_names", "save_any_names_but_these", "save_from_both_policies",
             "save_and_offload_only_these_names", "offload_dot_with_no_batch_dims"]


@pytest.mark.parametrize("factory", FACTORIES)
def test_remat_refuses_an_uncalled_policy_factory(factory: str) -> None:
    with ckptfx.recompute_handle_collector_ctx() as handles:
        with pytest.raises(TypeError, match=rf"policy=checkpoint_policies.{factory} is a "
                           rf"policy factory, not a policy: call it, e\.g\. policy="
                           rf"checkpoint_policies.{factory}\("):
            ckptfx.remat(lambda x: x.sin(), policy=getattr(cp, factory))
        with pytest.raises(TypeError, match=rf"policy=checkpoint_policies.{factory} is a "
                           "policy factory"):
            ckptfx.remat(policy=getattr(cp, factory))  # the decorator form
    assert handles == []
    assert_clean()


def test_remat_refuses_a_policy_class() -> None:
    with pytest.raises(TypeError, match=r"policy=DotsSaveable is a policy class, not a policy: "
                       r"pass an instance"):
        ckptfx.remat(lambda x: x.sin(), policy=policies.DotsSaveable)


def test_remat_refuses_a_policy_where_the_function_goes() -> None:
    with pytest.raises(TypeError, match=r"remat's first argument is the function to "
                       r"rematerialize, got the policy checkpoint_policies.dots_saveable; pass "
                       r"the policy by keyword: @remat\(policy=checkpoint_policies."
                       r"dots_saveable\), or remat\(fun, policy=checkpoint_policies."
                       r"dots_saveable\)"):
        ckptfx.remat(cp.dots_saveable)
    with pytest.raises(TypeError, match=r"got the policy save_only_these_names\('attn'\); pass "
                       r"the policy by keyword: @remat\(policy=save_only_these_names\('attn'\)\)"):
        ckptfx.remat(cp.save_only_these_names("attn"))
    with pytest.raises(TypeError, match=r"got the policy factory checkpoint_policies."
                       r"save_only_these_names; call it and pass the result by keyword: "
                       r"@remat\(policy=checkpoint_policies.save_only_these_names\('attn_out'\)\)"):
        ckptfx.remat(cp.save_only_these_names)
    with pytest.raises(TypeError, match=r"got the policy class DotsSaveable; pass an instance "
                       r"by keyword"):
        ckptfx.remat(policies.DotsSaveable)
    assert_clean()


def test_correct_policy_forms_still_work() -> None:
    x = torch.randn(4, 4, requires_grad=True)

    def f(x: torch.Tensor) -> torch.Tensor:
        return (x @ x).sin()

    expected = torch.autograd.grad(f(x).sum(), x)
    for block in (ckptfx.remat(f, policy=cp.dots_saveable),
                  ckptfx.remat(policy=cp.dots_saveable)(f),
                  ckptfx.remat(f, policy=policies.DotsSaveable())):
        assert_bitwise(torch.autograd.grad(block(x).sum(), x), expected)
    assert_clean()


# -- RecomputeHandle around something that is not a frame -------------------------------------


class _NotAFrame:
    active = None  # looks enough like a frame to get past attribute reads


def test_recompute_handle_refuses_anything_but_a_kernel_frame() -> None:
    thing = _NotAFrame()
    with pytest.raises(TypeError, match=r"RecomputeHandle wraps a ckptfx kernel Frame, got "
                       r"_NotAFrame; do not construct handles: get them from `with "
                       r"ckptfx.recompute_handle_collector_ctx\(\) as handles:`"):
        ckptfx.RecomputeHandle(thing)
    with pytest.raises(TypeError, match="got object"):
        ckptfx.RecomputeHandle(object())
    # A handle made without __init__ refers to nothing: recompute_handle says so.
    bare = ckptfx.RecomputeHandle.__new__(ckptfx.RecomputeHandle)
    assert bare.frame is None
    with pytest.raises(ValueError, match=r"not made by ckptfx.recompute_handle_collector_ctx"):
        ckptfx.recompute_handle(bare, "s")
    with pytest.raises(ValueError, match="handle must be a RecomputeHandle"):
        ckptfx.recompute_handle(thing, "s")
    assert_clean()


def test_collector_handles_still_prefire() -> None:
    x = torch.randn(3, requires_grad=True)
    block = ckptfx.remat(lambda x: x.sin().exp())
    with ckptfx.recompute_handle_collector_ctx() as handles:
        out = block(x)
    assert len(handles) == 1 and isinstance(handles[0].frame, Frame)
    try:
        ckptfx.recompute_handle(handles[0], "s")
        assert ckptfx.recompute_session_stats()["s"].replayed == 1
        with ckptfx.recompute_session_ctx("s"):
            (g,) = torch.autograd.grad(out.sum(), x)
    finally:
        ckptfx.clear_recompute_session("s")
    assert_bitwise([g], [torch.autograd.grad(x.sin().exp().sum(), x)[0]])
    assert_clean()


# -- call-order misuse of vjp_split / grad_split ---------------------------------------------


def _stage(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return ckptfx.checkpoint(lambda w, x: torch.tanh(x @ w) @ w, w, x)


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(4, 4, generator=g), torch.randn(3, 4, generator=g),
            torch.randn(3, 4, generator=g))


def _expected(w: torch.Tensor, x: torch.Tensor, ct: torch.Tensor) -> tuple[torch.Tensor, ...]:
    w, x = w.detach().requires_grad_(), x.detach().requires_grad_()
    return torch.autograd.grad((torch.tanh(x @ w) @ w), (x, w), ct)


def test_vjp_split_dw_before_dx_is_a_checkpoint_error_and_changes_nothing() -> None:
    w, x, ct = _inputs()
    out, dx_fn, dw_fn = ckptfx.vjp_split(_stage, w, x, x_argnums=1, session="s")
    with pytest.raises(ckptfx.CheckpointError, match=r"vjp_split: dw_fn called before dx_fn "
                       r"for session 's'; call dx_fn\(cotangent\) first, then dw_fn\(\)"):
        dw_fn()
    dx, dw = dx_fn(ct), dw_fn()  # the split is still usable, in the right order
    assert_bitwise([dx, dw], list(_expected(w, x, ct)))
    assert_clean()


def test_vjp_split_every_misplaced_call_is_a_checkpoint_error() -> None:
    w, x, ct = _inputs()
    out, dx_fn, dw_fn = ckptfx.vjp_split(_stage, w, x, x_argnums=1, session="s")
    dx_fn(ct)
    with pytest.raises(ckptfx.CheckpointError, match=r"dx_fn already ran for session 's'; "
                       r"call dw_fn next"):
        dx_fn(ct)
    with pytest.raises(ckptfx.CheckpointError, match=r"prefire\(\) must come before dx_fn; "
                       r"this split is past it.*drop this prefire\(\) call, or move it before"):
        dx_fn.prefire()
    dw_fn()
    for call in (dw_fn, lambda: dx_fn(ct), dx_fn.prefire):
        with pytest.raises(ckptfx.CheckpointError, match=r"is consumed|past it"):
            call()
    with pytest.raises(ckptfx.CheckpointError, match=r"session 's' is consumed \(its dw_fn "
                       r"ran.*make a new split"):
        dw_fn()
    assert_clean()


def test_vjp_split_after_clear_is_a_checkpoint_error() -> None:
    w, x, ct = _inputs()
    out, dx_fn, dw_fn = ckptfx.vjp_split(_stage, w, x, x_argnums=1, session="s")
    dx_fn(ct)
    ckptfx.clear_recompute_session("s")
    with pytest.raises(ckptfx.CheckpointError, match=r"session 's' was cleared "
                       r"\(clear_recompute_session\) before this split finished.*Make a new "
                       r"split for this micro-batch"):
        dw_fn()
    with pytest.raises(ckptfx.CheckpointError, match="consumed"):
        dw_fn()
    # cleared after a prefire, before dx
    out, dx_fn, dw_fn = ckptfx.vjp_split(_stage, w, x, x_argnums=1, session="s")
    dx_fn.prefire()
    ckptfx.clear_recompute_session("s")
    with pytest.raises(ckptfx.CheckpointError, match="was cleared"):
        dx_fn(ct)
    assert_clean()


def test_vjp_split_a_half_called_while_the_other_runs_is_a_checkpoint_error() -> None:
    w, x, ct = _inputs()
    fns: dict[str, object] = {}
    seen: list[BaseException] = []

    def stage(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ w)

        def reenter(grad: torch.Tensor) -> None:  # runs inside dx_fn's backward
            for name in ("dw", "dx"):
                try:
                    fns[name](ct) if name == "dx" else fns[name]()
                except BaseException as err:  # noqa: BLE001 - recorded for the assertion
                    seen.append(err)

        h.register_hook(reenter)
        return h @ w

    out, dx_fn, dw_fn = ckptfx.vjp_split(stage, w, x, x_argnums=1, session="s")
    fns.update(dx=dx_fn, dw=dw_fn)
    dx_fn(ct)
    assert [type(e) for e in seen] == [ckptfx.CheckpointError] * 2
    assert "vjp_split: dw_fn called while dx_fn of session 's' is running; the halves of " \
           "one split run one at a time: call it after dx_fn returns" == str(seen[0])
    assert "dx_fn called while dx_fn of session 's' is running" in str(seen[1])
    assert_bitwise([dw_fn()], [_expected(w, x, ct)[1]])
    assert_clean()


def test_grad_split_misplaced_calls_are_checkpoint_errors() -> None:
    w, x, _ = _inputs()
    fns: dict[str, object] = {}
    seen: list[BaseException] = []

    def loss(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if "dw" in fns and not seen:
            try:
                fns["dw"]("s")  # dw_fn of a session whose dx_fn is running right now
            except BaseException as err:  # noqa: BLE001
                seen.append(err)
        return _stage(w, x).sum()

    dx_fn, dw_fn = ckptfx.grad_split(loss, x_argnums=1)
    fns["dw"] = dw_fn
    with pytest.raises(ckptfx.CheckpointError, match=r"grad_split dw_fn: no dx_fn\(\.\.\., "
                       r"session='s'\) is waiting for its dw_fn \(this session is unknown or "
                       r"already consumed\); call dx_fn\(\*args, session='s'\) first"):
        dw_fn("s")
    dx_fn(w, x, session="s")
    assert len(seen) == 1 and type(seen[0]) is ckptfx.CheckpointError
    assert "that dx_fn is still running; call dw_fn after it returns" in str(seen[0])
    with pytest.raises(ckptfx.CheckpointError, match=r"session 's' is already in flight; call "
                       r"dw_fn\('s'\) before reusing it, or use another session key"):
        dx_fn(w, x, session="s")
    dw_fn("s")
    with pytest.raises(ckptfx.CheckpointError, match="already consumed"):
        dw_fn("s")
    assert issubclass(ckptfx.CheckpointError, RuntimeError)  # callers catching it still do
    assert_clean()


# -- names no checkpoint_name uses ------------------------------------------------------------


def _named_block(x: torch.Tensor) -> torch.Tensor:
    a = ckptfx.checkpoint_name(torch.tanh(x @ x), "attn")
    return ckptfx.checkpoint_name(a.sin() @ x, "mlp").cos()


def _caught(fn, *args):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = fn(*args)
    return out, [w for w in record if issubclass(w.category, ckptfx.UnusedNameWarning)]


def test_unused_name_warns_once_per_block_naming_the_unknown_names() -> None:
    x = torch.randn(4, 4, requires_grad=True)
    block = ckptfx.remat(_named_block, policy=cp.save_only_these_names("atn", "mlp", "ffn"))
    out, record = _caught(block, x)
    assert len(record) == 1
    msg = str(record[0].message)
    assert msg.startswith("ckptfx.remat: the policy save_only_these_names('atn', 'ffn', 'mlp') "
                          "of block _named_block (")
    assert "names ['atn', 'ffn'], but no ckptfx.checkpoint_name in the block's forward used " \
           "these names, so they have no effect; the names it used: ['attn', 'mlp']" in msg
    assert record[0].filename == __file__  # points at the call of the block
    for _ in range(3):  # not on every call
        assert _caught(block, x)[1] == []
    other = ckptfx.remat(_named_block, policy=cp.save_only_these_names("atn"))
    assert len(_caught(other, x)[1]) == 1  # per remat'd function
    # The warning changes nothing: gradients are the plain function's.
    x.grad = None
    block(x).sum().backward()
    assert_bitwise([x.grad], list(torch.autograd.grad(_named_block(x).sum(), x)))
    assert_clean()


@pytest.mark.parametrize("policy", [
    cp.save_any_names_but_these("nope"),
    cp.save_and_offload_only_these_names(names_which_can_be_saved=["attn"],
                                         names_which_can_be_offloaded=["nope"]),
    cp.save_from_both_policies(cp.dots_saveable, cp.save_only_these_names("nope")),
], ids=["any_but", "save_and_offload", "from_both"])
def test_every_name_based_policy_warns(policy: object) -> None:
    x = torch.randn(4, 4, requires_grad=True)
    _, record = _caught(ckptfx.remat(_named_block, policy=policy), x)
    assert len(record) == 1 and "names ['nope']" in str(record[0].message)


@pytest.mark.parametrize("policy", [
    cp.save_only_these_names("attn", "mlp"), cp.save_any_names_but_these("attn"),
    cp.dots_saveable, cp.everything_saveable, None,
    lambda ctx, op, *a, **k: op is torch.ops.aten.mm.default,
], ids=["only", "any_but", "dots", "everything", "none", "torch_sac"])
def test_no_warning_when_every_name_is_used_or_the_policy_names_nothing(policy: object) -> None:
    x = torch.randn(4, 4, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ckptfx.UnusedNameWarning)
        ckptfx.remat(_named_block, policy=policy)(x).sum().backward()
    assert_clean()


def test_names_of_a_nested_block_do_not_count_for_the_outer_one() -> None:
    inner = ckptfx.remat(_named_block, policy=cp.save_only_these_names("attn", "mlp"))

    def outer_fn(x: torch.Tensor) -> torch.Tensor:
        y = ckptfx.checkpoint_name(x.exp(), "outer")
        return inner(y) * 2

    x = torch.randn(4, 4, requires_grad=True)
    outer = ckptfx.remat(outer_fn, policy=cp.save_only_these_names("outer", "attn"))
    _, record = _caught(outer, x)
    assert len(record) == 1  # the outer block, about 'attn'; the inner uses all its names
    assert "<locals>.outer_fn (" in str(record[0].message)
    assert "names ['attn']" in str(record[0].message)
    assert "the names it used: ['outer']" in str(record[0].message)
    assert_clean()


def test_unused_name_check_under_torch_func_and_no_grad() -> None:
    x = torch.randn(4, 4)
    block = ckptfx.remat(_named_block, policy=cp.save_only_these_names("typo"))
    with torch.no_grad():  # not recorded: not checked
        assert _caught(block, x)[1] == []
    (g, record) = _caught(torch.func.grad(lambda x: block(x).sum()), x)
    assert len(record) == 1 and "names ['typo']" in str(record[0].message)
    assert "it used" in str(record[0].message)
    assert _caught(torch.func.grad(lambda x: block(x).sum()), x)[1] == []
    assert_bitwise([g], [torch.func.grad(lambda x: _named_block(x).sum())(x)])
    assert_clean()


def test_a_forward_that_raises_leaves_no_name_scope_and_does_not_use_up_the_check() -> None:
    x = torch.randn(4, 4, requires_grad=True)

    def fails_once(x: torch.Tensor, _state=[0]) -> torch.Tensor:  # noqa: B006
        _state[0] += 1
        if _state[0] == 1:
            ckptfx.checkpoint_name(x.sin(), "typo_not")
            raise ValueError("first call fails")
        return _named_block(x)

    block = ckptfx.remat(fails_once, policy=cp.save_only_these_names("typo"))
    with pytest.raises(ValueError, match="first call fails"):
        _caught(block, x)
    assert_clean()
    assert len(_caught(block, x)[1]) == 1  # the first forward that completes is checked


def test_unused_names_are_checked_per_thread() -> None:
    """A name used on one thread never counts for a block running on another at that time."""
    barrier = threading.Barrier(2, timeout=30)

    def uses_attn(x: torch.Tensor) -> torch.Tensor:
        barrier.wait()  # the other block is running now
        y = ckptfx.checkpoint_name(x.sin(), "attn")
        barrier.wait()
        return y

    def uses_nothing(x: torch.Tensor) -> torch.Tensor:
        barrier.wait()
        barrier.wait()  # the other thread has named "attn" meanwhile
        return x.sin()

    policy = cp.save_only_these_names("attn")
    blocks = {"attn": ckptfx.remat(uses_attn, policy=policy),
              "nothing": ckptfx.remat(uses_nothing, policy=policy)}
    errors: list[BaseException] = []

    def run(which: str) -> None:
        try:
            blocks[which](torch.randn(4, requires_grad=True))
            assert name_scopes.stack == []
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    # catch_warnings patches process-wide state: one recorder, around both threads.
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        threads = [threading.Thread(target=run, args=(k,)) for k in blocks]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []
    messages = [str(w.message) for w in record if w.category is ckptfx.UnusedNameWarning]
    assert len(messages) == 1
    assert "block test_unused_names_are_checked_per_thread.<locals>.uses_nothing" in messages[0]


# -- sessions: nothing left behind ------------------------------------------------------------


def test_nested_session_context_leaves_no_session() -> None:
    refs = []
    with pytest.raises(ckptfx.CheckpointError, match="do not nest") as info:
        with ckptfx.recompute_session_ctx("a"):
            refs.append(weakref.ref(session_mod._registry["a"]))
            with ckptfx.recompute_session_ctx("b"):
                pass  # pragma: no cover
    assert ckptfx.recompute_session_stats() == {}  # while the traceback still holds it
    assert "a" not in session_mod._registry and "b" not in session_mod._registry
    del info
    gc.collect()
    assert refs[0]() is None
    assert_clean()


def test_session_under_torch_func_leaves_no_session() -> None:
    block = ckptfx.remat(lambda x: x.sin() * x)
    x = torch.randn(3)
    refs = []
    with pytest.raises(ckptfx.CheckpointError, match="recompute sessions need plain autograd") \
            as info:
        with ckptfx.recompute_session_ctx("c"):
            refs.append(weakref.ref(session_mod._registry["c"]))
            torch.func.grad(lambda x: block(x).sum())(x)
    assert ckptfx.recompute_session_stats() == {}
    del info
    gc.collect()
    assert refs[0]() is None
    assert_clean()


def test_session_context_without_checkpointed_blocks_leaves_no_session() -> None:
    x = torch.randn(3, requires_grad=True)
    with ckptfx.recompute_session_ctx("plain", retain_on_unpack=True):
        assert "plain" in ckptfx.recompute_session_stats()  # live while open
        torch.autograd.grad(x.sin().sum(), x)
    assert_clean()


def test_session_with_frames_survives_its_context_until_cleared() -> None:
    x = torch.randn(3, requires_grad=True)
    out = ckptfx.remat(lambda x: x.sin().exp())(x)
    with ckptfx.recompute_session_ctx("s", retain_on_unpack=True):
        (g1,) = torch.autograd.grad(out.sum(), x, retain_graph=True)
    assert ckptfx.recompute_session_stats()["s"].frames == 1
    with ckptfx.recompute_session_ctx("s"):
        (g2,) = torch.autograd.grad(out.sum(), x)
    ckptfx.clear_recompute_session("s")
    assert_bitwise([g1, g2], [torch.autograd.grad(x.sin().exp().sum(), x)[0]] * 2)
    assert_clean()


def test_checkpoint_without_arguments_says_it_is_not_a_decorator() -> None:
    """jax.checkpoint(f) returns a function; ckptfx.checkpoint(f, *args) calls f now, as
    torch's does. Called with no arguments for an f that needs some, the error says so and
    points at remat; a function of no arguments is still checkpointed."""
    def block(x: torch.Tensor) -> torch.Tensor:
        return x.sin()

    for policy in (None, cp.dots_saveable):
        with pytest.raises(TypeError, match="missing 1 required positional") as info:
            ckptfx.checkpoint(block, policy=policy)
        assert "use ckptfx.remat(function, policy=...)" in "".join(
            getattr(info.value, "__notes__", ["use ckptfx.remat(function, policy=...)"]))
    with pytest.raises(TypeError, match=r"keyword arguments \['mask'\] but no function"):
        ckptfx.checkpoint(mask=None)  # a function's argument where the curried form's go
    with pytest.raises(ValueError, match="determinism_check"):
        ckptfx.checkpoint(determinism_check="sometimes")  # checked at once, curried too
    with pytest.raises(TypeError, match="function must be callable"):
        ckptfx.checkpoint(policy=cp.dots_saveable)(3)
    w = torch.randn(3, requires_grad=True)
    out = ckptfx.checkpoint(lambda: (w * 2).sin())
    out.sum().backward()
    assert torch.equal(w.grad, torch.autograd.grad((w * 2).sin().sum(), w)[0])


def test_grad_split_hints_has_aux_for_a_pair() -> None:
    w = torch.randn(3, requires_grad=True)
    dx_fn, _ = ckptfx.grad_split(lambda x: ((x * w).sum(), x.detach()))
    with pytest.raises(TypeError, match="it returned a pair: .* pass has_aux=True"):
        dx_fn(torch.randn(3), session="aux")
    assert not ckptfx.recompute_session_stats()


# -- what users bring from torch and JAX: their argument orders, names and habits ------------


def _tiny_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()) for _ in range(3)])


def test_a_checkpoint_function_where_the_policy_goes_is_refused_at_once() -> None:
    # torch's apply_activation_checkpointing takes checkpoint_wrapper_fn second; ckptfx's
    # second argument is the policy. A checkpoint function or wrapper there used to be
    # accepted and fail inside torch at the first forward.
    import functools

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        checkpoint_wrapper as torch_wrapper)

    model = _tiny_model()
    for wrong in (torch_wrapper, functools.partial(torch_wrapper, preserve_rng_state=True),
                  ckptfx.checkpoint, ckptfx.checkpoint_wrapper,
                  torch.utils.checkpoint.checkpoint):
        with pytest.raises(TypeError, match=r"policy takes what a checkpointed block keeps.*"
                           r"got the checkpoint function .*checkpoint_wrapper_fn second"):
            ckptfx.apply_activation_checkpointing(model, wrong)
    assert all(type(m).__name__ in ("Sequential", "Linear", "ReLU") for m in model.modules())
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(TypeError, match="got the checkpoint function ckptfx.checkpoint: "):
        ckptfx.remat(torch.sin, policy=ckptfx.checkpoint)
    with pytest.raises(TypeError, match="got the checkpoint function torch.utils.checkpoint"):
        ckptfx.checkpoint(torch.sin, x, policy=torch.utils.checkpoint.checkpoint)
    assert_clean()


@pytest.mark.parametrize("key, got", [
    (torch.tensor(0), "got a tensor: a tensor hashes by identity"),
    (("stage0", torch.tensor(1)), "got a tuple holding a tensor"),
    (("stage0", [1]), "got a tuple holding an unhashable list"),
    (None, "got None"),
])
def test_session_keys_that_cannot_name_a_session_are_refused_everywhere(key: object,
                                                                       got: str) -> None:
    # Two torch.tensor(0) hash differently, so a tensor key named a new session on every
    # call and could not be cleared; every entry point refuses it with the same words.
    x = torch.randn(3, requires_grad=True)
    with ckptfx.recompute_handle_collector_ctx() as handles:
        out = ckptfx.checkpoint(torch.sin, x)
    calls = [
        ("session_id", lambda: ckptfx.recompute_handle(handles[0], key)),
        ("session_id", lambda: ckptfx.recompute_session_ctx(key).__enter__()),
        ("session_id", lambda: ckptfx.clear_recompute_session(key)),
        ("grad_split dx_fn: session",
         lambda: ckptfx.grad_split(lambda v: v.sin().sum())[0](x, session=key)),
    ]
    if key is not None:  # vjp_split's session=None is its own fresh key
        calls.append(("vjp_split: session", lambda: ckptfx.vjp_split(torch.sin, x, session=key)))
    for what, call in calls:
        with pytest.raises(ValueError, match=rf"^{what} must be a hashable key.*{got}"):
            call()
    out.sum().backward()  # the frame was left as it was: a plain backward
    assert torch.equal(x.grad, torch.autograd.grad(torch.sin(x).sum(), x)[0])
    assert_clean()


def test_split_without_primals_says_so() -> None:
    with pytest.raises(TypeError, match=r"^vjp_split: no primals given, but x_argnums=0 names "
                       r"one; call vjp_split\(fun, \*primals\)"):
        ckptfx.vjp_split(torch.sin)
    dx_fn, dw_fn = ckptfx.grad_split(lambda v: v.sin().sum())
    with pytest.raises(TypeError, match=r"^grad_split: no primals given, .* call dx_fn"):
        dx_fn(session="mb")
    x = torch.randn(3, requires_grad=True)
    dx_fn(x, session="mb")  # the session key was not taken by the failed call
    dw_fn(session="mb")
    # x_argnums=() asks for no input gradient: a function of no primals is fine
    lin = torch.nn.Linear(3, 2)
    inputs = torch.randn(4, 3)
    _, dx, dw = ckptfx.vjp_split(lambda: ckptfx.checkpoint(lin, inputs), x_argnums=(),
                                 params=lin.parameters())
    dx(torch.ones(4, 2))
    dw()
    plain = torch.autograd.grad(lin(inputs), [lin.weight, lin.bias], torch.ones(4, 2))
    assert_bitwise([lin.weight.grad, lin.bias.grad], list(plain))
    assert_clean()


def test_grad_split_non_scalar_error_shows_shape_not_values() -> None:
    x = torch.full((4, 8), 0.123456789, requires_grad=True)
    dx_fn, _ = ckptfx.grad_split(lambda v: v * 2)
    with pytest.raises(TypeError, match=r"got a torch.float32 tensor of shape \(4, 8\)$") as info:
        dx_fn(x, session=0)
    assert "0.24" not in str(info.value)
    dx_fn, _ = ckptfx.grad_split(lambda v: v.sum().detach())
    with pytest.raises(TypeError, match=r"got a torch.float32 tensor of shape \(\) that does "
                       r"not require grad$"):
        dx_fn(x, session=0)
    assert_clean()


@pytest.mark.parametrize("value", ["False", 0, 1.0])
def test_use_reentrant_must_be_a_bool(value: object) -> None:
    x = torch.randn(3, requires_grad=True)
    message = rf"use_reentrant must be a bool .* got {type(value).__name__} {value!r}"
    with pytest.raises(TypeError, match=message):
        ckptfx.checkpoint(torch.sin, x, use_reentrant=value)
    with pytest.raises(TypeError, match=message):
        ckptfx.checkpoint_sequential(torch.nn.Sequential(torch.nn.Identity()), 1, x,
                                     use_reentrant=value)
    with pytest.raises(TypeError, match=message):
        ckptfx.checkpoint_wrapper(torch.nn.Linear(3, 3), use_reentrant=value)
    for ok in (False, None):
        assert torch.equal(ckptfx.checkpoint(torch.sin, x, use_reentrant=ok), x.sin())
    assert_clean()


def test_remat_takes_jaxs_prevent_cse_and_it_changes_nothing() -> None:
    # Code ported from jax.checkpoint(f, prevent_cse=False) runs as it is.
    x = torch.randn(4, 4, requires_grad=True)
    for value in (True, False):
        block = ckptfx.remat(_named_block, policy=cp.dots_saveable, prevent_cse=value)
        got = torch.autograd.grad(block(x).sum(), x)
        assert_bitwise(list(got), list(torch.autograd.grad(_named_block(x).sum(), x)))
    with pytest.raises(TypeError, match="prevent_cse must be a bool, got str"):
        ckptfx.remat(_named_block, prevent_cse="no")
    assert_clean()


def test_checkpoint_wrapper_unknown_options_list_the_accepted_ones() -> None:
    module = torch.nn.Linear(3, 3)
    with pytest.raises(TypeError, match=r"unknown checkpoint options \['checkpoint_impl'\]; "
                       r"it takes context_fn, .*policy \(checkpoint_impl of torch's "
                       r"checkpoint_wrapper has no counterpart"):
        ckptfx.checkpoint_wrapper(module, checkpoint_impl="no_reentrant")
    assert type(module) is torch.nn.Linear  # nothing changed
