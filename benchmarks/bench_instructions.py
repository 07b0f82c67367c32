"""Instructions per split step, counted by callgrind: a measure no clock or load can move.

    python benchmarks/bench_instructions.py [--steps 5] [--variants none,floor,sessions]
                                            [--backward]

The split step of ``ckptfx bench --overhead --only split`` (6 MLP blocks d=64, prefire +
dx + one dw call per parameter) runs in a child process under ``valgrind --tool=callgrind``
twice for each variant, the second time with ``--steps`` more steps; the difference of the
two counts, over ``--steps``, is the steps' alone (start-up, imports, warm-up and exit
cancel out; with ``--backward``, only the autograd engine's calls are counted). Only the
main thread's instructions count: other threads (torch's) spin or wait as scheduling has
them. The same program and inputs give the same count on any machine
state, so a change of a few tenths of a percent is visible, where the step's time moves by
+-5% from run to run on a shared 2-core machine. Counts are not time: cache misses, page
faults and the kernel's work do not show (a step's time over its instructions is about 3x
larger for ckptfx's Python than for torch's kernels); use it to see what a change does to
the work, and ``bench_overhead.py`` for what it does to the time.

Variants: ``none`` (no checkpointing), ``floor`` (every saved tensor through a Python
identity hook, plus one more forward of each block to its last pack: what any checkpoint on
saved-tensor hooks pays), ``sessions`` (ckptfx checkpoint, collector, prefire, sessions).
Needs valgrind (Debian's ``valgrind`` package); about 4-6 minutes per variant, two
children at once.
``PYTHONHASHSEED=0`` in the children: the hash seed moves a count by about 0.3%.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Callable

VARIANTS = ("none", "floor", "sessions")


def _step(variant: str) -> Callable[[], None]:
    import torch

    from ckptfx.bench.overhead_split import split_variants

    torch.set_num_threads(1)  # split_variants seeds the blocks and inputs itself
    name = {"none": "none", "floor": "hook floor", "sessions": "ckptfx sessions"}[variant]
    return split_variants()[name]


def _child(variant: str, steps: int) -> None:
    step = _step(variant)
    for _ in range(3 + steps):  # 3 warm-up steps (imports, first-call caches), then the rest
        step()


def _collected(variant: str, steps: int, backward: bool) -> int:
    """Instructions the main thread ran in one child running 3 + ``steps`` steps (other
    threads, torch's among them, wait or spin for as long as scheduling has them: their
    counts move from run to run and are left out)."""
    what = (["--collect-atstart=no", "--toggle-collect=THPEngine_run_backward*"]
            if backward else [])
    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "callgrind.out")
        cmd = ["valgrind", "--tool=callgrind", *what, "--separate-threads=yes",
               f"--callgrind-out-file={out_file}", sys.executable, os.path.abspath(__file__),
               "--child", variant, str(steps)]
        env = dict(os.environ, PYTHONHASHSEED="0")
        run = subprocess.run(cmd, capture_output=True, text=True, env=env)
        main_thread = out_file + "-01"
        if run.returncode != 0 or not os.path.exists(main_thread):
            raise RuntimeError(f"callgrind failed for {variant}:\n{run.stderr[-2000:]}")
        with open(main_thread) as f:
            m = re.search(r"^totals: (\d+)", f.read(), re.MULTILINE)
    if m is None:
        raise RuntimeError(f"callgrind wrote no total for {variant}'s main thread")
    return int(m.group(1))


def count(variant: str, steps: int, backward: bool = False,
          pool: concurrent.futures.Executor | None = None) -> float:
    """Instructions per step of ``variant``: two children under callgrind, one running
    ``steps`` more steps than the other; the difference is the steps' alone (start-up,
    imports, warm-up and exit cancel out)."""
    if pool is None:
        return (_collected(variant, steps, backward) - _collected(variant, 0, backward)) / steps
    hi, lo = pool.submit(_collected, variant, steps, backward), pool.submit(
        _collected, variant, 0, backward)
    return (hi.result() - lo.result()) / steps


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--backward", action="store_true",
                    help="count only inside the autograd engine's calls")
    ap.add_argument("--child", nargs=2, metavar=("VARIANT", "STEPS"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child(args.child[0], int(args.child[1]))
        return {}
    variants = args.variants.split(",")
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        ap.error(f"--variants takes {', '.join(VARIANTS)}; got {', '.join(bad)}")
    if args.steps < 1:
        ap.error(f"--steps must be a positive integer, got {args.steps}")
    if shutil.which("valgrind") is None:
        sys.exit("bench_instructions: valgrind is not installed (apt-get install valgrind)")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        counts = {v: count(v, args.steps, args.backward, pool) for v in variants}
    what = "engine calls" if args.backward else "step"
    for v, n in counts.items():
        line = f"{v:9s} {n / 1e6:8.3f} M instructions per {what}"
        if "none" in counts and v != "none":
            line += f"   {n / counts['none']:.4f}x none"
        if "floor" in counts and v not in ("none", "floor"):
            line += f"   {n / counts['floor']:.4f}x floor"
        print(line)
    return counts


if __name__ == "__main__":
    main()
