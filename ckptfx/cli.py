"""The ``ckptfx`` command: a demo, the benchmarks of a source checkout, and a residual report.

    ckptfx demo                 gradient parity and replay counts on a transformer block
    ckptfx residuals [--policy dots_saveable]   what a remat'd transformer block keeps
    ckptfx bench NAME [ARGS]    run benchmarks/bench_NAME.py from a source checkout
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from typing import Sequence

import torch
import torch.nn.functional as F

import ckptfx

_HERE = os.path.dirname(os.path.abspath(__file__))
_BENCHMARKS = os.path.join(os.path.dirname(_HERE), "benchmarks")


def _block_params(d: int = 32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w_qkv": torch.randn(d, 3 * d, generator=g) / d**0.5,
        "w_out": torch.randn(d, d, generator=g) / d**0.5,
        "w1": torch.randn(d, 4 * d, generator=g) / d**0.5,
        "w2": torch.randn(4 * d, d, generator=g) / (4 * d) ** 0.5,
    }


def _block(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    q, k, v = (F.layer_norm(x, x.shape[-1:]) @ p["w_qkv"]).chunk(3, dim=-1)
    att = ckptfx.checkpoint_name(torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, -1),
                                 "attn")
    x = x + F.dropout(att @ v, 0.1, True) @ p["w_out"]
    return x + F.gelu(F.layer_norm(x, x.shape[-1:]) @ p["w1"]) @ p["w2"]


def demo() -> None:
    """Parity and replay counts of checkpoint, remat and a split dx/dw backward."""
    p = {k: v.requires_grad_() for k, v in _block_params().items()}
    x = torch.randn(2, 16, 32, requires_grad=True)
    runs = [0]

    def counted(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        runs[0] += 1
        return _block(p, x)

    def grads(fn) -> list[torch.Tensor]:
        runs[0] = 0
        torch.manual_seed(0)
        return list(torch.autograd.grad(fn(p, x).square().sum(), [x, *p.values()]))

    ref = grads(counted)
    cp = ckptfx.checkpoint_policies
    for label, fn in [
        ("no checkpoint", counted),
        ("ckptfx.checkpoint", lambda p, x: ckptfx.checkpoint(counted, p, x)),
        ("remat(nothing_saveable)", ckptfx.remat(counted)),
        ("remat(dots_saveable)", ckptfx.remat(counted, policy=cp.dots_saveable)),
    ]:
        g = grads(fn)
        same = all(torch.equal(a, b) for a, b in zip(ref, g))
        print(f"{label:26s} function runs {runs[0]}   bitwise equal: {same}")
    print("(remat replays its recorded ops, so the Python function runs once)")


def residuals(policy: str) -> None:
    from ckptfx.policies import Policy

    chosen = getattr(ckptfx.checkpoint_policies, policy, None)
    if not isinstance(chosen, Policy):  # unknown, or a factory that needs arguments
        raise SystemExit(f"unknown or parametrised policy {policy!r}; try dots_saveable, "
                         "nothing_saveable, everything_saveable, dots_with_no_batch_dims_saveable")
    print(f"remat(policy={policy}) of a transformer block keeps:")
    ckptfx.print_saved_residuals(ckptfx.remat(_block, policy=chosen), _block_params(),
                                 torch.randn(2, 16, 32))


def bench(name: str, rest: Sequence[str]) -> None:
    path = os.path.join(_BENCHMARKS, f"bench_{name}.py")
    if not os.path.exists(path):
        found = sorted(f[6:-3] for f in os.listdir(_BENCHMARKS)) if os.path.isdir(
            _BENCHMARKS) else []
        raise SystemExit(f"no benchmark {name!r}" + (f"; available: {', '.join(found)}" if found
                                                     else " (benchmarks need a source checkout)"))
    sys.argv = [path, *rest]
    runpy.run_path(path, run_name="__main__")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="ckptfx", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version",
                        version=f"ckptfx {ckptfx.__version__} (torch {torch.__version__})")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="gradient parity and replay counts")
    r = sub.add_parser("residuals", help="residual report of a remat'd transformer block")
    r.add_argument("--policy", default="dots_saveable")
    b = sub.add_parser("bench", help="run a benchmark of a source checkout")
    b.add_argument("name")
    b.add_argument("rest", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.command == "demo":
        demo()
    elif args.command == "residuals":
        residuals(args.policy)
    else:
        bench(args.name, args.rest)


if __name__ == "__main__":
    main()
