"""The fake accelerator: a PrivateUse1 backend named ``fakeacc`` with two devices.

``fake_device.cpp`` is the backend (memory, generators, streams and events as ids, pinned
memory, autocast, device checks; read its header). This module builds it once per machine
(torch.utils.cpp_extension caches the build by the source's hash), names the backend and
registers the device module torch looks up for RNG, autocast and ``torch.fakeacc.*``.

Rules

1. Register before the process runs its first backward: autograd sizes its pool of device
   threads then (``conftest.py`` calls ``register()`` on its first lines).
2. ``register()`` never raises: it returns the reason the device is missing (``UNAVAILABLE``
   keeps it), and tests that need the device skip with that reason, except where
   ``CKPTFX_REQUIRE_FAKE_DEVICE=1`` (CI), where a failed build fails the run.

Example::

    import fake_device
    fake_device.register()
    x = torch.randn(4, device="fakeacc:1")   # host memory, backward on autograd's device thread
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pathlib
import sys
import types
from typing import Any

import torch

NAME = "fakeacc"
_HERE = pathlib.Path(__file__).resolve().parent
_ext: Any = None
UNAVAILABLE: str | None = "fake device not registered yet (call fake_device.register())"


def _build() -> Any:
    from torch.utils import cpp_extension

    build_dir = pathlib.Path(os.environ.get(
        "CKPTFX_FAKE_DEVICE_BUILD",
        pathlib.Path.home() / ".cache" / "ckptfx" / f"fake_device_py{sys.version_info[0]}{sys.version_info[1]}"
        f"_torch{torch.__version__.replace('+', '_')}",
    ))
    build_dir.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(
        name="ckptfx_fake_device",
        sources=[str(_HERE / "fake_device.cpp")],
        build_directory=str(build_dir),
        extra_cflags=["-O1"],
        verbose=False,
    )


class _Event(torch.Event):
    """``torch.fakeacc.Event``: torch's generic event on this device (an id; see the .cpp)."""

    def __new__(cls, enable_timing: bool = False, blocking: bool = False,
                interprocess: bool = False) -> "_Event":
        return super().__new__(cls, device=NAME, enable_timing=enable_timing,
                               blocking=blocking, interprocess=interprocess)


def _index(device: Any) -> int:
    if device is None:
        return _ext.current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != NAME:
        raise ValueError(f"expected a {NAME} device, got {device}")
    return _ext.current_device() if device.index is None else device.index


class _DeviceContext:
    """``torch.fakeacc.device(i)``: make device ``i`` current inside the block."""

    def __init__(self, device: Any) -> None:
        self.index = _index(device)

    def __enter__(self) -> None:
        self.prev = _ext.current_device()
        _ext.set_device(self.index)

    def __exit__(self, *exc: Any) -> None:
        _ext.set_device(self.prev)


