"""The memory-budget planner's model of a recording: scoring keep-sets as tracer.py would keep
and replay them, and the frontier of scored points a budget chooses from.

Rules (numbered with ckptfx.budget's, whose Rules 2 and 3 these implement)

2. ``_Model.score(keep)`` replays, on the recording, exactly what tracer.py does with a
   keep-set (packs.py's Rules 2 and 2b): which packs are kept, which values the replay's
   frontier keeps, and which ops the replay then runs (``Segment._plan``). Bytes are distinct
   storages kept beyond the block's arguments; the cost is (recompute FLOPs, recomputed
   output elements), compared in that order. A whole set is scored, never one value at a
   time: keeping a value removes the need to recompute its producers.

3. ``Frontier`` holds only scored points: sorted by bytes with strictly falling cost, so that
   a budget's choice (the point with the most bytes within it) is monotone in the budget by
   construction. The candidates come from ``budget.cut`` (the min-cut model's hull and a
   branch and bound proving each frontier interval, or the bound it reached), the chains of
   a greedy that adds and one that removes, ``dots_saveable``'s set and, for blocks of at
   most ``EXACT_UNITS`` candidate ops whose proof the search did not finish, every subset.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
from typing import Any, Iterable, Protocol

from ckptfx._format import human_bytes
from ckptfx.budget.cut import MAX_CUTS, CutModel, Proof, prove
from ckptfx.policies.named import DOTS
from ckptfx.recording.segment import Segment


class Recording(Protocol):
    """What the model reads of a planning call's recorder (``planner._PlanningTracer``,
    which imports this module: a protocol keeps the import one way)."""

    seg: Segment
    frame: Any
    root: Any
    op_cost: list[tuple[int, int]]      # op -> (FLOPs, output elements)
    op_view: list[bool]
    nbytes: dict[int, int]              # base slot -> storage bytes
    pack_time: dict[int, int]           # holder position -> ops recorded before
    pack_bytes: dict[int, int]          # holder position -> packed tensor's bytes (0: uncopyable)
    value_bytes: dict[int, int]         # slot -> op output's bytes (0: uncopyable)

__all__ = ["EXACT_UNITS", "Frontier", "Note", "Point", "pareto"]

# Blocks with at most this many candidate ops whose proof is unfinished are solved exactly
# (every subset is scored).
EXACT_UNITS = 10


@dataclasses.dataclass(frozen=True)
class Note:
    """What a budget chose for one call made under ``saved_residuals``."""

    text: str
    planned_now: bool


@dataclasses.dataclass(frozen=True)
class Point:
    """One scored keep-set: the ops whose outputs may be kept, the bytes kept beyond the
    arguments, and the replay's cost (FLOPs, output elements)."""

    keep: frozenset[int]
    nbytes: int
    flops: int
    elems: int

    @property
    def cost(self) -> tuple[int, int]:
        return (self.flops, self.elems)


def pareto(points: Iterable[Point]) -> list[Point]:
    """By bytes (then cost), the points that cost strictly less than every smaller one."""
    best: list[Point] = []
    for p in sorted(points, key=lambda p: (p.nbytes, p.cost, sorted(p.keep))):
        if not best or p.cost < best[-1].cost:
            best.append(p)
    return best


