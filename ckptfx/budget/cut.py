"""The budget planner's solver: a min-cut model of a recording, the exact lower convex hull of
its (bytes, cost) points, and a branch and bound that proves the frontier between them.

Rules

1. The model (``CutModel``) is a relaxation of tracer.py's keep and replay rules as
   ``_Model.score`` runs them. Its *contents* are base storages at a version (views and
   aliases are contracted into their base: they cost nothing and share its bytes; block
   arguments are free). Choose the set R of ops the replay runs: every content a live pack,
   or an op in R, reads must be made by an op in R or be kept; only a storage's final version
   can be kept; a random op in R needs the random op it continues from (segment.py Rule 3b).
   Cost: ``W``, the FLOPs of R (what a budget minimises; the recomputed elements that break
   ties between scored candidates are not part of the proof); bytes: the kept storages'.

2. Bound. For every keep-set, the replay tracer.py plans (its ops, what it keeps) satisfies
   the model's constraints and costs the model no more than ``_Model.score`` says, so the
   model's optimum at a byte budget is a lower bound on what any keep-set achieves there.
   The model is *exact* (a cut's keep-set scores what the cut costs) when every random op
   the replay may run only to continue another's generator reads, through values that cannot
   be kept, nothing but packed values (the replay's frontier walk does not follow that
   chain), no written storage has a view or alias, and every pack follows its value's last
   writer; elsewhere it is a bound only, and a cut is just one more candidate. Either way
   every candidate is scored by ``_Model.score``.

3. For integers ``a, b >= 0``, ``a*W + b*bytes`` is minimised by an s-t min cut: source->op
   costs ``a*W(op)`` (cut: the op is replayed), op->content ``b*bytes`` (cut: kept),
   content->reader and op->the random op continuing it are infinite. A packed content is
   folded into its maker's edge to the sink (cut: kept), and one that cannot be kept ties its
   readers to its maker. Integer capacities and Dinic's max flow keep it exact and
   deterministic; the sink side is the minimal one. Breakpoint search over the ratio ``b/a``
   (Eisner and Severance) gives every vertex of the lower convex hull.

4. Proof. For a byte limit ``L``, the Lagrangian dual (the hull of a subproblem, read at
   ``L``) bounds the cost from below; branch and bound fixes the sides of nodes on which the
   two hull points bracketing ``L`` disagree, best bound first, pruning what cannot beat the
   best scored keep-set. Work is counted in min cuts (``MAX_CUTS`` per block), never timed:
   a query stopped by the count keeps the lower bound it proved.
"""

from __future__ import annotations

import heapq
import itertools
import math
from fractions import Fraction
from typing import Any, Callable, Sequence

from ckptfx._ops import op_info

# The scorer (``model._Model``) and its points (``model.Point``) are model.py's, which imports
# this solver: they are typed ``Any`` here, so the import runs one way only.

__all__ = ["MAX_CUTS", "Cut", "CutModel", "Proof", "prove"]

# Min cuts one block's planning may solve (Rule 4): a deterministic work limit, not a clock.
# The hull's cuts (at most two per vertex) are always solved, and count towards it.
MAX_CUTS = 3000

_SRC, _SINK = 0, 1


class Cut:
    """One min cut: the nodes on the sink side, the ops it replays and contents it keeps, its
    model cost ``w`` and ``nbytes``."""

    __slots__ = ("sink", "w", "nbytes", "keep")

    def __init__(self, sink: frozenset[int], w: int, nbytes: int, keep: frozenset[int]) -> None:
        self.sink = sink
        self.w = w
        self.nbytes = nbytes
        self.keep = keep  # the keep-set (recorded op positions) standing for the cut


