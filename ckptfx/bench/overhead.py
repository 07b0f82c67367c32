"""Per-call overhead where blocks are small: remat's forward, the split step, vjp_split.

    ckptfx bench --overhead [--quick] [--only remat|split|vjp256] [--rounds N]
    python benchmarks/bench_overhead.py [--quick] [--only remat|split|vjp256] [--rounds N]

All variants of a part run in one process, alternated (A B C ... then C B A ...), one
thread; each figure is a median over rounds, reported as a ratio to its alternative in the
same run, with the interquartile range of the per-round ratios (the spread). Times are the
benchmarking thread's CPU time (``time.thread_time``): on a machine shared with other work
the wall clock also counts the time the other processes held the cores. Parts:

remat   forward of a transformer block (d=64 / d=256): ``remat(nothing_saveable)`` vs
        torch's checkpoint, ``remat(dots_saveable)`` vs torch's selective checkpoint (SAC)
        saving the dots. Floor: torch's checkpoint forward under an empty
        TorchDispatchMode, the least any recorder of ATen ops costs (Python per op).
        Targets: nothing <= 1.1x, dots <= 1.0x. nothing_saveable's calls after the first
        run unrecorded (ckptfx.rerun); ``always_record=True`` is the recorded forward, for
        comparison. Then a whole step (forward + backward) of the same variants: an
        unrecorded call's replay re-runs the block under a dispatch mode (the explicit
        generator watch), so the recording's cost moves to the backward rather than going.
split   a split step over 6 small MLP blocks (d=64, hidden 256, batch 8): ckptfx sessions
        (prefire + dx + one dw call per parameter) vs no checkpointing (target <= 1.3x),
        and its floor: every saved tensor through a Python saved-tensor hook plus one more
        forward of each block to its last pack, what any hook-based checkpoint pays;
        ``vjp_split`` (prefire + dx + its weight pass) vs one fused backward without
        checkpointing (target <= 1.5x). Floors: torch's own split (stage_backward_input /
        stage_backward_weight) over the same blocks without checkpointing, the autograd
        calls a per-group weight pass makes at the least; a fused step plus one more
        forward, the compute that any step replaying each block once adds; the split
        floor: the hook floor's forward and replays plus vjp_split's two engine calls at
        this size (dx, then one weight backward from the outputs), what any checkpointed
        split replaying each block once through saved-tensor hooks pays. Also: ckptfx's
        checkpoint with prefire and one fused backward, vjp_split against it, and
        vjp_split forced to its per-group weight pass (what the rule's choice saves), and
        what a checkpoint's own machinery costs per block over the hook floor in a fused
        step (forward + one backward), ckptfx's checkpoint against torch's.
vjp256  dx + dw of ``vjp_split`` vs one fused backward over 6 checkpointed transformer
        blocks (d=256, batch 8, seq 128; target <= 1.05x). Floor: torch's split against a
        fused backward, both without checkpointing (dw reads each activation a second time,
        after dx, out of cache). Also: dx dropping the tensors only it reads when it ends
        instead of at their read (what the drop at the read saves).

At the end a verdict: one line per target of issue 17 whose part ran, met or not, with the
floor measured for it in the same run (``verdict``; a floor above its target says the
target is below what that step costs before any of ckptfx's own work).

``main()`` returns every figure as a flat dict (for ``ckptfx bench``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

import ckptfx
import ckptfx._weight_calls as weight_calls
import ckptfx.split as cx_split
from ckptfx import checkpoint_policies as cp

aten = torch.ops.aten
DOTS = (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default)


class Block(nn.Module):
    """A pre-norm transformer block (no dropout: bench_remat.py's)."""

    def __init__(self, d: int, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(
            2, 0, 3, 1, 4).reshape(3, b * self.heads, t, d // self.heads)
        a = torch.softmax(torch.bmm(q, k.transpose(1, 2)) / (d // self.heads) ** 0.5, -1)
        o = torch.bmm(a, v).view(b, self.heads, t, -1).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(o)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class MLPBlock(nn.Module):
    """x + fc2(gelu(fc1(x))) (bench_sessions.py's small block)."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class _Empty(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        return func(*args, **(kwargs or {}))


def _sac_dots(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in DOTS else CheckpointPolicy.PREFER_RECOMPUTE


def rounds_of(fns: dict[str, Callable[[], Any]], rounds: int, inner: int = 1
              ) -> dict[str, list[float]]:
    """Seconds per call of each variant, one entry per round, variants alternated."""
    for fn in fns.values():  # warm up
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for r in range(rounds):
        for k in (names if r % 2 == 0 else names[::-1]):
            fn = fns[k]
            t0 = time.thread_time()
            for _ in range(inner):
                fn()
            times[k].append((time.thread_time() - t0) / inner)
    return times


def ratio(times: dict[str, list[float]], a: str, b: str
          ) -> tuple[float, float, float, float]:
    """Median of a / median of b (the figure), the quartiles of the per-round ratios a/b, and
    their median: each round times a and b next to each other, so where the machine's speed
    drifts during a run the per-round median can differ from the figure, even fall outside
    the quartiles (both are printed)."""
    per_round = sorted(x / y for x, y in zip(times[a], times[b]))
    n = len(per_round)
    return (statistics.median(times[a]) / statistics.median(times[b]),
            per_round[n // 4], per_round[(3 * n) // 4], statistics.median(per_round))


def _fmt(r: tuple[float, float, float, float]) -> str:
    return f"{r[0]:.3f}x (per round: median {r[3]:.3f}, IQR {r[1]:.3f}-{r[2]:.3f})"


def _target(key: str) -> str:
    """The printed target of figure ``key``, from ``TARGETS`` (issue 17's, below)."""
    limit = next(t[1] for t in TARGETS if t[0] == key)
    return f"   (target <= {limit})"


def bench_remat(d: int, rounds: int, inner: int) -> dict[str, float]:
    b, t = (2, 32) if d <= 64 else (8, 128)
    torch.manual_seed(0)
    block = Block(d)
    x = torch.randn(b, t, d, requires_grad=True)
    nothing = ckptfx.remat(block.forward, policy=cp.nothing_saveable)
    recorded = ckptfx.remat(block.forward, policy=cp.nothing_saveable, always_record=True)
    dots = ckptfx.remat(block.forward, policy=cp.dots_saveable)

    def floor() -> Any:
        with _Empty():
            return checkpoint(block, x, use_reentrant=False)

    fns = {
        "plain": lambda: block(x),
        "torch": lambda: checkpoint(block, x, use_reentrant=False),
        "floor": floor,
        "remat nothing": lambda: nothing(x),
        "remat nothing recorded": lambda: recorded(x),
        "torch SAC dots": lambda: checkpoint(
            block, x, use_reentrant=False,
            context_fn=lambda: create_selective_checkpoint_contexts(_sac_dots)),
        "remat dots": lambda: dots(x),
    }
    times = rounds_of(fns, rounds, inner)
    med = {k: statistics.median(v) for k, v in times.items()}
    r_nothing = ratio(times, "remat nothing", "torch")
    r_dots = ratio(times, "remat dots", "torch SAC dots")
    r_floor = ratio(times, "floor", "torch")
    r_recorded = ratio(times, "remat nothing recorded", "torch")
    print(f"remat forward, transformer block d={d} batch={b} seq={t} ({rounds}x{inner} calls): "
          + ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in med.items()))
    print(f"  nothing_saveable / torch checkpoint: {_fmt(r_nothing)}" + _target(f"remat{d}_nothing_vs_torch"))
    print(f"  nothing_saveable, always_record=True / torch checkpoint: {_fmt(r_recorded)}")
    print(f"  dots_saveable / torch SAC:           {_fmt(r_dots)}" + _target(f"remat{d}_dots_vs_sac"))
    print(f"  floor: torch checkpoint under an empty dispatch mode / torch checkpoint: "
          f"{_fmt(r_floor)}")
    steps = rounds_of({k: _fwd_bwd(fns[k]) for k in
                       ("torch", "remat nothing", "remat nothing recorded")}, rounds, inner)
    s_nothing = ratio(steps, "remat nothing", "torch")
    s_recorded = ratio(steps, "remat nothing recorded", "torch")
    print(f"  step (forward + backward), nothing_saveable / torch checkpoint: {_fmt(s_nothing)}")
    print(f"  step, nothing_saveable, always_record=True / torch checkpoint: {_fmt(s_recorded)}")
    return {f"remat{d}_nothing_vs_torch": r_nothing[0], f"remat{d}_dots_vs_sac": r_dots[0],
            f"remat{d}_dispatch_floor_vs_torch": r_floor[0],
            f"remat{d}_recorded_nothing_vs_torch": r_recorded[0],
            f"remat{d}_step_nothing_vs_torch": s_nothing[0],
            f"remat{d}_step_recorded_nothing_vs_torch": s_recorded[0]}


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


class _LastPack(Exception):
    pass


def _saves_of(block: nn.Module, x: torch.Tensor) -> int:
    """How many tensors autograd saves in one call of ``block``."""
    count = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        count[0] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, _identity):
        block(x)
    return count[0]


def _run_to_last_pack(block: nn.Module, x: torch.Tensor, saves: int) -> None:
    """Run ``block`` under a pack hook that stops it in its last pack (a replay's compute)."""
    count = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        count[0] += 1
        if count[0] == saves:
            raise _LastPack
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, _identity):
        try:
            block(x)
        except _LastPack:
            pass


def _fwd_bwd(fn: Callable[[], Any]) -> Callable[[], None]:
    def step() -> None:
        fn().sum().backward()
    return step


def _split_backward(out: torch.Tensor, x: torch.Tensor, params: Sequence[torch.Tensor],
                    g: torch.Tensor, session: Any) -> None:
    """dx, then one dw call per parameter (bench_sessions.py's split step)."""
    if session is None:
        torch.autograd.grad(out, x, g, retain_graph=True)
        for p in params[:-1]:
            torch.autograd.grad(out, p, g, retain_graph=True)
        torch.autograd.grad(out, params[-1], g)
        return
    with ckptfx.recompute_session_ctx(session, retain_on_unpack=True):
        torch.autograd.grad(out, x, g, retain_graph=True)
        for p in params[:-1]:
            torch.autograd.grad(out, p, g, retain_graph=True)
    with ckptfx.recompute_session_ctx(session, retain_on_unpack=False):
        torch.autograd.grad(out, params[-1], g)


def split_variants(d: int = 64, hidden: int = 256, batch: int = 8, nblocks: int = 6
                   ) -> dict[str, Callable[[], None]]:
    """The split step's variants over ``nblocks`` small MLP blocks, each a step to call (what
    ``bench_split`` times and ``benchmarks/bench_instructions.py`` counts)."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    torch.manual_seed(0)
    blocks = [MLPBlock(d, hidden) for _ in range(nblocks)]
    x = torch.randn(batch, d, requires_grad=True)
    g = torch.randn(batch, d)
    params = [p for b in blocks for p in b.parameters()]

    def plain(h: torch.Tensor) -> torch.Tensor:
        for b in blocks:
            h = b(h)
        return h

    def stack(h: torch.Tensor) -> torch.Tensor:
        for b in blocks:
            h = ckptfx.checkpoint(b, h)
        return h

    def none() -> None:
        _split_backward(plain(x), x, params, g, None)

    def sessions() -> None:
        with ckptfx.recompute_handle_collector_ctx() as handles:
            h = stack(x)
        try:
            for hd in handles:
                ckptfx.recompute_handle(hd, "mb")
            _split_backward(h, x, params, g, "mb")
        finally:
            ckptfx.clear_recompute_session("mb")

    def vjp_split() -> None:
        _, dx_fn, dw_fn = ckptfx.vjp_split(stack, x, params=params, session="mb")
        dx_fn.prefire()
        dx_fn(g)
        dw_fn()
        for p in params:
            p.grad = None

    def vjp_split_per_group() -> None:
        # the per-group weight pass, which the rule leaves for larger blocks (_weight_calls)
        weight_calls._force = "per_group"
        try:
            vjp_split()
        finally:
            weight_calls._force = None

    def fused() -> None:
        torch.autograd.grad(plain(x), [x, *params], g)

    def torch_split_plain() -> None:
        xr = x.detach().requires_grad_()
        out = plain(xr)
        _, groups = stage_backward_input([out], [g], [xr], iter(params))
        stage_backward_weight(iter(params), groups)
        for p in params:
            p.grad = None

    saves_per_block = _saves_of(blocks[0], x)

    def floor_forward() -> torch.Tensor:
        # What any checkpoint built on saved-tensor hooks pays at the least: every saved
        # tensor through a Python hook (identity here), and each block run once more under
        # the hook up to its last pack (the replay's compute, stopped as an early stop does).
        with torch.autograd.graph.saved_tensors_hooks(_identity, _identity):
            out = plain(x)
        for b in blocks:
            _run_to_last_pack(b, x, saves_per_block)
        return out

    def hook_floor() -> None:
        _split_backward(floor_forward(), x, params, g, None)

    def split_floor() -> None:
        # The least a checkpointed split with one replay per block costs here: the hook
        # floor's forward and replays, then vjp_split's two engine calls at this size (its
        # whole weight pass: dx, then one weight backward from the outputs; the gradients
        # returned, where vjp_split also puts them in .grad).
        out = floor_forward()
        torch.autograd.grad(out, x, g, retain_graph=True)
        torch.autograd.grad(out, params, g)

    def fused_and_forward() -> None:
        plain(x)  # the compute of one replay, which any checkpointed step adds
        fused()

    def ckptfx_fused() -> None:
        with ckptfx.recompute_handle_collector_ctx() as handles:
            h = stack(x)
        try:
            for hd in handles:
                ckptfx.recompute_handle(hd, "mb")
            with ckptfx.recompute_session_ctx("mb"):
                torch.autograd.grad(h, [x, *params], g)
        finally:
            ckptfx.clear_recompute_session("mb")

    def torch_fused() -> None:
        # torch's checkpoint, one fused backward (it replays each block once per backward
        # call, so it has no split step to compare with: this measures its machinery)
        h = x
        for b in blocks:
            h = checkpoint(b, h, use_reentrant=False)
        torch.autograd.grad(h, [x, *params], g)

    def hook_floor_fused() -> None:
        # the hook floor's forward and replays, then one fused backward
        torch.autograd.grad(floor_forward(), [x, *params], g)

    def ckptfx_plain_fused() -> None:
        torch.autograd.grad(stack(x), [x, *params], g)

    return {"none": none, "ckptfx sessions": sessions, "hook floor": hook_floor,
            "vjp_split": vjp_split,
            "vjp_split per group": vjp_split_per_group, "fused": fused,
            "floor": torch_split_plain, "split floor": split_floor,
            "fused + forward": fused_and_forward,
            "ckptfx fused": ckptfx_fused, "torch checkpoint fused": torch_fused,
            "hook floor fused": hook_floor_fused, "ckptfx checkpoint fused": ckptfx_plain_fused}


def bench_split(rounds: int, inner: int, d: int = 64, hidden: int = 256, batch: int = 8,
                nblocks: int = 6) -> dict[str, float]:
    fns = split_variants(d, hidden, batch, nblocks)
    times = rounds_of(fns, rounds, inner)
    med = {k: statistics.median(v) for k, v in times.items()}
    r_sess = ratio(times, "ckptfx sessions", "none")
    r_hooks = ratio(times, "hook floor", "none")
    r_sess_floor = ratio(times, "ckptfx sessions", "hook floor")
    r_vjp = ratio(times, "vjp_split", "fused")
    r_floor = ratio(times, "floor", "fused")
    r_split_floor = ratio(times, "split floor", "fused")
    r_vjp_split_floor = ratio(times, "vjp_split", "split floor")
    r_recompute = ratio(times, "fused + forward", "fused")
    r_ck = ratio(times, "ckptfx fused", "fused")
    r_vjp_ck = ratio(times, "vjp_split", "ckptfx fused")
    r_pg = ratio(times, "vjp_split per group", "fused")
    r_whole = ratio(times, "vjp_split", "vjp_split per group")
    print(f"split step, {nblocks} MLP blocks d={d} hidden={hidden} batch={batch} "
          f"({rounds}x{inner} steps): " + ", ".join(f"{k} {v * 1e3:.3f} ms"
                                                   for k, v in med.items()))
    dw_calls = 4 * nblocks  # one per parameter: fc1's and fc2's weight and bias
    print(f"  ckptfx sessions (prefire + dx + {dw_calls} dw calls) / none: {_fmt(r_sess)}"
          + _target("split_sessions_vs_none"))
    print(f"  floor: saved-tensor hooks + one more forward to each block's last pack / none: "
          f"{_fmt(r_hooks)}; ckptfx sessions / that floor: {_fmt(r_sess_floor)}")
    print(f"  vjp_split step / fused step:          {_fmt(r_vjp)}" + _target("split_vjp_vs_fused"))
    print(f"  floor: torch's split without checkpointing / fused: {_fmt(r_floor)}")
    print(f"  floor: saved-tensor hooks + one more forward to each block's last pack + "
          f"vjp_split's two engine calls (dx, then dw from the outputs) / fused: "
          f"{_fmt(r_split_floor)}; vjp_split / that floor: {_fmt(r_vjp_split_floor)}")
    print(f"  floor: fused step + one more forward (a replay's compute) / fused: "
          f"{_fmt(r_recompute)}")
    print(f"  ckptfx checkpoint, prefire + one fused backward / fused: {_fmt(r_ck)}")
    print(f"  vjp_split step / that checkpointed fused step: {_fmt(r_vjp_ck)}")
    print(f"  vjp_split with the per-group weight pass / fused: {_fmt(r_pg)}; the rule's "
          f"pass / per-group: {_fmt(r_whole)}")
    # What a checkpoint's own machinery costs per block, over the hook floor, in a fused
    # step (forward + one backward): ckptfx's against torch's, the same blocks and run.
    floor_fused = med["hook floor fused"]
    per_block = {k: (med[k] - floor_fused) / nblocks
                 for k in ("ckptfx checkpoint fused", "torch checkpoint fused")}
    r_machinery = per_block["ckptfx checkpoint fused"] / per_block["torch checkpoint fused"]
    print(f"  fused step, per block over the hook floor: ckptfx's checkpoint "
          f"{per_block['ckptfx checkpoint fused'] * 1e6:.0f} us, torch's "
          f"{per_block['torch checkpoint fused'] * 1e6:.0f} us (ckptfx / torch "
          f"{r_machinery:.2f}); ckptfx's checkpoint / torch's, whole step: "
          f"{_fmt(ratio(times, 'ckptfx checkpoint fused', 'torch checkpoint fused'))}")
    return {"split_sessions_vs_none": r_sess[0], "split_hook_floor_vs_none": r_hooks[0],
            "split_sessions_vs_hook_floor": r_sess_floor[0], "split_vjp_vs_fused": r_vjp[0],
            "split_torch_plain_vs_fused": r_floor[0],
            "split_vjp_floor_vs_fused": r_split_floor[0],
            "split_vjp_vs_vjp_floor": r_vjp_split_floor[0],
            "split_fused_plus_forward_vs_fused": r_recompute[0],
            "split_ckptfx_fused_vs_fused": r_ck[0], "split_vjp_vs_ckptfx_fused": r_vjp_ck[0],
            "split_vjp_per_group_vs_fused": r_pg[0], "split_vjp_vs_per_group": r_whole[0],
            "split_machinery_ckptfx_vs_torch": r_machinery}


def bench_vjp256(rounds: int, d: int = 256, nblocks: int = 6, batch: int = 8,
                 seq: int = 128) -> dict[str, float]:
    torch.manual_seed(0)
    blocks = [Block(d) for _ in range(nblocks)]
    x, g = torch.randn(batch, seq, d), torch.randn(batch, seq, d)
    params = [p for b in blocks for p in b.parameters()]

    def stack(h: torch.Tensor) -> torch.Tensor:
        for b in blocks:
            h = ckptfx.checkpoint(b, h)
        return h

    def fused() -> None:
        xr = x.detach().requires_grad_()
        torch.autograd.grad(stack(xr), [xr, *params], g)

    def split() -> None:
        _, dx_fn, dw_fn = ckptfx.vjp_split(stack, x, params=params)
        dx_fn(g)
        dw_fn()
        for p in params:
            p.grad = None

    def split_late_drop() -> None:
        # dx-only replayed tensors dropped when dx ends, not at their read (split Rule 4)
        cx_split._early_drop_enabled = False
        try:
            split()
        finally:
            cx_split._early_drop_enabled = True

    def plain(h: torch.Tensor) -> torch.Tensor:
        for b in blocks:
            h = b(h)
        return h

    def plain_fused() -> None:
        xr = x.detach().requires_grad_()
        torch.autograd.grad(plain(xr), [xr, *params], g)

    def plain_split() -> None:
        from torch.distributed.pipelining._backward import (stage_backward_input,
                                                            stage_backward_weight)
        xr = x.detach().requires_grad_()
        _, groups = stage_backward_input([plain(xr)], [g], [xr], iter(params))
        stage_backward_weight(iter(params), groups)
        for p in params:
            p.grad = None

    times = rounds_of({"fused": fused, "vjp_split": split, "plain fused": plain_fused,
                       "plain split": plain_split, "late drop": split_late_drop}, rounds)
    r = ratio(times, "vjp_split", "fused")
    r_late = ratio(times, "late drop", "fused")
    r_floor = ratio(times, "plain split", "plain fused")
    print(f"dx + dw, {nblocks} checkpointed transformer blocks d={d} batch={batch} seq={seq} "
          f"({rounds} steps): fused {statistics.median(times['fused']) * 1e3:.1f} ms")
    print(f"  vjp_split / fused: {_fmt(r)}" + _target("vjp256_vs_fused"))
    print(f"  floor: torch's split / fused backward, both without checkpointing: {_fmt(r_floor)}")
    print(f"  vjp_split with dx-only tensors dropped when dx ends, not at their read / fused: "
          f"{_fmt(r_late)}")
    return {"vjp256_vs_fused": r[0], "vjp256_torch_plain_split_vs_fused": r_floor[0],
            "vjp256_late_drop_vs_fused": r_late[0]}


PARTS = ("remat", "split", "vjp256")

# Issue 17's targets: (figure, at most, what it is, the figure of its floor or None).
TARGETS: tuple[tuple[str, float, str, str | None], ...] = (
    ("remat64_nothing_vs_torch", 1.1, "remat nothing_saveable forward / torch checkpoint, d=64",
     None),
    ("remat256_nothing_vs_torch", 1.1, "remat nothing_saveable forward / torch checkpoint, d=256",
     None),
    ("remat64_dots_vs_sac", 1.0, "remat dots_saveable forward / torch SAC, d=64", None),
    ("remat256_dots_vs_sac", 1.0, "remat dots_saveable forward / torch SAC, d=256", None),
    ("split_sessions_vs_none", 1.3, "split step with sessions / no checkpointing, d=64",
     "split_hook_floor_vs_none"),
    ("split_vjp_vs_fused", 1.5, "vjp_split step / a fused step without checkpointing, d=64",
     "split_vjp_floor_vs_fused"),
    ("split_vjp_vs_ckptfx_fused", 1.5,
     "vjp_split step / ckptfx's checkpointed fused step, d=64 (the same blocks, not split)",
     None),
    ("vjp256_vs_fused", 1.05, "dx + dw / one fused backward, d=256",
     "vjp256_torch_plain_split_vs_fused"),
)


def verdict(figures: dict[str, float]) -> list[str]:
    """One line per target whose figure is in ``figures``: met or not, and whether its floor
    (what any implementation of that step pays, measured in the same run) is above it.

    Example::

        >>> figures = {"split_vjp_vs_fused": 2.8, "split_vjp_floor_vs_fused": 1.9}
        >>> print(verdict(figures)[0])  # doctest: +ELLIPSIS
        NOT met  2.800x <= 1.5  vjp_split step / ... (floor 1.900x: the target is below it)
    """
    lines = []
    for key, limit, what, floor_key in TARGETS:
        if key not in figures:
            continue
        value = figures[key]
        line = f"{'met' if value <= limit else 'NOT met':8s} {value:.3f}x <= {limit:<4} {what}"
        if floor_key is not None and floor_key in figures:
            floor = figures[floor_key]
            line += f" (floor {floor:.3f}x" + (": the target is below it)" if floor > limit
                                                 else ")")
        lines.append(line)
    return lines


def run(only: str | None = None, quick: bool = False, rounds: int | None = None
        ) -> dict[str, float]:
    """Run the parts (``only`` one of ``PARTS``, or all), print each figure, return them all.

    Example::

        figures = run("remat", quick=True, rounds=1)   # a smoke run: seconds
    """
    if only is not None and only not in PARTS:
        raise ValueError(f"only must be one of {', '.join(PARTS)} or None, got {only!r}")
    if rounds is not None and rounds < 1:
        raise ValueError(f"rounds must be a positive integer, got {rounds!r}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        q = quick
        print(f"torch {torch.__version__}, ckptfx {ckptfx.__version__}, 1 thread")
        figures: dict[str, float] = {}
        if only in (None, "remat"):
            figures.update(bench_remat(64, rounds or (5 if q else 41), 5 if q else 20))
            figures.update(bench_remat(256, rounds or (3 if q else 21), 1))
        if only in (None, "split"):
            figures.update(bench_split(rounds or (5 if q else 41), 2 if q else 10))
        if only in (None, "vjp256"):
            figures.update(bench_vjp256(rounds or (3 if q else 15)))
        print("verdict on issue 17's targets (this run):")
        for line in verdict(figures):
            print("  " + line)
        return figures
    finally:
        torch.set_num_threads(threads)


def main(argv: list[str] | None = None) -> dict[str, float]:
    """``python benchmarks/bench_overhead.py``'s entry (``ckptfx bench --overhead``'s twin)."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="few rounds (a smoke run)")
    ap.add_argument("--only", choices=PARTS)
    ap.add_argument("--rounds", type=int, default=None)
    args = ap.parse_args(argv)
    return run(args.only, args.quick, args.rounds)


if __name__ == "__main__":
    main()
