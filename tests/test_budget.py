"""checkpoint_policies.memory_budget: exact at every budget, the properties an exact optimiser
has (checked by measurement on random blocks), planning once per signature, bad input."""

from __future__ import annotations

import itertools
import math
import random
import re
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import ckptfx
from ckptfx import budget
from ckptfx.budget.planner import _plans
from ckptfx.recording.signature import signature
from ckptfx import checkpoint_policies as cp
from ckptfx.budget.cut import CutModel, hull_at
from ckptfx.budget.model import pareto
from ckptfx.policies.tracer_stack import tracer_stack

from conftest import assert_bitwise, grads
from models import Block, TransformerBlock

pytestmark = pytest.mark.usefixtures("no_hooks_left_behind")

FRACTIONS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.45, 0.6, 0.8, 0.95, 1.0)


def kept_bytes(fn: Callable[..., Any], *args: Any) -> int:
    """Measured: distinct storages a remat call keeps beyond its arguments (what the
    forward's packs and the replay's frontier hold), from the residual report."""
    report: list[Any] = []
    outer, tracer_stack.report = tracer_stack.report, report
    try:
        out = fn(*args)
    finally:
        tracer_stack.report = outer
    storages = {}
    for _, kind, x, _, _ in report:
        if kind != "argument":
            storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
    del out
    return sum(storages.values())


def backward_flops(fn: Callable[..., Any], *args: Any, seed: int = 0,
                   params: tuple = ()) -> tuple[int, list]:
    """Measured FLOPs of one backward (the replay included), and the gradients of ``args``
    and ``params``."""
    for a in (*args, *params):
        a.grad = None
    torch.manual_seed(seed)
    out = fn(*args)
    with FlopCounterMode(display=False) as counter:
        out.float().sum().backward()
    return counter.get_total_flops(), grads([*args, *params])


class RandomBlock:
    """A random DAG of matmuls, elementwise ops, softmax, layer norm, dropout and views."""

    def __init__(self, seed: int, d: int = 16, steps: tuple[int, int] = (4, 11)) -> None:
        rng = random.Random(seed)
        self.d = d
        self.steps: list[tuple[str, int, int]] = []
        n = rng.randint(*steps)
        for i in range(n):
            kind = rng.choice(["mm", "mm", "relu", "tanh", "sigmoid", "mul", "add",
                               "softmax", "ln", "dropout", "t", "exp"])
            a = rng.randrange(i + 1)  # values 0..i: 0 is the input
            b = rng.randrange(i + 1)
            self.steps.append((kind, a, b))
        g = torch.Generator().manual_seed(seed)
        self.weights = [(torch.randn(d, d, generator=g) / 4).requires_grad_()
                        for _ in range(n)]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        vals = [x]
        for i, (kind, a, b) in enumerate(self.steps):
            va, vb = vals[a], vals[b]
            if va.shape != vals[0].shape:
                va = va.t()
            if vb.shape != va.shape:
                vb = vb.t()
            if kind == "mm":
                v = va @ self.weights[i]
            elif kind == "mul":
                v = va * vb
            elif kind == "add":
                v = va + vb
            elif kind == "softmax":
                v = torch.softmax(va, -1)
            elif kind == "ln":
                v = F.layer_norm(va, (self.d,))
            elif kind == "dropout":
                v = F.dropout(va, 0.3, training=True)
            elif kind == "t":
                v = va.t()
            else:
                v = getattr(torch, kind)(va)
            vals.append(v)
        # every value reaches the output (a dropped branch keeps nothing: no dead branches)
        read = {0} | {a for _, a, _ in self.steps} | {b for k, _, b in self.steps
                                                      if k in ("mul", "add")}
        out = vals[-1]
        for i, v in enumerate(vals[1:-1], 1):
            if i not in read:
                out = out + (v if v.shape == out.shape else v.t())
        return out if out.shape == x.shape else out.t()


def measure(block: Callable[..., Any], policy: Any, x: torch.Tensor, seed: int
            ) -> tuple[int, int, list]:
    fn = ckptfx.remat(block, policy=policy)
    torch.manual_seed(seed)
    fn(x).sum().backward()  # a budget plans in its first call
    torch.manual_seed(seed)
    nbytes = kept_bytes(fn, x)
    flops, g = backward_flops(fn, x, seed=seed, params=tuple(getattr(block, "weights", ())))
    return nbytes, flops, g


