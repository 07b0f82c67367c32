"""Benchmark: ckptfx under torch.compile, and ckptfx around compiled blocks.

A stack of pre-norm transformer blocks with dropout (``ckptfx.bench.blocks.Block``, each
behind an op that counts its runs inside the compiled graphs), one training step (forward +
backward):

- ``compiled``            torch.compile(model), no checkpoint (the reference: 1.00x)
- ``remat_dots``          torch.compile(model), blocks ``@ckptfx.remat(policy=dots_saveable)``
- ``torch_sac_dots``      torch.compile(model), blocks under torch's checkpoint with a
                          selective-checkpoint context for the same policy (torch's own way)
- ``remat_none``          torch.compile(model), blocks ``@ckptfx.remat`` (keep only inputs)
- ``ckptfx(compiled)``    each block compiled, then ``ckptfx.checkpoint`` (torchtitan order)
- ``torch(compiled)``     each block compiled, then torch's checkpoint

Per variant: the median step time over alternated rounds (one thread) as a ratio to
``compiled``, the peak resident memory of a step above its start (VmHWM; the script
re-execs itself with MALLOC_MMAP_THRESHOLD_=65536), block runs per step, and, for aot_eager,
the matmuls of the first compiled backward graph (the graph's own recomputation included).

Split: the same blocks compiled then checkpointed by ckptfx, one ``vjp_split`` (prefire, dx,
dw) against one fused backward; block runs counted by an op inside the compiled graph; and
the whole model compiled around ``ckptfx.checkpoint`` under ``vjp_split``, which cannot share
the replay (it warns).

    python benchmarks/bench_compile.py                      # aot_eager
    python benchmarks/bench_compile.py --backend inductor   # compiles take minutes on CPU
"""

from __future__ import annotations

import argparse
import functools
import time
import warnings
from typing import Any, Callable

from ckptfx.bench.memory import peak_above_start, reexec_with_small_mmap_threshold

reexec_with_small_mmap_threshold()

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.utils.checkpoint as tcp  # noqa: E402
from torch._dynamo.backends.common import aot_autograd  # noqa: E402

import ckptfx  # noqa: E402
from ckptfx import checkpoint_policies as cp  # noqa: E402
from ckptfx.bench.blocks import Block  # noqa: E402
from ckptfx.bench.child import add_shape_options  # noqa: E402
from ckptfx.bench.figures import medians, rounds_of  # noqa: E402

RUNS = [0]


@torch.library.custom_op("ckptfx_bench::count_run", mutates_args=())
def count_run(x: torch.Tensor) -> torch.Tensor:
    RUNS[0] += 1
    return x.clone()


@count_run.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


count_run.register_autograd(lambda ctx, g: g)


def counted_block(d: int) -> nn.Sequential:
    """A pre-norm transformer block with dropout, its runs counted by ``count_run``, an op
    that stays inside compiled graphs (a Python counter would run once, at tracing)."""
    return nn.Sequential(_CountRun(), Block(d, dropout=0.1, attention="matmul"))


