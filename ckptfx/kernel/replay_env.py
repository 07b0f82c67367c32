"""The replay environment: what must be the same when a block is replayed.

Captured once per forward call and restored around each replay:

- the CPU generator state and, when the accelerator is initialised, the generator state of
  every accelerator device the call's tensor arguments (positional and keyword) live on;
- the state of each explicit ``torch.Generator`` the block draws from, as it was before the
  block's first draw, when the caller can see the block's ops (``note_generator``: remat's
  tracer and its torch.func path do; ``ckptfx.checkpoint``, like torch's checkpoint, cannot);
- CPU and accelerator autocast (enabled, dtype, cache), so a replay run outside autocast
  still computes in the forward's dtype;
- the ``torch.device(...)`` context the forward ran under;
- the default dtype, which ATen reads inside ops (``linspace``, ``randn``, a Python float
  times an integer tensor): a backward run under another default still replays the
  forward's numbers (torch's checkpoint raises "different metadata", or, where the result is
  cast back, gives other gradients).

The caller's generator states are put back after the replay: a backward or a prefire never
moves the user's RNG. Device code goes through torch's device-module API, so CUDA, NPU and
XPU take the same path.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from ckptfx import _compat


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
                 "device_ctx", "generators", "default_dtype")

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
        self.default_dtype = torch.get_default_dtype()

    def note_generator(self, generator: torch.Generator) -> None:
        """Record ``generator``'s state if this is the block's first draw from it (call it
        before the op draws)."""
        if generator not in self.generators:
            self.generators[generator] = generator.get_state()

    def note_generators_of(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """``note_generator`` for each explicit generator a random op is given (positionally,
        or as ``generator=``)."""
        for g in (*args, kwargs.get("generator")):
            if isinstance(g, torch.Generator):
                self.note_generator(g)

    def restored(self) -> "_Restored":
        """Run the body as the forward ran: its RNG, autocast, device context and default
        dtype.

        The caller's generator states are saved first and put back on exit, also when the
        body raises. Autocast is entered only where the current state differs.
        """
        return _Restored(self)

    def enter(self) -> "_Saved":
        """``restored()``'s enter, as a call: returns what ``leave`` needs to put the
        caller's state back (a replay pays two Python calls, not a context manager's five).
        Raises with nothing changed if entering a context raises."""
        saved_cpu = None
        saved_dev: list[tuple[Any, int, torch.Tensor]] = []
        saved_gens: list[tuple[torch.Generator, torch.Tensor]] = []
        if self.cpu_rng is not None:
            saved_cpu = _CPU_GENERATOR.get_state()
            _CPU_GENERATOR.set_state(self.cpu_rng)
        if self.device_rng:
            mod = _device_module(self.device_type)  # type: ignore[arg-type]
            saved_dev = [(mod, i, mod.get_rng_state(i)) for i, _ in self.device_rng]
            for i, state in self.device_rng:
                mod.set_rng_state(state, i)
        if self.generators:
            saved_gens = [(g, g.get_state()) for g in self.generators]
            for g, state in self.generators.items():
                g.set_state(state)
        saved = (saved_cpu, saved_dev, saved_gens, _NO_CONTEXTS)
        contexts: list[Any] = []
        if _autocast_state("cpu") != self.cpu_autocast:
            enabled, dtype, cache = self.cpu_autocast
            contexts.append(torch.amp.autocast("cpu", enabled=enabled, dtype=dtype,
                                               cache_enabled=cache))
        if self.device_autocast is not None and _autocast_state(
                self.device_type) != self.device_autocast:  # type: ignore[arg-type]
            enabled, dtype, cache = self.device_autocast
            contexts.append(torch.amp.autocast(self.device_type, enabled=enabled,  # type: ignore
                                               dtype=dtype, cache_enabled=cache))
        if self.device_ctx is not None:
            contexts.append(self.device_ctx)
        if torch.get_default_dtype() is not self.default_dtype:
            contexts.append(DefaultDtype(self.default_dtype))
        if not contexts:  # the common case: RNG only
            return saved
        entered = []
        try:
            for ctx in contexts:
                ctx.__enter__()
                entered.append(ctx)
        except BaseException:
            ReplayEnv.leave((saved_cpu, saved_dev, saved_gens, entered), None, None, None)
            raise
        return (saved_cpu, saved_dev, saved_gens, entered)

    @staticmethod
    def leave(saved: "_Saved", *exc: Any) -> None:
        """``restored()``'s exit: leave the contexts ``enter`` entered (given the exception
        info, if any) and put the caller's generator states back, also if an exit raises."""
        saved_cpu, saved_dev, saved_gens, contexts = saved
        try:
            if contexts:
                _exit_all(contexts, exc)
        finally:
            if saved_cpu is not None:
                _CPU_GENERATOR.set_state(saved_cpu)
            for mod, i, state in saved_dev:
                mod.set_rng_state(state, i)
            for g, state in saved_gens:
                g.set_state(state)


class DefaultDtype:
    """Run the body under default dtype ``dtype``, and put the caller's back after (a
    function re-run's, and the recorded replay's: segment.py's ``_ReplayGuard``)."""

    __slots__ = ("dtype", "caller")

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __enter__(self) -> None:
        self.caller = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)

    def __exit__(self, *exc: Any) -> None:
        torch.set_default_dtype(self.caller)


def _exit_all(contexts: list[Any], exc: tuple[Any, ...]) -> None:
    """Exit ``contexts``, innermost first, each even if one before it raised (an autocast
    left entered would outlive the replay); the first error is raised once all are out."""
    error: BaseException | None = None
    for ctx in reversed(contexts):
        try:
            ctx.__exit__(*exc)
        except BaseException as err:
            if error is None:
                error = err
    if error is not None:
        raise error


# (caller's CPU state or None, [(device module, index, state)], [(generator, state)],
#  contexts entered): what ReplayEnv.enter saved, for ReplayEnv.leave
_Saved = tuple
_NO_CONTEXTS: list[Any] = []  # never written: enter makes a new list when it has contexts


class _Restored:
    """The context manager of ``ReplayEnv.restored``."""

    __slots__ = ("env", "saved")

    def __init__(self, env: ReplayEnv) -> None:
        self.env = env

    def __enter__(self) -> None:
        self.saved = self.env.enter()

    def __exit__(self, *exc: Any) -> None:
        ReplayEnv.leave(self.saved, *exc)