class CutModel:
    """The min-cut model of one recording (Rule 1).

    Example::

        cut = CutModel(model, funcs)
        c = cut.solve(1, 0)        # least cost, whatever the bytes
        model.score(c.keep)        # what the tracer does with that keep-set
    """

    def __init__(self, model: Any, funcs: Sequence[Any]) -> None:
        seg, root = model.seg, model.root
        final = {b: len(ws) for b, ws in seg.writers.items()}
        maker: dict[tuple[int, int], int] = {}
        for s, b in enumerate(seg.base):
            if b == s and root[s] < 0 and seg.producer[s] >= 0:
                maker[(s, 0)] = seg.producer[s]
        for b, ws in seg.writers.items():
            if root[b] < 0:
                for k, w in enumerate(ws):
                    maker[(b, k + 1)] = w

        def content(slot: int, version: int) -> tuple[int, int] | None:
            return None if root[slot] >= 0 else (seg.base[slot], version)

        ops = sorted(set(maker.values()))
        needs: dict[int, list[tuple[int, int]]] = {}
        read: set[tuple[int, int]] = set()
        for i in ops:
            cs = []
            for _, s, v in seg.ops[i].inputs:
                c = content(s, v)
                if c is not None and c in maker and c not in cs:
                    cs.append(c)
            needs[i] = cs
            read.update(cs)
        packed: list[tuple[int, int]] = []
        exact = True
        for _, (s, v), t in model.packs:
            c = content(s, v)
            if c is None or c not in maker:
                continue
            if c not in packed:
                packed.append(c)
            if maker[c] >= t:  # packed before its last writer ran (packs.py Rule 1b)
                exact = False

        def keepable(c: tuple[int, int]) -> bool:
            return c[1] == final.get(c[0], 0)

        # Exactness (Rule 2). A random op the replay runs only to continue a generator reads
        # what the replay's frontier walk never reached: exact if all it reads (through
        # values that cannot be kept) is packed, so kept or recomputed for its packs anyway.
        chain = [c for p in set(seg.rng_prev.values()) if p in needs for c in needs[p]]
        seen: set[tuple[int, int]] = set()
        while chain:
            c = chain.pop()
            if c in seen:
                continue
            seen.add(c)
            if not keepable(c):
                chain.extend(needs[maker[c]])
            elif c not in packed:
                exact = False
        # No view or alias of a written storage; no op handing back a value it did not write.
        for s, b in enumerate(seg.base):
            if b != s and b in final:
                exact = False
        for i, outs in enumerate(model.op_outs):
            for slot, new, version in outs:
                if not new and maker.get((seg.base[slot], version)) != i:
                    exact = False
        self.exact = exact

        # Nodes: the ops, and the contents that are kept or not by choice (read, not packed,
        # keepable). A packed content is always available: its maker's edge to the sink is
        # its bytes (cut: kept); a content that cannot be kept ties its readers to its maker.
        free = sorted(c for c in read if c not in packed and keepable(c))
        self.op_index = {i: 2 + k for k, i in enumerate(ops)}
        self.content_index = {c: 2 + len(ops) + k for k, c in enumerate(free)}
        self.n = 2 + len(ops) + len(free)
        self.op_w = {self.op_index[i]: model.cost[i][0] for i in ops}
        nbytes = model.nbytes
        self.content_bytes = {self.content_index[c]: nbytes.get(c[0], 0) for c in free}
        self.maker_node = {self.content_index[c]: self.op_index[maker[c]] for c in free}
        # The ops whose keep decision keeps a content: its maker and the non-view aliases
        # (``_unsafe_view``) of it, which the policy is asked about too.
        keepers: dict[tuple[int, int], set[int]] = {c: {maker[c]} for c in read | set(packed)}
        for i, outs in enumerate(model.op_outs):
            if op_info(funcs[i]).view:
                continue
            for slot, _, version in outs:
                c = content(slot, version)
                if c is not None and c in keepers:
                    keepers[c].add(i)
        self.keepers = {self.content_index[c]: frozenset(keepers[c]) for c in free}
        # Per op node: the bytes and keepers of its packed outputs, kept when it is not
        # replayed (None bytes: one cannot be kept, so the op is always replayed).
        self.packed_of: dict[int, tuple[int | None, frozenset[int]]] = {}
        for c in packed:
            n = self.op_index[maker[c]]
            held, ks = self.packed_of.get(n, (0, frozenset()))
            held = None if held is None or not keepable(c) else held + nbytes.get(c[0], 0)
            self.packed_of[n] = (held, ks | keepers[c])

        head: list[list[int]] = [[] for _ in range(self.n)]
        to: list[int] = []

        def edge(u: int, v: int) -> int:
            head[u].append(len(to))
            to.append(v)
            head[v].append(len(to))
            to.append(u)
            return len(to) - 2

        self.cost_edges = [(edge(_SRC, n), w) for n, w in self.op_w.items()]
        self.keep_edges = [(edge(self.maker_node[n], n), b) for n, b in self.content_bytes.items()]
        self.inf_edges = []
        for n, (held, _) in self.packed_of.items():
            if held is None:
                self.inf_edges.append(edge(n, _SINK))
            else:
                self.keep_edges.append((edge(n, _SINK), held))
        for i in ops:
            for c in needs[i]:
                if c in self.content_index:
                    self.inf_edges.append(edge(self.content_index[c], self.op_index[i]))
                elif c not in packed:  # cannot be kept: replaying the reader replays its maker
                    self.inf_edges.append(edge(self.op_index[maker[c]], self.op_index[i]))
        for i, p in seg.rng_prev.items():
            if i in self.op_index and p in self.op_index:
                self.inf_edges.append(edge(self.op_index[p], self.op_index[i]))
        self.fix_edges = {n: (edge(_SRC, n), edge(n, _SINK)) for n in range(2, self.n)}
        self.head, self.to = head, to
        self.total_w = sum(self.op_w.values())
        self.total_bytes = sum(b for _, b in self.keep_edges)
        self.cuts = 0  # min cuts solved (Rule 4's count)

    def solve(self, a: int, b: int, fix: dict[int, bool] | None = None) -> Cut | None:
        """The min cut of ``a*W + b*bytes`` with the nodes in ``fix`` on the sink side
        (True) or the source side (False); None if the fixing admits no replay."""
        self.cuts += 1
        cap = [0] * len(self.to)
        finite = 0
        for e, w in self.cost_edges:
            cap[e] = a * w
            finite += a * w
        for e, nb in self.keep_edges:
            cap[e] = b * nb
            finite += b * nb
        inf = finite + 1
        for e in self.inf_edges:
            cap[e] = inf
        for n, side in (fix or {}).items():
            from_source, to_sink = self.fix_edges[n]
            cap[to_sink if side else from_source] = inf
        flow = _max_flow(self.n, self.head, self.to, cap)
        if flow >= inf:
            return None
        sink = _sink_side(self.n, self.head, self.to, cap)
        keep: set[int] = set()
        kept_bytes = 0
        for n, nb in self.content_bytes.items():
            if n in sink and self.maker_node[n] not in sink:
                keep |= self.keepers[n]
                kept_bytes += nb
        for n, (held, ks) in self.packed_of.items():
            if n not in sink:
                keep |= ks
                kept_bytes += held or 0
        w = sum(wn for n, wn in self.op_w.items() if n in sink)
        return Cut(frozenset(sink), w, kept_bytes, frozenset(keep))

    def hull(self) -> list[Cut]:
        """Every vertex of the lower convex hull of the model's (bytes, W) points, by
        bytes (Rule 3)."""
        lo = self.solve(1, self.total_w + 1)       # least bytes, then least cost
        hi = self.solve(self.total_bytes + 1, 1)   # least cost, then least bytes
        assert lo is not None and hi is not None  # no fixing: the full replay is one
        if (lo.nbytes, lo.w) == (hi.nbytes, hi.w):
            return [lo]
        out = [lo]

        def between(p: Cut, q: Cut) -> None:
            a, b = q.nbytes - p.nbytes, p.w - q.w
            c = self.solve(a, b)
            assert c is not None
            if a * c.w + b * c.nbytes < a * p.w + b * p.nbytes:
                between(p, c)
                out.append(c)
                between(c, q)

        between(lo, hi)
        out.append(hi)
        return out


