"""How a memory budget plans: the recorder of a planning call, the plans cached per function
and signature, the per-op policy of a planned call, and model-level budgets spread over
blocks. The package's Rules (``ckptfx.budget``) say what each part promises.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any, Callable, Sequence

import optree
import torch
from torch.utils.flop_counter import flop_registry

from ckptfx._ops import op_info
from ckptfx.budget.model import Frontier, Note, Point
from ckptfx.budget.place import Placement, offload_answer, place, spread_placed
from ckptfx.policies.budget_policy import MemoryBudget
from ckptfx.policies.named import everything_saveable
from ckptfx.policies.protocol import Decision
from ckptfx.policies.tracer_stack import reporting
from ckptfx.recording.signature import per_function, signature
from ckptfx.recording.tracer import Tracer

__all__ = ["BlockShare", "ModelBudget", "memory_budget_policies", "placement_of", "spread",
           "take_notes", "tracer_for"]


def memory_budget_policies(blocks: Sequence[Any], memory_budget: float, offload: float = 0.0
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

    ``offload`` (default ``0.0``: nothing offloaded, the above exactly) is the fraction of the
    same bytes that may be kept in host memory instead (``memory_budget``'s ``offload``):
    each block starts from its own ``memory_budget(memory_budget, offload)`` choice, and
    upgrades are taken while one split of all the blocks' values keeps the model's device
    bytes within ``memory_budget`` and its host bytes within ``offload`` of the total
    (``ckptfx.budget.place`` Rule 5c).

    Example::

        policies = ckptfx.memory_budget_policies(model.layers, 0.25)
        calls = [ckptfx.remat(layer.forward, policy=p)
                 for layer, p in zip(model.layers, policies)]
        offloading = ckptfx.memory_budget_policies(model.layers, 0.1, offload=0.3)
    """
    if isinstance(blocks, (str, bytes)) or not isinstance(blocks, Sequence) and not (
            isinstance(blocks, torch.nn.ModuleList)):
        raise TypeError(f"memory_budget_policies: blocks must be a sequence of blocks, got "
                        f"{type(blocks).__name__}")
    checked = MemoryBudget(memory_budget, offload)  # checks both fractions
    model = ModelBudget(len(blocks))
    return [BlockShare(checked.fraction, checked.offload, model=model, index=i)
            for i in range(len(blocks))]


class ModelBudget:
    """The frontiers of a model's blocks, and the points a whole-model budget gives them."""

    def __init__(self, n: int) -> None:
        self.frontiers: list[Frontier | None] = [None] * n
        self.shares: list[Placement] | None = None
        self.first: int | None = None  # the block that registered first: a step's start
        self.active = False

    # Pickled (torch.save of a model) without what it learned: the frontiers are a cache of
    # plans made from recordings (they hold ATen ops); a loaded model plans again.
    def __getstate__(self) -> dict[str, int]:
        return {"n": len(self.frontiers)}

    def __setstate__(self, state: dict[str, int]) -> None:
        self.__init__(state["n"])  # type: ignore[misc]

    def register(self, index: int, frontier: "Frontier", fraction: float,
                 offload: float = 0.0) -> None:
        if self.frontiers[index] is not frontier:
            if self.first is None:
                self.first = index
            self.frontiers[index] = frontier
            self.shares, self.active = None, False
            if all(f is not None for f in self.frontiers):
                frontiers: list[Frontier] = self.frontiers  # type: ignore[assignment]
                if offload:
                    self.shares = spread_placed(frontiers, fraction, offload)
                else:
                    self.shares = [Placement.on_device(p) for p in spread(frontiers, fraction)]
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

    def place(self, frontier: "Frontier") -> Placement:
        model = self.model
        model.register(self.index, frontier, self.fraction, self.offload)
        if not model.active or model.shares is None:
            return place(frontier, self.fraction, self.offload)
        return model.shares[self.index]


def placement_of(budget: MemoryBudget, frontier: "Frontier") -> Placement:
    """The point ``budget`` keeps of ``frontier``, split between device and host memory: a
    model budget's share for a ``BlockShare``, else the block's own (``place``)."""
    if isinstance(budget, BlockShare):
        return budget.place(frontier)
    return place(frontier, budget.fraction, budget.offload)


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
    """The plan cache of ``fun`` (``recording.signature.per_function``: bound methods and partials
    keep theirs with the module they are bound to)."""
    return per_function(fun, _plans, _owner_plans)


# For functions that name what they record (``__ckptfx_plan_key__``: a key of classes and
# shapes, no tensors), so that short-lived closures over identical layers share one plan.
_shared_plans: dict[Any, dict[Any, "Frontier"]] = {}


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


