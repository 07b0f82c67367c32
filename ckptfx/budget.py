"""``checkpoint_policies.memory_budget(fraction)``: what a remat'd block keeps, chosen by bytes.

A policy is normally asked op by op; a budget needs the whole block before it can choose. So
the budget plans once per remat'd function and call signature, from a recording:

Rules

1. The first call of a remat'd function with a new signature (tensor shapes, dtypes, devices,
   ``requires_grad``, the non-tensor arguments, the autocast state) runs as
   ``nothing_saveable`` (the least memory: a budget is a ceiling, so the call that plans must
   not exceed it) under a recorder that also notes each op's FLOPs
   (``torch.utils.flop_counter``'s formulas), each value's storage bytes and when each saved
   tensor was packed. At the end of that forward the *frontier* is computed and cached: the
   keep-sets (sets of recorded ops whose outputs the policy lets keep) that are not beaten
   in both bytes and recompute cost by another candidate. Later calls with that signature
   pay no planning cost: a per-op policy answers from the chosen set by op position.

2. A keep-set is scored by replaying, on the recording, exactly what trace.py does with it
   (keep.py's Rules 2 and 2b): which packs are kept, which values the replay's frontier keeps, and
   which ops the replay then runs (``Segment._plan``). Bytes are distinct storages kept beyond
   the block's arguments; the cost is (recompute FLOPs, recomputed output elements), compared
   in that order (most elementwise ops count 0 FLOPs; the elements break their ties).
   Keeping a value removes the need to recompute its producers; the score sees that, since
   a whole set is scored, not one value at a time.

3. Candidates: nothing, everything, ``dots_saveable``'s set, every subset when the block has
   at most ``EXACT_UNITS`` candidate ops (so small blocks are solved exactly), and the chains
   of a greedy that adds (best cost drop per byte) and a greedy that removes (least cost rise
   per byte freed). The frontier is sorted by bytes with strictly falling cost; a budget of
   ``fraction`` picks the frontier point with the most bytes at most ``fraction`` times the
   bytes ``everything_saveable`` keeps. Hence, by construction: kept bytes are monotone in
   the fraction, the cost never rises with it, and at the fraction ``dots_saveable`` keeps,
   the cost is at most dots'. ``0.0`` is ``nothing_saveable`` and ``1.0`` is
   ``everything_saveable`` exactly (no planning).

4. Any keep-set is exact (a policy only chooses what is recomputed), so a call whose ops do
   not match the plan (data-dependent control flow) is still exact: from the first op that
   differs, the rest of that call is recomputed (``nothing_saveable``). A block that cannot
   be replayed from its recording (trace.py Rule 4) has only two points: nothing and
   everything. Under ``torch.func`` transforms (func.py's path) the budget acts as
   ``nothing_saveable``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import threading
import weakref
from typing import Any, Callable, Iterable, Sequence

import optree
import torch
from torch.utils.flop_counter import flop_registry

from . import policies as _policies
from ._ops import op_info
from ._signature import per_function, signature
from ._term import human_bytes
from ._tracers import reporting
from .policies import DOTS, Decision, Policy, everything_saveable
from .trace import Segment, Tracer

__all__ = ["BlockShare", "Frontier", "MemoryBudget", "ModelBudget", "memory_budget",
           "memory_budget_policies", "spread"]

# Blocks with at most this many candidate ops are solved exactly (every subset is scored).
EXACT_UNITS = 10


@dataclasses.dataclass(frozen=True)
class MemoryBudget(Policy):
    """Keep at most ``fraction`` of the bytes ``everything_saveable`` would keep beyond the
    block's arguments, choosing what to keep to recompute the fewest FLOPs.

    Made by ``checkpoint_policies.memory_budget(fraction)``; see this module's Rules.
    """

    fraction: float

    def __post_init__(self) -> None:
        f = self.fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)):
            raise TypeError(f"memory_budget: fraction must be a float in [0, 1], got "
                            f"{type(f).__name__} {f!r}")
        if not (0.0 <= f <= 1.0):  # also refuses NaN
            raise ValueError(f"memory_budget: fraction must be in [0, 1] (0.0 keeps nothing, "
                             f"1.0 keeps what everything_saveable keeps), got {f!r}")
        object.__setattr__(self, "fraction", float(f))

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Decision:
        # Asked op by op (the torch.func path, Rule 4): without a plan, recompute.
        return False

    def choose(self, frontier: "Frontier") -> "Point":
        """The frontier point this policy keeps (a model budget's share overrides it)."""
        return frontier.choose(self.fraction)

    def tracer_for(self, fun: Callable[..., Any], args: tuple, kwargs: dict,
                   tensors: Sequence[torch.Tensor]) -> Callable[..., Tracer]:
        """The recorder for one remat call of ``fun``: planning (first call of a signature)
        or answering from the cached plan. Called by ``remat``."""
        if self.fraction in (0.0, 1.0):
            if reporting():
                same = "nothing_saveable" if self.fraction == 0.0 else "everything_saveable"
                _notes.append(Note(f"memory_budget({self.fraction:g}) is {same}", False))
            policy = None if self.fraction == 0.0 else everything_saveable
            return lambda frame, ts, names: Tracer(frame, list(ts), policy, names)
        key = signature(args, kwargs, tensors)
        shared = getattr(fun, "__ckptfx_plan_key__", None)
        if shared is not None:  # e.g. checkpoint_layers' groups of identical layers
            plans = _shared_plans.setdefault(shared, {})
        else:
            plans = _plans_of(fun)
        frontier = plans.get(key)
        if frontier is None:
            def planning(frame: Any, ts: Sequence[torch.Tensor], names: Any) -> Tracer:
                return _PlanningTracer(frame, ts, names, plans, key, self)
            return planning
        choice = self.choose(frontier)
        if reporting():
            _notes.append(frontier.explain(self.fraction, planned_now=False, choice=choice))
        if choice.keep == frontier.everything_keep and not frontier.replayable:
            return lambda frame, ts, names: Tracer(frame, ts, everything_saveable, names)

        def planned(frame: Any, ts: Sequence[torch.Tensor], names: Any) -> Tracer:
            tracer = Tracer(frame, list(ts), None, names)
            if choice.keep:
                tracer.policy = _PlanCursor(choice.keep, frontier.funcs, tracer.seg)
            return tracer
        return planned


def memory_budget(fraction: float) -> MemoryBudget:
    """A policy keeping at most ``fraction`` of what ``everything_saveable`` keeps (bytes
    beyond the block's arguments), chosen to recompute the fewest FLOPs.

    ``0.0`` is ``nothing_saveable``, ``1.0`` is ``everything_saveable``. The first call of a
    block with a new input signature runs as ``nothing_saveable`` and plans; later calls use
    the plan (``print_saved_residuals`` shows it). A fraction outside ``[0, 1]`` is a
    ``ValueError``, a non-number a ``TypeError``.

    Example::

        from ckptfx import checkpoint_policies as cp

        @ckptfx.remat(policy=cp.memory_budget(0.3))
        def block(x):
            return mlp(attention(x))

        block(x).sum().backward()    # plans, recomputes everything this once
        block(x).sum().backward()    # keeps at most 30% of everything_saveable's bytes
    """
    return MemoryBudget(fraction)


def memory_budget_policies(blocks: Sequence[Any], memory_budget: float
                           ) -> list[MemoryBudget]:
    """Spread a model-level budget over ``blocks``: one policy per block, in order.

    The model keeps at most ``memory_budget`` times the bytes ``everything_saveable`` would
    keep in all the blocks together. Until every block has planned (its first call), each
    keeps at most that fraction of its own (a sum of per-block bounds). Once all have, the
    budget is re-spread over them: starting from that even split, the slack it leaves goes
    to the blocks whose next frontier point lowers the recompute cost most per byte, while
    the total fits. So the model never recomputes more than under the even split, and
    blocks that gain most from memory get more of it. ``memory_budget`` outside ``[0, 1]``
    is a ``ValueError``, a non-number a ``TypeError``; ``blocks`` must be a sequence (or an
    ``nn.ModuleList``), else a ``TypeError``. Pass policy ``i`` to block ``i`` only.

    Example::

        policies = ckptfx.memory_budget_policies(model.layers, 0.25)
        calls = [ckptfx.remat(layer.forward, policy=p)
                 for layer, p in zip(model.layers, policies)]
    """
    if isinstance(blocks, (str, bytes)) or not isinstance(blocks, Sequence) and not (
            isinstance(blocks, torch.nn.ModuleList)):
        raise TypeError(f"memory_budget_policies: blocks must be a sequence of blocks, got "
                        f"{type(blocks).__name__}")
    MemoryBudget(memory_budget)  # checks the fraction
    model = ModelBudget(len(blocks))
    return [BlockShare(float(memory_budget), model, i) for i in range(len(blocks))]


class ModelBudget:
    """The frontiers of a model's blocks, and the points a whole-model budget gives them."""

    def __init__(self, n: int) -> None:
        self.frontiers: list[Frontier | None] = [None] * n
        self.shares: list[Point] | None = None
        self.first: int | None = None  # the block that registered first: a step's start
        self.active = False

    # Pickled (torch.save of a model) without what it learned: the frontiers are a cache of
    # plans made from recordings (they hold ATen ops); a loaded model plans again.
    def __getstate__(self) -> dict[str, int]:
        return {"n": len(self.frontiers)}

    def __setstate__(self, state: dict[str, int]) -> None:
        self.__init__(state["n"])  # type: ignore[misc]

    def register(self, index: int, frontier: "Frontier", fraction: float) -> None:
        if self.frontiers[index] is not frontier:
            if self.first is None:
                self.first = index
            self.frontiers[index] = frontier
            self.shares, self.active = None, False
            if all(f is not None for f in self.frontiers):
                self.shares = spread(self.frontiers, fraction)  # type: ignore[arg-type]
        elif self.shares is not None and index == self.first:
            # From the start of the next step: a step in which some blocks already ran
            # with the even split must not give the others their re-spread shares.
            self.active = True


def spread(frontiers: Sequence["Frontier"], fraction: float) -> list["Point"]:
    """Frontier points for blocks sharing ``fraction`` of their total everything_saveable
    bytes: the even split, then upgrades by cost drop per byte while the total fits."""
    limit = sum(f.budget_bytes(fraction) for f in frontiers)
    chosen = [f.choose(fraction) for f in frontiers]
    at = [f.points.index(p) if p in f.points else -1 for f, p in zip(frontiers, chosen)]
    used = sum(p.nbytes for p in chosen)
    while True:
        best, best_score = None, None
        for i, f in enumerate(frontiers):
            if at[i] < 0 or at[i] + 1 >= len(f.points):
                continue
            nxt = f.points[at[i] + 1]
            extra = nxt.nbytes - chosen[i].nbytes
            if used + extra > limit:
                continue
            gain = (chosen[i].flops - nxt.flops) + (chosen[i].elems - nxt.elems)
            score = (gain / (extra + 1), -i)
            if best_score is None or score > best_score:
                best, best_score = i, score
        if best is None:
            return chosen
        used += frontiers[best].points[at[best] + 1].nbytes - chosen[best].nbytes
        at[best] += 1
        chosen[best] = frontiers[best].points[at[best]]


@dataclasses.dataclass(frozen=True)
class BlockShare(MemoryBudget):
    """Block ``index``'s part of a model-level budget (``memory_budget_policies``)."""

    model: ModelBudget = dataclasses.field(default=None, compare=False, repr=False)  # type: ignore[assignment]
    index: int = 0

    def choose(self, frontier: "Frontier") -> "Point":
        model = self.model
        model.register(self.index, frontier, self.fraction)
        if not model.active or model.shares is None:
            return frontier.choose(self.fraction)
        return model.shares[self.index]


# -- plans: cached per remat'd function and signature ---------------------------------------

# fun -> {signature: Frontier}; weak, so a dropped function drops its plans.
_plans: "weakref.WeakKeyDictionary[Any, dict[Any, Frontier]]" = weakref.WeakKeyDictionary()
# module (or wrapped function) -> {(function, partials' arguments): {signature: Frontier}}:
# the plans of bound methods and partials (a checkpoint_wrapper'd module's forward, a
# Hugging Face layer's __call__ in a fresh functools.partial per call), kept while the
# module lives.
_owner_plans: "weakref.WeakKeyDictionary[Any, dict[Any, dict[Any, Frontier]]]" = (
    weakref.WeakKeyDictionary())


def _plans_of(fun: Callable[..., Any]) -> dict[Any, "Frontier"]:
    """The plan cache of ``fun`` (``_signature.per_function``: bound methods and partials
    keep theirs with the module they are bound to)."""
    return per_function(fun, _plans, _owner_plans)


# For functions that name what they record (``__ckptfx_plan_key__``: a key of classes and
# shapes, no tensors), so that short-lived closures over identical layers share one plan.
_shared_plans: dict[Any, dict[Any, "Frontier"]] = {}


@dataclasses.dataclass(frozen=True)
class Note:
    """What a budget chose for one call made under ``saved_residuals``."""

    text: str
    planned_now: bool


class _Notes(threading.local):
    def __init__(self) -> None:
        self.items: list[Note] = []

    def append(self, note: Note) -> None:
        self.items.append(note)


_notes = _Notes()


def take_notes() -> list[Note]:
    """The budget notes made on this thread since the last call (for
    ``print_saved_residuals``), removed."""
    items, _notes.items = _notes.items, []
    return items


def peek_notes() -> list[Note]:
    """The budget notes made on this thread since the last ``take_notes``."""
    return list(_notes.items)


class _PlanCursor:
    """The per-op policy of a planned call: keep the outputs of the chosen ops, by position
    in the recording; from an op that differs from the plan's, recompute (Rule 4)."""

    __slots__ = ("keep", "funcs", "seg", "off")

    def __init__(self, keep: frozenset[int], funcs: tuple[Any, ...], seg: Any) -> None:
        self.keep = keep
        self.funcs = funcs
        self.seg = seg
        self.off = False

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Decision:
        if self.off:
            return False
        i = len(self.seg.ops) - 1  # the tracer asks after recording the op
        if i >= len(self.funcs) or self.funcs[i] is not op:
            self.off = True
            return False
        return i in self.keep


# -- the planning recorder ------------------------------------------------------------------


class _PlanningTracer(Tracer):
    """A ``nothing_saveable`` recording that also notes what the planner needs (Rule 1)."""

    def __init__(self, frame: Any, tensors: Sequence[torch.Tensor], names: Any,
                 plans: dict, key: Any, budget: MemoryBudget) -> None:
        super().__init__(frame, list(tensors), None, names)
        self._plans, self._key, self._budget = plans, key, budget
        self.op_cost: list[tuple[int, int]] = []  # op -> (FLOPs, output elements)
        self.op_view: list[bool] = []
        self.op_writes: list[bool] = []
        self.nbytes: dict[int, int] = {}          # base slot -> storage bytes
        self.pack_time: dict[int, int] = {}       # holder position -> ops recorded before

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        out = super().__torch_dispatch__(func, types, args, kwargs)
        info = op_info(func)
        count = flop_registry.get(func.overloadpacket)
        flops = int(count(*args, **kwargs, out_val=out)) if count is not None else 0
        elems = 0
        seg = self.seg
        for j, slot in seg.ops[-1].outs:
            base = seg.base[slot]
            if base not in self.nbytes:
                t = out if isinstance(out, torch.Tensor) else optree.tree_leaves(
                    out, none_is_leaf=True)[j]
                self.nbytes[base] = t.untyped_storage().nbytes()
            if not info.alias:
                t = out if isinstance(out, torch.Tensor) else optree.tree_leaves(
                    out, none_is_leaf=True)[j]
                elems += t.numel()
        self.op_cost.append((flops, elems))
        self.op_view.append(info.view)
        self.op_writes.append(bool(info.writes))
        return out

    def pack(self, x: torch.Tensor) -> Any:
        pos = len(self.frame.holders)
        packed = super().pack(x)
        self.pack_time[pos] = len(self.seg.ops)
        return packed

    def finish(self) -> Any:
        seg = super().finish()
        frontier = Frontier.from_recording(self)
        self._plans[self._key] = frontier
        if reporting():
            _notes.append(frontier.explain(self._budget.fraction, planned_now=True))
        return seg


# -- scoring keep-sets on the recording (Rule 2) ----------------------------------------------


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


class Frontier:
    """The scored candidates of one recorded block, and the choice for a fraction."""

    def __init__(self, points: list[Point], everything: Point, nothing: Point, dots: Point,
                 funcs: tuple[Any, ...], replayable: bool, units: int, exact: bool) -> None:
        self.everything = everything
        self.everything_keep = everything.keep
        self.nothing = nothing
        self.dots = dots
        self.funcs = funcs
        self.replayable = replayable
        self.units = units
        self.exact = exact
        self.candidates = len(points)
        self.model: _Model | None = None  # set by from_recording, for ``why``
        # Pareto frontier: by bytes (then cost), keep a point only if it costs strictly less
        # than every smaller one (Rule 3).
        best: list[Point] = []
        for p in sorted(points, key=lambda p: (p.nbytes, p.cost, sorted(p.keep))):
            if not best or p.cost < best[-1].cost:
                best.append(p)
        self.points = best

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

    def explain(self, fraction: float, planned_now: bool, choice: "Point | None" = None
                ) -> Note:
        p = self.choose(fraction) if choice is None else choice
        ev, no = self.everything, self.nothing
        lines = [
            f"memory_budget({fraction:g}): keeps {human_bytes(p.nbytes)} of {human_bytes(ev.nbytes)} "
            f"(everything_saveable; budget {human_bytes(self.budget_bytes(fraction))}), recomputes "
            f"{_f(p.flops)} of {_f(no.flops)} FLOPs (nothing_saveable; dots_saveable keeps "
            f"{human_bytes(self.dots.nbytes)} and recomputes {_f(self.dots.flops)}); chosen from "
            f"{len(self.points)} frontier points of {self.candidates} candidates over "
            f"{self.units} ops ({'exact' if self.exact else 'greedy chains + dots'})",
        ]
        if planned_now:
            lines.append("  (this call planned and kept nothing; later calls with this "
                         "signature keep the set below)")
        for i, saved in self.why(p):
            lines.append(f"  may keep op {i} ({self.funcs[i]}): dropping it would recompute "
                         f"{_f(saved[0])} FLOPs ({saved[1]} elements) more")
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
    def from_recording(cls, tracer: _PlanningTracer) -> "Frontier":
        model = _Model(tracer)
        funcs = tuple(op.func for op in tracer.seg.ops)
        everything = model.score(frozenset(range(len(funcs))))
        nothing = model.score(frozenset())
        dots = model.score(frozenset(i for i, f in enumerate(funcs) if f in DOTS))
        if not model.replayable:
            return cls([nothing, everything], everything, nothing, dots, funcs, False, 0,
                       True)
        units = model.units
        exact = len(units) <= EXACT_UNITS
        if exact:
            for r in range(len(units) + 1):
                for combo in itertools.combinations(units, r):
                    model.score(frozenset(combo))
        else:
            model.greedy_add()
            model.greedy_remove()
        frontier = cls(list(model.memo.values()), everything, nothing, dots, funcs, True,
                       len(units), exact)
        frontier.model = model
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
    """trace.py's keep and replay rules, run on a recording for a given keep-set."""

    def __init__(self, tracer: _PlanningTracer) -> None:
        seg = _graph_only(tracer.seg)
        self.seg = seg
        self.replayable = seg.replayable and not seg.subclass
        self.root = tracer.root
        self.cost = tracer.op_cost
        self.view = tracer.op_view
        self.nbytes = tracer.nbytes
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
        wanted: list[tuple[int, int]] = []
        for _, sv, t in self.packs:
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
            else:
                wanted.append(sv)
        # the replay's frontier (keep.py, Tracer._keep_what_the_replay_reads)
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
        available = {sv: True for sv in kept | frontier}
        plan = seg._plan(wanted, available) if wanted else []
        flops = sum(self.cost[i][0] for i in plan)
        elems = sum(self.cost[i][1] for i in plan)
        bases = {seg.base[s] for s, _ in kept | frontier}
        nbytes = sum(self.nbytes.get(b, 0) for b in bases)
        p = self.memo[keep] = Point(keep, nbytes, flops, elems)
        return p

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


# ``policy=checkpoint_policies.memory_budget`` (not called) is refused like the other
# factories, with the call to write instead.
_policies._FACTORY_CALLS[memory_budget] = "memory_budget(0.5)"
