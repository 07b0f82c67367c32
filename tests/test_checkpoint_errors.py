"""Errors of ``ckptfx.checkpoint``: bad input, replay mismatches, misuse, failed forwards.

Bad input raises ValueError/TypeError naming the argument and leaves nothing behind. A replay
that differs from the forward raises ``ckptfx.CheckpointError`` (a subclass of torch's), as
torch's checkpoint does for the same misuse.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint

import ckptfx
from conftest import Counted, run_variant, saved_hooks_stack_empty

pytestmark = pytest.mark.usefixtures("no_hooks_left_behind")

CHECKPOINTED = ("torch", "ckptfx")


def _custom_ctx_fn():
    return contextlib.nullcontext(), contextlib.nullcontext()


BAD_OPTIONS = [
    # (options, exception type, words the message must contain)
    ({"early_stop": "yes"}, TypeError, ("early_stop", "bool")),
    ({"early_stop": 1}, TypeError, ("early_stop", "bool")),
    ({"preserve_rng_state": None}, TypeError, ("preserve_rng_state", "bool")),
    ({"debug": "on"}, TypeError, ("debug", "bool")),
    ({"determinism_check": "strict"}, ValueError, ("determinism_check", "'default'", "'none'")),
    ({"determinism_check": None}, ValueError, ("determinism_check",)),
    ({"context_fn": None}, TypeError, ("context_fn", "callable")),
    ({"context_fn": (contextlib.nullcontext(), contextlib.nullcontext())}, TypeError,
     ("context_fn", "callable")),
    ({"debug": True, "context_fn": _custom_ctx_fn}, ValueError, ("debug=True", "context_fn")),
    ({"use_reentrant": True}, ValueError, ("use_reentrant", "non-reentrant")),
]


@pytest.mark.parametrize("options,exc,words", BAD_OPTIONS,
                         ids=[",".join(f"{k}={v!r}"[:30] for k, v in o.items())
                              for o, _, _ in BAD_OPTIONS])
def test_bad_options(options, exc, words) -> None:
    block = Counted(torch.sin)
    x = torch.randn(3, requires_grad=True)
    with ckptfx.recompute_handle_collector_ctx() as handles:
        with pytest.raises(exc) as info:
            ckptfx.checkpoint(block, x, **options)
    for word in words:
        assert word in str(info.value)
    assert block.calls == 0 and handles == []  # refused before anything ran or was made
    # ... and the next call works.
    ckptfx.checkpoint(block, x).sum().backward()
    assert block.calls == 2 and torch.equal(x.grad, x.cos())


@pytest.mark.parametrize("options", [{"determinism_check": "strict"}, {"context_fn": None},
                                     {"debug": True, "context_fn": _custom_ctx_fn}])
def test_bad_options_same_type_as_torch(options) -> None:
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(Exception) as from_torch:
        torch_checkpoint.checkpoint(torch.sin, x, use_reentrant=False, **options)
    with pytest.raises(Exception) as from_ckptfx:
        ckptfx.checkpoint(torch.sin, x, **options)
    assert type(from_ckptfx.value) is type(from_torch.value)


# -- what context_fn returns ---------------------------------------------------------------


class _Calls(torch.nn.Module):
    """A module whose forward calls ``fn`` (for checkpoint_wrapper)."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


BAD_CONTEXT_PAIRS = {
    "none_pair": lambda: (None, None),
    "none": lambda: None,
    "one_context": lambda: (contextlib.nullcontext(),),
    "three_contexts": lambda: [contextlib.nullcontext()] * 3,
    "recompute_not_a_context": lambda: (contextlib.nullcontext(), "replay"),
    "a_string_of_two": lambda: "ab",
}


@pytest.mark.parametrize("how", ["checkpoint", "checkpoint_wrapper"])
@pytest.mark.parametrize("name", list(BAD_CONTEXT_PAIRS))
def test_context_fn_must_return_a_pair_of_context_managers(name: str, how: str) -> None:
    block = Counted(torch.sin)
    x = torch.randn(3, requires_grad=True)
    module = _Calls(block)
    with ckptfx.recompute_handle_collector_ctx() as handles:
        with pytest.raises(TypeError) as info:
            if how == "checkpoint":
                ckptfx.checkpoint(block, x, context_fn=BAD_CONTEXT_PAIRS[name])
            else:
                ckptfx.checkpoint_wrapper(module, context_fn=BAD_CONTEXT_PAIRS[name])(x)
    message = str(info.value)
    assert "context_fn" in message and "context manager" in message
    assert block.calls == 0 and handles == [] and saved_hooks_stack_empty()
    ckptfx.checkpoint(block, x, context_fn=_custom_ctx_fn).sum().backward()  # the next works
    assert block.calls == 2 and torch.equal(x.grad, x.cos())


