"""The split parts of the overhead benchmark (``ckptfx.bench.overhead``, whose docstring says
what each measures): ``split``, a split step over small MLP blocks, and ``vjp256``, dx + dw
over transformer blocks at d=256.

``split_steps`` is the split step itself, one per way of running it (no checkpointing,
torch's checkpoint, ckptfx sessions, ``vjp_split``, a fused backward): ``split_variants``
adds the floors to it for this bench, and ``benchmarks/bench_sessions.py`` times it at other
sizes."""

from __future__ import annotations

import json
import os
import platform
import site
import statistics
import subprocess
import sys
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import ckptfx
import ckptfx.split.passes as split_passes
import ckptfx.split.weight_calls as weight_calls
from ckptfx.bench.blocks import Block, MLPBlock, chain
from ckptfx.bench.figures import fmt, medians, ratio, rounds_of, target_note

try:
    import resource  # page-fault counts (not on Windows)
except ImportError:
    resource = None  # type: ignore[assignment]

__all__ = ["KEEP_FREED_MEMORY", "bench_split", "bench_vjp256",
           "bench_vjp256_keeping_freed_memory", "split_backward", "split_inputs", "split_steps",
           "split_variants"]

Step = Callable[[], None]


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


class _LastPack(Exception):
    """Raised in a block's last pack: a replay's early stop, as the floors run it."""


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


def split_backward(out: torch.Tensor, x: torch.Tensor, params: Sequence[torch.Tensor],
                    g: torch.Tensor, session: Any) -> None:
    """dx, then one dw call per parameter; under ``session`` if given (the split step of
    this bench and of ``benchmarks/bench_sessions.py``)."""
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


def _switched(module: Any, switch: str, value: object, step: Step) -> Step:
    """``step`` run with ckptfx's internal ``module.switch`` set to ``value`` (what the choice
    it makes saves is measured against it), put back after each call."""
    def run() -> None:
        before = getattr(module, switch)
        setattr(module, switch, value)
        try:
            step()
        finally:
            setattr(module, switch, before)
    return run


def split_inputs(d: int = 64, hidden: int = 256, batch: int = 8, nblocks: int = 6
                 ) -> tuple[list[MLPBlock], torch.Tensor, torch.Tensor]:
    """The split step's ``nblocks`` MLP blocks, input ``x`` (requiring grad) and output
    gradient ``g``, seeded (0)."""
    torch.manual_seed(0)
    blocks = [MLPBlock(d, hidden) for _ in range(nblocks)]
    x = torch.randn(batch, d, requires_grad=True)
    g = torch.randn(batch, d)
    return blocks, x, g


def _in_session(stack: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                backward: Callable[[torch.Tensor], object]) -> None:
    """``stack(x)`` with its checkpoints collected and prefired into the session ``"mb"``,
    then ``backward(out)``; the session cleared whatever happens."""
    with ckptfx.recompute_handle_collector_ctx() as handles:
        h = stack(x)
    try:
        for hd in handles:
            ckptfx.recompute_handle(hd, "mb")
        backward(h)
    finally:
        ckptfx.clear_recompute_session("mb")


def split_steps(blocks: Sequence[nn.Module], x: torch.Tensor, g: torch.Tensor
                ) -> dict[str, Step]:
    """A split step (forward, dx, then one dw call per parameter) over ``blocks``, one per way
    of running it: ``none`` (no checkpointing), ``torch checkpoint``, ``ckptfx sessions``
    (collector, prefire, dx under ``retain_on_unpack=True``), ``ckptfx sessions, no
    prefire`` (dx replays), ``vjp_split`` (prefire, dx, its own weight pass), and ``fused``:
    no checkpointing, one backward for x and every parameter (not a split step: the floor
    any split backward is measured against)."""
    params = [p for b in blocks for p in b.parameters()]
    plain, stack = chain(blocks), chain(blocks, ckptfx.checkpoint)

    def none() -> None:
        split_backward(plain(x), x, params, g, None)

    def torch_checkpoint() -> None:
        h = x
        for b in blocks:
            h = checkpoint(b, h, use_reentrant=False)
        split_backward(h, x, params, g, None)

    def sessions() -> None:
        _in_session(stack, x, lambda h: split_backward(h, x, params, g, "mb"))

    def sessions_without_prefire() -> None:
        h = stack(x)
        try:
            split_backward(h, x, params, g, "mb")
        finally:
            ckptfx.clear_recompute_session("mb")

    def vjp_split() -> None:
        _, dx_fn, dw_fn = ckptfx.vjp_split(stack, x, params=params, session="mb")
        dx_fn.prefire()
        dx_fn(g)
        dw_fn()
        for p in params:  # dw_fn accumulates into .grad; each step starts from None
            p.grad = None

    def fused() -> None:
        torch.autograd.grad(plain(x), [x, *params], g)

    return {"none": none, "torch checkpoint": torch_checkpoint, "ckptfx sessions": sessions,
            "ckptfx sessions, no prefire": sessions_without_prefire, "vjp_split": vjp_split,
            "fused": fused}


