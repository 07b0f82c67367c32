"""What each random op of a recorded block replays its generators from (segment.py Rule 3b,
tracer.py Rule 5).

The tracer asks ``Draws`` at every random op, and around every op that might draw without
saying so. Generator states are compared, never assumed: a draw continues from the previous
one only if its generators are where that one left them, and starts from the block's start
state only if they still hold it; anything else stores the states, so a generator reseeded
or set inside the block, outside the dispatcher, replays as it ran.
"""

from __future__ import annotations

from typing import Any, Hashable

import torch

from ckptfx.recording.segment import (
    BLOCK_START,
    CPU_DEFAULT,
    DEVICE_BLOCK_START,
    Segment,
    rng_states,
)

__all__ = ["Draws", "generator_keys"]


class Draws:
    """The draws of one recording so far: for each generator (a key: an explicit generator's
    ``id``, or ``("default", device type, index)``) the last random op that drew from it and
    the state it left."""

    def __init__(self, env: Any, seg: Segment) -> None:
        self.env = env
        self.seg = seg
        # Generator key -> the last random op that drew from it, and op -> its keys.
        self.last_draw: dict[Hashable, int] = {}
        self.draw_keys: dict[int, frozenset[Any]] = {}
        self.drawn_types: set[str] = set()  # device types drawn on so far, by any generator
        # Generator key -> its state after the last recorded draw from it.
        self.after: dict[Hashable, torch.Tensor] = {}

    def states_for(self, index: int, device: Any, gens: list[torch.Generator],
                   keys: frozenset[Hashable]) -> Any:
        """What random op ``index`` replays its generators from (segment.py Rule 3b): nothing
        when the random op before it drew from the same generators, nothing else drew from
        them in between and they are where that op left them (the replay runs that op first
        and continues from there), ``BLOCK_START`` for the block's first draw from the CPU
        generator and ``(DEVICE_BLOCK_START, index)`` for its first draw from a device's
        default generator while they still hold the state the frame captured when the block
        began, else the states themselves (tracer.py Rule 5: a generator reseeded or set inside the
        block is never assumed to continue)."""
        now = {k: _key_state(k, gens) for k in keys}
        prev = {self.last_draw.get(k) for k in keys}
        self._drew(index, keys)
        # A block-start state serves only the block's first draw on that device type by any
        # name: an explicit generator may be the default one under another Python object.
        types = {g.device.type for g in gens} or {_draw_device(device).type}
        first_of_type = not (types & self.drawn_types)
        self.drawn_types |= types
        if len(prev) == 1:
            p = next(iter(prev))
            if p is not None and self.draw_keys[p] == keys and self._untouched(now):
                self.seg.rng_prev[index] = p
                return None
            if p is None and first_of_type:
                env = self.env
                if keys == CPU_DEFAULT and env.cpu_rng is not None:
                    if torch.equal(now[_CPU_KEY], env.cpu_rng):
                        return BLOCK_START
                else:
                    (key,) = keys if len(keys) == 1 else (None,)
                    if isinstance(key, tuple) and key[1] == env.device_type:
                        for i, state in env.device_rng:
                            if i == key[2] and torch.equal(now[key], state):
                                return (DEVICE_BLOCK_START, i)
        states = rng_states(device, gens)
        if states[1] is not None:
            self.seg.rng_devices.add(states[1][1])
        return states

    def _drew(self, index: int, keys: frozenset[Hashable]) -> None:
        for k in keys:
            self.last_draw[k] = index
        self.draw_keys[index] = keys

    def _untouched(self, now: dict[Hashable, torch.Tensor]) -> bool:
        """True if every generator in ``now`` holds the state the last recorded draw from it
        left (tracer.py Rule 5)."""
        after = self.after
        for k, state in now.items():
            left = after.get(k)
            if left is None or not torch.equal(state, left):
                return False
        return True

    def note_after(self, keys: frozenset[Hashable], gens: list[torch.Generator]) -> None:
        """After a random op drew from ``keys``: where it left them."""
        for k in keys:
            self.after[k] = _key_state(k, gens)

    def opaque(self, device: Any, before: tuple[Any, ...]) -> Any:
        """After an op whose randomness no schema declares (a custom op, say) ran: its
        generator states if it moved the CPU's or its device's default generator (it drew
        random numbers: the replay must start it from the same states), else None (tracer.py Rule 5)."""
        keys = _default_keys(device)
        moved = False
        for k in keys:
            state = _key_state(k, [])
            if not moved:
                moved = not torch.equal(state, _stored_state(before, k))
            self.after[k] = state
        if not moved:
            return None
        self._drew(len(self.seg.ops), keys)
        self.drawn_types.add(_draw_device(device).type)
        if before[1] is not None:
            self.seg.rng_devices.add(before[1][1])
        return before


_CPU_KEY = ("default", "cpu", None)


def _draw_device(device: Any) -> torch.device:
    if isinstance(device, str):
        device = torch.device(device)
    return device if isinstance(device, torch.device) else torch.device("cpu")


def generator_keys(device: Any, gens: list[torch.Generator]) -> frozenset[Hashable]:
    """The generators a random op draws from: its explicit ones, else its device's default."""
    if gens:
        return frozenset(id(g) for g in gens)
    dev = _draw_device(device)
    return frozenset({_default_key(dev.type, dev.index)})


def _default_keys(device: Any) -> frozenset[Hashable]:
    """The default generators an op with undeclared randomness may draw from: the CPU's and,
    for an op on a device, that device's."""
    dev = _draw_device(device)
    if dev.type in ("cpu", "meta"):
        return frozenset({_CPU_KEY})
    return frozenset({_CPU_KEY, _default_key(dev.type, dev.index)})


def _key_state(key: Hashable, gens: list[torch.Generator]) -> torch.Tensor:
    """The current state of the generator ``key`` names."""
    if isinstance(key, tuple):
        _, device_type, index = key
        if device_type == "cpu":
            return torch.get_rng_state()
        return torch.get_device_module(device_type).get_rng_state(index)
    for g in gens:
        if id(g) == key:
            return g.get_state()
    raise AssertionError("an explicit generator's key names one of the op's generators")


def _stored_state(states: tuple[Any, ...], key: Hashable) -> torch.Tensor:
    """The state of default generator ``key`` in ``rng_states``'s answer."""
    return states[0] if key == _CPU_KEY else states[1][2]



def _default_key(device_type: str, index: int | None) -> tuple[str, str, int | None]:
    """The key of a device's default generator, however a draw named it: ``"cuda"`` and
    ``"cuda:0"`` are one generator when device 0 is current (the CPU has one, index None)."""
    if device_type != "cpu" and index is None:
        index = torch.get_device_module(device_type).current_device()
    return ("default", device_type, index)
