"""The replay environment: what must be the same when a block is replayed.

Captured once per forward call and restored around each replay:

- the CPU generator state and, when the accelerator is initialised, the generator state of
  every accelerator device the call's tensor arguments (positional and keyword) live on;
- CPU and accelerator autocast (enabled, dtype, cache), so a replay run outside autocast
  still computes in the forward's dtype;
- the ``torch.device(...)`` context the forward ran under.

The caller's generator states are put back after the replay: a backward or a prefire never
moves the user's RNG. Device code goes through torch's device-module API, so CUDA, NPU and
XPU take the same path.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator

import torch

from . import _compat


def accelerator_type() -> str | None:
    """The accelerator device type of this process ("cuda", "npu", ...), or None."""
    acc = torch.accelerator.current_accelerator()
    return None if acc is None else acc.type


_ACCELERATOR: str | None = accelerator_type()


def _device_module(device_type: str) -> Any:
    return torch.get_device_module(device_type)


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype, bool]:
    return (
        torch.is_autocast_enabled(device_type),
        torch.get_autocast_dtype(device_type),
        torch.is_autocast_cache_enabled(),
    )


class ReplayEnv:
    """RNG, autocast and device context of one forward call, restorable for its replays."""

    __slots__ = ("cpu_rng", "device_type", "device_rng", "cpu_autocast", "device_autocast",
                 "device_ctx")

    def __init__(self, tensors: Iterable[Any], preserve_rng_state: bool) -> None:
        device_type = None
        device_ids: list[int] = []
        for t in tensors:
            if isinstance(t, torch.Tensor):
                dev = t.device
                if dev.type != "cpu" and dev.type != "meta":
                    if device_type is None:
                        device_type = dev.type
                    if dev.type == device_type and dev.index not in device_ids:
                        device_ids.append(dev.index)
        if device_type is None:
            device_type = _ACCELERATOR
        self.device_type = device_type
        self.cpu_rng = torch.get_rng_state() if preserve_rng_state else None
        self.device_rng: list[tuple[int, torch.Tensor]] = []
        if preserve_rng_state and device_type is not None and device_ids:
            mod = _device_module(device_type)
            if mod.is_initialized():
                self.device_rng = [(i, mod.get_rng_state(i)) for i in device_ids]
        self.cpu_autocast = _autocast_state("cpu")
        self.device_autocast = (
            _autocast_state(device_type)
            if device_type is not None and torch.amp.is_autocast_available(device_type)
            else None
        )
        self.device_ctx = _compat.device_context_mode() if _compat.has_function_modes() else None

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        """Run the body as the forward ran: its RNG, autocast and device context.

        The caller's generator states are saved first and put back on exit, also when the
        body raises.
        """
        saved_cpu = None
        saved_dev: list[tuple[int, torch.Tensor]] = []
        mod = None
        if self.cpu_rng is not None:
            saved_cpu = torch.get_rng_state()
            torch.set_rng_state(self.cpu_rng)
        if self.device_rng:
            mod = _device_module(self.device_type)  # type: ignore[arg-type]
            saved_dev = [(i, mod.get_rng_state(i)) for i, _ in self.device_rng]
            for i, state in self.device_rng:
                mod.set_rng_state(state, i)
        try:
            with contextlib.ExitStack() as stack:
                enabled, dtype, cache = self.cpu_autocast
                stack.enter_context(torch.amp.autocast("cpu", enabled=enabled, dtype=dtype,
                                                       cache_enabled=cache))
                if self.device_autocast is not None:
                    enabled, dtype, cache = self.device_autocast
                    stack.enter_context(torch.amp.autocast(
                        self.device_type, enabled=enabled, dtype=dtype, cache_enabled=cache))
                if self.device_ctx is not None:
                    stack.enter_context(self.device_ctx)
                yield
        finally:
            if saved_cpu is not None:
                torch.set_rng_state(saved_cpu)
            if mod is not None:
                for i, state in saved_dev:
                    mod.set_rng_state(state, i)
