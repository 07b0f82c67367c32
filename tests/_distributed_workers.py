"""Multi-process workers for test_distributed.py (gloo, CPU), spawned by ``spawn_ranks``.

Each worker runs every check of its world in one process group (a spawn costs seconds) and
returns plain data (bools, ints, strings) for the tests to assert on. The process group is
destroyed in a ``finally``; the parent waits with a timeout.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.utils.checkpoint as tcp
from torch.utils._python_dispatch import TorchDispatchMode

import ckptfx
from models import D, Block


def _worker(rank: int, world: int, path: str, fn: Callable[[int, int], Any], queue: Any) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", store=dist.FileStore(path, world), rank=rank,
                                world_size=world, timeout=__import__("datetime").timedelta(
                                    seconds=120))
        try:
            queue.put((rank, fn(rank, world)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # report, never hang the parent
        queue.put((rank, {"error": traceback.format_exc()}))


def spawn_ranks(fn: Callable[[int, int], Any], world: int, timeout: float = 240) -> dict:
    """Run ``fn(rank, world)`` on ``world`` gloo ranks; return {rank: result}."""
    # forkserver: torch is imported once (in the server), not once per rank
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["_distributed_workers"])
    queue = ctx.Queue()
    path = tempfile.mktemp(prefix="ckptfx_pg_")
    procs = [ctx.Process(target=_worker, args=(r, world, path, fn, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict = {}
    try:
        for _ in range(world):
            rank, value = queue.get(timeout=timeout)
            results[rank] = value
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        if os.path.exists(path):
            os.unlink(path)
    return results


class OpCounts(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n[str(func)] = self.n.get(str(func), 0) + 1
        return func(*args, **(kwargs or {}))


class ClassCountedBlock(Block):
    """models.Block (pre-norm, tanh, no dropout) whose runs are counted class-wide, in
    ``ClassCountedBlock.runs``: one counter for every block of a model (FSDP2's and DDP's
    wrapped blocks included), which the plain block functions below count into too."""

    runs = 0  # class-wide counter of Python runs of forward

    def __init__(self) -> None:
        super().__init__(norm=True, act=torch.tanh, p=0.0)

    def note_run(self) -> None:
        ClassCountedBlock.runs += 1


def model(wrap: str) -> nn.Sequential:
    torch.manual_seed(0)
    m = nn.Sequential(ClassCountedBlock(), ClassCountedBlock())
    for b in m:
        if wrap == "checkpoint_wrapper":
            ckptfx.checkpoint_wrapper(b)
        elif wrap == "remat":
            b.forward = ckptfx.remat(ClassCountedBlock.forward).__get__(b)
    return m


def _eq(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        x is not None and y is not None and torch.equal(x, y) for x, y in zip(a, b))


# -- two ranks ---------------------------------------------------------------------------------


def _runs_and_backward_collectives(rank: int, blk: Callable[[torch.Tensor], torch.Tensor],
                                   collective: str, dots: bool = True) -> dict:
    """Per variant around ``blk``: (block runs, calls of ``collective`` in the backward), and
    whether each variant's gradient is bitwise the plain one."""
    variants = {
        "plain": blk,
        "checkpoint": lambda x: ckptfx.checkpoint(blk, x),
        "remat": ckptfx.remat(blk),
        "torch": lambda x: tcp.checkpoint(blk, x, use_reentrant=False),
    }
    if dots:
        variants["remat_dots"] = ckptfx.remat(
            blk, policy=ckptfx.checkpoint_policies.dots_saveable)
    out: dict = {}
    grads = {}
    for name, f in variants.items():
        torch.manual_seed(rank)
        x = torch.randn(6, requires_grad=True)
        ClassCountedBlock.runs = 0
        loss = f(x).sum()
        with OpCounts() as counts:
            loss.backward()
        out[name] = (ClassCountedBlock.runs, counts.n.get(collective, 0))
        grads[name] = x.grad
    out["bitwise"] = {k: torch.equal(g, grads["plain"]) for k, g in grads.items()}
    return out


def _collectives(rank: int) -> dict:
    import torch.distributed._functional_collectives as fc

    def blk(x: torch.Tensor) -> torch.Tensor:
        ClassCountedBlock.runs += 1
        y = torch.sin(x) * 3
        dist.all_reduce(y)
        return torch.cos(y) * x

    def functional(x: torch.Tensor) -> torch.Tensor:
        # an AsyncCollectiveTensor, waited on by the next op; the plain backward runs one
        # all_reduce itself (the gradient's)
        ClassCountedBlock.runs += 1
        y = fc.all_reduce(torch.sin(x) * 3, "sum", dist.group.WORLD)
        return torch.cos(y) * x

    def functional_autograd(x: torch.Tensor) -> torch.Tensor:
        # the autograd collectives: each one's gradient is the other, so the plain backward
        # runs one all_gather (reduce_scatter's gradient)
        ClassCountedBlock.runs += 1
        y = fc.all_gather_tensor_autograd(torch.sin(x), 0, dist.group.WORLD)
        z = fc.reduce_scatter_tensor_autograd(y * 3, "sum", 0, dist.group.WORLD)
        return torch.cos(z) * x

    out = _runs_and_backward_collectives(rank, blk, "c10d.allreduce_.default")
    out["functional"] = _runs_and_backward_collectives(
        rank, functional, "_c10d_functional.all_reduce.default", dots=False)
    out["functional_autograd"] = _runs_and_backward_collectives(
        rank, functional_autograd, "_c10d_functional.all_gather_into_tensor.default",
        dots=False)
    return out