def split_variants(d: int = 64, hidden: int = 256, batch: int = 8, nblocks: int = 6
                   ) -> dict[str, Step]:
    """The split step's variants over ``nblocks`` small MLP blocks, each a step to call (what
    ``bench_split`` times and ``benchmarks/bench_instructions.py`` counts): ``split_steps``'
    and the floors."""
    from torch.distributed.pipelining._backward import (
        stage_backward_input,
        stage_backward_weight,
    )

    blocks, x, g = split_inputs(d, hidden, batch, nblocks)
    steps = split_steps(blocks, x, g)
    params = [p for b in blocks for p in b.parameters()]
    plain, stack = chain(blocks), chain(blocks, ckptfx.checkpoint)
    vjp_split, fused = steps["vjp_split"], steps["fused"]

    # the per-group weight pass, which the rule leaves for larger blocks (weight_calls)
    vjp_split_per_group = _switched(weight_calls, "_force", "per_group", vjp_split)

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
        split_backward(floor_forward(), x, params, g, None)

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

    def fused_in_session(h: torch.Tensor) -> None:
        with ckptfx.recompute_session_ctx("mb"):
            torch.autograd.grad(h, [x, *params], g)

    def ckptfx_fused() -> None:
        _in_session(stack, x, fused_in_session)

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

    return {"none": steps["none"], "ckptfx sessions": steps["ckptfx sessions"],
            "hook floor": hook_floor, "vjp_split": vjp_split,
            "vjp_split per group": vjp_split_per_group, "fused": fused,
            "floor": torch_split_plain, "split floor": split_floor,
            "fused + forward": fused_and_forward,
            "ckptfx fused": ckptfx_fused, "torch checkpoint fused": torch_fused,
            "hook floor fused": hook_floor_fused, "ckptfx checkpoint fused": ckptfx_plain_fused}


# The split part's figures: (the variant, the one it is timed against), in the order returned.
_SPLIT_RATIOS = {
    "split_sessions_vs_none": ("ckptfx sessions", "none"),
    "split_hook_floor_vs_none": ("hook floor", "none"),
    "split_sessions_vs_hook_floor": ("ckptfx sessions", "hook floor"),
    "split_vjp_vs_fused": ("vjp_split", "fused"), "split_torch_plain_vs_fused": ("floor", "fused"),
    "split_vjp_floor_vs_fused": ("split floor", "fused"),
    "split_vjp_vs_vjp_floor": ("vjp_split", "split floor"),
    "split_fused_plus_forward_vs_fused": ("fused + forward", "fused"),
    "split_ckptfx_fused_vs_fused": ("ckptfx fused", "fused"),
    "split_vjp_vs_ckptfx_fused": ("vjp_split", "ckptfx fused"),
    "split_vjp_per_group_vs_fused": ("vjp_split per group", "fused"),
    "split_vjp_vs_per_group": ("vjp_split", "vjp_split per group"),
}