@pytest.mark.parametrize("seed, big", [*((s, False) for s in range(10)),
                                       *((s, True) for s in (20, 21, 22))])
def test_budget_properties_on_random_blocks(seed: int, big: bool) -> None:
    """Measured on random blocks (``big``: more than EXACT_UNITS candidate ops, so the
    solver's choice stands alone): exact; kept bytes within the budget and monotone in it;
    backward FLOPs never rise with it; 0.0 and 1.0 are nothing/everything_saveable; at the
    byte fraction dots_saveable keeps, no more FLOPs than dots_saveable."""
    block = RandomBlock(seed, steps=(14, 18)) if big else RandomBlock(seed)
    x = torch.randn(block.d, block.d, requires_grad=True)
    _, ref = backward_flops(block, x, seed=seed, params=tuple(block.weights))
    every_b, every_f, g = measure(block, cp.everything_saveable, x, seed)
    assert_bitwise(g, ref)
    nothing_b, nothing_f, _ = measure(block, cp.nothing_saveable, x, seed)
    dots_b, dots_f, _ = measure(block, cp.dots_saveable, x, seed)
    prev_b, prev_f = -1, math.inf
    for f in FRACTIONS:
        nbytes, flops, g = measure(block, cp.memory_budget(f), x, seed)
        assert_bitwise(g, ref, f"gradient at memory_budget({f})")
        assert nbytes <= f * every_b + 1e-6, (f, nbytes, every_b)
        assert nbytes >= prev_b and flops <= prev_f, (f, nbytes, prev_b, flops, prev_f)
        prev_b, prev_f = nbytes, flops
        if f == 0.0:
            assert (nbytes, flops) == (nothing_b, nothing_f)
        if f == 1.0:
            assert (nbytes, flops) == (every_b, every_f)
    if every_b:
        nbytes, flops, _ = measure(block, cp.memory_budget(dots_b / every_b), x, seed)
        assert flops <= dots_f and nbytes <= dots_b
    if big:
        (frontier,) = _plans[block].values()
        assert frontier.units > budget.EXACT_UNITS


@pytest.mark.parametrize("seed", range(4))
def test_the_planner_scores_what_the_tracer_does(seed: int) -> None:
    """The planner's model of tracer.py (which packs are kept, the replay's frontier, the
    ops the replay runs) agrees with measurement for every frontier point."""
    block = RandomBlock(100 + seed)
    x = torch.randn(block.d, block.d, requires_grad=True)
    every_f, _ = backward_flops(ckptfx.remat(block, policy=cp.everything_saveable), x)
    fn = ckptfx.remat(block, policy=cp.memory_budget(0.5))
    fn(x).sum().backward()
    (frontier,) = _plans[block].values()
    assert frontier.exact  # proven by the solver, or every subset scored
    for p in frontier.points:
        f = p.nbytes / frontier.everything.nbytes if frontier.everything.nbytes else 1.0
        chosen = ckptfx.remat(block, policy=cp.memory_budget(min(f, 1.0)))
        if frontier.choose(min(f, 1.0)) is not p:
            continue
        torch.manual_seed(seed)
        assert kept_bytes(chosen, x) == p.nbytes
        flops, _ = backward_flops(chosen, x, seed=seed)
        assert flops - every_f == p.flops


# -- the solver (ckptfx/budget/cut.py) ------------------------------------------------------


def plan(block: Callable[..., Any], x: torch.Tensor, monkeypatch: pytest.MonkeyPatch,
         **options: Any) -> budget.Frontier:
    """Plan ``block`` on ``x`` with ``Frontier.from_recording``'s ``options`` (e.g. no
    exhaustive search), and return the frontier."""
    real = budget.Frontier.from_recording.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(budget.Frontier, "from_recording",
                        classmethod(lambda cls, t: real(cls, t, **options)))
    torch.manual_seed(0)
    ckptfx.remat(block, policy=cp.memory_budget(0.5))(x).sum().backward()
    monkeypatch.undo()
    (frontier,) = _plans[block].values()
    return frontier