class _CountRun(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return count_run(x)


class Model(nn.Module):
    """The blocks in sequence, each called through ``wrap(block)`` (made once, here)."""

    def __init__(self, blocks: list[Any], wrap: Callable[[Any], Callable[..., Any]]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([b for b in blocks if isinstance(b, nn.Module)])
        self.calls = [wrap(b) for b in blocks]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for call in self.calls:
            x = call(x)
        return x


MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)


def counting_backend(backend: str, matmuls: list[int]) -> Any:
    """``backend`` with the matmuls of each backward graph counted (AOT backends)."""
    if backend == "eager":
        return backend
    inner = torch._dynamo.lookup_backend(backend)
    if backend == "aot_eager":
        def bw(g: torch.fx.GraphModule, ex: Any) -> Any:
            matmuls.append(sum(n.target in MATMULS for n in g.graph.nodes))
            return torch._functorch.aot_autograd.make_boxed_func(g.forward)

        def fw(g: torch.fx.GraphModule, ex: Any) -> Any:
            return torch._functorch.aot_autograd.make_boxed_func(g.forward)

        return aot_autograd(fw_compiler=fw, bw_compiler=bw)
    return inner  # inductor's graphs are its own; matmuls not counted


def make_variants(blocks: list[nn.Module], backend: str, matmuls: dict[str, list[int]]
                  ) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    sac = functools.partial(tcp.create_selective_checkpoint_contexts, cp.dots_saveable)
    whole = {
        "compiled": lambda b: b,
        "remat_dots": lambda b: ckptfx.remat(b, policy=cp.dots_saveable),
        "torch_sac_dots": lambda b: functools.partial(tcp.checkpoint, b, use_reentrant=False,
                                                      context_fn=sac),
        "remat_none": lambda b: ckptfx.remat(b),
    }
    variants: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
    for name, call in whole.items():
        matmuls[name] = []
        variants[name] = torch.compile(Model(blocks, call),
                                       backend=counting_backend(backend, matmuls[name]))
    matmuls["ckptfx(compiled)"] = matmuls["torch(compiled)"] = []
    compiled = [torch.compile(b, backend=backend) for b in blocks]
    variants["ckptfx(compiled)"] = Model(
        compiled, lambda b: functools.partial(ckptfx.checkpoint, b))
    variants["torch(compiled)"] = Model(
        compiled, lambda b: functools.partial(tcp.checkpoint, b, use_reentrant=False))
    return variants


def train_step(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
               params: list[torch.Tensor]) -> None:
    torch.manual_seed(0)
    out = fn(x)
    torch.autograd.grad(out.sum(), [x, *params])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="aot_eager", choices=["eager", "aot_eager", "inductor"])
    add_shape_options(ap, d=128, seq=64, batch=4)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch._functorch.config.donated_buffer = False  # the split runs dx with retain_graph
    torch.manual_seed(0)
    blocks = [counted_block(args.d) for _ in range(args.blocks)]
    params = [p for b in blocks for p in b.parameters()]
    x = torch.randn(args.batch, args.seq, args.d, requires_grad=True)
    matmuls: dict[str, list[int]] = {}
    variants = make_variants(blocks, args.backend, matmuls)

    t0 = time.perf_counter()
    reference = None
    for name, fn in variants.items():  # compile, and check the gradients bitwise
        torch.manual_seed(0)
        out = fn(x)
        g = torch.autograd.grad(out.sum(), [x, *params])
        if reference is None:
            reference = g
        exact = all(torch.equal(a, b) for a, b in zip(g, reference))
        print(f"{name:18s} gradients bitwise equal to 'compiled': {exact}")
    print(f"compilation: {time.perf_counter() - t0:.1f} s")

    times = medians(rounds_of({name: functools.partial(train_step, fn, x, params)
                               for name, fn in variants.items()}, args.rounds,
                              clock=time.perf_counter))
    base = times["compiled"]
    print(f"\n{args.blocks} blocks d={args.d} seq={args.seq} batch={args.batch}, backend "
          f"{args.backend}, median of {args.rounds} alternated rounds, one thread")
    print(f"{'variant':18s} {'step':>7s} {'peak MiB':>9s} {'runs':>5s} {'bw matmuls':>10s}")
    for name, fn in variants.items():
        peak = peak_above_start(lambda: train_step(fn, x, params)) / 2**20
        RUNS[0] = 0
        train_step(fn, x, params)
        runs = RUNS[0] / args.blocks
        mm = matmuls[name][0] if matmuls[name] else "-"
        print(f"{name:18s} {times[name] / base:6.3f}x {peak:9.1f} "
              f"{runs:5.1f} {mm!s:>10s}")

    # split backward with compiled blocks (torchtitan order) vs one fused backward
    stage = variants["ckptfx(compiled)"]

    def split_step_of(model: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], int]:
        def split_step() -> int:
            RUNS[0] = 0
            torch.manual_seed(0)
            out, dx_fn, dw_fn = ckptfx.vjp_split(model, x, params=params)
            dx_fn(torch.ones_like(out))
            dw_fn()
            return RUNS[0]
        return split_step

    def fused_step() -> int:
        RUNS[0] = 0
        torch.manual_seed(0)
        out = stage(x)
        torch.autograd.grad(out, [x, *params], torch.ones_like(out))
        return RUNS[0]

    whole = torch.compile(Model(blocks, lambda b: functools.partial(ckptfx.checkpoint, b)),
                          backend=args.backend)
    split_step, whole_split_step = split_step_of(stage), split_step_of(whole)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runs = {"fused": fused_step(), "vjp_split": split_step(),
                "whole-model vjp_split": whole_split_step()}
    split_times = medians(rounds_of({"fused": fused_step, "vjp_split": split_step}, args.rounds,
                                    clock=time.perf_counter))
    ratio = split_times["vjp_split"] / split_times["fused"]
    print(f"\nsplit, blocks compiled then ckptfx.checkpoint: vjp_split (prefire + dx + dw) "
          f"{ratio:.3f}x one fused backward; block runs per step: "
          + ", ".join(f"{k} {v / args.blocks:.0f}" for k, v in runs.items()))
    for w in caught:
        if issubclass(w.category, ckptfx.CompiledReplayWarning):
            print(f"warned: {str(w.message)[:110]}...")


if __name__ == "__main__":
    main()