def _ddp(rank: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    out: dict = {}
    for static in (False, True):
        ours, ref = model("checkpoint_wrapper"), model("plain")
        d, dref = DDP(ours, static_graph=static), DDP(ref, static_graph=static)
        steps = []
        for step in range(3):
            torch.manual_seed(rank + 10 * step)
            x = torch.randn(3, D, requires_grad=True)
            dref(x).sum().backward()
            try:
                y, dx_fn, dw_fn = ckptfx.vjp_split(d, x, params=d.parameters())
            except ckptfx.CheckpointError as err:
                steps.append(("refused", all(p.grad is None for p in ours.parameters()),
                              "DistributedDataParallel" in str(err)))
                d(x).sum().backward()  # the first step the plain way
                continue
            dx = dx_fn(torch.ones_like(y))
            dw_fn()
            steps.append(("split", _eq([p.grad for p in ours.parameters()],
                                       [p.grad for p in ref.parameters()]),
                          torch.equal(dx, torch.autograd.grad(dref(x).sum(), x)[0])))
        out[static] = steps
        # replicas agree: the gradient all-reduce happened
        sums = torch.stack([p.grad.sum() for p in ours.parameters()])
        gathered = [torch.empty_like(sums) for _ in range(2)]
        dist.all_gather(gathered, sums)
        out[f"replicas_{static}"] = torch.equal(gathered[0], gathered[1])
    return out


FSDP_CASES = [("checkpoint_wrapper", "vjp_split"), ("checkpoint_wrapper", "vjp_split_prefire"),
              ("checkpoint_wrapper", "grad_split"), ("remat", "vjp_split"),
              ("remat", "vjp_split_prefire"), ("remat", "grad_split")]

# How a block of a fully_shard-ed model is checkpointed for a scheduler's own prefire
# (recompute_handle): the module's forward wrapped, remat on the forward inside the FSDP
# call, remat around the FSDP call, the remat'd forward replayed lazily by the session, and
# (refused) a remat'd forward that reaches its block through a global only.
SESSION_PREFIRES = ("checkpoint_wrapper", "remat", "remat_around_call", "remat_lazy",
                    "remat_through_a_global")
_GLOBAL_BLOCKS: list = []


def _through_a_global(i: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: ClassCountedBlock.forward(_GLOBAL_BLOCKS[i], x)


def _fsdp(rank: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    out: dict = {}

    def shard(m: nn.Module) -> nn.Module:
        for b in m:
            fully_shard(b)
        return fully_shard(m)

    def sharded_now(m: nn.Module) -> bool:
        from ckptfx import _compat
        return all(g.is_sharded for s in _compat.fsdp_all_states(_compat.fsdp_state_of(m))
                   for g in _compat.fsdp_param_groups(s))

    for wrap, how in FSDP_CASES:
        ours, ref = shard(model(wrap)), shard(model("plain"))
        checks = []
        for step in range(2):
            torch.manual_seed(rank + 10 * step)
            x = torch.randn(3, D, requires_grad=True)
            y_ref = ref(x)
            dx_ref, = torch.autograd.grad(y_ref.sum(), x, retain_graph=True)
            y_ref.sum().backward()
            ClassCountedBlock.runs = 0
            if how == "grad_split":
                dx_fn, dw_fn = ckptfx.grad_split(lambda x: ours(x).sum())
                value, dx = dx_fn(x, session=("fsdp", step))
                dw_fn(("fsdp", step))
                y_same = torch.equal(value, y_ref.sum().detach())
            else:
                y, dx_fn, dw_fn = ckptfx.vjp_split(ours, x, params=ours.parameters())
                if how == "vjp_split_prefire":
                    dx_fn.prefire()
                dx = dx_fn(torch.ones_like(y))
                dw_fn()
                y_same = torch.equal(y, y_ref.detach())
            checks.append((
                y_same, torch.equal(dx, dx_ref),
                _eq([p.grad.to_local() for p in ours.parameters()],
                    [p.grad.to_local() for p in ref.parameters()]),
                sharded_now(ours), ClassCountedBlock.runs,
            ))
        out[(wrap, how)] = checks
    # a scheduler's own prefire (sessions API: recompute_handle, then the session backward)
    for how in SESSION_PREFIRES:
        ours = shard(model("remat" if how in ("remat", "remat_lazy") else
                           "plain" if how.startswith("remat_") else how))
        ref = shard(model("plain"))
        torch.manual_seed(rank)
        x = torch.randn(3, D, requires_grad=True)
        ref(x).sum().backward()
        run = [ours]
        if how == "remat_around_call":
            run = [ckptfx.remat(lambda h, b=b: b(h)) for b in ours]
        elif how == "remat_through_a_global":
            _GLOBAL_BLOCKS[:] = list(ours)
            for i, b in enumerate(ours):
                b.forward = ckptfx.remat(_through_a_global(i))
        with ckptfx.recompute_handle_collector_ctx() as handles:
            y = x
            for f in run:
                y = f(y)
        error = ""
        try:
            if how != "remat_lazy":  # lazy: each block replays in its backward
                for h in handles:
                    ckptfx.recompute_handle(h, "s")
            with ckptfx.recompute_session_ctx("s", retain_on_unpack=False):
                y.sum().backward()
        except ckptfx.CheckpointError as err:
            error = str(err)
        finally:
            ckptfx.clear_recompute_session("s")
            _GLOBAL_BLOCKS.clear()
        out[("sessions", how)] = (
            error, _eq([None if p.grad is None else p.grad.to_local() for p in ours.parameters()],
                       [p.grad.to_local() for p in ref.parameters()]),
            all(p.grad is None for p in ours.parameters()))
    # an abandoned split (session cleared between dx and dw) reduces nothing, reshards, and
    # leaves FSDP ready for the next step
    ours, ref = shard(model("checkpoint_wrapper")), shard(model("plain"))
    x = torch.randn(3, D, requires_grad=True)
    y, dx_fn, dw_fn = ckptfx.vjp_split(ours, x, params=ours.parameters(), session="gone")
    dx_fn(torch.ones_like(y))
    ckptfx.clear_recompute_session("gone")
    try:
        dw_fn()
        refused = False
    except ckptfx.CheckpointError:
        refused = True
    clean = all(p.grad is None for p in ours.parameters()) and sharded_now(ours)
    ours(x).sum().backward()
    ref(x).sum().backward()
    out["abandoned"] = (refused, clean, _eq([p.grad.to_local() for p in ours.parameters()],
                                            [p.grad.to_local() for p in ref.parameters()]))
    return out


def _remat_fsdp_call(rank: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    out: dict = {}
    for name, policy in (("none", None), ("dots", ckptfx.checkpoint_policies.dots_saveable)):
        ours, ref = model("plain"), model("plain")
        for m in (ours, ref):
            for b in m:
                fully_shard(b)
            fully_shard(m)
        blocks = [ckptfx.remat(lambda x, b=b: b(x), policy=policy) for b in ours]
        checks = []
        for step in range(2):
            torch.manual_seed(rank + step)
            x = torch.randn(3, D, requires_grad=True)
            ref(x).sum().backward()
            h = x
            for f in blocks:
                h = f(h)
            ClassCountedBlock.runs = 0
            with OpCounts() as counts:
                h.sum().backward()
            checks.append((
                ClassCountedBlock.runs, counts.n.get("aten.addmm.default", 0),
                _eq([p.grad.to_local() for p in ours.parameters()],
                    [p.grad.to_local() for p in ref.parameters()]),
            ))
        out[name] = checks
    return out


def _variants(rank: int) -> dict:
    """DDP(find_unused_parameters=True) and FSDP2 with a bf16 mixed-precision policy."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    out: dict = {}
    ours, ref = model("checkpoint_wrapper"), model("plain")
    d = DDP(ours, find_unused_parameters=True)
    dref = DDP(ref, find_unused_parameters=True)
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def shard(m: nn.Module) -> nn.Module:
        for b in m:
            fully_shard(b, mp_policy=mp_policy)
        return fully_shard(m, mp_policy=mp_policy)

    f_ours, f_ref = shard(model("checkpoint_wrapper")), shard(model("plain"))
    for name, mod, mref, local in (("ddp_find_unused", d, dref, False),
                                   ("fsdp_bf16", f_ours, f_ref, True)):
        checks = []
        for step in range(2):
            torch.manual_seed(rank + 10 * step)
            x = torch.randn(3, D, requires_grad=True)
            mref(x).float().sum().backward()
            y, dx_fn, dw_fn = ckptfx.vjp_split(mod, x, params=mod.parameters())
            dx_fn(torch.ones_like(y))
            dw_fn()
            get = (lambda p: p.grad.to_local()) if local else (lambda p: p.grad)
            checks.append(_eq([get(p) for p in mod.parameters()],
                              [get(p) for p in mref.parameters()]))
        out[name] = checks
    return out


def two_ranks(rank: int, world: int) -> dict:
    """Every two-rank check, in one process group."""
    return {
        "collectives": _collectives(rank),
        "ddp": _ddp(rank),
        "fsdp": _fsdp(rank),
        "remat_fsdp_call": _remat_fsdp_call(rank),
        "variants": _variants(rank),
    }


# -- four ranks: the 2 x 2 pipeline x FSDP2 example ----------------------------------------------


def pipeline_2x2(rank: int, world: int) -> dict:
    os.environ["CKPTFX_PP_DIM"] = "16"
    path = Path(__file__).resolve().parent.parent / "examples" / "fsdp_pipeline.py"
    spec = importlib.util.spec_from_file_location("ckptfx_example_fsdp_pipeline", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)  # type: ignore[union-attr]
    return example.main(steps=2, with_torch_checkpoint=False)
