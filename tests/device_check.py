"""The GPU check: ckptfx's device suite and figures on a real accelerator (CUDA or NPU).

Run on a machine with an accelerator, from the repository root::

    python tests/device_check.py              # the suite, then the figures
    python tests/device_check.py --figures    # the figures only
    python tests/device_check.py --fake       # the same on the fake device (a dry run on CPU)

It prints, for the accelerator torch reports (``torch.accelerator``):

1. the device suite (``tests/test_device.py`` and the device-parametrized tests) run there,
   with the fake device kept out (``CKPTFX_FAKE_DEVICE=0``);
2. parity: every variant's gradients against no checkpoint, ``torch.equal``, with dropout, in
   fp32 and bf16 autocast (forward under autocast, backward outside);
3. replay counts of a split step (dx then two dw calls) under a session, with and without a
   prefire, and the threads the backward ran on;
4. peak device memory of one training step (the device module's ``max_memory_allocated``:
   the caching allocator's on CUDA) and the step time (median of ``--steps``), for no
   checkpoint, torch's checkpoint, ``ckptfx.checkpoint`` and ``ckptfx.remat``, with ratios
   against no checkpoint measured in the same run;
5. offload (``ckptfx.bench.offload``): the step time of offloading the matmul outputs with
   overlapped copies against keeping them on the device (target: within 5%) and with copies
   on the compute stream, and the device bytes each holds between forward and backward.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint

HERE = pathlib.Path(__file__).resolve().parent
SUITE = ["test_device.py", "test_offload.py", "test_sessions.py", "test_sessions_threads.py", "test_split.py",
         "test_split_calls.py", "test_pipelining.py", "test_refill.py", "test_remat_rng.py",
         "test_checkpoint_differential.py"]


class Block(nn.Module):
    """A transformer-sized MLP block with dropout: what users checkpoint."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.dropout(self.down(F.gelu(self.up(self.norm(x)))), 0.1, self.training)


def _variants(blocks: nn.ModuleList) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    import ckptfx
    from ckptfx import checkpoint_policies as cp

    remats = [ckptfx.remat(b) for b in blocks]
    dots = [ckptfx.remat(b, policy=cp.dots_saveable) for b in blocks]

    def chain(run: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> Callable[..., Any]:
        def model(x: torch.Tensor) -> torch.Tensor:
            for i, b in enumerate(blocks):
                x = run(i, x)
            return x
        return model

    return {
        "none": chain(lambda i, x: blocks[i](x)),
        "torch": chain(lambda i, x: torch_checkpoint.checkpoint(blocks[i], x, use_reentrant=False)),
        "ckptfx": chain(lambda i, x: ckptfx.checkpoint(blocks[i], x)),
        "remat": chain(lambda i, x: remats[i](x)),
        "remat_dots": chain(lambda i, x: dots[i](x)),
    }


def _grads(model: Callable[..., torch.Tensor], x: torch.Tensor, params: list[torch.Tensor],
           amp: bool, device: torch.device) -> list[torch.Tensor]:
    torch.manual_seed(0)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
        out = model(x)
    return list(torch.autograd.grad(out.float().square().mean(), [x, *params]))


def parity(device: torch.device, d: int, depth: int, tokens: int) -> None:
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block(d) for _ in range(depth)).to(device)
    params = list(blocks.parameters())
    x = torch.randn(tokens, d, device=device, requires_grad=True)
    variants = _variants(blocks)
    print("\n## parity against no checkpoint (torch.equal on every gradient, dropout on)")
    for amp in (False, True):
        ref = _grads(variants["none"], x, params, amp, device)
        row = []
        for name, model in variants.items():
            if name != "none":
                got = _grads(model, x, params, amp, device)
                row.append(f"{name}={'exact' if all(map(torch.equal, ref, got)) else 'DIFFERENT'}")
        print(f"{'bf16 autocast' if amp else 'fp32':14s}", "  ".join(row))