def every_subset(frontier: budget.Frontier) -> list[budget.Point]:
    """The exact frontier: every subset of the candidate ops scored."""
    model = frontier.model
    assert model is not None and len(model.units) <= budget.EXACT_UNITS
    for r in range(len(model.units) + 1):
        for combo in itertools.combinations(model.units, r):
            model.score(frozenset(combo))
    return pareto(model.memo.values())


def optimum(points: list[budget.Point], limit: int) -> int:
    return min(p.flops for p in points if p.nbytes <= limit)


class TwoDropouts:
    """Dropout of (dropout's output @ w): the second dropout continues the first's generator
    and reads a value nothing packs, so the replay's frontier never keeps it (the cut model
    is a bound only here, budget/cut.py Rule 2)."""

    d = 16

    def __init__(self) -> None:
        self.w = torch.randn(16, 16, generator=torch.Generator().manual_seed(0)) / 4

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(F.dropout(x @ self.w, 0.3) @ self.w, 0.3)


class ViewWrite:
    """In-place writes on a block's own value, one through a view of it (the cut model is a
    bound only here: a pack of the value reads the decision of its first maker)."""

    d = 16

    def __init__(self) -> None:
        self.w = torch.randn(16, 16, generator=torch.Generator().manual_seed(1)) / 4

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.w
        h[0].mul_(2)
        h.relu_()
        return torch.tanh(h @ self.w)


class Knapsack:
    """Branches ``tanh(x[:, :k] @ w)`` of ``n`` columns: keeping one costs bytes in ``n``,
    recomputing it FLOPs in ``k * n``, so between the hull's points the best choice is a
    knapsack's, which the branch and bound must search for."""

    d = 16

    def __init__(self, ks: tuple[int, ...], ns: tuple[int, ...]) -> None:
        g = torch.Generator().manual_seed(0)
        self.ks, self.w = ks, [torch.randn(k, n, generator=g) / 4 for k, n in zip(ks, ns)]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.tanh(x[:, :k] @ w) for k, w in zip(self.ks, self.w)], 1)


# Random blocks of at most EXACT_UNITS candidate ops (every_subset checks), two that the cut
# model only bounds, and knapsacks.
SMALL: list[Any] = [2, 4, 6, 8, 14, 15, 18, 23, "two dropouts", "view write", "knapsack 3",
                    "knapsack 4"]