_OFFLOAD = offload_answer()


class _PlanCursor:
    """The per-op policy of a planned call: keep the outputs of the chosen ops, by position
    in the recording, in host memory for those in ``offload``; from an op that differs from
    the plan's, recompute (Rule 4)."""

    __slots__ = ("keep", "funcs", "seg", "off", "offload")

    def __init__(self, keep: frozenset[int], funcs: tuple[Any, ...], seg: Any,
                 offload: frozenset[int] = frozenset()) -> None:
        self.keep = keep
        self.funcs = funcs
        self.seg = seg
        self.off = False
        self.offload = offload

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Decision:
        if self.off:
            return False
        i = len(self.seg.ops) - 1  # the tracer asks after recording the op
        if i >= len(self.funcs) or self.funcs[i] is not op:
            self.off = True
            return False
        if i in self.offload:
            return _OFFLOAD
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
        self.pack_bytes: dict[int, int] = {}      # holder position -> _copied_bytes
        self.value_bytes: dict[int, int] = {}     # slot -> _copied_bytes of the op output

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
            t = out if isinstance(out, torch.Tensor) else optree.tree_leaves(
                out, none_is_leaf=True)[j]
            if base not in self.nbytes:
                self.nbytes[base] = t.untyped_storage().nbytes()
            self.value_bytes[slot] = _copied_bytes(t)
            if not info.alias:
                elems += t.numel()
        self.op_cost.append((flops, elems))
        self.op_view.append(info.view)
        self.op_writes.append(bool(info.writes))
        return out

    def pack(self, x: torch.Tensor) -> Any:
        pos = len(self.frame.holders)
        packed = super().pack(x)
        self.pack_time[pos] = len(self.seg.ops)
        self.pack_bytes[pos] = _copied_bytes(x)
        return packed

    def finish(self) -> Any:
        seg = super().finish()
        frontier = Frontier.from_recording(self)
        self._plans[self._key] = frontier
        if reporting():
            budget = self._budget
            # the budget's own placement: a model budget's share registers on later calls
            placement = place(frontier, budget.fraction, budget.offload)
            _notes.append(frontier.explain(budget.fraction, planned_now=True,
                                           placement=placement, label=budget.label()))
        return seg


def _copied_bytes(t: torch.Tensor) -> int:
    """The bytes by which the eager side decides whether to copy ``t`` to the host
    (``ckptfx.offload`` Rules 1-2): its own elements'; 0 where it never copies it (a tensor
    subclass, a non-strided layout, a lazy conjugate or negation, a quantized tensor, an
    empty storage or one that is not a whole number of its elements), so the plan counts it
    as staying on the device (place.py Rule 5a)."""
    if (t.__class__ is not torch.Tensor or t.layout is not torch.strided or t.is_conj()
            or t.is_neg() or t.is_quantized):
        return 0
    size = t.element_size()
    nbytes = t.untyped_storage().nbytes()
    if nbytes == 0 or nbytes % size:
        return 0
    return t.numel() * size


def tracer_for(budget: MemoryBudget, fun: Callable[..., Any], args: tuple, kwargs: dict,
               tensors: Sequence[torch.Tensor]) -> Callable[..., Tracer]:
    """The recorder for one remat call of ``fun`` under ``budget``: planning (first call of
    a signature) or answering from the cached plan. Called by ``remat``."""
    if budget.fraction == 1.0 or budget.fraction == 0.0 and not budget.offload:
        if reporting():
            same = "nothing_saveable" if budget.fraction == 0.0 else "everything_saveable"
            _notes.append(Note(f"{budget.label()} is {same}", False))
        policy = None if budget.fraction == 0.0 else everything_saveable
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
            return _PlanningTracer(frame, ts, names, plans, key, budget)
        return planning
    placement = placement_of(budget, frontier)
    choice = placement.point
    if reporting():
        label = budget.label()
        if budget.offload and placement != place(frontier, budget.fraction, budget.offload):
            # a model budget's share may exceed the block's own limits (Rule 5c)
            label += ", this block's share of a model-level budget"
        _notes.append(frontier.explain(budget.fraction, planned_now=False, choice=choice,
                                       placement=placement, label=label))
    if (choice.keep == frontier.everything_keep and not frontier.replayable
            and not placement.offload):
        return lambda frame, ts, names: Tracer(frame, ts, everything_saveable, names)

    def planned(frame: Any, ts: Sequence[torch.Tensor], names: Any) -> Tracer:
        tracer = Tracer(frame, list(ts), None, names)
        if choice.keep:
            tracer.policy = _PlanCursor(choice.keep, frontier.funcs, tracer.seg,
                                        placement.offload)
        return tracer
    return planned