def bench_split(rounds: int, inner: int, d: int = 64, hidden: int = 256, batch: int = 8,
                nblocks: int = 6) -> dict[str, float]:
    """The split part: ``rounds`` rounds of ``inner`` steps of each ``split_variants``
    variant; prints its figures and returns them, keyed ``split_...``."""
    fns = split_variants(d, hidden, batch, nblocks)
    times = rounds_of(fns, rounds, inner)
    med = medians(times)
    r = {key: ratio(times, a, b) for key, (a, b) in _SPLIT_RATIOS.items()}
    print(f"split step, {nblocks} MLP blocks d={d} hidden={hidden} batch={batch} "
          f"({rounds}x{inner} steps): " + ", ".join(f"{k} {v * 1e3:.3f} ms"
                                                   for k, v in med.items()))
    dw_calls = 4 * nblocks  # one per parameter: fc1's and fc2's weight and bias
    print(f"  ckptfx sessions (prefire + dx + {dw_calls} dw calls) / none: "
          f"{fmt(r['split_sessions_vs_none'])}" + target_note("split_sessions_vs_none"))
    print(f"  floor: saved-tensor hooks + one more forward to each block's last pack / none: "
          f"{fmt(r['split_hook_floor_vs_none'])}; ckptfx sessions / that floor: "
          f"{fmt(r['split_sessions_vs_hook_floor'])}")
    print(f"  vjp_split step / fused step:          {fmt(r['split_vjp_vs_fused'])}"
          + target_note("split_vjp_vs_fused"))
    print(f"  floor: torch's split without checkpointing / fused: "
          f"{fmt(r['split_torch_plain_vs_fused'])}")
    print(f"  floor: saved-tensor hooks + one more forward to each block's last pack + "
          f"vjp_split's two engine calls (dx, then dw from the outputs) / fused: "
          f"{fmt(r['split_vjp_floor_vs_fused'])}; vjp_split / that floor: "
          f"{fmt(r['split_vjp_vs_vjp_floor'])}")
    print(f"  floor: fused step + one more forward (a replay's compute) / fused: "
          f"{fmt(r['split_fused_plus_forward_vs_fused'])}")
    print(f"  ckptfx checkpoint, prefire + one fused backward / fused: "
          f"{fmt(r['split_ckptfx_fused_vs_fused'])}")
    print(f"  vjp_split step / that checkpointed fused step: "
          f"{fmt(r['split_vjp_vs_ckptfx_fused'])}")
    print(f"  vjp_split with the per-group weight pass / fused: "
          f"{fmt(r['split_vjp_per_group_vs_fused'])}; the rule's pass / per-group: "
          f"{fmt(r['split_vjp_vs_per_group'])}")
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
          f"{fmt(ratio(times, 'ckptfx checkpoint fused', 'torch checkpoint fused'))}")
    return {**{key: figure[0] for key, figure in r.items()},
            "split_machinery_ckptfx_vs_torch": r_machinery}


def bench_vjp256(rounds: int, d: int = 256, nblocks: int = 6, batch: int = 8,
                 seq: int = 128) -> dict[str, float]:
    """The vjp256 part: ``rounds`` steps of each variant over ``nblocks`` checkpointed
    transformer blocks; prints its figures and returns them, keyed ``vjp256_...``."""
    torch.manual_seed(0)
    blocks = [Block(d) for _ in range(nblocks)]
    x, g = torch.randn(batch, seq, d), torch.randn(batch, seq, d)
    params = [p for b in blocks for p in b.parameters()]
    plain, stack = chain(blocks), chain(blocks, ckptfx.checkpoint)

    def fused() -> None:
        xr = x.detach().requires_grad_()
        torch.autograd.grad(stack(xr), [xr, *params], g)

    def split() -> None:
        _, dx_fn, dw_fn = ckptfx.vjp_split(stack, x, params=params)
        dx_fn(g)
        dw_fn()
        for p in params:
            p.grad = None

    # dx-only replayed tensors dropped when dx ends, not at their read (ckptfx.split.passes Rule 4)
    split_late_drop = _switched(split_passes, "early_drop_enabled", False, split)

    def plain_fused() -> None:
        xr = x.detach().requires_grad_()
        torch.autograd.grad(plain(xr), [xr, *params], g)

    def plain_split() -> None:
        from torch.distributed.pipelining._backward import (
            stage_backward_input,
            stage_backward_weight,
        )
        xr = x.detach().requires_grad_()
        _, groups = stage_backward_input([plain(xr)], [g], [xr], iter(params))
        stage_backward_weight(iter(params), groups)
        for p in params:
            p.grad = None

    fns = {"fused": fused, "vjp_split": split, "plain fused": plain_fused,
           "plain split": plain_split, "late drop": split_late_drop}
    faults: dict[str, list[int]] = {k: [] for k in fns}
    times = rounds_of({k: _counting_faults(fn, faults[k]) for k, fn in fns.items()}, rounds)
    r = ratio(times, "vjp_split", "fused")
    r_late = ratio(times, "late drop", "fused")
    r_floor = ratio(times, "plain split", "plain fused")
    print(f"dx + dw, {nblocks} checkpointed transformer blocks d={d} batch={batch} seq={seq} "
          f"({rounds} steps): fused {statistics.median(times['fused']) * 1e3:.1f} ms")
    print(f"  vjp_split / fused: {fmt(r)}" + target_note("vjp256_vs_fused"))
    print(f"  floor: torch's split / fused backward, both without checkpointing: "
          f"{fmt(r_floor)}")
    print(f"  vjp_split with dx-only tensors dropped when dx ends, not at their read / fused: "
          f"{fmt(r_late)}")
    figures = {"vjp256_vs_fused": r[0], "vjp256_torch_plain_split_vs_fused": r_floor[0],
               "vjp256_late_drop_vs_fused": r_late[0]}
    if resource is not None:
        # A split holds what dw reads (the captured gradients and its replayed inputs) from
        # dx to dw, where a fused backward frees each as it goes: more memory live at the
        # peak, which glibc hands back to the system after the step and faults in again
        # (zeroed) in the next one.
        med = {k: statistics.median(v[-rounds:]) for k, v in faults.items()}  # no warm-up
        print("  minor page faults per step: "
              + ", ".join(f"{k} {v:.0f}" for k, v in med.items()))
        figures.update({f"vjp256_page_faults_{k.replace(' ', '_')}": float(v)
                        for k, v in med.items()})
    return figures