def hull_at(hull: Sequence[tuple[int, Any]], limit: int) -> Fraction | None:
    """The lower hull through (bytes, W) vertices, read at ``limit`` bytes: a lower bound on
    the cost of anything with at most ``limit`` bytes; None below the least bytes."""
    if not hull or limit < hull[0][0]:
        return None
    for (b0, w0), (b1, w1) in zip(hull, hull[1:]):
        if limit < b1:
            return Fraction(w0) + Fraction(w1 - w0) * (limit - b0) / (b1 - b0)
    return Fraction(hull[-1][1])


class Proof:
    """What the planner proved for one block: the model's hull (bytes, FLOPs), and per byte
    limit ``L`` a lower bound on the least FLOPs of any keep-set with at most ``L`` bytes."""

    def __init__(self, hull: list[tuple[int, int]], exact_model: bool, top: int) -> None:
        self.top = top  # the limit proved for the last frontier point: every byte
        self.hull = hull
        self.exact_model = exact_model
        self.bounds: dict[int, Fraction] = {}  # L -> lower bound on OPT(L), in W
        self.closed: set[int] = set()          # L whose bound the search finished
        self.cuts = 0

    def lower_bound(self, limit: int) -> Fraction | None:
        """A lower bound on OPT(limit), in W: the hull at ``limit``, or a bound proved at a
        larger limit (OPT never rises as the limit falls)."""
        best = hull_at(self.hull, limit)
        for L, lb in self.bounds.items():
            if L >= limit and (best is None or lb > best):
                best = lb
        return best


