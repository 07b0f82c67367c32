"""Benchmark: the memory budget's solver (ckptfx/budget/cut.py) against greedy chains alone.

For each block, the planner's frontier (the solver's hull and branch and bound, the greedy
chains, dots, and every subset for small blocks whose proof is unfinished) is compared with a
frontier of the greedy chains, nothing, everything and dots alone (what the budget chose
before the solver), both scored on the same recording by ``_Model.score``. At every byte
budget where either frontier changes, it counts where the solver's choice recomputes fewer
FLOPs, and reports how many blocks were proven exact, the min cuts, and the planning time
(``Frontier.from_recording``, median; FLOPs and cuts are counts, times depend on the load).

Blocks: random "knapsacks" (branches ``tanh(x[:, :k] @ w)`` of ``n`` columns: keeping one
costs bytes in ``n``, recomputing it FLOPs in ``k * n``) and ``ckptfx.bench.blocks.Block``,
a pre-norm transformer block (dropout 0.1).

Usage::

    python benchmarks/bench_budget_solver.py             # 60 knapsacks, Block d=256
    python benchmarks/bench_budget_solver.py --quick     # 12 knapsacks, Block d=64
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from typing import Any, Callable

import torch

import ckptfx
from ckptfx import budget
from ckptfx import checkpoint_policies as cp
from ckptfx.bench.blocks import Block
from ckptfx.budget.model import Frontier, _Model
from ckptfx.policies import DOTS


class Knapsack:
    """Branches ``tanh(x[:, :k] @ w)`` of ``n`` columns, concatenated."""

    def __init__(self, ks: tuple[int, ...], ns: tuple[int, ...]) -> None:
        g = torch.Generator().manual_seed(0)
        self.ks, self.w = ks, [torch.randn(k, n, generator=g) / 4 for k, n in zip(ks, ns)]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.tanh(x[:, :k] @ w) for k, w in zip(self.ks, self.w)], 1)


def greedy_only(tracer: Any, funcs: tuple[Any, ...]) -> Frontier:
    """The frontier of nothing, everything, dots and the two greedy chains alone."""
    m = _Model(tracer)
    every = m.score(frozenset(range(len(funcs))))
    nothing = m.score(frozenset())
    dots = m.score(frozenset(i for i, f in enumerate(funcs) if f in DOTS))
    m.greedy_add()
    m.greedy_remove()
    return Frontier(list(m.memo.values()), every, nothing, dots, funcs, True, len(m.units))


def compare(block: Callable[..., Any], x: torch.Tensor) -> dict[str, Any]:
    real = budget.Frontier.from_recording.__func__  # type: ignore[attr-defined]
    out: dict[str, Any] = {}

    def planned(cls: Any, tracer: Any) -> Frontier:
        t0 = time.perf_counter()
        frontier = real(cls, tracer)
        out["seconds"] = time.perf_counter() - t0
        out["greedy"] = greedy_only(tracer, frontier.funcs)
        out["solver"] = frontier
        return frontier

    budget.Frontier.from_recording = classmethod(planned)  # type: ignore[method-assign]
    try:
        ckptfx.remat(block, policy=cp.memory_budget(0.5))(x).sum().backward()
    finally:
        budget.Frontier.from_recording = classmethod(real)  # type: ignore[method-assign]
    new, old = out["solver"], out["greedy"]
    limits = sorted({p.nbytes for p in new.points} | {p.nbytes for p in old.points})
    every = new.everything.nbytes
    gains = []
    for limit in limits:
        f = min(limit / every, 1.0) if every else 1.0
        n, o = new.choose(f), old.choose(f)
        assert n.flops <= o.flops  # the solver's candidates include the chains
        if n.flops < o.flops:
            gains.append(1.0 - n.flops / o.flops)
    proof = new.proof
    return {"budgets": len(limits), "gains": gains, "exact": new.exact, "units": new.units,
            "cuts": proof.cuts if proof is not None else 0, "seconds": out["seconds"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--knapsacks", type=int, default=60)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    n = 12 if args.quick else args.knapsacks
    rng = random.Random(0)
    rows = []
    for _ in range(n):
        branches = rng.randint(3, 6)
        ks = tuple(rng.randint(1, 16) for _ in range(branches))
        ns = tuple(rng.randint(1, 12) for _ in range(branches))
        rows.append(compare(Knapsack(ks, ns), torch.randn(8, 16, requires_grad=True)))
    gains = [g for r in rows for g in r["gains"]]
    print(f"{n} random knapsack blocks ({min(r['units'] for r in rows)}-"
          f"{max(r['units'] for r in rows)} candidate ops): proven exact "
          f"{sum(r['exact'] for r in rows)}; the solver recomputes fewer FLOPs than the greedy "
          f"chains at some budget in {sum(bool(r['gains']) for r in rows)} blocks, at "
          f"{len(gains)} of {sum(r['budgets'] for r in rows)} budgets (median "
          f"{100 * statistics.median(gains) if gains else 0:.1f}% fewer, max "
          f"{100 * max(gains) if gains else 0:.1f}%); min cuts median "
          f"{statistics.median(r['cuts'] for r in rows):.0f}, max {max(r['cuts'] for r in rows)}; "
          f"planning median {statistics.median(r['seconds'] for r in rows):.3f} s")
    big = [r for r in rows if r["units"] > budget.EXACT_UNITS]
    print(f"  of which {len(big)} have more than EXACT_UNITS={budget.EXACT_UNITS} candidate ops "
          f"(planned by greedy chains alone before the solver): fewer FLOPs at some budget in "
          f"{sum(bool(r['gains']) for r in big)}, at {sum(len(r['gains']) for r in big)} of "
          f"{sum(r['budgets'] for r in big)} budgets")
    d, seq, batch = (64, 32, 2) if args.quick else (256, 128, 8)
    torch.manual_seed(0)
    r = compare(Block(d, dropout=0.1, attention="matmul").forward, torch.randn(batch, seq, d, requires_grad=True))
    print(f"transformer Block d={d} seq {seq} batch {batch}: {r['units']} candidate ops, proven "
          f"exact {r['exact']}, {r['cuts']} min cuts, planning {r['seconds']:.3f} s; fewer "
          f"FLOPs than the greedy chains at {len(r['gains'])} of {r['budgets']} budgets")
    return 0


if __name__ == "__main__":
    sys.exit(main())
