"""Where the tensors an unrecorded call of a remat'd block reads live, and their checks.

A later call of a block that keeps nothing may run unrecorded (unrecorded.py), and its replay
then re-runs the block's Python function, which reads every tensor outside its arguments
where it finds it when it runs. This file finds those places and notes what is at them: it
implements Rules 4a and 4d of unrecorded.py (and the last condition of its Rule 2), whose
note gives the detail:

- at a first call, ``owners_of`` and ``modules_near`` name the modules a block belongs to,
  ``places_of`` the one place among them of each tensor its recording read from outside its
  arguments (Rules 2 and 4a), and ``watched_places`` the places of the other tensors a later
  call could read (Rule 4d); ``Unrecorded``, the entry a first call leaves its signature,
  holds them;
- at a later call, ``Unrecorded.current`` notes the tensor at each place and each watched
  place, and its version (Rules 4a and 4d);
- in its replay, ``reads_to_check`` says what the re-run checks at its first read of each
  watched tensor (unrecorded.py's ``_DrawWatch``, Rule 4d).
"""

from __future__ import annotations

import functools
import types
import weakref
from typing import Any, Callable, Sequence

import torch

__all__ = ["Outside", "Unrecorded", "Watched", "modules_near", "owners_of", "places_of",
           "reads_to_check", "watched_places"]  # for unrecorded.py

# What a call's forward reads from outside its arguments (Rule 4a): the dict it is found in
# (a module's ``_parameters``, ``_buffers`` or ``__dict__``), its name there, the tensor and
# its version at the call's start.
Outside = list[tuple[dict[str, Any], str, torch.Tensor, int]]

# What a later call's forward may read that its first call did not (Rule 4d): the place (a
# dict and a name there, or a closure cell and its variable), a weak reference to the tensor
# there at the call's start (a module attribute the forward replaces must not live on for
# this), its version then, and the place's owner (a module's weak reference; for a closure
# cell or a global dict, the cell or dict itself), which names it in an error.
Watched = list[tuple[Any, str, "weakref.ref[torch.Tensor]", int, Any]]

_NOTHING_WATCHED: Watched = []  # a call that watches nothing (never appended to)
_CELL = "<cell>"  # a place's "store": a closure cell of the block's function
_GLOBAL = "<global>"  # a place's "store": a global of the block's function


class Unrecorded:
    """Entry: calls with this signature run unrecorded. ``places`` say where the tensors the
    first call read from outside its arguments live: (module, ``"_parameters"``,
    ``"_buffers"`` or None for a plain attribute, name), the module weakly (Rule 4a).
    ``modules`` and ``others`` say where the other tensors a later call could read live
    (Rule 4d): per module (weakly), the (store, name) of its other tensors; and the block
    function's closure cells (cell, ``_CELL``, variable) and globals (dict, ``_GLOBAL``,
    name) that held a tensor at the first call."""

    __slots__ = ("places", "modules", "others", "watching")

    def __init__(self, places: Sequence[tuple[torch.nn.Module, str | None, str]],
                 watched: Sequence[tuple[Any, str | None, str]] = ()) -> None:
        self.places = tuple((weakref.ref(m), store, name) for m, store, name in places)
        by_module: dict[int, tuple[torch.nn.Module, list[tuple[str | None, str]]]] = {}
        others = []
        for owner, store, name in watched:
            if store is _CELL or store is _GLOBAL:
                others.append((owner, store, name))
            else:
                by_module.setdefault(id(owner), (owner, []))[1].append((store, name))
        self.modules = tuple((weakref.ref(m), tuple(names)) for m, names in by_module.values())
        self.others = tuple(others)
        self.watching = bool(self.modules or self.others)

    def current(self) -> tuple[Outside, Watched] | None:
        """What is at each place now, which this call's forward reads (a
        ``torch.func.functional_call`` may have swapped it in), or None if a place is gone;
        and what is at each watched place now, with its version (Rule 4d).

        Runs at every unrecorded call, so it is lookups only: a dict lookup, a weak
        reference and a ``_version`` read per watched place; there are none where the first
        call read every tensor of the block's modules (a layer's forward), as is usual, and
        ``_MAX_WATCHED`` bounds those of other submodules."""
        found: Outside = []
        for mref, store, name in self.places:
            m: torch.nn.Module | None = mref()
            if m is None:
                return None
            where = m.__dict__ if store is None else m.__dict__[store]
            t = where.get(name)
            if not isinstance(t, torch.Tensor):
                return None
            try:
                found.append((where, name, t, t._version))
            except RuntimeError:  # an inference tensor: no version counter to check
                found.append((where, name, t, -1))
        if not self.watching:  # the usual case: nothing but the places
            return found, _NOTHING_WATCHED
        watched: Watched = []
        if self.modules:
            for mref, names in self.modules:
                m = mref()
                if m is None:
                    continue
                d = m.__dict__
                for store, name in names:  # _note, inlined: this loop is the hot one
                    where = d if store is None else d[store]
                    v: Any = where.get(name)
                    try:
                        watched.append((where, name, weakref.ref(v), v._version, mref))
                    except (TypeError, AttributeError):  # None, or not a tensor now
                        pass
                    except RuntimeError:  # an inference tensor: no version counter
                        watched.append((where, name, weakref.ref(v), -1, mref))
        for where, store, name in self.others:
            if store is _CELL:
                try:
                    _note(watched, where, name, where.cell_contents, where)
                except ValueError:  # an empty cell
                    pass
            else:
                _note(watched, where, name, where.get(name), where)
        return found, watched