def prove(model: Any, cut: CutModel, frontier: Callable[[], list[Any]],
          max_cuts: int = MAX_CUTS) -> Proof:
    """Score the hull's keep-sets, then prove the frontier interval by interval (Rule 4):
    for frontier points ``p`` and ``q`` (the next), search for a keep-set under
    ``q.nbytes`` bytes cheaper than ``p``; each one found joins the candidates (scored by
    ``model.score``). ``frontier()`` is the current Pareto frontier of ``model.memo``."""
    hull = cut.hull()
    for c in hull:
        model.score(c.keep)
    proof = Proof([(c.nbytes, c.w) for c in hull], cut.exact, cut.total_bytes)
    search = _Search(model, cut, hull, max_cuts)
    while True:
        points = frontier()
        todo = None
        for i, p in enumerate(points):
            if p.flops == 0 or (i and points[i - 1].flops == p.flops):
                continue  # nothing to prove, or the FLOPs proved for the run's first point
            j = next((j for j in range(i + 1, len(points)) if points[j].flops < p.flops), None)
            limit = proof.top if j is None else points[j].nbytes - 1
            if limit not in proof.bounds:
                todo = (limit, p)
                break
        if todo is None:
            break
        limit, p = todo
        lb, closed = search.query(limit, p.flops)
        proof.bounds[limit] = lb
        if closed:
            proof.closed.add(limit)
    proof.cuts = cut.cuts
    return proof


class _Dual:
    """A subproblem's Lagrangian bound at a limit and its bracketing cuts (``_Search._dual``)."""

    __slots__ = ("bound", "lo", "hi")

    def __init__(self, bound: Fraction | None, lo: Cut | None, hi: Cut | None) -> None:
        self.bound, self.lo, self.hi = bound, lo, hi


