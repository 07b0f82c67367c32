"""The replay environment: what must be the same when a block is replayed.

Captured once per forward call and restored around each replay:

- the CPU generator state and, when the accelerator is initialised, the generator state of
  every accelerator device the call's tensor arguments (positional and keyword) live on;
- the state of each explicit ``torch.Generator`` the block draws from, as it was before the
  block's first draw, when the caller can see the block's ops (``note_generator``: remat's
  tracer and its torch.func path do; ``ckptfx.checkpoint``, like torch's checkpoint, cannot);
- CPU and accelerator autocast (enabled, dtype, cache), so a replay run outside autocast
  still computes in the forward's dtype;
- the ``torch.device(...)`` context the forward ran under.

The caller's generator states are put back after the replay: a backward or a prefire never
moves the user's RNG. Device code goes through torch's device-module API, so CUDA, NPU and
XPU take the same path.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from . import _compat


def accelerator_type() -> str | None:
    """The accelerator device type of this process ("cuda", "npu", ...), or None."""
    acc = torch.accelerator.current_accelerator()
    return None if acc is None else acc.type


_ACCELERATOR: str | None = accelerator_type()
_CPU_GENERATOR = torch.default_generator  # torch.get_rng_state()'s, without its wrapper


def _device_module(device_type: str) -> Any:
    return torch.get_device_module(device_type)


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype, bool]:
    # All three even when autocast is off: a region inside the block that turns it back on
    # without a dtype (``torch.autocast("cpu")``) takes the dtype and the cache flag from
    # around it, so two "off" states with other dtypes compute differently.
    return (
        torch.is_autocast_enabled(device_type),
        torch.get_autocast_dtype(device_type),
        torch.is_autocast_cache_enabled(),
    )


class ReplayEnv:
    """RNG, autocast and device context of one forward call, restorable for its replays."""

    __slots__ = ("cpu_rng", "device_type", "device_rng", "cpu_autocast", "device_autocast",
                 "device_ctx", "generators")

    def __init__(self, tensors: Iterable[Any], preserve_rng_state: bool) -> None:
        device_type = None
        device_ids: list[int] = []
        for t in tensors:
            if isinstance(t, torch.Tensor) and not t.is_cpu:  # is_cpu: no device object
                dev = t.device
                if dev.type != "cpu" and dev.type != "meta":
                    if device_type is None:
                        device_type = dev.type
                    if dev.type == device_type and dev.index not in device_ids:
                        device_ids.append(dev.index)
        if device_type is None:
            device_type = _ACCELERATOR
        self.device_type = device_type
        self.cpu_rng = _CPU_GENERATOR.get_state() if preserve_rng_state else None
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
        self.device_ctx = _compat.device_context_mode() if _compat.function_mode_count() else None
        self.generators: dict[torch.Generator, torch.Tensor] = {}

    def note_generator(self, generator: torch.Generator) -> None:
        """Record ``generator``'s state if this is the block's first draw from it (call it
        before the op draws)."""
        if generator not in self.generators:
            self.generators[generator] = generator.get_state()

    def restored(self) -> "_Restored":
        """Run the body as the forward ran: its RNG, autocast and device context.

        The caller's generator states are saved first and put back on exit, also when the
        body raises. Autocast is entered only where the current state differs.
        """
        return _Restored(self)


class _Restored:
    """The context manager of ``ReplayEnv.restored`` (a class: replays are frequent)."""

    __slots__ = ("env", "saved_cpu", "saved_dev", "saved_gens", "contexts")

    def __init__(self, env: ReplayEnv) -> None:
        self.env = env

    def __enter__(self) -> None:
        env = self.env
        self.saved_cpu = None
        self.saved_dev: list[tuple[Any, int, torch.Tensor]] = []
        if env.cpu_rng is not None:
            self.saved_cpu = _CPU_GENERATOR.get_state()
            _CPU_GENERATOR.set_state(env.cpu_rng)
        if env.device_rng:
            mod = _device_module(env.device_type)  # type: ignore[arg-type]
            self.saved_dev = [(mod, i, mod.get_rng_state(i)) for i, _ in env.device_rng]
            for i, state in env.device_rng:
                mod.set_rng_state(state, i)
        self.saved_gens = []
        if env.generators:
            self.saved_gens = [(g, g.get_state()) for g in env.generators]
            for g, state in env.generators.items():
                g.set_state(state)
        contexts = []
        if _autocast_state("cpu") != env.cpu_autocast:
            enabled, dtype, cache = env.cpu_autocast
            contexts.append(torch.amp.autocast("cpu", enabled=enabled, dtype=dtype,
                                               cache_enabled=cache))
        if env.device_autocast is not None and _autocast_state(
                env.device_type) != env.device_autocast:  # type: ignore[arg-type]
            enabled, dtype, cache = env.device_autocast
            contexts.append(torch.amp.autocast(env.device_type, enabled=enabled,  # type: ignore
                                               dtype=dtype, cache_enabled=cache))
        if env.device_ctx is not None:
            contexts.append(env.device_ctx)
        if not contexts:  # the common case: RNG only
            self.contexts = contexts
            return
        entered = []
        try:
            for ctx in contexts:
                ctx.__enter__()
                entered.append(ctx)
        except BaseException:
            for ctx in reversed(entered):
                ctx.__exit__(None, None, None)
            self._put_back_rng()
            raise
        self.contexts = entered

    def __exit__(self, *exc: Any) -> None:
        try:
            for ctx in reversed(self.contexts):
                ctx.__exit__(*exc)
        finally:
            self._put_back_rng()

    def _put_back_rng(self) -> None:
        if self.saved_cpu is not None:
            _CPU_GENERATOR.set_state(self.saved_cpu)
        for mod, i, state in self.saved_dev:
            mod.set_rng_state(state, i)
        for g, state in self.saved_gens:
            g.set_state(state)
