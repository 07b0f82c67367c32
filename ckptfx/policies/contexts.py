"""What a ``context_fn`` returns, checked; torch's selective-checkpoint contexts, made exact.

``ckptfx.checkpoint(fn, x, context_fn=...)`` (and ``checkpoint_wrapper``) call
``context_fn()`` once per forward and enter the two context managers it returns around the
forward and around each replay. ``checked_contexts`` is that call. Rules:

1. **A pair of context managers, or a TypeError.** The result must unpack into two objects
   whose types have ``__enter__`` and ``__exit__``; anything else (``(None, None)``, a single
   context, a list of three) is a ``TypeError`` naming ``context_fn`` and what it returned,
   raised before the checkpoint makes its frame or pushes a hook, so nothing is left behind.
   torch fails on the same results, later and in its own words.

2. **A cached value that the block writes afterwards is recomputed, not handed out.**
   ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` caches the outputs of the
   ops its policy saves, and the replay takes them from that cache instead of running the op
   again. torch refuses a cached tensor whose version counter moved since, but a write can
   reach the cached storage through an alias that has a version counter of its own: matmul
   returns its ``mm`` output through ``aten._unsafe_view``, so with a 3-D ``x``,
   ``t = x @ w; t.add_(1)`` rewrites the cached ``mm`` output unseen, and the replay, which
   runs the ``add_`` again on the already-written value, hands out wrong tensors (torch 2.13
   gives wrong gradients there). For a pair made by that function, ckptfx therefore watches
   the forward (``_Watch``, a dispatch mode above the caching one): before an op that writes
   in place, every entry cached so far whose storage the op writes (storage identity, not
   version counters) is turned back into "recompute", so the replay runs that op again and
   gets the value the forward had. The forward's outputs may still be written after the
   forward: the aliases of cached storages made by ops that do not share a version counter
   (``_unsafe_view`` and its kind, ``ckptfx._ops``) are kept as version-sharing handles, and
   when a replay starts, an entry whose tensor or such an alias moved on is recomputed as
   well (torch would raise "Tensor cached during selective activation checkpoint has been
   mutated" for the first kind, or hand out the written value for the second). A write the
   dispatcher does not see (``.data``, a NumPy view) is beyond both checks, as it is beyond
   autograd's, and so is one inside a compiled function the block calls (its code runs as
   compiled, unseen by the watch as by torch's caching mode). Recomputing a value is what a plain checkpoint does for every op: the
   gradients are those of no checkpoint, bit for bit.

3. **Nothing else changes.** Other contexts are entered as given. The watch costs one Python
   call per op of the forward of a block with torch's selective-checkpoint contexts (their
   own caching mode costs one already), and nothing in the replay. Under ``torch.compile``
   the checkpoint is torch's op and its contexts are torch's business (functionalization
   sees every write).
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_leaves

from ckptfx import _compat
from ckptfx._ops import OP_INFO, op_info

__all__ = ["checked_contexts"]

# torch's selective-checkpoint internals (the caching and cached modes, and the entry that
# means "run the op again"). Without them (another torch) the contexts are entered as given.
_CACHING = _compat.SAC_CACHING_MODE
_CACHED = _compat.SAC_CACHED_MODE
_RECOMPUTE = _compat.SAC_RECOMPUTE


def checked_contexts(context_fn: Callable[[], Any]) -> tuple[Any, Any]:
    """``context_fn()``, checked (Rule 1), with torch's selective-checkpoint pair guarded
    (Rule 2)."""
    result = context_fn()
    try:
        forward, recompute = result
    except (TypeError, ValueError):
        raise TypeError(
            "context_fn must return a pair (forward_context, recompute_context) of context "
            "managers, such as torch.utils.checkpoint.create_selective_checkpoint_contexts"
            f"(...) returns; it returned {_describe(result)}"
        ) from None
    for which, ctx in (("first (forward)", forward), ("second (recompute)", recompute)):
        kind = type(ctx)
        if not (hasattr(kind, "__enter__") and hasattr(kind, "__exit__")):
            raise TypeError(
                f"context_fn returned {_describe(ctx)} as its {which} context; each of the "
                "two must be a context manager (with __enter__ and __exit__): return "
                "contextlib.nullcontext() for a side that has nothing to enter"
            )
    if (_RECOMPUTE is not None and _CACHING is not None and _CACHED is not None
            and isinstance(forward, _CACHING) and isinstance(recompute, _CACHED)
            and getattr(forward, "storage", None) is not None
            and forward.storage is getattr(recompute, "storage", None)):
        guard = _Guard(forward.storage)
        return _GuardedForward(forward, guard), _GuardedRecompute(recompute, guard)
    return forward, recompute


def _describe(value: Any) -> str:
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{type(value).__name__} {text}"


def _storage_id(t: torch.Tensor) -> int | None:
    """The identity of ``t``'s storage, or None where it has none to read (a wrapper
    subclass, a sparse tensor): such a tensor is matched with every write (Rule 2)."""
    try:
        return t.untyped_storage()._cdata
    except Exception:  # noqa: BLE001 - any tensor without a plain storage
        return None


def _alias_sharing_version(t: torch.Tensor) -> torch.Tensor:
    """A detached alias of ``t`` that shares its version counter, made below autograd (inside
    a dispatch mode, where a plain ``detach`` would get a counter of its own); no mode sees
    it."""
    with _compat.with_inplace_or_view(), torch._C._DisableTorchDispatch():
        return t.detach()


_Entry = tuple[Any, int]  # (storage key of torch's cache, invocation index)


class _Guard:
    """The bookkeeping of one checkpoint call's selective-checkpoint cache (Rule 2)."""

    __slots__ = ("storage", "indexed", "fresh", "aliases")

    def __init__(self, storage: Any) -> None:
        self.storage = storage  # torch's: key -> {index -> entry}
        self.indexed: dict[Any, int] = {}  # key -> entries already filed in ``fresh``
        # storage identity (None: unknown) -> the cached entries holding a tensor on it
        self.fresh: dict[int | None, list[_Entry]] = {}
        # (alias sharing the version counter of a forward alias of a cached storage, the
        # storage's identity, the alias's version when the forward ended (None before))
        self.aliases: list[list[Any]] = []
        # No reference to the watch: the frame keeps this guard (through the recompute
        # context) and must free torch's cache with it by reference counting, not wait for
        # the cycle collector.

    def sync(self) -> None:
        """File the entries torch's caching mode added since the last call."""
        for key, entries in self.storage.items():
            start = self.indexed.get(key, 0)
            n = len(entries)
            if n == start:
                continue
            self.indexed[key] = n
            for idx in range(start, n):
                for leaf in tree_leaves(entries.get(idx)):
                    val = getattr(leaf, "val", None)
                    if isinstance(val, torch.Tensor):
                        self.fresh.setdefault(_storage_id(val), []).append((key, idx))

    def recompute(self, sid: int | None) -> None:
        """Turn every fresh entry on storage ``sid`` back into "recompute"."""
        for key, idx in self.fresh.pop(sid, ()):
            self.storage[key][idx] = _RECOMPUTE
        if self.aliases:
            self.aliases = [a for a in self.aliases if a[1] != sid]

    def before_write(self, written: list[torch.Tensor]) -> None:
        self.sync()
        if not self.fresh:
            return
        self.recompute(None)  # entries of unknown storage: any write may reach them
        for t in written:
            sid = _storage_id(t)
            if sid is None:
                for s in list(self.fresh):
                    self.recompute(s)
                return
            if sid in self.fresh:
                self.recompute(sid)

    def unknown_op(self) -> None:
        """An op whose schema cannot be read may write anything."""
        self.sync()
        for s in list(self.fresh):
            self.recompute(s)

    def note_alias(self, out: Any) -> None:
        self.sync()
        if not self.fresh:
            return
        for t in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(t, torch.Tensor):
                sid = _storage_id(t)
                if sid is not None and sid in self.fresh:
                    self.aliases.append([_alias_sharing_version(t), sid, None])

    def forward_done(self) -> None:
        self.sync()
        for a in self.aliases:
            a[2] = a[0]._version

    def before_replay(self) -> None:
        """Recompute what was written after the forward (Rule 2)."""
        self.sync()
        for alias, sid, version in list(self.aliases):
            if version is not None and alias._version != version:
                self.recompute(sid)
        for sid, entries in list(self.fresh.items()):
            for key, idx in entries:
                for leaf in tree_leaves(self.storage[key].get(idx)):
                    version = getattr(leaf, "version", None)
                    if version is not None and leaf.val._version != version:
                        self.recompute(sid)
                        break
                else:
                    continue
                break

    def after_replay(self) -> None:
        # The replay has taken what it reads; the aliases would only keep storages alive.
        self.aliases = []


