"""Shared test helpers: counted blocks, the three checkpoint variants, bitwise comparison, and
the devices tests run on.

Keep this small and generic; topic-specific helpers belong in the test file that uses them.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Iterator, Sequence

import optree
import pytest
import torch

# The accelerator under test, registered before anything runs a backward: autograd sizes its
# pool of device threads at the first backward of the process (fake_device/__init__.py). Where
# a real accelerator is present (the GPU check, tests/device_check.py) it is the one tested and
# the fake one stays out; CKPTFX_FAKE_DEVICE=0 keeps it out too.
import fake_device  # noqa: E402  (tests/ is on sys.path, as for models.py)

if torch.accelerator.current_accelerator() is None and os.environ.get("CKPTFX_FAKE_DEVICE") != "0":
    fake_device.register()
ACCELERATOR: torch.device | None = torch.accelerator.current_accelerator()
NO_ACCELERATOR_REASON = (
    "no accelerator (CKPTFX_FAKE_DEVICE=0 keeps the fake one out)"
    if os.environ.get("CKPTFX_FAKE_DEVICE") == "0" else str(fake_device.UNAVAILABLE))

# Where device-sensitive tests run: the CPU, where autograd runs the backward on the caller's
# thread, and the accelerator, where it runs on autograd's device threads (skipped, with the
# reason, where there is none).
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        ACCELERATOR.type if ACCELERATOR is not None else "accelerator",
        id=ACCELERATOR.type if ACCELERATOR is not None else "accelerator",
        marks=pytest.mark.skipif(ACCELERATOR is None, reason=NO_ACCELERATOR_REASON),
    ),
]
needs_accelerator = pytest.mark.skipif(ACCELERATOR is None, reason=NO_ACCELERATOR_REASON)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                   items: list[pytest.Item]) -> None:
    """``CKPTFX_SHUFFLE=SEED``: run the tests in an order shuffled by SEED (one test's state
    leaking into the next shows up as a failure in some order; CI runs one shuffled pass).
    The seed is printed, so a failing order can be run again."""
    seed = os.environ.get("CKPTFX_SHUFFLE")
    if not seed:
        return
    import random

    random.Random(seed).shuffle(items)
    print(f"\ntests shuffled with CKPTFX_SHUFFLE={seed}")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Move everything alive after collection (modules, torch, the collected tests) out of the
    collector's sight: the many ``gc.collect()`` of the leak and session tests then scan only
    what the tests made, not the whole of torch each time."""
    import gc

    gc.collect()
    gc.freeze()


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    """Each device-sensitive test runs on the CPU and on the accelerator under test (device
    index 0; the fake accelerator has two devices)."""
    return torch.device(request.param, 0) if request.param != "cpu" else torch.device("cpu")
import torch.utils.checkpoint as torch_checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

import ckptfx

# The three ways to run a block: as is, under torch's non-reentrant checkpoint, under ckptfx.
VARIANTS = ("plain", "torch", "ckptfx")


