"""``checkpoint_policies.memory_budget(fraction)``: what a remat'd block keeps, chosen by bytes.

``ckptfx.budget`` is public (``ckptfx.budget.memory_budget``; pickles of budget policies name
it). Its files, imports pointing down: ``cut.py`` (the min-cut solver), ``model.py`` (scoring
keep-sets on a recording, the frontier), ``place.py`` (splitting a point between device and
host memory for ``offload``), ``planner.py`` (the planning recorder, plan caches, model-level
budgets). The policy value itself is ``ckptfx.policies.budget_policy``'s.

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

2. A keep-set is scored by replaying, on the recording, exactly what the recorder
   (``ckptfx.recording``) does with it (``model._Model.score``): bytes are distinct storages
   kept beyond the block's arguments; the cost is (recompute FLOPs, recomputed output
   elements), compared in that order (most elementwise ops count 0 FLOPs; the elements break
   their ties).

3. Candidates (``model.Frontier.from_recording``): nothing, everything,
   ``dots_saveable``'s set, two greedy chains, and what the solver proposes
   (``cut.py``): the vertices of the lower convex hull of a min-cut model of the
   recording (a relaxation of Rule 2, so it bounds every keep-set's FLOPs from below), then,
   for each interval between frontier points, a branch and bound that proves no keep-set
   within the interval's bytes recomputes fewer FLOPs than its point, or finds one. Work is
   counted in min cuts, not timed; what the count leaves open keeps its proven lower bound, and
   ``print_saved_residuals`` says which: "exact" or "within X FLOPs (Y%) of optimal".
   Blocks of at most ``EXACT_UNITS`` candidate ops with an unfinished proof have every
   subset scored. The frontier is sorted by bytes with strictly falling cost; a budget of
   ``fraction`` picks the frontier point with the most bytes at most ``fraction`` times the
   bytes ``everything_saveable`` keeps. Hence, by construction: kept bytes are monotone in
   the fraction, the cost never rises with it, and at the fraction ``dots_saveable`` keeps,
   the cost is at most dots'. ``0.0`` is ``nothing_saveable`` and ``1.0`` is
   ``everything_saveable`` exactly (no planning).

4. Any keep-set is exact (a policy only chooses what is recomputed), so a call whose ops do
   not match the plan (data-dependent control flow) is still exact: from the first op that
   differs, the rest of that call is recomputed (``nothing_saveable``). A block that cannot
   be replayed from its recording (``ckptfx.recording.tracer`` Rule 4) has only two points:
   nothing and everything. Under ``torch.func`` transforms (``ckptfx.func_path``) the budget acts as
   ``nothing_saveable``.

5. Offload as a budget (``memory_budget(fraction, offload=o)``, ``place.py``): a kept value may
   live in host memory (``ckptfx.Offload``), which costs transfers (overlapped with compute
   by ``ckptfx.offload``), not FLOPs. The plan is the frontier point recomputing the fewest
   FLOPs within (fraction + o) x everything_saveable's bytes whose values split with at most
   ``fraction`` of those bytes on the device (the guarantee of Rule 3, unchanged) and at
   most ``o`` on the host, copying as few bytes as it can: large values go first, values
   under ``place.MIN_OFFLOAD_BYTES`` (64 KiB) stay on the device. It never recomputes more
   FLOPs than ``memory_budget(fraction)``; ``o = 0.0`` (the default) is that budget exactly,
   and ``fraction = 1.0`` keeps everything on the device. ``print_saved_residuals`` lists
   the offloaded values and says what went to host.
"""

from ckptfx._public import report_home
from ckptfx.budget.model import EXACT_UNITS, Frontier
from ckptfx.budget.planner import BlockShare, ModelBudget, memory_budget_policies, spread
from ckptfx.policies.budget_policy import MemoryBudget, memory_budget

# Pickles of budget policies (a model saved with its blocks' policies) name this module.
report_home(__name__, [MemoryBudget, BlockShare, ModelBudget, memory_budget])

__all__ = ["EXACT_UNITS", "BlockShare", "Frontier", "MemoryBudget", "ModelBudget", "memory_budget",
           "memory_budget_policies", "spread"]