class _Watch(_compat.TorchDispatchMode):
    """Above torch's caching mode during the forward: sees each op before it is cached."""

    def __init__(self, guard: _Guard) -> None:
        super().__init__()
        self.guard = guard

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # as torch's caching mode: compiled code runs as compiled

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        info = OP_INFO.get(func)
        if info is None:
            try:
                info = op_info(func)
            except AttributeError:  # no schema (a higher-order op): it may write anything
                self.guard.unknown_op()
                return func(*args, **kwargs)
        writes = info.writes
        if writes:
            written: list[torch.Tensor] = []
            for i, name in writes:
                arg = args[i] if i < len(args) else kwargs.get(name)
                for t in arg if isinstance(arg, (list, tuple)) else (arg,):
                    if isinstance(t, torch.Tensor):
                        written.append(t)
            self.guard.before_write(written)
        out = func(*args, **kwargs)
        if info.alias and not info.view:  # an alias with a version counter of its own
            self.guard.note_alias(out)
        return out


class _GuardedForward:
    """torch's caching mode with the watch pushed above it."""

    __slots__ = ("inner", "guard", "watch")

    def __init__(self, inner: Any, guard: _Guard) -> None:
        self.inner = inner
        self.guard = guard
        self.watch = _Watch(guard)

    def __enter__(self) -> Any:
        entered = self.inner.__enter__()
        try:
            self.watch.__enter__()
        except BaseException:
            self.inner.__exit__(*sys.exc_info())
            raise
        return entered

    def __exit__(self, *exc: Any) -> Any:
        try:
            self.watch.__exit__(*exc)
        finally:
            suppressed = self.inner.__exit__(*exc)
        if exc[0] is None:
            self.guard.forward_done()
        return suppressed


class _GuardedRecompute:
    """torch's cached mode, entered once what was written since is set to recompute."""

    __slots__ = ("inner", "guard")

    def __init__(self, inner: Any, guard: _Guard) -> None:
        self.inner = inner
        self.guard = guard

    def __enter__(self) -> Any:
        self.guard.before_replay()
        return self.inner.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        try:
            return self.inner.__exit__(*exc)
        finally:
            self.guard.after_replay()