def _device_module() -> types.ModuleType:
    """What torch looks up as ``torch.fakeacc`` (the calls torch's RNG, autocast, checkpoint
    and accelerator code make on a device module)."""
    mod = types.ModuleType(f"torch.{NAME}")
    gens = [_ext.default_generator(i) for i in range(_ext.device_count())]
    mod._initialized = True  # torch.utils.checkpoint saves device RNG only when truthy
    mod.is_initialized = lambda: True
    mod._is_in_bad_fork = lambda: False
    mod.is_available = lambda: True
    mod.device_count = _ext.device_count
    mod.current_device = _ext.current_device
    mod.set_device = lambda device: _ext.set_device(_index(device))
    mod.device = _DeviceContext
    mod.synchronize = lambda device=None: None
    mod.get_rng_state = lambda device="fakeacc": gens[_index(device)].get_state()
    mod.set_rng_state = lambda state, device="fakeacc": gens[_index(device)].set_state(state)
    mod.get_rng_state_all = lambda: [g.get_state() for g in gens]
    mod.set_rng_state_all = lambda states: [g.set_state(s) for g, s in zip(gens, states)]
    mod.manual_seed = lambda seed: gens[_ext.current_device()].manual_seed(int(seed))
    mod.manual_seed_all = lambda seed: [g.manual_seed(int(seed)) for g in gens]
    mod.seed = lambda: gens[_ext.current_device()].seed()
    mod.initial_seed = lambda: gens[_ext.current_device()].initial_seed()
    mod.default_generators = tuple(gens)
    mod.get_amp_supported_dtype = lambda: [torch.float16, torch.bfloat16]
    mod.is_bf16_supported = lambda including_emulation=True: True
    mod.Stream = lambda priority=0: torch.Stream(NAME, priority=priority)
    mod.Event = _Event
    mod.current_stream = lambda device=None: torch.accelerator.current_stream(
        torch.device(NAME, _index(device)))
    mod.stream = lambda stream: stream if stream is not None else contextlib.nullcontext()
    mod.memory_allocated = lambda device=None: _ext.memory_allocated(_index(device))
    mod.max_memory_allocated = lambda device=None: _ext.max_memory_allocated(_index(device))
    mod.reset_peak_memory_stats = lambda device=None: _ext.reset_peak_memory_stats(_index(device))
    return mod


def register() -> str | None:
    """Build (first time on this machine), load and register the fake accelerator.

    Returns None once it is registered, else the reason it could not be (also kept in
    ``UNAVAILABLE``). Safe to call again.
    """
    global _ext, UNAVAILABLE
    if _ext is not None or UNAVAILABLE is None:
        return UNAVAILABLE
    try:
        if torch._C._get_privateuse1_backend_name() not in ("privateuseone", NAME):
            raise RuntimeError("another PrivateUse1 backend is registered in this process")
        _ext = _build()
        if torch._C._get_privateuse1_backend_name() != NAME:
            torch.utils.rename_privateuse1_backend(NAME)
            torch.utils.generate_methods_for_privateuse1_backend()
        torch._register_device_module(NAME, _device_module())
        _settle_device_threads()
    except Exception as err:  # Rule 2: the reason, for the skips
        _ext = None
        UNAVAILABLE = f"the fake accelerator could not be built or registered: {err!r}"[:500]
        if os.environ.get("CKPTFX_REQUIRE_FAKE_DEVICE") == "1":
            raise
        return UNAVAILABLE
    UNAVAILABLE = None
    atexit.register(_settle_device_threads)
    return None


def _settle_device_threads() -> None:
    """Leave each of autograd's device threads with nothing that needs Python.

    After a backward returns, its device threads still free the finished graph task, whose
    thread-local state holds Python objects (torch stashes the caller's context there); a
    thread that does so while the interpreter finalizes aborts the process ("terminate called
    without an active exception": torch's exit race, as on CUDA). A thread that has not yet
    taken the GIL once to set itself up does the same. One more backward per device, run
    through the engine directly (no Python object in its task), returns only after that
    device's thread has set itself up and freed every earlier task, and leaves it nothing
    Python to free. Called when the device is registered and at exit."""
    engine = torch.autograd.Variable._execution_engine
    for index in range(_ext.device_count()):
        x = torch.zeros((), device=torch.device(NAME, index), requires_grad=True)
        y = x * 1
        engine.run_backward((y,), (torch.ones_like(y),), False, False, (), False, True)


def available() -> bool:
    return _ext is not None


@contextlib.contextmanager
def stream_log() -> Any:
    """Log what a real device would run asynchronously (fake_device.cpp Rule 4): copies between
    device and host memory, event records and waits, each with its stream, in issue order. The
    list it yields is filled when the block exits. Example::

        with fake_device.stream_log() as log:
            y = x.to("cpu", non_blocking=True)
        assert log == [("d2h", 0, 0, x.nbytes)]
    """
    entries: list[tuple[str, int, int, int]] = []
    _ext.stream_log_start()
    try:
        yield entries
    finally:
        entries.extend(_ext.stream_log_stop())