@pytest.mark.parametrize("name", ["none_pair", "none", "recompute_not_a_context"])
def test_bad_context_fn_result_same_type_as_torch(name: str) -> None:
    """torch raises TypeError too: in the forward, or for a bad recompute context only when
    its backward enters it; ckptfx raises in the forward, before anything is saved."""
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(Exception) as from_torch:
        torch_checkpoint.checkpoint(torch.sin, x, use_reentrant=False,
                                    context_fn=BAD_CONTEXT_PAIRS[name]).sum().backward()
    with pytest.raises(Exception) as from_ckptfx:
        ckptfx.checkpoint(torch.sin, x, context_fn=BAD_CONTEXT_PAIRS[name])
    assert type(from_ckptfx.value) is type(from_torch.value) is TypeError


@pytest.mark.parametrize("function", [3, None, "sin"])
def test_non_callable_function(function) -> None:
    with pytest.raises(TypeError, match="function must be callable"):
        ckptfx.checkpoint(function, torch.randn(3, requires_grad=True))


@pytest.mark.parametrize("module,options,exc,word", [
    (torch.sin, {}, TypeError, "module"),
    (torch.nn.Linear(2, 2), {"use_reentrant": True}, ValueError, "use_reentrant"),
    (torch.nn.Linear(2, 2), {"early_stop": "no"}, TypeError, "early_stop"),
    (torch.nn.Linear(2, 2), {"preserve_rng": True}, TypeError, "preserve_rng"),
])
def test_checkpoint_wrapper_bad_input(module, options, exc, word) -> None:
    before = type(module)
    with pytest.raises(exc, match=word):
        ckptfx.checkpoint_wrapper(module, **options)
    assert type(module) is before  # left as it was


# -- replay mismatches ----------------------------------------------------------------------


def _dtype_flipping_block():
    """Saves x (position 0), then h twice (positions 1, 2); the replay's h is float64.

    Autograd casts a gradient back to its input's dtype, so with the check off the backward
    still gives the exact gradient: only the check can notice.
    """
    block = Counted(None)

    def fn(x):
        a = x.sin()
        h = x.to(torch.float32 if block.calls == 1 else torch.float64)
        return a.sum() + (h * h).sum().float()

    block.fn = fn
    return block


@pytest.mark.parametrize("variant", CHECKPOINTED)
def test_determinism_check_default_names_position(variant: str) -> None:
    x = torch.randn(4, requires_grad=True)
    loss = run_variant(variant, _dtype_flipping_block(), x)
    with pytest.raises(torch_checkpoint.CheckpointError) as info:
        loss.backward()
    message = str(info.value)
    # torch's sentence, so code written against torch's message keeps working
    assert "tensors have different metadata than during the forward pass" in message
    assert "position 1" in message and "float32" in message and "float64" in message
    if variant == "ckptfx":
        assert isinstance(info.value, ckptfx.CheckpointError)
        assert "debug=True" in message  # says what to try next


@pytest.mark.parametrize("variant", CHECKPOINTED)
def test_determinism_check_none_disables(variant: str) -> None:
    x = torch.randn(4, requires_grad=True)
    block = _dtype_flipping_block()
    run_variant(variant, block, x, ckpt_determinism_check="none").backward()
    assert block.calls == 2
    assert torch.equal(x.grad, x.detach().cos() + 2 * x.detach())


@pytest.mark.parametrize("variant", CHECKPOINTED)
def test_replay_saves_a_different_number_of_tensors(variant: str) -> None:
    x = torch.randn(4, requires_grad=True)
    block = Counted(None)
    block.fn = lambda x: (x.sin().exp() if block.calls == 1 else x.sin()).sum()
    loss = run_variant(variant, block, x, ckpt_early_stop=False)
    with pytest.raises(torch_checkpoint.CheckpointError) as info:
        loss.backward()
    assert "A different number of tensors was saved" in str(info.value)
    if variant == "ckptfx":
        assert isinstance(info.value, ckptfx.CheckpointError)