class Frontier:
    """The scored candidates of one recorded block, the choice for a fraction, and what was
    proved about it (``proof``: the min-cut model's hull and bounds, ``budget.cut``)."""

    def __init__(self, points: list[Point], everything: Point, nothing: Point, dots: Point,
                 funcs: tuple[Any, ...], replayable: bool, units: int,
                 proof: Proof | None = None, exhaustive: bool = False) -> None:
        self.everything = everything
        self.everything_keep = everything.keep
        self.nothing = nothing
        self.dots = dots
        self.funcs = funcs
        self.replayable = replayable
        self.units = units
        self.proof = proof
        self.exhaustive = exhaustive
        self.candidates = len(points)
        self.model: _Model | None = None  # set by from_recording, for ``why``
        # The recording's model, replayable or not, for splitting a point between device and
        # host memory (place.py); set by from_recording.
        self.recorded: _Model | None = None
        # (fraction, offload) -> its place.Placement: a planned call asks at every call.
        self.placements: dict[tuple[float, float], Any] = {}
        self.points = pareto(points)  # Rule 3
        # Exact: every budget's choice is proven to recompute the fewest FLOPs (every subset
        # scored, or every frontier interval's search finished), or the block has only
        # nothing and everything.
        self.exact = exhaustive or not replayable or (
            proof is not None and all(p.flops == 0 or self._run_limit(i) in proof.closed
                                      for i, p in enumerate(self.points)))

    def _run_limit(self, i: int) -> int:
        """The most bytes within which nothing cheaper than point ``i`` (in FLOPs) is on the
        frontier: the byte limit the solver proves point ``i``'s FLOPs at."""
        p = self.points[i]
        for q in self.points[i + 1:]:
            if q.flops < p.flops:
                return q.nbytes - 1
        assert self.proof is not None
        return self.proof.top

    def budget_bytes(self, fraction: float) -> int:
        # Bytes are integers; the small slack makes fraction = kept / everything (a float
        # quotient) admit exactly ``kept`` bytes despite rounding.
        return int(math.floor(fraction * self.everything.nbytes + 1e-6))

    def choose(self, fraction: float) -> Point:
        if fraction >= 1.0:
            return self.everything
        if fraction <= 0.0:
            return self.nothing
        limit = self.budget_bytes(fraction)
        choice = self.points[0]
        for p in self.points:
            if p.nbytes <= limit:
                choice = p
        return choice

    def lower_bound(self, limit: int) -> int | None:
        """A proven lower bound on the FLOPs every keep-set within ``limit`` bytes
        recomputes, or None when nothing was proved."""
        if self.exhaustive or not self.replayable:
            best = [p for p in self.points if p.nbytes <= limit]
            return best[-1].flops if best else None
        if self.proof is None:
            return None
        lb = self.proof.lower_bound(limit)
        return None if lb is None else math.ceil(lb)

    def proven(self, p: Point, limit: int) -> str:
        """What is proved of ``p`` as the choice within ``limit`` bytes, in words."""
        if not self.replayable:
            return "the block cannot be replayed from its recording: nothing or everything"
        if self.exhaustive:
            return f"exact: every subset of the {self.units} candidate ops scored"
        proof = self.proof
        assert proof is not None
        lb = self.lower_bound(limit)
        how = (f"{self._hull_place(p)}; min-cut model"
               f"{'' if proof.exact_model else ' (a bound only, here)'}, {proof.cuts} cuts")
        if p.flops == 0 or (lb is not None and lb >= p.flops):
            return f"exact: no keep-set within the budget recomputes fewer FLOPs ({how})"
        if lb is None:
            return f"no bound proved ({how})"
        gap = p.flops - lb
        return f"within {_f(gap)} FLOPs ({100.0 * gap / p.flops:.1f}%) of optimal ({how})"

    def _hull_place(self, p: Point) -> str:
        assert self.proof is not None
        hull = self.proof.hull
        if (p.nbytes, p.flops) in hull:
            return f"hull point {hull.index((p.nbytes, p.flops)) + 1} of {len(hull)}"
        k = sum(1 for b, _ in hull if b <= p.nbytes)
        if k >= len(hull):
            return f"past the last of {len(hull)} hull points"
        return f"between hull points {k} and {k + 1} of {len(hull)}"

    def explain(self, fraction: float, planned_now: bool, choice: "Point | None" = None,
                placement: Any = None, label: str | None = None) -> Note:
        """What a budget chose, in words. ``placement`` (a ``place.Placement``) is the
        choice split between device and host memory; ``label`` names the budget."""
        if placement is not None and placement.offload:
            return self._explain_offload(fraction, planned_now, placement, label or "")
        p = self.choose(fraction) if choice is None else choice
        # A model-level budget (memory_budget_policies) may give the block more or less than
        # its even split: its share, the choice, is then the budget it was held to.
        shared = choice is not None and choice is not self.choose(fraction)
        limit = p.nbytes if shared else self.budget_bytes(fraction)
        budget = (f"its share of a model-level budget of {fraction:g}: {human_bytes(limit)}"
                  if shared else f"budget {human_bytes(limit)}")
        ev, no = self.everything, self.nothing
        lines = [
            f"{label or f'memory_budget({fraction:g})'}: keeps {human_bytes(p.nbytes)} of "
            f"{human_bytes(ev.nbytes)} (everything_saveable; {budget}), recomputes "
            f"{_f(p.flops)} of {_f(no.flops)} FLOPs (nothing_saveable; dots_saveable keeps "
            f"{human_bytes(self.dots.nbytes)} and recomputes {_f(self.dots.flops)}); chosen from "
            f"{len(self.points)} frontier points of {self.candidates} candidates over "
            f"{self.units} ops; {self.proven(p, limit)}",
        ]
        if planned_now:
            lines.append("  (this call planned and kept nothing; later calls with this "
                         "signature keep the set below)")
        for i, saved in self.why(p):
            lines.append(f"  may keep op {i} ({self.funcs[i]}): dropping it would recompute "
                         f"{_f(saved[0])} FLOPs ({saved[1]} elements) more")
        return Note("\n".join(lines), planned_now)

    def _explain_offload(self, fraction: float, planned_now: bool, placement: Any,
                         label: str) -> Note:
        """``explain`` for a choice that keeps some values in host memory (place.py)."""
        p = placement.point
        ev, no = self.everything, self.nothing
        lines = [
            f"{label}: keeps {human_bytes(placement.device)} on the device and "
            f"{human_bytes(placement.host)} in host memory (offloaded) of "
            f"{human_bytes(ev.nbytes)} (everything_saveable; device budget "
            f"{human_bytes(self.budget_bytes(fraction))}), recomputes {_f(p.flops)} of "
            f"{_f(no.flops)} FLOPs (nothing_saveable; memory_budget({fraction:g}) alone "
            f"recomputes {_f(self.choose(fraction).flops)}); chosen from {len(self.points)} "
            f"frontier points of {self.candidates} candidates over {self.units} ops; "
            f"{self.proven(p, p.nbytes)}",
        ]
        if planned_now:
            lines.append("  (this call planned and kept nothing; later calls with this "
                         "signature keep the set below)")
        why = dict(self.why(p))
        for i in sorted(p.keep):
            if i in placement.offload:
                lines.append(f"  offloads op {i} ({self.funcs[i]}) to host memory")
            elif i in why:
                saved = why[i]
                lines.append(f"  may keep op {i} ({self.funcs[i]}): dropping it would "
                             f"recompute {_f(saved[0])} FLOPs ({saved[1]} elements) more")
        return Note("\n".join(lines), planned_now)

    def why(self, p: Point) -> list[tuple[int, tuple[int, int]]]:
        """Per op of ``p``'s keep-set, the cost its keep saves (the cost of the set
        without it, minus ``p``'s), as scored on the recording."""
        if self.model is None:
            return [(i, (0, 0)) for i in sorted(p.keep)]
        out = []
        for i in sorted(p.keep):
            q = self.model.score(p.keep - {i})
            if (q.nbytes, q.cost) != (p.nbytes, p.cost):  # ops whose keep changes nothing
                out.append((i, (q.flops - p.flops, q.elems - p.elems)))
        return out

    @classmethod
    def from_recording(cls, tracer: Recording, max_cuts: int = MAX_CUTS,
                       exhaustive_units: int = EXACT_UNITS) -> "Frontier":
        """Score the candidates of Rule 3 on ``tracer``'s recording. ``max_cuts`` bounds the
        solver's work; blocks of at most ``exhaustive_units`` candidate ops whose proof is
        unfinished have every subset scored."""
        model = _Model(tracer)
        funcs = tuple(op.func for op in tracer.seg.ops)
        everything = model.score(frozenset(range(len(funcs))))
        nothing = model.score(frozenset())
        dots = model.score(frozenset(i for i, f in enumerate(funcs) if f in DOTS))
        if not model.replayable:
            frontier = cls([nothing, everything], everything, nothing, dots, funcs, False, 0)
            frontier.recorded = model
            return frontier
        units = model.units
        model.greedy_add()
        model.greedy_remove()
        proof = prove(model, CutModel(model, funcs), lambda: pareto(model.memo.values()),
                      max_cuts)
        frontier = cls(list(model.memo.values()), everything, nothing, dots, funcs, True,
                       len(units), proof)
        if not frontier.exact and len(units) <= exhaustive_units:
            for r in range(len(units) + 1):
                for combo in itertools.combinations(units, r):
                    model.score(frozenset(combo))
            frontier = cls(list(model.memo.values()), everything, nothing, dots, funcs, True,
                           len(units), proof, exhaustive=True)
        frontier.model = frontier.recorded = model
        return frontier


