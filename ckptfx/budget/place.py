"""Offload as a budget: splitting a frontier point's kept values between device and host memory
(``memory_budget(fraction, offload=...)``).

Rules (numbered on from ckptfx.budget's, whose Rule 5 this is)

5. Cost model. A value kept in host memory (an ``Offload`` answer) is copied there in the
   forward and back for the backward: transfer time over the host link, which the eager side
   (``ckptfx.offload``) overlaps with compute on a side stream, and no FLOPs. For a given
   keep-set the replay runs the same ops wherever its values live, so the FLOPs are the
   same; the split changes the device bytes (at most ``fraction`` of what
   ``everything_saveable`` keeps, exactly as without offload) and the host bytes (at most
   ``offload`` of it, and as few as the plan can make them: every byte crosses the link
   twice, slower than recomputing an elementwise op reads device memory).

5a. Units and bytes. The policy answers per op and a view of a kept value is kept with it,
   so the values of one storage live where the ops that make, rewrite or alias it say: a
   *unit* is a connected set of the point's ops and the storages they output (an op with
   several outputs joins theirs); it is offloaded whole or not at all. Its ops answer
   ``Offload(min_bytes=MIN_OFFLOAD_BYTES)``, and the eager side copies one host copy of a
   whole storage per block call, made when a kept tensor of it has at least that many bytes
   (``ckptfx.offload`` Rules 1-2). So, per storage the point keeps: its host bytes are the
   storage's if a tensor holders keep of it (a saved tensor, a value the replay's frontier
   keeps) is that large; its device bytes are freed only if every such tensor is (a norm's
   statistics beside its output stay on the device). A collective's output is kept
   ``MUST_SAVE`` on the device: its unit is never offloaded.

5b. Choice. Among the frontier points with at most (fraction + offload) x everything bytes
   whose units split with device bytes <= ``budget_bytes(fraction)`` and host bytes <=
   ``budget_bytes(offload)``: the fewest FLOPs, then the fewest host bytes, then the fewest
   recomputed elements (Rule 2's tie-break, demoted: an elementwise output is cheaper to
   recompute than to copy twice). The split of a point: nothing if it fits the device;
   else, while the device bytes are over, the smallest offloadable unit that alone brings
   them within the limit, or the largest if none does (large values first: attention
   scores, MLP activations); then units no longer needed are put back, smallest first.
   ``memory_budget(fraction)``'s own point always splits (nothing offloaded), so offload
   never recomputes more FLOPs than ``memory_budget(fraction)``, and ``offload=0.0`` is
   exactly that budget (no split is computed). With fraction + offload >= 1 the plan
   recomputes no FLOPs, as everything_saveable, split between the memories.

5c. A model-level budget (``memory_budget_policies(blocks, fraction, offload=...)``) starts
   from every block's own choice (each within its own limits), then moves a block to its
   next frontier point with fewer FLOPs (best FLOPs drop per byte first) while one split of
   all the blocks' units together keeps the model's device and host bytes within the sums
   of the blocks' limits. FLOPs only fall, so the model recomputes no more than with each
   block's own choice.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from ckptfx.budget.model import Frontier, Point, _Model
from ckptfx.kernel.collectives import is_collective
from ckptfx.policies.protocol import Offload

__all__ = ["MIN_OFFLOAD_BYTES", "Placement", "Unit", "offload_answer", "place", "spread_placed",
           "units_of"]

# Values below this many bytes stay on the device (Rule 5a). A host copy has a fixed cost per
# transfer (a copy launch, an event, a pinned buffer from the pool): some microseconds, the
# time PCIe moves about 64 KiB in, so a smaller copy costs more time than its bytes and frees
# little memory; a block's small values (norm statistics, per-token scalars) are many. The
# eager side's own default (``Offload.min_bytes``, 1 KiB) is for hand-written policies that
# name what to offload; the budget passes this larger one to it in every Offload answer.
MIN_OFFLOAD_BYTES = 64 * 1024


@dataclasses.dataclass(frozen=True)
class Unit:
    """Ops whose kept values live in one place (Rule 5a): the device bytes of their kept
    storages, those offloading frees, and the bytes it copies to the host."""

    ops: frozenset[int]
    device: int
    freed: int
    host: int
    offloadable: bool


@dataclasses.dataclass(frozen=True)
class Placement:
    """A frontier point split between memories: the ops whose outputs are offloaded (they
    answer ``offload_answer()``), the rest of the keep-set kept on the device."""

    point: Point
    offload: frozenset[int]
    device: int
    host: int

    @classmethod
    def on_device(cls, point: Point) -> "Placement":
        return cls(point, frozenset(), point.nbytes, 0)


def offload_answer() -> Offload:
    """What the plan's offloaded ops answer: the eager side (``ckptfx.offload``) then copies
    exactly the tensors of at least ``MIN_OFFLOAD_BYTES`` that Rule 5a counts as moved."""
    return Offload(min_bytes=MIN_OFFLOAD_BYTES)


def units_of(frontier: Frontier, point: Point) -> list[Unit]:
    """The offload units of ``point``'s keep-set (Rule 5a), by their first op."""
    model: _Model | None = frontier.recorded
    if model is None or not point.keep or not point.nbytes:
        return []
    seg, root = model.seg, model.root
    kept_packs, _, replay_kept, _ = model.held_by(point.keep)
    parent: dict[Any, Any] = {}

    def find(x: Any) -> Any:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for i in sorted(point.keep):
        for _, slot in seg.ops[i].outs:
            if root[slot] < 0:
                parent[find(("op", i))] = find(("base", seg.base[slot]))
    # (storage, version) -> the bytes of each tensor a holder keeps of it: a copy of the
    # storage is made if one is large enough, and frees the device storage if all are.
    views: dict[tuple[int, int], list[int]] = {}
    targets = {pos: sv for pos, sv, _ in model.packs}
    for pos in kept_packs:
        slot, version = targets[pos]
        views.setdefault((seg.base[slot], version), []).append(model.pack_bytes.get(pos, 0))
    for slot, version in replay_kept:
        views.setdefault((seg.base[slot], version), []).append(model.value_bytes.get(slot, 0))
    stays: set[int] = set()
    device: dict[Any, int] = {}
    host: dict[Any, int] = {}
    for (b, _), sizes in views.items():
        r = find(("base", b))
        if any(n >= MIN_OFFLOAD_BYTES for n in sizes):
            host[r] = host.get(r, 0) + model.nbytes.get(b, 0)
        if any(n < MIN_OFFLOAD_BYTES for n in sizes):
            stays.add(b)
    freed: dict[Any, int] = {}
    for b in {b for b, _ in views}:
        r = find(("base", b))
        device[r] = device.get(r, 0) + model.nbytes.get(b, 0)
        if b not in stays:
            freed[r] = freed.get(r, 0) + model.nbytes.get(b, 0)
    ops: dict[Any, set[int]] = {}
    for key in list(parent):
        if key[0] == "op":
            ops.setdefault(find(key), set()).add(key[1])
    out = []
    for r, members in ops.items():
        if not device.get(r):
            continue  # held only during the forward: where it lives changes nothing
        collective = any(is_collective(frontier.funcs[i]) for i in members)
        out.append(Unit(frozenset(members), device[r], freed.get(r, 0), host.get(r, 0),
                        freed.get(r, 0) > 0 and not collective))
    out.sort(key=lambda u: min(u.ops))
    return out