def _counting_faults(fn: Callable[[], None], into: list[int]) -> Callable[[], None]:
    """``fn``, appending the minor page faults of each call to ``into`` (where it can)."""
    if resource is None:
        return fn
    getrusage, who = resource.getrusage, resource.RUSAGE_SELF

    def step() -> None:
        before = getrusage(who).ru_minflt
        fn()
        into.append(getrusage(who).ru_minflt - before)
    return step


# glibc told to keep freed memory, as a caching allocator (CUDA's, NPU's) keeps it: blocks
# under 32 MiB (the largest mmap threshold glibc accepts; this part's tensors are 4 MiB at
# most) come from the heap, and the heap is never trimmed, so no step faults in again the
# peak of the step before it.
KEEP_FREED_MEMORY = {"MALLOC_MMAP_THRESHOLD_": "33554432",
                     "MALLOC_TRIM_THRESHOLD_": "4294967296"}
_FIGURES_LINE = "ckptfx-bench-figures: "
# The child: the same ckptfx as this process (checked), one thread, bench_vjp256 with the
# arguments given as JSON in argv, its figures printed as one JSON line.
_CHILD = """\
import json, os, sys
import torch
import ckptfx
args = json.loads(sys.argv[1])
if os.path.realpath(ckptfx.__file__) != args["ckptfx"]:
    sys.exit("the child imported another ckptfx: " + ckptfx.__file__)
torch.set_num_threads(1)
from ckptfx.bench.overhead_split import bench_vjp256
figures = bench_vjp256(args["rounds"], **args["sizes"])
print(args["mark"] + json.dumps(figures))
"""


def bench_vjp256_keeping_freed_memory(rounds: int, **sizes: int) -> dict[str, float]:
    """``bench_vjp256`` in a child process whose glibc keeps freed memory
    (``KEEP_FREED_MEMORY``: malloc reads it at start-up, so it takes a new process); its
    report is printed indented. Its figures come back with ``vjp256_kept_`` in place of
    ``vjp256_``. None where the C library is not glibc, where this process already runs with
    those settings (its own figures are then that run's), or where the child failed (what
    it printed on stderr is shown): the verdict then has no line for them."""
    if platform.libc_ver()[0] != "glibc":
        print("  (the run keeping freed memory needs glibc: skipped)")
        return {}
    if all(os.environ.get(k) == v for k, v in KEEP_FREED_MEMORY.items()):
        print("  (this process already keeps freed memory: the d=256 figures above are that "
              "run's)")
        return {}
    package = os.path.realpath(ckptfx.__file__)
    env = {**os.environ, **KEEP_FREED_MEMORY}
    root = os.path.dirname(os.path.dirname(package))
    if root not in _site_dirs():  # a checkout: put it first; never site-packages itself
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (root, env.get("PYTHONPATH"))))
    args = json.dumps({"rounds": int(rounds), "sizes": sizes, "ckptfx": package,
                       "mark": _FIGURES_LINE})
    print("with glibc keeping freed memory ("
          + " ".join(f"{k}={v}" for k, v in KEEP_FREED_MEMORY.items()) + "), a new process:")
    try:
        proc = subprocess.run([sys.executable, "-c", _CHILD, args], env=env,
                              capture_output=True, text=True, timeout=3600)
    except subprocess.TimeoutExpired:
        print("  (the run keeping freed memory took over an hour: stopped, no figures)")
        return {}
    figures: dict[str, float] = {}
    for line in proc.stdout.splitlines():
        if line.startswith(_FIGURES_LINE):
            figures = json.loads(line[len(_FIGURES_LINE):])
        else:
            print("  " + line)
    if proc.stderr.strip():
        print("  " + "\n  ".join(proc.stderr[-4000:].rstrip().splitlines()))
    if proc.returncode != 0 or not figures:
        print(f"  (the run keeping freed memory failed: exit {proc.returncode}, no figures)")
        return {}
    return {k.replace("vjp256_", "vjp256_kept_", 1): v for k, v in figures.items()}


def _site_dirs() -> set[str]:
    dirs = [*getattr(site, "getsitepackages", lambda: [])(), site.getusersitepackages()]
    return {os.path.realpath(d) for d in dirs}
