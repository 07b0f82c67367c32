"""Behaviour of ``ckptfx.checkpoint`` beyond one forward+backward, compared with torch's.

Repeated backward, unpack outside backward, no_grad/inference_mode, per-call early stop,
RNG and autocast handling (the replay environment left whole when one of its contexts fails
to exit, the autocast dtype of an "off" region restored), worker-thread backward, the
torch.compile fallback, and leaks.
"""

from __future__ import annotations

import contextlib
import functools

import gc
import threading
import weakref

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint

import ckptfx
from ckptfx import _compat
from conftest import Counted, assert_bitwise, grads, maybe_autocast, run_variant

pytestmark = pytest.mark.usefixtures("no_hooks_left_behind")

CHECKPOINTED = ("torch", "ckptfx")


def _dropout_block(w: torch.Tensor) -> Counted:
    return Counted(lambda x: F.dropout((x * w).sin(), 0.5, training=True).exp())


def _dropout_case() -> tuple[torch.Tensor, torch.Tensor, Counted, tuple[torch.Tensor, ...]]:
    """A weight, an input, a counted dropout block of them and its plain gradients (not
    counted), with the RNG put back where the plain run started it."""
    torch.manual_seed(0)
    w = torch.randn(8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    block = _dropout_block(w)
    state = torch.get_rng_state()
    expected = torch.autograd.grad(block.fn(x).sum(), [x, w])
    torch.set_rng_state(state)
    return w, x, block, expected


@pytest.mark.parametrize("variant", CHECKPOINTED)
def test_retain_graph_replays_each_backward(variant: str) -> None:
    w, x, block, expected = _dropout_case()
    loss = run_variant(variant, block, x).sum()
    assert block.calls == 1
    for n in (2, 3, 4):
        got = torch.autograd.grad(loss, [x, w], retain_graph=True)
        assert block.calls == n
        assert_bitwise(got, expected)


@pytest.mark.parametrize("variant", CHECKPOINTED)
def test_unpack_outside_backward_replays_each_access(variant: str) -> None:
    x = torch.randn(4, 8, requires_grad=True)
    block = Counted(lambda x: (x * 2).sin())
    out = run_variant(variant, block, x)
    first = out.grad_fn._saved_self  # sin saved its input, x * 2
    assert block.calls == 2
    second = out.grad_fn._saved_self
    assert block.calls == 3
    assert torch.equal(first, x * 2) and torch.equal(second, x * 2)
    out.sum().backward()  # the backward still works, with its own replay
    assert block.calls == 4
    assert torch.equal(x.grad, 2 * (x * 2).cos())


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("variant", CHECKPOINTED)
def test_no_grad_runs_once_and_saves_nothing(variant: str, mode: str) -> None:
    x = torch.randn(4, 8, requires_grad=True)
    block = Counted(lambda x: x.sin().cos())
    ctx = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with ckptfx.recompute_handle_collector_ctx() as handles, ctx:
        out = run_variant(variant, block, x)
    assert block.calls == 1
    assert not out.requires_grad and out.grad_fn is None
    assert torch.equal(out, x.detach().sin().cos())
    assert handles == []  # no frame was made


def _tail_counting_block():
    """A block whose Python code after its last saving op counts how far a replay got."""
    tail = Counted(lambda: None)

    def block(x):
        y = x.sin()  # the last (and only) op that saves a tensor
        z = y + 1  # an early-stopped replay ends here, at the next torch call
        tail()
        return z

    return block, tail


@pytest.mark.parametrize("torch_global", [True, False])
@pytest.mark.parametrize("early_stop", [True, False])
def test_early_stop_is_per_call(early_stop: bool, torch_global: bool) -> None:
    block, tail = _tail_counting_block()
    x = torch.randn(4, requires_grad=True)
    with torch_checkpoint.set_checkpoint_early_stop(torch_global):
        ckptfx.checkpoint(block, x, early_stop=early_stop).sum().backward()
    assert tail.calls == (1 if early_stop else 2)
    assert torch.equal(x.grad, x.cos())


@pytest.mark.parametrize("switch", [True, False, None])
@pytest.mark.parametrize("variant", CHECKPOINTED)
def test_global_debug_switch_leaves_gradients_and_replays_unchanged(variant: str,
                                                                    switch: bool | None
                                                                    ) -> None:
    """Under torch's set_checkpoint_debug_enabled, which turns ckptfx's debug on or off as it
    does torch's, a block that replays faithfully gives the same gradients, bit for bit,
    with one replay: debug only records ops for an error message."""
    w, x, block, expected = _dropout_case()
    with torch_checkpoint.set_checkpoint_debug_enabled(switch):
        loss = run_variant(variant, block, x).sum()
    assert_bitwise(torch.autograd.grad(loss, [x, w]), expected)
    assert block.calls == 2


def test_rng_moved_between_forward_and_backward() -> None:
    # The replay uses the forward's RNG state, whatever the caller drew since; the caller's
    # state after the backward is what it was before it.
    w, x, block, expected = _dropout_case()
    loss = ckptfx.checkpoint(block, x).sum()
    torch.randn(100)  # the caller moves on
    before = torch.get_rng_state()
    got = torch.autograd.grad(loss, [x, w])
    assert torch.equal(torch.get_rng_state(), before)
    assert_bitwise(got, expected)


@pytest.mark.parametrize("variant", CHECKPOINTED)
def test_a_replay_that_raises_puts_rng_and_autocast_back(variant: str) -> None:
    # The replay runs in the forward's RNG and autocast state (bf16 autocast here, the
    # backward outside it); when the block raises during the replay the error reaches the
    # caller as it is, and the caller's generator state and autocast state are its own
    # again, as with torch's checkpoint.
    calls = []

    def block(x):
        calls.append(torch.is_autocast_enabled("cpu"))
        if len(calls) == 2:
            raise KeyError("replay failed")
        return F.dropout(x.sin(), 0.5, training=True).exp()

    x = torch.randn(16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = run_variant(variant, block, x)
    torch.randn(10)  # the caller moves on
    before = torch.get_rng_state()
    with pytest.raises(KeyError, match="replay failed"):
        out.sum().backward()
    assert calls == [True, True]  # the replay ran under the forward's autocast
    assert torch.equal(torch.get_rng_state(), before)
    assert not torch.is_autocast_enabled("cpu")
    assert torch.get_autocast_dtype("cpu") == torch.bfloat16  # torch's default, untouched


# Found in review of the kernel's replay environment (was test_review_regressions_3.py).
def test_replay_env_leaves_every_context_when_one_exit_raises() -> None:
    # A replay environment enters the forward's autocast and torch.device contexts; if one
    # exit raises (here the device context's), the others are left all the same and the
    # caller's RNG is put back: no autocast outlives the replay.
    from ckptfx.kernel.replay_env import ReplayEnv

    class ExitRaises:
        def __enter__(self) -> None:
            pass

        def __exit__(self, *exc: object) -> None:
            raise RuntimeError("device context exit failed")

    with torch.autocast("cpu", dtype=torch.bfloat16):
        env = ReplayEnv([], True)
    env.device_ctx = ExitRaises()
    torch.manual_seed(7)
    before = torch.get_rng_state()
    with pytest.raises(RuntimeError, match="device context exit failed"):
        with env.restored():
            assert torch.is_autocast_enabled("cpu")
            torch.rand(3)
    assert not torch.is_autocast_enabled("cpu")
    assert torch.equal(torch.get_rng_state(), before)


def test_preserve_rng_state_false_does_not_restore() -> None:
    torch.manual_seed(0)
    x = torch.randn(64, requires_grad=True)
    masks = []

    def block(x):
        y = F.dropout(x, 0.5, training=True)
        masks.append(y != 0)
        return y.sin()

    out = ckptfx.checkpoint(block, x, preserve_rng_state=False, determinism_check="none")
    out.sum().backward()
    # Without the restore the replay draws a fresh mask (so the gradient is not exact: that
    # is what preserve_rng_state=True is for).
    assert len(masks) == 2 and not torch.equal(masks[0], masks[1])


@pytest.mark.parametrize("variant", CHECKPOINTED)
def test_autocast_backward_outside_autocast(variant: str) -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    dtypes = []

    def block(x):
        y = lin(x)
        dtypes.append(y.dtype)
        return F.gelu(y)

    with maybe_autocast(True):
        ref = block(x)
    expected = torch.autograd.grad(ref.float().sum(), [x, *lin.parameters()])
    with maybe_autocast(True):
        out = run_variant(variant, block, x)
    got = torch.autograd.grad(out.float().sum(), [x, *lin.parameters()])  # no autocast here
    assert dtypes == [torch.bfloat16] * 3  # the replay ran in the forward's dtype
    assert_bitwise(got, expected)


X2 = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
W = torch.randn(6, 6, generator=torch.Generator().manual_seed(2))


def _ambient_autocast_block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu"):  # no dtype: the one autocast around it holds, even off
        y = x @ w
    return (y.float().sin() * 2).sum(0)


# Found in review of the replay's autocast state (was test_review_regressions_2.py).
@pytest.mark.parametrize("forward_dtype,backward_dtype", [
    (torch.float16, None),   # forward in fp16-then-off, backward outside autocast (bf16)
    (None, torch.float16),   # forward outside autocast, backward in fp16-then-off
])
def test_replay_restores_the_autocast_dtype_of_an_off_region(
        forward_dtype: torch.dtype | None, backward_dtype: torch.dtype | None) -> None:
    # An "autocast off" state still carries a dtype and a cache flag, which an inner
    # torch.autocast("cpu") takes up: the replay must restore them, as torch's does.
    def around(dtype: torch.dtype | None) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        if dtype is not None:
            stack.enter_context(torch.autocast("cpu", dtype=dtype))
            stack.enter_context(torch.autocast("cpu", enabled=False))
        return stack

    results = {}
    for name, run in (("plain", _ambient_autocast_block),
                      ("torch", lambda a, b: torch.utils.checkpoint.checkpoint(
                          _ambient_autocast_block, a, b, use_reentrant=False)),
                      ("ckptfx", lambda a, b: ckptfx.checkpoint(_ambient_autocast_block, a, b))):
        x, w = X2.clone().requires_grad_(), W.clone().requires_grad_()
        with around(forward_dtype):
            out = run(x, w)
        with around(backward_dtype):
            results[name] = torch.autograd.grad(out.sum(), (x, w))
    for name in ("torch", "ckptfx"):
        assert all(torch.equal(a, b) for a, b in zip(results[name], results["plain"])), name


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_backward_on_worker_thread(autocast: bool) -> None:
    torch.manual_seed(0)
    w = torch.randn(8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    block = _dropout_block(w)
    state = torch.get_rng_state()
    with maybe_autocast(autocast):
        expected_loss = block.fn(x).float().sum()
    expected = torch.autograd.grad(expected_loss, [x, w])
    torch.set_rng_state(state)
    with maybe_autocast(autocast):
        loss = ckptfx.checkpoint(block, x).float().sum()
    errors: list[BaseException] = []

    def work() -> None:
        try:
            loss.backward()
        except BaseException as err:  # reported on the main thread below
            errors.append(err)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert errors == []
    assert block.calls == 2
    assert_bitwise(grads([x, w]), list(expected))


def test_compile_falls_back_to_torch_checkpoint() -> None:
    graphs: list[str] = []

    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    def block(x, *, w):
        return (x.sin() * w).cos()

    @torch.compile(backend=backend, fullgraph=True)
    def compiled(x, w):
        return ckptfx.checkpoint(block, x, w=w)

    x = torch.randn(4, requires_grad=True)
    w = torch.randn(4, requires_grad=True)
    got = torch.autograd.grad(compiled(x, w).sum(), [x, w])
    expected = torch.autograd.grad(block(x, w=w).sum(), [x, w])
    assert_bitwise(got, expected)
    assert len(graphs) == 1 and "tag_activation_checkpoint" in graphs[0]


def _torch_checkpoint_calls_as_if_compiling(monkeypatch) -> list[dict]:
    """Make ckptfx see dynamo tracing, and list the keyword arguments of each call it then
    makes to torch's checkpoint (which still runs)."""
    calls: list[dict] = []
    real = torch_checkpoint.checkpoint

    def spy(fn, *args, **kwargs):
        calls.append(kwargs)
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(_compat, "is_compiling", lambda: True)
    monkeypatch.setattr(torch_checkpoint, "checkpoint", spy)
    return calls


def test_default_call_under_compile_passes_the_defaults_and_keeps_them(monkeypatch) -> None:
    # a call with every option at its default shares one read-only options map: the compile
    # branch gets its own copy of it, with ckptfx's context_fn in place of torch's
    from ckptfx.checkpoint import DEFAULT_OPTIONS

    before = dict(DEFAULT_OPTIONS)
    calls = _torch_checkpoint_calls_as_if_compiling(monkeypatch)
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    out = ckptfx.checkpoint(lin, x)
    assert len(calls) == 1 and calls[0]["early_stop"] is True
    assert calls[0]["preserve_rng_state"] is True and "debug" not in calls[0]
    assert isinstance(calls[0]["context_fn"], functools.partial)
    assert dict(DEFAULT_OPTIONS) == before
    with pytest.raises(TypeError):
        DEFAULT_OPTIONS["debug"] = True  # type: ignore[index]
    assert torch.equal(out, torch.nn.functional.linear(x, lin.weight, lin.bias))


@pytest.mark.parametrize("wrapped", [False, True], ids=["checkpoint", "checkpoint_wrapper"])
def test_is_compiling_branch_calls_torch_checkpoint(monkeypatch, wrapped: bool) -> None:
    calls = _torch_checkpoint_calls_as_if_compiling(monkeypatch)
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    if wrapped:
        out = ckptfx.checkpoint_wrapper(lin, early_stop=False)(x)
    else:
        out = ckptfx.checkpoint(lin, x, early_stop=False)
    assert len(calls) == 1
    assert calls[0]["use_reentrant"] is False and calls[0]["early_stop"] is False
    # never torch's noop_context_fn (dynamo refuses it passed in): ckptfx's own, a partial
    # dynamo accepts, which replays random numbers under the eager backend (lowering.py)
    assert calls[0]["context_fn"] is not torch_checkpoint.noop_context_fn
    assert isinstance(calls[0]["context_fn"], functools.partial)
    assert torch.equal(out, torch.nn.functional.linear(x, lin.weight, lin.bias))


@pytest.mark.parametrize("retain_graph", [False, True])
def test_no_leak_after_graph_freed(retain_graph: bool) -> None:
    x = torch.randn(4, 8, requires_grad=True)
    replayed: list[weakref.ref] = []

    def block(x):
        h = (x * 2).exp()  # exp saves its output: h is a saved (then replayed) tensor
        replayed.append(weakref.ref(h))
        return h.sin()

    with ckptfx.recompute_handle_collector_ctx() as handles:
        out = ckptfx.checkpoint(block, x)
    frame = weakref.ref(handles[0].frame)
    out.sum().backward(retain_graph=retain_graph)
    gc.collect()
    # The replayed tensors are handed out once and dropped, even while the graph lives.
    assert len(replayed) == 2 and all(r() is None for r in replayed)
    if retain_graph:
        assert frame() is not None  # the retained graph still holds it
    del out
    gc.collect()
    assert frame() is None
    assert handles[0].frame is None


def test_checkpoint_wrapper_survives_torch_save_and_load() -> None:
    """torch.save(model) pickles the module by its class; the generated checkpointed class is
    made again from the original one on load, with its options, parameters and behaviour."""
    import copy
    import io

    torch.manual_seed(0)
    nn = torch.nn
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 2))
    ckptfx.checkpoint_wrapper(model[0], early_stop=False)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for other in (loaded, copy.deepcopy(model)):
        assert type(other[0]) is type(model[0]) and isinstance(other[0], nn.Linear)
        assert other[0]._ckptfx_options == {"early_stop": False}
        assert other.state_dict().keys() == model.state_dict().keys()
        calls = []
        other[0].register_forward_hook(lambda *a: calls.append(1))
        x = torch.randn(3, 4, requires_grad=True)
        g = torch.autograd.grad(other(x).sum(), [x, *other.parameters()])
        x2 = x.detach().requires_grad_()
        g_ref = torch.autograd.grad(model(x2).sum(), [x2, *model.parameters()])
        assert all(torch.equal(a, b) for a, b in zip(g, g_ref))
        assert calls == [1]


@pytest.mark.parametrize("policy", [None, "dots"])
def test_curried_form_checkpoints_as_the_direct_call(policy: str | None) -> None:
    """``checkpoint(**options)(function)(*args, **kwargs)``: torch's curried form (after
    2.13) and torch_remat's, and a decorator; the same gradients and replays as the direct
    call."""
    from ckptfx import checkpoint_policies as cp

    pol = cp.dots_saveable if policy else None
    w = torch.randn(4, 4, requires_grad=True)
    calls = [0]

    def block(x: torch.Tensor, *, scale: float) -> torch.Tensor:
        calls[0] += 1
        return torch.tanh(x @ w).sin() * scale

    x = torch.randn(3, 4, requires_grad=True)
    expected = torch.autograd.grad(block(x, scale=0.5).sum(), [x, w])
    calls[0] = 0
    out = ckptfx.checkpoint(policy=pol, early_stop=False)(block)(x, scale=0.5)
    assert torch.equal(out, block(x, scale=0.5).detach())
    calls[0] = 0
    actual = torch.autograd.grad(out.sum(), [x, w])
    assert all(torch.equal(a, e) for a, e in zip(actual, expected))
    assert calls[0] == (1 if pol is None else 0)  # a remat replay runs no Python

    @ckptfx.checkpoint()
    def decorated(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ w).sin() * 0.5

    assert decorated.__name__ == "decorated"

    def named_like_options(x: torch.Tensor, policy: float, debug: bool) -> torch.Tensor:
        return (x * policy).sin() if debug else x
    out = ckptfx.checkpoint(early_stop=False)(named_like_options)(x, policy=2.0, debug=True)
    assert torch.equal(out, (x * 2.0).sin())  # the function's keywords are the function's
    actual = torch.autograd.grad(decorated(x).sum(), [x, w])
    assert all(torch.equal(a, e) for a, e in zip(actual, expected))