def small_block(seed: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    if seed == "two dropouts":
        return TwoDropouts()
    if seed == "view write":
        return ViewWrite()
    if seed == "knapsack 3":
        return Knapsack((16, 9, 5), (3, 5, 7))
    if seed == "knapsack 4":
        return Knapsack((16, 12, 7, 3), (2, 3, 5, 7))
    return RandomBlock(seed)


@pytest.mark.parametrize("seed", SMALL)
def test_the_cut_model_bounds_every_keep_set(seed: Any, monkeypatch: pytest.MonkeyPatch
                                             ) -> None:
    """For weights a, b: no keep-set's a*FLOPs + b*bytes (as scored, i.e. as the tracer
    does) is below the min cut's, so the model's hull bounds every keep-set; where the model
    is exact, a cut's keep-set scores exactly the cut's FLOPs and bytes."""
    block = small_block(seed)
    frontier = plan(block, torch.randn(16, 16, requires_grad=True), monkeypatch)
    assert frontier.model is not None
    cut = CutModel(frontier.model, frontier.funcs)
    assert cut.exact == (seed not in ("two dropouts", "view write"))
    points = every_subset(frontier)
    scored = list(frontier.model.memo.values())
    for a, b in [(1, 0), (0, 1), (1, 1), (1, 64), (1, 4096), (3, 2**20), (1, 10**9)]:
        c = cut.solve(a, b)
        assert c is not None
        least = min(a * p.flops + b * p.nbytes for p in scored)
        assert a * c.w + b * c.nbytes <= least, (a, b)
        if cut.exact and a and b:
            p = frontier.model.score(c.keep)
            assert (p.flops, p.nbytes) == (c.w, c.nbytes), (a, b)
            assert a * c.w + b * c.nbytes == least
    hull = [(c.nbytes, c.w) for c in cut.hull()]
    for limit in sorted({p.nbytes for p in points} | {p.nbytes - 1 for p in points}):
        if limit >= 0:
            lb = hull_at(hull, limit)
            assert lb is not None and lb <= optimum(points, limit), limit


@pytest.mark.parametrize("seed", SMALL)
def test_the_solver_finds_the_optimum_every_subset_finds(seed: Any,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the exhaustive search: at every budget the solver's lower bound is at most
    the best FLOPs of every subset, which is at most the choice's, and the solver proves
    the choice optimal: it is that best. On the knapsacks the search proves more than the
    hull alone does."""
    block = small_block(seed)
    frontier = plan(block, torch.randn(16, 16, requires_grad=True), monkeypatch,
                    exhaustive_units=0)
    assert not frontier.exhaustive and frontier.exact
    proof = frontier.proof
    assert proof is not None
    if isinstance(seed, str) and seed.startswith("knapsack"):
        assert any(proof.bounds[L] > hull_at(proof.hull, L) for L in proof.closed)
    points = every_subset(frontier)
    every = frontier.everything.nbytes
    fractions = {*FRACTIONS, *(p.nbytes / every for p in points if every)}
    for f in sorted(fractions):
        f = min(f, 1.0)
        choice, limit = frontier.choose(f), frontier.budget_bytes(f)
        best = optimum(points, limit)
        lb = frontier.lower_bound(limit)
        assert lb is not None and lb <= best <= choice.flops, (f, lb, best, choice.flops)
        assert choice.flops == best, f
        assert "exact" in frontier.proven(choice, limit)


def test_the_solver_beats_the_greedy_chains_on_a_knapsack(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """Past EXACT_UNITS, where greedy chains were all a budget had: on a knapsack the
    solver's choice, measured, recomputes fewer FLOPs than the best greedy-chain point that
    fits, and is proven optimal."""
    block = Knapsack((14, 2, 10, 11, 5, 6), (11, 10, 7, 11, 2, 2))
    x = torch.randn(8, 16, requires_grad=True)
    frontier = plan(block, x, monkeypatch)
    assert frontier.units > budget.EXACT_UNITS and frontier.exact and frontier.model
    greedy = frontier.model.fresh()
    greedy.greedy_add()
    greedy.greedy_remove()
    chains = pareto(greedy.memo.values())
    every_f, _ = backward_flops(ckptfx.remat(block, policy=cp.everything_saveable), x)
    beaten = 0
    for p in frontier.points:
        f = p.nbytes / frontier.everything.nbytes
        fitting = [q.flops for q in chains if q.nbytes <= p.nbytes]
        if p.flops < min(fitting):
            fn = ckptfx.remat(block, policy=cp.memory_budget(min(f, 1.0)))
            assert frontier.choose(min(f, 1.0)) is p
            flops, _ = backward_flops(fn, x)
            assert flops - every_f == p.flops < min(fitting)
            beaten += 1
    assert beaten


@pytest.mark.parametrize("max_cuts", [12, 40])
def test_a_stopped_solver_reports_a_bound(max_cuts: int, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    """With too few cuts to finish, the choice carries the bound it proved: at most the
    optimum (the unstopped solver's, proven), which is at most the choice; the properties
    still hold, since every candidate was scored."""
    block, _ = transformer_block()
    x = torch.randn(2, 8, 32, requires_grad=True)
    full = plan(block, x, monkeypatch)
    _plans.pop(block)
    stopped = plan(block, x, monkeypatch, max_cuts=max_cuts)
    assert full.exact and full.units > budget.EXACT_UNITS and not stopped.exact
    assert stopped.proof is not None and stopped.proof.cuts <= max_cuts
    _plans.pop(block)
    again = plan(block, x, monkeypatch, max_cuts=max_cuts)  # work is counted, not timed
    assert again.points == stopped.points and again.proof is not None
    assert again.proof.bounds == stopped.proof.bounds
    prev = None
    texts = set()
    for f in FRACTIONS:
        choice, limit = stopped.choose(f), stopped.budget_bytes(f)
        best = full.choose(f).flops
        lb = stopped.lower_bound(limit)
        assert lb is not None and lb <= best <= choice.flops
        texts.add(stopped.proven(choice, limit))
        if prev is not None:
            assert choice.nbytes >= prev.nbytes and choice.cost <= prev.cost
        prev = choice
    assert any(t.startswith("within ") and "%) of optimal" in t for t in texts), texts


def transformer_block(d: int = 32, heads: int = 4) -> tuple[Callable[..., Any], list]:
    block = TransformerBlock(torch.device("cpu"), 0, d, heads)
    return block, block.params


@pytest.mark.parametrize("autocast", [False, True])
def test_budget_is_bitwise_exact_on_a_transformer_block(autocast: bool) -> None:
    block, params = transformer_block()
    x = torch.randn(2, 8, 32, requires_grad=True)

    def run(fn: Callable[..., Any]) -> list:
        for t in (x, *params):
            t.grad = None
        torch.manual_seed(3)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = fn(x)
        out.float().sum().backward()
        return grads([x, *params])

    ref = run(block)
    for f in (0.0, 0.15, 0.4, 0.7, 1.0):
        fn = ckptfx.remat(block, policy=cp.memory_budget(f))
        for _ in range(2):  # the planning call, then a planned one
            assert_bitwise(run(fn), ref, f"gradient at memory_budget({f})")


def test_planning_happens_once_per_signature(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = budget.Frontier.from_recording
    monkeypatch.setattr(budget.Frontier, "from_recording",
                        classmethod(lambda cls, t: calls.append(1) or real(t)))

    def block(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.relu(x @ x.t()) @ x)

    x = torch.randn(8, 8, requires_grad=True)
    for f in (0.3, 0.3, 0.6):  # fractions share the plan: it does not depend on them
        ckptfx.remat(block, policy=cp.memory_budget(f))(x).sum().backward()
    assert len(calls) == 1
    with torch.no_grad():
        ckptfx.remat(block, policy=cp.memory_budget(0.3))(torch.randn(4, 8)).sum()
    assert len(calls) == 1  # no grad: no frame, no plan
    ckptfx.remat(block, policy=cp.memory_budget(0.3))(
        torch.randn(4, 8, requires_grad=True)).sum().backward()
    assert len(calls) == 2  # a new shape plans again
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ckptfx.remat(block, policy=cp.memory_budget(0.3))(x).float().sum().backward()
    assert len(calls) == 3  # autocast is part of the signature


def test_a_call_that_leaves_the_plan_is_still_exact() -> None:
    """Data-dependent control flow: ops that differ from the planned ones are recomputed."""
    w = torch.randn(8, 8, requires_grad=True)

    def block(x: torch.Tensor, flag: bool) -> torch.Tensor:
        h = torch.relu(x @ w)
        h = torch.sigmoid(h) if flag else torch.exp(h * 0.1) @ w
        return torch.tanh(h @ w)

    fn = ckptfx.remat(block, policy=cp.memory_budget(0.5))
    x = torch.randn(4, 8, requires_grad=True)
    fn(x, True).sum().backward()  # plans with flag=True
    for flag in (True, False):
        x.grad = w.grad = None
        block(x, flag).sum().backward()
        ref = grads([x, w])
        x.grad = w.grad = None
        # hashable non-tensor arguments are in the signature, so the call must be steered
        # to the True plan: the cursor sees other ops and falls back to recompute
        plans = _plans[block]
        key = next(iter(plans))
        plans[signature((x, False), {}, [x])] = plans[key]
        fn(x, flag).sum().backward()
        assert_bitwise(grads([x, w]), ref)


def test_print_saved_residuals_shows_the_choice(capsys: pytest.CaptureFixture[str]) -> None:
    def block(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.relu(x @ x.t()) @ x)

    fn = ckptfx.remat(block, policy=cp.memory_budget(0.5))
    x = torch.randn(8, 8)
    ckptfx.print_saved_residuals(fn, x)
    text = capsys.readouterr().out
    assert "memory_budget(0.5): keeps" in text and "of everything" not in text
    assert "exact: " in text  # what was proved of the choice
    assert "this call planned" in text  # the first call planned; the list is a later call's
    assert text.count("memory_budget(0.5): keeps") == 1  # the plan is told once
    assert "output of aten" in text  # the listed residuals are what the plan keeps
    ckptfx.print_saved_residuals(fn, x)
    assert "this call planned" not in capsys.readouterr().out
    ckptfx.print_saved_residuals(ckptfx.remat(block, policy=cp.memory_budget(1.0)), x)
    assert "memory_budget(1) is everything_saveable" in capsys.readouterr().out


@pytest.mark.parametrize("bad, error", [
    (1.5, ValueError), (-0.1, ValueError), (float("nan"), ValueError),
    ("0.5", TypeError), (True, TypeError), (None, TypeError),
])
def test_bad_fractions(bad: Any, error: type) -> None:
    with pytest.raises(error, match="memory_budget: fraction"):
        cp.memory_budget(bad)
    with pytest.raises(error, match="memory_budget"):
        budget.memory_budget_policies([lambda x: x], bad)


def test_uncalled_factory_is_refused() -> None:
    with pytest.raises(TypeError, match=r"memory_budget\(0.5\)"):
        ckptfx.remat(lambda x: x, policy=cp.memory_budget)
    with pytest.raises(TypeError, match="sequence of blocks"):
        ckptfx.memory_budget_policies(object(), 0.5)


@pytest.mark.parametrize("fraction", [0.25, 0.5])
def test_model_budget_spreads_over_blocks(fraction: float) -> None:
    """memory_budget_policies, measured on unlike blocks: the model keeps at most the
    fraction of what everything_saveable keeps in all its blocks, exactly, and recomputes
    no more FLOPs than giving each block the same fraction."""
    blocks = [RandomBlock(s) for s in (1, 2, 3, 5)]
    params = tuple(w for b in blocks for w in b.weights)
    x = torch.randn(16, 16, requires_grad=True)

    def model(calls: list) -> Callable[[torch.Tensor], torch.Tensor]:
        def run(h: torch.Tensor) -> torch.Tensor:
            for c in calls:
                h = torch.tanh(c(h))  # bounded between blocks (exp of exp overflows)
            return h
        return run

    _, ref = backward_flops(model(blocks), x, seed=4, params=params)
    every = sum(kept_bytes(ckptfx.remat(b, policy=cp.everything_saveable), x) for b in blocks)
    results = {}
    for kind in ("even", "model"):
        policies = (ckptfx.memory_budget_policies(blocks, fraction) if kind == "model"
                    else [cp.memory_budget(fraction)] * len(blocks))
        calls = [ckptfx.remat(b, policy=p) for b, p in zip(blocks, policies)]
        for _ in range(3):  # plan; register every block's frontier; the re-spread starts
            flops, g = backward_flops(model(calls), x, seed=4, params=params)
            assert_bitwise(g, ref)
        h, total = x, 0
        for c in calls:
            total += kept_bytes(c, h)
            h = torch.tanh(c(h))
        results[kind] = (total, flops)
    assert results["model"][0] <= fraction * every
    assert results["even"][0] <= fraction * every
    assert results["model"][1] <= results["even"][1]
    shares = ckptfx.memory_budget_policies(blocks, fraction)[0]
    assert isinstance(shares, budget.BlockShare) and shares.fraction == fraction


def test_a_cached_plan_keeps_no_tensor_alive() -> None:
    import gc
    import weakref

    lin = torch.nn.Linear(8, 8)

    def block(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(m(x).relu() @ m.weight)

    ref = weakref.ref(lin.weight)
    ckptfx.remat(block, policy=cp.memory_budget(0.5))(lin, torch.randn(4, 8, requires_grad=True)
                                                      ).sum().backward()
    assert _plans[block]  # planned
    del lin
    gc.collect()
    assert ref() is None


def test_a_block_of_a_model_budget_reports_its_share_as_its_budget(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Under memory_budget_policies, once every block planned, a block keeps its share of
    the model's budget, which may exceed its even split: the report names that share as
    the budget the block was held to (not the even split it exceeds)."""
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(Block(32, 128, p=0.0) for _ in range(3))  # no dropout
    policies = budget.memory_budget_policies(layers, 0.3)
    calls = [ckptfx.remat(layer.forward, policy=p) for layer, p in zip(layers, policies)]
    x = torch.randn(4, 8, 32, requires_grad=True)
    for _ in range(2):
        h = x
        for call in calls:
            h = call(h)
        h.sum().backward()
    ckptfx.print_saved_residuals(calls[0], x)
    head = capsys.readouterr().out.splitlines()[0]
    kept = re.search(r"keeps ([\d.]+ KiB) of", head)
    assert kept is not None
    assert f"its share of a model-level budget of 0.3: {kept.group(1)})" in head, head