def test_debug_error_has_op_traces() -> None:
    x = torch.randn(4, requires_grad=True)
    loss = ckptfx.checkpoint(_dtype_flipping_block(), x, debug=True)
    with pytest.raises(ckptfx.CheckpointError) as info:
        loss.backward()
    message = str(info.value)
    assert "position 1" in message
    assert "Ops of the original forward" in message and "Ops of the replay" in message
    forward_part, replay_part = message.split("Ops of the replay")
    assert "aten.sin" in forward_part and "aten.sin" in replay_part
    assert "test_checkpoint_errors.py" in forward_part  # each op names the user's line


def _debug_run(variant: str, switch: bool | None, debug: bool | None = None):
    """The dtype-flipping block's backward error under ``variant`` (``"wrapper"``: a
    ``checkpoint_wrapper``'d module), with torch's global debug switch at ``switch``."""
    x = torch.randn(4, requires_grad=True)
    block = _dtype_flipping_block()
    options = {} if debug is None else {"debug": debug}
    with torch_checkpoint.set_checkpoint_debug_enabled(switch):
        if variant == "wrapper":
            loss = ckptfx.checkpoint_wrapper(_Calls(block), **options)(x)
        else:
            loss = run_variant(variant, block, x, **{f"ckpt_{k}": v for k, v in options.items()})
    with pytest.raises(torch_checkpoint.CheckpointError) as info:
        loss.backward()  # outside the switch: torch reads it at the forward
    return info.value


@pytest.mark.parametrize("variant", ["ckptfx", "wrapper"])
@pytest.mark.parametrize("debug", [None, False])
def test_global_debug_switch_turns_debug_on_as_for_torch(variant: str, debug: bool | None
                                                         ) -> None:
    """torch.utils.checkpoint.set_checkpoint_debug_enabled(True) overrides debug= (left out
    or False): both checkpoints dump their op traces, say that debugging is why, and drop the
    tip that says how to turn it on."""
    from_torch = str(_debug_run("torch", True, debug))
    assert "because you passed `debug=True`" in from_torch
    assert "Tip: To see a more detailed error message" not in from_torch
    err = _debug_run(variant, True, debug)
    assert isinstance(err, ckptfx.CheckpointError)
    message = str(err)
    assert "position 1" in message  # the mismatch itself is still said
    assert "Ops of the original forward" in message and "Ops of the replay" in message
    assert "You are seeing these op lists because checkpoint debugging is on" in message
    assert "set_checkpoint_debug_enabled(True) was active" in message
    assert "Tip: pass debug=True" not in message


@pytest.mark.parametrize("variant", ["ckptfx", "wrapper"])
def test_global_debug_switch_off_overrides_debug_true_as_for_torch(variant: str) -> None:
    from_torch = str(_debug_run("torch", False, True))
    assert "because you passed `debug=True`" not in from_torch
    assert "Tip: To see a more detailed error message" in from_torch
    message = str(_debug_run(variant, False, True))
    assert "Ops of the original forward" not in message
    assert message.endswith(ckptfx.kernel.frame.DEBUG_TIP)
    assert "set_checkpoint_debug_enabled(True)" in message  # the tip names both switches


def test_debug_true_error_says_why_it_shows_ops_instead_of_the_tip() -> None:
    message = str(_debug_run("ckptfx", None, True))
    assert "Ops of the original forward" in message
    assert "checkpoint debugging is on for this block: debug=True was passed" in message
    assert "Tip: pass debug=True" not in message


@pytest.mark.parametrize("how", ["checkpoint", "checkpoint_wrapper"])
def test_global_debug_switch_with_a_context_fn_is_refused_as_by_torch(how: str) -> None:
    block = Counted(torch.sin)
    x = torch.randn(3, requires_grad=True)
    with torch_checkpoint.set_checkpoint_debug_enabled(True):
        with pytest.raises(ValueError, match="debug=True is incompatible"):
            torch_checkpoint.checkpoint(block, x, use_reentrant=False,
                                        context_fn=_custom_ctx_fn)
        with ckptfx.recompute_handle_collector_ctx() as handles:
            with pytest.raises(ValueError) as info:
                if how == "checkpoint":
                    ckptfx.checkpoint(block, x, context_fn=_custom_ctx_fn)
                else:
                    ckptfx.checkpoint_wrapper(_Calls(block), context_fn=_custom_ctx_fn)(x)
    assert "set_checkpoint_debug_enabled(True)" in str(info.value)
    assert "context_fn" in str(info.value)
    assert block.calls == 0 and handles == []