def replay_counts(device: torch.device, d: int) -> None:
    import ckptfx

    torch.manual_seed(0)
    blocks = nn.ModuleList(Block(d) for _ in range(2)).to(device)
    runs, threads = [0], set()

    def counted(b: nn.Module, x: torch.Tensor) -> torch.Tensor:
        runs[0] += 1
        return b(x)

    x = torch.randn(64, d, device=device, requires_grad=True)
    params = list(blocks.parameters())
    print("\n## a split step under a session: dx, then two dw calls (2 blocks)")
    for prefire in (True, False):
        runs[0] = 0
        with ckptfx.recompute_handle_collector_ctx() as handles:
            out = x
            for b in blocks:
                out = ckptfx.checkpoint(counted, b, out)
        out.register_hook(lambda g: threads.add(threading.get_ident()))
        loss = out.square().mean()
        sid = ("check", prefire)
        try:
            if prefire:
                for h in handles:
                    ckptfx.recompute_handle(h, sid)
            with ckptfx.recompute_session_ctx(sid, retain_on_unpack=True):
                torch.autograd.grad(loss, [x], retain_graph=True)
            with ckptfx.recompute_session_ctx(sid, retain_on_unpack=True):
                torch.autograd.grad(loss, params[:4], retain_graph=True)
            with ckptfx.recompute_session_ctx(sid, retain_on_unpack=False):
                torch.autograd.grad(loss, params[4:])
        finally:
            ckptfx.clear_recompute_session(sid)
        print(f"{'prefire' if prefire else 'no prefire':11s} block runs: {runs[0]} "
              f"(2 forward + {runs[0] - 2} replays; torch's checkpoint replays 6)")
    on_caller = threading.get_ident() in threads
    print(f"backward ran on {'the caller' if on_caller else 'autograd device threads'}")


def memory_and_time(device: torch.device, d: int, depth: int, tokens: int, steps: int) -> None:
    mod = torch.get_device_module(device.type)
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block(d) for _ in range(depth)).to(device)
    params = list(blocks.parameters())
    x = torch.randn(tokens, d, device=device, requires_grad=True)
    variants = _variants(blocks)
    print(f"\n## one training step: {depth} blocks, d={d}, {tokens} tokens, median of {steps}")
    print(f"{'variant':11s} {'peak MiB':>9s} {'x none':>7s} {'ms':>8s} {'x none':>7s}")
    results: dict[str, tuple[float, float]] = {}
    for name, model in variants.items():
        times = []
        peak = 0.0
        for step in range(steps + 1):
            for p in params:
                p.grad = None
            mod.synchronize()
            base = mod.memory_allocated(device.index or 0)
            mod.reset_peak_memory_stats(device.index or 0)
            t0 = time.perf_counter()
            model(x).square().mean().backward()
            mod.synchronize()
            if step:  # the first step warms up
                times.append(time.perf_counter() - t0)
                peak = (mod.max_memory_allocated(device.index or 0) - base) / 2**20
        results[name] = (peak, statistics.median(times) * 1e3)
    none_peak, none_ms = results["none"]
    for name, (peak, ms) in results.items():
        print(f"{name:11s} {peak:9.1f} {peak / none_peak:7.3f} {ms:8.2f} {ms / none_ms:7.3f}")


def offload(device: torch.device, d: int, depth: int, tokens: int, steps: int) -> None:
    """The offload figure (ckptfx.bench.offload): matmul outputs kept on the device against
    offloaded with overlapped copies (target: within 5% of the step time) and with copies on
    the compute stream, and the device memory each holds between forward and backward."""
    from ckptfx.bench.offload import _print, measure

    seq = min(tokens, 2048)
    print(f"\n## offload: {depth} blocks, d={d}, batch {max(1, tokens // seq)} x seq {seq}")
    _print(measure(device, d, seq, max(1, tokens // seq), depth, steps))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fake", action="store_true", help="use the fake device (a dry run)")
    parser.add_argument("--figures", action="store_true", help="skip the test suite")
    parser.add_argument("--d", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    if args.fake:
        import fake_device

        reason = fake_device.register()
        if reason is not None:
            print(reason)
            return 1
    acc = torch.accelerator.current_accelerator()
    if acc is None:
        print("no accelerator: run on a machine with one, or pass --fake")
        return 1
    device = torch.device(acc.type, 0)
    print(f"# ckptfx device check on {device} (torch {torch.__version__})")
    rc = 0
    if not args.figures:
        env = dict(os.environ, CKPTFX_FAKE_DEVICE="1" if args.fake else "0")
        rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              *(str(HERE / f) for f in SUITE)], env=env, cwd=HERE.parent)
        print(f"device suite: {'passed' if rc == 0 else 'FAILED'}")
    parity(device, min(args.d, 256), 2, 256)
    replay_counts(device, min(args.d, 256))
    memory_and_time(device, args.d, args.depth, args.tokens, args.steps)
    offload(device, args.d, args.depth, args.tokens, args.steps)
    return rc


if __name__ == "__main__":
    sys.exit(main())