def _note(watched: Watched, where: Any, name: str, t: Any, owner: Any) -> None:
    """Add ``t``, found at a watched place, to a call's ``watched`` (skips a non-tensor)."""
    try:
        watched.append((where, name, weakref.ref(t), t._version, owner))
    except (TypeError, AttributeError):  # None, or an object other than a tensor
        pass
    except RuntimeError:  # an inference tensor: no version counter to check
        watched.append((where, name, weakref.ref(t), -1, owner))


def owners_of(fun: Callable[..., Any], args: tuple) -> list[torch.nn.Module]:
    """The modules a block is a method of: ``fun`` itself, the module a bound method or a
    partial is bound to, or the ``self`` a method decorated with ``@remat`` is called with."""
    found: list[torch.nn.Module] = []
    inner = fun
    while isinstance(inner, functools.partial):
        found.extend(a for a in inner.args if isinstance(a, torch.nn.Module))
        inner = inner.func
    if isinstance(inner, torch.nn.Module):
        found.append(inner)
    owner = getattr(inner, "__self__", None)
    if isinstance(owner, torch.nn.Module):
        found.append(owner)
    if not found and args and isinstance(args[0], torch.nn.Module):
        found.append(args[0])
    return found


def modules_near(owners: list[torch.nn.Module], fun: Callable[..., Any]
                 ) -> list[torch.nn.Module]:
    """``owners``, and the modules a plain function's closure holds (``lambda x: layer(x)``):
    where a block's outside tensors may live (Rule 4a; asked at a first call only)."""
    found = list(owners)
    inner = fun
    while isinstance(inner, functools.partial):
        inner = inner.func
    inner = getattr(inner, "__func__", inner)
    for cell in getattr(inner, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, torch.nn.Module):
            found.append(value)
    return found


def places_of(outside: Sequence[torch.Tensor], modules: Sequence[torch.nn.Module]
              ) -> list[tuple[torch.nn.Module, str | None, str]] | None:
    """Where each of ``outside`` lives below ``modules`` (a parameter, a buffer or a plain
    tensor attribute of one of their submodules), or None if one lives elsewhere, or at two
    places (tied weights: ``functional_call`` may swap one place and not the other, and the
    re-run must read each where the forward did) or is a copy made outside (a cast: the cast
    tensor, not the module's, is what the forward read, and nothing checks it later)."""
    if not outside:
        return []
    where: dict[int, list[tuple[torch.nn.Module, str | None, str]]] = {}
    for top in modules:
        for m in top.modules():
            for store in ("_parameters", "_buffers"):
                for name, t in m.__dict__[store].items():
                    if t is not None:
                        _add_place(where, t, (m, store, name))
            for name, t in m.__dict__.items():
                if isinstance(t, torch.Tensor):
                    _add_place(where, t, (m, None, name))
    places = []
    for t in outside:
        w = where.get(id(t))
        if w is None or len(w) != 1:
            return None
        places.append(w[0])
    return places


def _add_place(where: dict[int, list[tuple[torch.nn.Module, str | None, str]]],
               t: torch.Tensor, place: tuple[torch.nn.Module, str | None, str]) -> None:
    # A module reached twice (shared submodule) is one place, not an alias.
    found = where.setdefault(id(t), [])
    if not any(p[0] is place[0] and p[1:] == place[1:] for p in found):
        found.append(place)