@pytest.mark.parametrize("variant", CHECKPOINTED)
def test_second_unpack_in_one_backward(variant: str) -> None:
    class ReadsTwice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * 2

        @staticmethod
        def backward(ctx, g):
            (a,) = ctx.saved_tensors
            (b,) = ctx.saved_tensors
            return g * 2

    x = torch.randn(4, requires_grad=True)
    loss = run_variant(variant, lambda x: ReadsTwice.apply(x.sin()), x).sum()
    with pytest.raises(torch_checkpoint.CheckpointError) as info:
        loss.backward()
    assert "Unpack is being triggered for a tensor that was already unpacked once" in str(
        info.value)
    assert "GraphExecGroup" not in str(info.value)
    if variant == "ckptfx":
        assert isinstance(info.value, ckptfx.CheckpointError)


@pytest.mark.parametrize("variant", CHECKPOINTED)
@pytest.mark.parametrize("early_stop", [True, False])
def test_replay_saves_more_tensors(variant: str, early_stop: bool) -> None:
    """Without early stop a replay that saves more than the forward is refused in torch's
    words; with it, the replay ends at the forward's last saved tensor and both accept it."""
    x = torch.randn(4, requires_grad=True)
    block = Counted(None)
    block.fn = lambda x: (x.sin() if block.calls == 1 else x.sin().exp()).sum()
    loss = run_variant(variant, block, x, ckpt_early_stop=early_stop)
    if early_stop:
        loss.backward()
        assert torch.equal(x.grad, x.detach().cos())
        return
    with pytest.raises(torch_checkpoint.CheckpointError) as info:
        loss.backward()
    assert "trying to save more tensors during recomputation" in str(info.value)
    if variant == "ckptfx":
        assert isinstance(info.value, ckptfx.CheckpointError)


@pytest.mark.parametrize("variant", CHECKPOINTED)
def test_overlapping_backward_calls_in_a_graph_exec_group(variant: str) -> None:
    """Two backward calls inside one GraphExecGroup that read the same saved tensor: torch
    refuses the second, and so does ckptfx, with torch's sentence (the group is one key, so
    the first call took the tensor)."""
    w = torch.randn(4, requires_grad=True)
    x = torch.randn(4, requires_grad=True)
    out = run_variant(variant, lambda x, w: (x * w).sin(), x, w).sum()
    with torch_checkpoint.GraphExecGroup():
        torch.autograd.grad(out, x, retain_graph=True)
        with pytest.raises(torch_checkpoint.CheckpointError) as info:
            torch.autograd.grad(out, w)
    message = str(info.value)
    assert "Unpack is being triggered for a tensor that was already unpacked once" in message
    assert "Performing two backward calls that overlap" in message
    if variant == "ckptfx":
        assert isinstance(info.value, ckptfx.CheckpointError)
        assert "recompute_session_ctx" in message  # what to do instead


# -- a forward that raises leaves nothing behind ------------------------------------------------


def _raising_flat(ck, x):
    return ck(lambda x: x.sin() * (1 / 0), x)


def _raising_nested(ck, x):
    return ck(lambda x: ck(lambda h: h.exp() + int("not a number"), x.sin()), x)


class _Failing(contextlib.AbstractContextManager):
    def __exit__(self, *exc):
        return None

    def __enter__(self):
        raise KeyError("forward context failed")


def _raising_context(ck, x):
    return ck(torch.sin, x, context_fn=lambda: (_Failing(), contextlib.nullcontext()))


@pytest.mark.parametrize("raiser,exc", [(_raising_flat, ZeroDivisionError),
                                        (_raising_nested, ValueError),
                                        (_raising_context, KeyError)],
                         ids=["flat", "nested", "context_fn"])
def test_forward_that_raises_leaves_nothing(raiser, exc) -> None:
    x = torch.randn(4, requires_grad=True)
    with ckptfx.recompute_handle_collector_ctx() as handles:
        with pytest.raises(exc):
            raiser(ckptfx.checkpoint, x)
    assert saved_hooks_stack_empty()
    assert handles == []
    # The next call works normally (and its tensors are not packed into the failed frame).
    block = Counted(lambda x: (x * 3).sin())
    ckptfx.checkpoint(block, x).sum().backward()
    assert block.calls == 2 and torch.equal(x.grad, 3 * (x * 3).cos())


def test_forward_context_that_swallows_the_error() -> None:
    class Swallow(contextlib.AbstractContextManager):
        def __exit__(self, *exc):
            return True

    x = torch.randn(4, requires_grad=True)
    with pytest.raises(RuntimeError, match="suppressed an exception"):
        ckptfx.checkpoint(lambda x: x.sin() / 0 + [], x,
                          context_fn=lambda: (Swallow(), contextlib.nullcontext()))
    assert saved_hooks_stack_empty()
