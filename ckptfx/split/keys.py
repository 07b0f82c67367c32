"""Which split owns which session key: the one registry of ``vjp_split``'s keys.

Rules

1. A split *claims* its session key when it is made (``claim``): the key given by the user,
   or a fresh ``SplitKey``. A key is owned by at most one unfinished split; a second claim
   while the first has not run its dw_fn is a ``ValueError``. A finished split, or one the
   user abandoned, gives the key up to the next claim.

2. The registry holds splits weakly: a split dropped unfinished frees its key.

3. A split clears its own session only while it owns the key (``clear_as_owner``): an
   abandoned split whose key a new split has taken clears nothing, the session being the new
   split's. Such clears are marked per thread, so that ``_note_clear`` tells them apart from
   the user's.

4. A user's ``clear_recompute_session`` of a key whose split has no block in the session yet
   (made, not prefired, dx not run) abandons that split all the same (``_note_clear``, run by
   session.py at every clear): there is no session state that could say so.

A claimant is a ``Split`` (passes.py); this module reads its ``state`` ("forward" until dx
runs, "done" once released), ``session_obj`` (the ``Session`` once a block joined it) and
``abandoned()``, and sets ``cleared_early``.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any, Hashable

from ckptfx.kernel.session import clear_recompute_session, on_clear

__all__ = ["SplitKey", "claim", "clear_as_owner", "forget"]

_lock = threading.Lock()
_owners: "weakref.WeakValueDictionary[Hashable, Any]" = weakref.WeakValueDictionary()
_counter = itertools.count()


class SplitKey:
    """A fresh session key, for splits made without ``session=``."""

    __slots__ = ("n", "__weakref__")

    def __init__(self) -> None:
        self.n = next(_counter)

    def __repr__(self) -> str:
        return f"<vjp_split session {self.n}>"


def claim(key: Hashable, split: Any, who: str) -> None:
    """Rule 1: make ``split`` the owner of ``key``, or raise ``ValueError``."""
    with _lock:
        other = _owners.get(key)
        if other is not None and other.state != "done" and not other.abandoned():
            raise ValueError(
                f"{who}: session {key!r} is already used by a split whose dw_fn has not "
                "run; use one session key per micro-batch (and stage)"
            )
        _owners[key] = split


def forget(key: Hashable, split: Any) -> None:
    """Give ``key`` up if ``split`` owns it."""
    with _lock:
        if _owners.get(key) is split:
            del _owners[key]


_NO_KEY = object()


class _OwnClear(threading.local):
    key: Any = _NO_KEY  # the key a split on this thread is clearing itself


_own_clear = _OwnClear()


def clear_as_owner(key: Hashable, split: Any) -> None:
    """Rule 3: clear ``key``'s session as ``split``, unless another split owns the key."""
    with _lock:
        owner = _owners.get(key)
    if owner is not None and owner is not split:
        return
    _own_clear.key = key
    try:
        clear_recompute_session(key)
    finally:
        _own_clear.key = _NO_KEY


def _note_clear(session_id: Hashable) -> None:
    """Rule 4 (``session.on_clear``). A split's own clears are not the user's."""
    if _own_clear.key is not _NO_KEY and _own_clear.key == session_id:
        return
    with _lock:
        split = _owners.get(session_id)
    if split is not None and split.state == "forward" and split.session_obj is None:
        split.cleared_early = True


on_clear(_note_clear)