def _split(units: Sequence[Unit], nbytes: int, device_limit: int, host_limit: int
           ) -> list[Unit] | None:
    """The units to offload so that of ``nbytes`` kept at most ``device_limit`` stay on the
    device and the copies fit ``host_limit`` (Rule 5b), or None."""
    over = nbytes - device_limit
    if over <= 0:
        return []
    pool = sorted((u for u in units if u.offloadable), key=lambda u: (-u.freed, min(u.ops)))
    chosen: list[Unit] = []
    while over > 0:
        if not pool:
            return None
        enough = [u for u in pool if u.freed >= over]
        u = enough[-1] if enough else pool[0]
        pool.remove(u)
        chosen.append(u)
        over -= u.freed
    for u in sorted(chosen, key=lambda u: (u.freed, min(u.ops))):
        if -over >= u.freed:  # still within the limit without it: keep it on the device
            chosen.remove(u)
            over += u.freed
    if sum(u.host for u in chosen) > host_limit:
        return None
    return chosen


def _placed(point: Point, chosen: Sequence[Unit]) -> Placement:
    return Placement(point, frozenset(i for u in chosen for i in u.ops),
                     point.nbytes - sum(u.freed for u in chosen), sum(u.host for u in chosen))


def place(frontier: Frontier, fraction: float, offload: float) -> Placement:
    """The point ``memory_budget(fraction, offload=offload)`` keeps and its split (Rule 5b)."""
    if offload <= 0.0 or fraction >= 1.0:
        return Placement.on_device(frontier.choose(fraction))
    placement = frontier.placements.get((fraction, offload))
    if placement is None:
        placement = frontier.placements[(fraction, offload)] = _place(frontier, fraction,
                                                                      offload)
    return placement


