"""What offloading costs and saves: one training step of a stack of transformer blocks (``Block``)
with the matmul outputs kept on the device, offloaded with overlapped copies, offloaded with
copies on the compute stream (ckptfx's offload before it overlapped), or recomputed.

For each variant: the device peak of the step above what the step starts with (the device
module's ``max_memory_allocated``: the caching allocator's on CUDA, the live storage bytes on
the tests' fake device), the device bytes held between forward and backward, the host bytes holding residuals after the forward
(``offload_pool_stats``), and the step time (median of alternated rounds, wall clock with a
device synchronisation; ratios per round against ``keep``). Every variant's gradients are
checked ``torch.equal`` to the plain step's. Run::

    python -m ckptfx.bench.offload --device cuda --d 2048 --seq 2048 --batch 4 \
        --blocks 8
    python -m ckptfx.bench.offload --fake          # the tests' fake accelerator (a dry run)

On the CPU there is nothing to offload (host memory already); the figures that matter need
an accelerator. The target: offload with overlap within 5% of ``keep``'s step time.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import time
from typing import Any, Callable

import torch

import ckptfx
from ckptfx import checkpoint_policies as cp
from ckptfx.bench.blocks import Block
from ckptfx.bench.figures import medians, ratio, rounds_of
from ckptfx.offload.streams import serialized_copies

__all__ = ["VARIANTS", "measure", "main"]

# name -> (policy, copies serialized on the compute stream)
VARIANTS: dict[str, tuple[Any, bool]] = {
    "none": (None, False),
    "keep": (cp.dots_with_no_batch_dims_saveable, False),
    "offload": (cp.offload_dot_with_no_batch_dims(), False),
    "offload_serial": (cp.offload_dot_with_no_batch_dims(), True),
    "recompute": (cp.nothing_saveable, False),
}
TARGET = 1.05  # offload / keep step time


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _step_fn(blocks: torch.nn.ModuleList, x: torch.Tensor, variant: str,
             between: Callable[[], None] | None = None) -> Callable[[], list[torch.Tensor]]:
    """One training step of ``variant`` (fresh remat'd blocks); ``between`` runs after the
    forward, before the backward."""
    policy, serial = VARIANTS[variant]
    calls = [b if variant == "none" else ckptfx.remat(b, policy=policy) for b in blocks]
    params = [p for b in blocks for p in b.parameters()]

    def step() -> list[torch.Tensor]:
        with serialized_copies() if serial else contextlib.nullcontext():
            h = x
            for call in calls:
                h = call(h)
        if between is not None:
            between()
        return list(torch.autograd.grad(h.float().square().mean(), params))
    return step


def measure(device: torch.device, d: int, seq: int, batch: int, blocks: int, rounds: int,
            variants: list[str] | None = None) -> dict[str, Any]:
    """Peak, host bytes and step time of each variant (see the module docstring)."""
    names = variants or list(VARIANTS)
    torch.manual_seed(0)
    stack = torch.nn.ModuleList(Block(d) for _ in range(blocks)).to(device)
    x = torch.randn(batch, seq, d, device=device)
    steps = {v: _step_fn(stack, x, v) for v in names}
    reference = steps[names[0]]()
    result: dict[str, Any] = {"device": str(device), "shape": dict(d=d, seq=seq, batch=batch,
                                                                  blocks=blocks)}
    figures: dict[str, dict[str, Any]] = {}
    for v in names:
        step = steps[v]
        bitwise = all(torch.equal(a, b) for a, b in zip(step(), reference))
        gc.collect()
        _sync(device)
        base = torch.accelerator.memory_allocated(device) if device.type != "cpu" else 0
        if device.type != "cpu":
            torch.accelerator.reset_peak_memory_stats(device)
        host, after = [0], [0]

        def note_forward() -> None:
            host[0] = ckptfx.offload_pool_stats().in_use_bytes
            _sync(device)
            after[0] = (torch.accelerator.memory_allocated(device) - base
                        if device.type != "cpu" else 0)
        _step_fn(stack, x, v, between=note_forward)()
        _sync(device)
        peak = (torch.accelerator.max_memory_allocated(device) - base
                if device.type != "cpu" else None)
        figures[v] = {"peak_bytes": peak, "forward_bytes": after[0] if peak is not None else None,
                      "host_bytes": host[0], "bitwise": bitwise}
    def timed(step: Callable[[], list[torch.Tensor]]) -> Callable[[], None]:
        def run() -> None:
            step()
            _sync(device)
        return run

    times = rounds_of({v: timed(steps[v]) for v in names}, rounds, clock=time.perf_counter)
    for v, t in medians(times).items():
        figures[v]["step_ms"] = t * 1e3
        if "keep" in times and v != "keep":
            figures[v]["time_vs_keep"] = ratio(times, v, "keep")[0]
    result["variants"] = figures
    if "offload" in figures and "keep" in figures:
        r = figures["offload"]["time_vs_keep"]
        if device.type == "cpu" or not _overlaps(device):
            result["verdict"] = (
                f"offload: {r:.3f}x keep's step time; no verdict on the {device.type} device "
                "(its copies cannot overlap: "
                + ("an Offload keeps values as they are on the CPU)" if device.type == "cpu"
                   else "the fake accelerator runs every op when it is called)"))
        else:
            result["verdict"] = (f"offload with overlap: {r:.3f}x keep's step time "
                                 f"(target <= {TARGET}): {'met' if r <= TARGET else 'NOT met'}")
    return result


def _overlaps(device: torch.device) -> bool:
    """Whether copies on a side stream of ``device`` can run beside its computation: not on
    the tests' fake accelerator, which runs every op synchronously."""
    return device.type != "fakeacc"


def _print(result: dict[str, Any]) -> None:
    print(f"device {result['device']}, shape {result['shape']}")
    print(f"{'variant':<16}{'peak MiB':>10}{'after fwd':>10}{'host MiB':>10}{'step ms':>10}"
          f"{'vs keep':>9}  bitwise")
    for v, f in result["variants"].items():
        peak = "-" if f["peak_bytes"] is None else f"{f['peak_bytes'] / 2**20:.1f}"
        fwd = "-" if f["forward_bytes"] is None else f"{f['forward_bytes'] / 2**20:.1f}"
        rel = f"{f['time_vs_keep']:.3f}" if "time_vs_keep" in f else "1"
        print(f"{v:<16}{peak:>10}{fwd:>10}{f['host_bytes'] / 2**20:>10.1f}"
              f"{f['step_ms']:>10.2f}{rel:>9}  {'yes' if f['bitwise'] else 'NO'}")
    if "verdict" in result:
        print(result["verdict"])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None,
                        help="a torch device (default: the accelerator, else cpu)")
    parser.add_argument("--fake", action="store_true",
                        help="the tests' fake accelerator (tests/fake_device; a checkout only)")
    parser.add_argument("--d", type=int, default=256,
                        help="model width, a multiple of the 4 heads (default: %(default)s)")
    parser.add_argument("--seq", type=int, default=256,
                        help="sequence length (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=4, help="batch size (default: %(default)s)")
    parser.add_argument("--blocks", type=int, default=4,
                        help="transformer blocks (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=7,
                        help="timed rounds per variant, alternated (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON too")
    args = parser.parse_args(argv)
    for name in ("d", "seq", "batch", "blocks", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be a positive int")
    if args.d % 4:
        parser.error(f"--d must be a multiple of the 4 attention heads, got {args.d}")
    if args.fake:
        import pathlib

        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests"))
        import fake_device  # type: ignore[import-not-found]

        reason = fake_device.register()
        if reason:
            parser.error(reason)
        device = torch.device(fake_device.NAME, 0)
    elif args.device is not None:
        try:
            device = torch.device(args.device)
            torch.empty(0, device=device)
        except (RuntimeError, AssertionError) as err:
            parser.error(f"--device {args.device}: {err}".splitlines()[0]
                         + (" (the tests' fake accelerator: --fake)"
                            if "fakeacc" in args.device else ""))
    else:
        acc = torch.accelerator.current_accelerator()
        device = torch.device(acc.type, 0) if acc is not None else torch.device("cpu")
    result = measure(device, args.d, args.seq, args.batch, args.blocks, args.rounds)
    _print(result)
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