class _GraphOp:
    __slots__ = ("inputs", "outs")

    def __init__(self, inputs: list[tuple[int, int, int]], outs: list[tuple[int, int]]) -> None:
        self.inputs = inputs
        self.outs = outs


def _graph_only(seg: Segment) -> Segment:
    """The recording's dataflow alone (what ``Segment._plan`` reads), without tensors: a
    cached plan must not keep the block's parameters or anything else alive."""
    lite = Segment()
    lite.ops = [_GraphOp(op.inputs, op.outs) for op in seg.ops]  # type: ignore[misc]
    lite.producer, lite.base = list(seg.producer), list(seg.base)
    lite.writers = {k: list(v) for k, v in seg.writers.items()}
    lite.rng_prev = dict(seg.rng_prev)
    lite.targets = dict(seg.targets)
    lite.replayable, lite.subclass = seg.replayable, seg.subclass
    return lite


class _Model:
    """The recorder's keep and replay rules (``ckptfx.recording.tracer``), run on a recording
    for a given keep-set."""

    def __init__(self, tracer: Recording) -> None:
        seg = _graph_only(tracer.seg)
        self.seg = seg
        self.replayable = seg.replayable and not seg.subclass
        self.root = tracer.root
        self.cost = tracer.op_cost
        self.view = tracer.op_view
        self.nbytes = tracer.nbytes
        # Whether an Offload answer would copy a kept tensor to the host (place.py Rule 5a):
        # per pack, the packed tensor's bytes; per value the replay frontier keeps, the op
        # output's (0 where the eager side never copies it).
        self.pack_bytes = tracer.pack_bytes
        self.value_bytes = tracer.value_bytes
        self.memo: dict[frozenset[int], Point] = {}
        # Per op: its output slots, new (made by it) or rewritten, with the version they
        # have after the op.
        self.op_outs: list[list[tuple[int, bool, int]]] = []
        for i, op in enumerate(seg.ops):
            outs = []
            for _, slot in op.outs:
                base = seg.base[slot]
                ws = seg.writers.get(base, ())
                version = sum(1 for w in ws if w <= i)
                outs.append((slot, seg.producer[slot] == i, version))
            self.op_outs.append(outs)
        # Packs: (holder position, (slot, version), ops recorded before the pack).
        # Only packs whose holder is still alive at the end of the forward: a branch whose
        # result the block dropped takes its saved tensors with it (so does the replay).
        holders = tracer.frame.holders
        self.packs = [(pos, sv, tracer.pack_time.get(pos, 0))
                      for pos, sv in seg.targets.items() if holders[pos]() is not None]
        # Candidate ops: not views (a view inherits its input's keep) with an output that
        # is not an argument.
        self.units = [i for i, outs in enumerate(self.op_outs)
                      if not self.view[i] and any(self.root[s] < 0 for s, _, _ in outs)]

    def score(self, keep: frozenset[int]) -> Point:
        p = self.memo.get(keep)
        if p is not None:
            return p
        seg = self.seg
        _, kept, frontier, wanted = self.held_by(keep)
        available = {sv: True for sv in kept | frontier}
        plan = seg._plan(wanted, available) if wanted else []
        flops = sum(self.cost[i][0] for i in plan)
        elems = sum(self.cost[i][1] for i in plan)
        bases = {seg.base[s] for s, _ in kept | frontier}
        nbytes = sum(self.nbytes.get(b, 0) for b in bases)
        p = self.memo[keep] = Point(keep, nbytes, flops, elems)
        return p

    def held_by(self, keep: frozenset[int]) -> tuple[list[int], set[tuple[int, int]],
                                                     set[tuple[int, int]],
                                                     list[tuple[int, int]]]:
        """What the tracer holds for ``keep``: the holder positions of the packs it keeps,
        their values, the replay frontier's values (kept for the replay only) and the
        values the replay must rebuild, each value as (slot, version)."""
        seg, root = self.seg, self.root
        # decision history: slot -> [(ops recorded when set, decision)]
        decision: dict[int, bool] = {}
        history: dict[int, list[tuple[int, bool]]] = {}
        held: dict[tuple[int, int], bool] = {}
        for i, op in enumerate(seg.ops):
            src = op.inputs[0][1] if op.inputs else None
            for slot, new, version in self.op_outs[i]:
                if new and self.view[i] and src is not None and decision.get(src, False):
                    d = decision[src]  # a view of a kept value: kept with it, not held
                    inherited = True
                else:
                    d = i in keep
                    inherited = False
                decision[slot] = d
                history.setdefault(slot, []).append((i + 1, d))
                if d and not inherited and root[slot] < 0:
                    held[(slot, version)] = True
        kept: set[tuple[int, int]] = set()
        kept_packs: list[int] = []
        wanted: list[tuple[int, int]] = []
        for pos, sv, t in self.packs:
            slot = sv[0]
            if root[slot] >= 0:
                wanted.append(sv)
                continue
            d = False
            for when, value in history.get(slot, ()):
                if when <= t:
                    d = value
            if d:
                kept.add(sv)
                kept_packs.append(pos)
            else:
                wanted.append(sv)
        # the replay's frontier (packs.py, Tracer._keep_what_the_replay_reads)
        frontier: set[tuple[int, int]] = set()
        stack = list(wanted)
        seen: set[tuple[int, int]] = set()
        while stack:
            sv = stack.pop()
            if sv in seen:
                continue
            seen.add(sv)
            if sv in kept:
                continue
            slot, version = sv
            if sv in held and seg.version(slot) == version:
                frontier.add(sv)
                continue
            for i in seg.makers(slot, version):
                if i >= 0:
                    stack.extend((s, v) for _, s, v in seg.ops[i].inputs)
        return kept_packs, kept, frontier, wanted

    def fresh(self) -> "_Model":
        """This model with nothing scored yet (to compare ways of proposing candidates)."""
        model = copy.copy(self)
        model.memo = {}
        return model

    def greedy_add(self) -> None:
        """From nothing, add the op whose keep lowers the cost most per byte added."""
        current: frozenset[int] = frozenset()
        rest = set(self.units)
        while rest:
            base = self.score(current)
            best, best_score = None, None
            for u in sorted(rest):
                p = self.score(current | {u})
                gain = (base.flops - p.flops) + (base.elems - p.elems)
                added = max(p.nbytes - base.nbytes, 0)
                score = (gain / (added + 1), -added, -u)
                if best_score is None or score > best_score:
                    best, best_score = u, score
            assert best is not None
            current = current | {best}
            rest.discard(best)

    def greedy_remove(self) -> None:
        """From everything, drop the op whose keep raises the cost least per byte freed."""
        current = frozenset(self.units)
        while current:
            base = self.score(current)
            best, best_score = None, None
            for u in sorted(current):
                p = self.score(current - {u})
                loss = (p.flops - base.flops) + (p.elems - base.elems)
                freed = max(base.nbytes - p.nbytes, 0)
                score = (-loss / (freed + 1), freed, -u)
                if best_score is None or score > best_score:
                    best, best_score = u, score
            assert best is not None
            current = current - {best}


def _f(n: int) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)