def run_variant(variant: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call ``fn(*args, **kwargs)`` with no checkpoint, torch's, or ckptfx's.

    Extra checkpoint options go in ``kwargs`` with a ``ckpt_`` prefix (``ckpt_early_stop=``).

    Example::

        out = run_variant("ckptfx", block, x, ckpt_context_fn=my_ctx_fn)
    """
    options = {k[5:]: kwargs.pop(k) for k in list(kwargs) if k.startswith("ckpt_")}
    if variant == "plain":
        return fn(*args, **kwargs)
    if variant == "torch":
        return torch_checkpoint.checkpoint(fn, *args, use_reentrant=False, **options, **kwargs)
    if variant == "ckptfx":
        return ckptfx.checkpoint(fn, *args, **options, **kwargs)
    raise ValueError(f"unknown variant {variant!r}")


def checkpoint_fn(variant: str) -> Callable[..., Any]:
    """The checkpoint callable of a variant, for blocks that checkpoint inside themselves."""
    return lambda fn, *a, **k: run_variant(variant, fn, *a, **k)


class Counted:
    """Wraps a block and counts how many times it runs (forward and replays).

    Example::

        block = Counted(lambda x: x.sin())
        ckptfx.checkpoint(block, x).sum().backward()
        assert block.calls == 2
    """

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.fn(*args, **kwargs)


def assert_bitwise(actual: Sequence[torch.Tensor | None],
                   expected: Sequence[torch.Tensor | None], what: str = "gradient") -> None:
    """Every tensor equal bit for bit (``torch.equal``), None where the other is None."""
    assert len(actual) == len(expected), f"{what}: {len(actual)} vs {len(expected)} tensors"
    for i, (a, e) in enumerate(zip(actual, expected)):
        if a is None or e is None:
            assert a is None and e is None, f"{what} {i}: one side is None"
            continue
        assert a.dtype == e.dtype and a.shape == e.shape, f"{what} {i}: metadata differs"
        assert torch.equal(a, e), (
            f"{what} {i} differs: max abs diff {(a.double() - e.double()).abs().max().item()}"
        )


def grads(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """Clones of ``.grad`` of each tensor (None where there is none)."""
    return [None if t.grad is None else t.grad.clone() for t in tensors]


@contextlib.contextmanager
def maybe_autocast(enabled: bool, device: torch.device | str = "cpu") -> Iterator[None]:
    """bf16 autocast on ``device``'s type (the CPU by default) when ``enabled``, else nothing."""
    if enabled:
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            yield
    else:
        yield


def input_grads(run: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor],
                amp: bool = False) -> list[torch.Tensor]:
    """The gradients of ``run(*xs).float().pow(2).sum()`` for fresh leaf copies ``xs`` of
    ``inputs``, the forward under CPU bf16 autocast when ``amp``.

    Example::

        assert_bitwise(input_grads(ckptfx.remat(f), [x, w]), input_grads(f, [x, w]))
    """
    xs = [t.detach().clone().requires_grad_() for t in inputs]
    with maybe_autocast(amp):
        out = run(*xs)
    out.float().pow(2).sum().backward()
    return [x.grad for x in xs]


def settle_device_threads() -> None:
    """Wait until autograd's device threads have freed the graph tasks of earlier backward
    calls. A backward returns before its device threads drop the finished task, whose state
    carries the caller's Python objects (a session's activation, say); one more backward per
    device, run through the engine directly, returns only after that device's thread freed
    every earlier task. A test that checks what a finished backward let go calls this first."""
    if ACCELERATOR is None:
        return
    engine = torch.autograd.Variable._execution_engine
    for index in range(torch.accelerator.device_count()):
        x = torch.zeros((), device=torch.device(ACCELERATOR.type, index), requires_grad=True)
        y = x * 1
        engine.run_backward((y,), (torch.ones_like(y),), False, False, (), False, True)


def saved_hooks_stack_empty() -> bool:
    """True when no saved-tensor default hooks are pushed on this thread."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is None


@pytest.fixture
def no_hooks_left_behind() -> Iterator[None]:
    """The test must leave the saved-tensor hooks stack empty, as it found it.

    Opt in per module: ``pytestmark = pytest.mark.usefixtures("no_hooks_left_behind")``.
    """
    assert saved_hooks_stack_empty()
    yield
    assert saved_hooks_stack_empty(), "a test left saved-tensor hooks pushed"


@pytest.fixture
def no_sessions_left() -> Iterator[None]:
    """The test starts and ends with no live recompute session (sessions are weak: collect
    first, so only sessions whose frames are still alive are listed)."""
    import gc

    gc.collect()
    for sid in list(ckptfx.recompute_session_stats()):
        ckptfx.clear_recompute_session(sid)
    yield
    gc.collect()
    for sid in list(ckptfx.recompute_session_stats()):
        ckptfx.clear_recompute_session(sid)


def assert_tree_bitwise(actual: Any, expected: Any) -> None:
    """Same pytree structure, every tensor leaf equal bit for bit."""
    a_leaves, a_spec = optree.tree_flatten(actual)
    e_leaves, e_spec = optree.tree_flatten(expected)
    assert a_spec == e_spec
    for i, (a, e) in enumerate(zip(a_leaves, e_leaves)):
        assert a.dtype == e.dtype and a.shape == e.shape, f"leaf {i}: metadata differs"
        assert torch.equal(a, e), (
            f"leaf {i}: max abs diff {(a.double() - e.double()).abs().max().item()}")


class OpCounter(TorchDispatchMode):
    """Counts the ATen ops that run, by overload packet name (``"mm"``, ``"addmm"``)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def gloo_world_of_one(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A one-process gloo group for the module's tests (pipelining needs one), destroyed
    after them."""
    import torch.distributed as dist

    if dist.is_initialized():  # pragma: no cover - another module owns it
        yield
        return
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()