def _place(frontier: Frontier, fraction: float, offload: float) -> Placement:
    device_limit = frontier.budget_bytes(fraction)
    host_limit = frontier.budget_bytes(offload)
    fitting = [p for p in frontier.points if p.nbytes <= device_limit + host_limit]
    # By bytes with strictly falling cost (Rule 3): the first from the top that splits
    # recomputes the fewest FLOPs; of the points that recompute as few (they differ only
    # in the elementwise outputs recomputed), the one that copies the fewest bytes.
    best: tuple[tuple[int, int, int], Placement] | None = None
    for p in reversed(fitting):
        if best is not None and p.flops > best[1].point.flops:
            break
        chosen = _split(units_of(frontier, p), p.nbytes, device_limit, host_limit)
        if chosen is not None:
            placed = _placed(p, chosen)
            key = (p.flops, placed.host, p.elems)
            if best is None or key < best[0]:
                best = (key, placed)
    if best is None:  # unreachable: memory_budget(fraction)'s own point always splits
        return Placement.on_device(frontier.choose(fraction))
    return best[1]


def _pooled(frontiers: Sequence[Frontier], points: Sequence[Point], device_limit: int,
            host_limit: int, cache: dict[tuple[int, frozenset[int]], list[Unit]]
            ) -> list[Placement] | None:
    """One split of all the blocks' units together (Rule 5c), or None."""
    tagged: list[tuple[int, Unit]] = []
    for b, (f, p) in enumerate(zip(frontiers, points)):
        key = (b, p.keep)
        if key not in cache:
            cache[key] = units_of(f, p)
        tagged += [(b, u) for u in cache[key]]
    # Units of different blocks are told apart by a block offset on their op positions, so
    # the split's tie-break (the first op) stays deterministic.
    width = max((len(f.funcs) for f in frontiers), default=0) + 1
    shifted = [Unit(frozenset(i + b * width for i in u.ops), u.device, u.freed, u.host,
                    u.offloadable) for b, u in tagged]
    chosen = _split(shifted, sum(p.nbytes for p in points), device_limit, host_limit)
    if chosen is None:
        return None
    picked = {id(u) for u in chosen}
    per_block: list[list[Unit]] = [[] for _ in frontiers]
    for (b, u), s in zip(tagged, shifted):
        if id(s) in picked:
            per_block[b].append(u)
    return [_placed(p, c) for p, c in zip(points, per_block)]


def spread_placed(frontiers: Sequence[Frontier], fraction: float, offload: float
                  ) -> list[Placement]:
    """Placements for blocks sharing ``fraction`` (device) and ``offload`` (host) of their
    total everything_saveable bytes (Rule 5c)."""
    device_limit = sum(f.budget_bytes(fraction) for f in frontiers)
    host_limit = sum(f.budget_bytes(offload) for f in frontiers)
    placements = [place(f, fraction, offload) for f in frontiers]
    chosen = [pl.point for pl in placements]
    at = [f.points.index(p) if p in f.points else -1 for f, p in zip(frontiers, chosen)]
    cache: dict[tuple[int, frozenset[int]], list[Unit]] = {}
    while True:
        best: tuple[int, int, list[Placement]] | None = None
        best_score: tuple[float, int] | None = None
        used = sum(p.nbytes for p in chosen)
        for i, f in enumerate(frontiers):
            # Host bytes are spent on FLOPs only: the next point that recomputes fewer.
            j = next((j for j in range(at[i] + 1, len(f.points))
                      if f.points[j].flops < chosen[i].flops), None) if at[i] >= 0 else None
            if j is None:
                continue
            nxt = f.points[j]
            extra = nxt.nbytes - chosen[i].nbytes
            if used + extra > device_limit + host_limit:
                continue
            score = ((chosen[i].flops - nxt.flops) / (extra + 1), -i)
            if best_score is not None and score <= best_score:
                continue
            trial = chosen[:i] + [nxt] + chosen[i + 1:]
            pooled = _pooled(frontiers, trial, device_limit, host_limit, cache)
            if pooled is not None:
                best, best_score = (i, j, pooled), score
        if best is None:
            return placements
        i, at[i], placements = best
        chosen[i] = frontiers[i].points[at[i]]