class _Search:
    """Branch and bound for least cost under a byte limit (Rule 4)."""

    def __init__(self, model: Any, cut: CutModel, hull: list[Cut], max_cuts: int) -> None:
        self.model, self.cut, self.hull, self.max_cuts = model, cut, hull, max_cuts
        self.order = itertools.count()

    def _w(self, keep: frozenset[int]) -> tuple[int, int]:
        p = self.model.score(keep)
        return p.nbytes, p.flops

    def _dual(self, fix: dict[int, bool], limit: int, best: list[int]) -> _Dual | None:
        """The Lagrangian bound of a subproblem at ``limit`` and the hull points bracketing
        it (left within the limit, right over it; right None when the least-cost cut fits;
        both None: the fixing is infeasible or nothing fits). Feasible cuts found on the way
        are scored: ``best[0]`` is the best W within the limit. None: out of cuts."""
        cut = self.cut
        if not fix:
            left = [c for c in self.hull if c.nbytes <= limit]
            right = [c for c in self.hull if c.nbytes > limit]
            if not left:
                return _Dual(None, None, None)
            lo = left[-1]
            if not right:
                return _Dual(Fraction(lo.w), lo, None)
            hi = right[0]
            return _Dual(hull_at([(lo.nbytes, lo.w), (hi.nbytes, hi.w)], limit), lo, hi)
        if cut.cuts + 2 > self.max_cuts:
            return None
        least_w = cut.solve(cut.total_bytes + 1, 1, fix)
        if least_w is None:
            return _Dual(None, None, None)
        self._offer(least_w, limit, best)
        if least_w.nbytes <= limit:
            return _Dual(Fraction(least_w.w), least_w, None)
        least_bytes = cut.solve(1, cut.total_w + 1, fix)
        if least_bytes is None or least_bytes.nbytes > limit:
            return _Dual(None, None, None)
        self._offer(least_bytes, limit, best)
        lo, hi = least_bytes, least_w
        bound = Fraction(hi.w)  # no cut of the subproblem costs less
        while cut.cuts < self.max_cuts:
            a, b = hi.nbytes - lo.nbytes, lo.w - hi.w  # both > 0: lo fits, hi does not
            c = cut.solve(a, b, fix)
            assert c is not None  # lo and hi satisfy the fixing
            # Weak duality: every cut within the limit costs at least this. Once c is on
            # the segment lo-hi, it is the hull read at the limit, the dual's optimum.
            bound = max(bound, Fraction(a * c.w + b * c.nbytes - b * limit, a))
            if a * c.w + b * c.nbytes >= a * lo.w + b * lo.nbytes:
                break
            if c.nbytes <= limit:
                lo = c
                self._offer(c, limit, best)
            else:
                hi = c
        return _Dual(bound, lo, hi)

    def _offer(self, c: Cut, limit: int, best: list[int]) -> None:
        nbytes, w = self._w(c.keep)
        if nbytes <= limit and w < best[0]:
            best[0] = w

    def query(self, limit: int, incumbent: int) -> tuple[Fraction, bool]:
        """A lower bound on the least W of a keep-set within ``limit`` bytes, and whether the
        search finished (then the bound is the best scored W itself). Candidates found are
        in ``model.memo``."""
        best = [incumbent]
        root = self._dual({}, limit, best)
        assert root is not None  # the root's hull is known: no cut solved
        heap: list[tuple[Fraction, int, dict[int, bool], Cut, Cut]] = []
        open_lbs: list[Fraction] = []  # subproblems whose optimum fits but scores more

        def push(fix: dict[int, bool], dual: _Dual) -> None:
            d, lo, hi = dual.bound, dual.lo, dual.hi
            if d is None or math.ceil(d) >= best[0]:
                return
            if hi is None or lo is None:
                open_lbs.append(d)
                return
            heapq.heappush(heap, (d, next(self.order), fix, lo, hi))

        push({}, root)
        while heap:
            d, order, fix, lo, hi = heap[0]
            if math.ceil(d) >= best[0]:
                heapq.heappop(heap)
                continue
            node = self._branch_node(lo, hi)
            children = []
            for side in (node in lo.sink, node in hi.sink):
                child = dict(fix)
                child[node] = side
                dual = self._dual(child, limit, best)
                if dual is None:
                    break
                children.append((child, dual))
            if len(children) < 2:  # out of cuts: this node stays open
                break
            heapq.heappop(heap)
            for child, dual in children:
                push(child, dual)
        lb = min([Fraction(best[0])] + [h[0] for h in heap] + open_lbs)
        if math.ceil(lb) >= best[0]:  # costs are integers: nothing open can beat the best
            return Fraction(best[0]), True
        return lb, False

    def _branch_node(self, lo: Cut, hi: Cut) -> int:
        """A node the two bracketing cuts put on different sides: the heaviest at the
        bracket's ratio (an op's cost, a content's bytes times the ratio), lowest first."""
        cut = self.cut
        a, b = hi.nbytes - lo.nbytes, lo.w - hi.w
        best, best_weight = -1, -1
        for n in sorted(lo.sink ^ hi.sink):
            if n in cut.op_w:
                weight = a * cut.op_w[n]
            else:
                weight = b * cut.content_bytes.get(n, 0)
            if weight > best_weight:
                best, best_weight = n, weight
        return best


def _max_flow(n: int, head: list[list[int]], to: list[int], cap: list[int]) -> int:
    """Dinic's max flow from node 0 to node 1; ``cap`` is left as the residual graph."""
    flow = 0
    while True:
        level = [-1] * n
        level[_SRC] = 0
        queue = [_SRC]
        for u in queue:
            for e in head[u]:
                v = to[e]
                if cap[e] > 0 and level[v] < 0:
                    level[v] = level[u] + 1
                    queue.append(v)
        if level[_SINK] < 0:
            return flow
        it = [0] * n
        path: list[int] = []  # edges from the source to u
        u = _SRC
        while True:
            if u == _SINK:
                f = min(cap[e] for e in path)
                for e in path:
                    cap[e] -= f
                    cap[e ^ 1] += f
                flow += f
                path.clear()
                u = _SRC
                continue
            hu, k = head[u], it[u]
            next_level = level[u] + 1
            while k < len(hu):
                e = hu[k]
                if cap[e] > 0 and level[to[e]] == next_level:
                    break
                k += 1
            it[u] = k
            if k < len(hu):
                path.append(hu[k])
                u = to[hu[k]]
            elif u == _SRC:
                break
            else:  # a dead end: retreat, and skip the edge that led here
                level[u] = -1
                e = path.pop()
                u = to[e ^ 1]
                it[u] += 1


def _sink_side(n: int, head: list[list[int]], to: list[int], cap: list[int]) -> set[int]:
    """The nodes that reach the sink in the residual graph: the minimal sink side."""
    seen = {_SINK}
    queue = [_SINK]
    for v in queue:
        for e in head[v]:
            u = to[e]
            if u not in seen and cap[e ^ 1] > 0:
                seen.add(u)
                queue.append(u)
    return seen