def _code_of(fun: Callable[..., Any]) -> Any:
    """The plain Python function behind a block (a partial's, a bound method's, a module's
    ``forward``), or None."""
    inner = fun
    while isinstance(inner, functools.partial):
        inner = inner.func
    if isinstance(inner, torch.nn.Module):
        inner = type(inner).forward
    inner = getattr(inner, "__func__", inner)
    return inner if hasattr(inner, "__code__") else None


def _names_in(code: Any) -> set[str]:
    """The global and attribute names a code object and the code nested in it use."""
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _names_in(const)
    return names


_MAX_WATCHED = 16  # Rule 4d: the most tensors of other submodules a later call notes


def watched_places(fun: Callable[..., Any], modules: list[torch.nn.Module],
                   places: list[tuple[torch.nn.Module, str | None, str]]
                   ) -> list[tuple[Any, str | None, str]]:
    """Rule 4d: where a later call could find a tensor its first call did not read (a branch
    that call did not take), as far as a first call can tell: the tensors in the function's
    closure cells and among the globals its code names, and the other parameters, buffers
    and tensor attributes of ``modules`` (the block's own) and of the modules the first call
    read from; of their other submodules too where these hold at most ``_MAX_WATCHED``
    (every later call notes each one: a method of a whole model, reading one layer, would
    note every other layer's)."""
    inner = _code_of(fun)
    others: list[tuple[Any, str | None, str]] = []
    if inner is not None:
        code = inner.__code__
        for var, cell in zip(code.co_freevars, getattr(inner, "__closure__", None) or ()):
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(value, torch.Tensor):
                others.append((cell, _CELL, var))
        globs = getattr(inner, "__globals__", None) or {}
        for name in sorted(_names_in(code)):
            if isinstance(globs.get(name), torch.Tensor):
                others.append((globs, _GLOBAL, name))
    known = {(id(m), store, name) for m, store, name in places}
    near_ids = {id(m) for m in modules} | {id(m) for m, _, _ in places}
    near: list[tuple[Any, str | None, str]] = []
    far: list[tuple[Any, str | None, str]] = []
    seen: set[int] = set()
    for top in modules:
        for m in top.modules():
            if id(m) in seen:
                continue
            seen.add(id(m))
            found = near if id(m) in near_ids else far
            for store in ("_parameters", "_buffers"):
                for name, t in m.__dict__[store].items():
                    if t is not None and (id(m), store, name) not in known:
                        found.append((m, store, name))
            for name, t in m.__dict__.items():
                if isinstance(t, torch.Tensor) and (id(m), None, name) not in known:
                    found.append((m, None, name))
    if len(far) <= _MAX_WATCHED:
        near += far
    return near + others


_REBOUND = -2  # a check's version: the tensor now at a place that held another one (Rule 4d)


def reads_to_check(watched: Watched) -> dict[int, tuple[torch.Tensor, int, str]]:
    """Rule 4d: what the re-run must not read unchecked, by id: each watched place's tensor
    at the call's start, with its version then, and the tensor now at a watched place that
    then held another one (the forward read the other one, if it read the place)."""
    reads: dict[int, tuple[torch.Tensor, int, str]] = {}
    for where, name, ref, version, owner in watched:
        label = _label(where, name, owner)
        t = ref()
        if t is not None:  # else no one can read it (nor could the forward, if it did)
            reads[id(t)] = (t, version, label)
        if where.__class__ is types.CellType:
            try:
                now = where.cell_contents
            except ValueError:
                continue
        else:
            now = where.get(name)
        if now is not t and isinstance(now, torch.Tensor) and id(now) not in reads:
            reads[id(now)] = (now, _REBOUND, label)
    return reads


def _label(where: Any, name: str | None, owner: Any) -> str:
    """Where a watched tensor lives, in words: ``buffer 'b' of Scale``."""
    if where.__class__ is types.CellType:
        return f"closure variable {name!r}"
    if owner is where:
        return f"global {name!r} of {where.get('__name__', 'a module')}"
    m = owner() if isinstance(owner, weakref.ref) else None
    if m is None:
        return f"{name!r}"
    kind = ("parameter" if where is m.__dict__.get("_parameters")
            else "buffer" if where is m.__dict__.get("_buffers") else "tensor attribute")
    return f"{kind} {name!r} of {type(m).__name__}"
