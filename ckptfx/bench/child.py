"""Measuring children: each measurement that reads a process's peak memory runs in a fresh
process (memory.py says why), which answers with one JSON object on its last stdout line.

Both sides, for ``ckptfx bench`` (sweep.py, measure.py) and the scripts in ``benchmarks/``:
the parent runs a child with ``run_json`` (a failed child is a ``BenchError`` carrying its
stderr's end), the child prints its result with ``answer``; ``script_parser`` holds the
options every script with children takes, ``add_shape_options`` those of a run's size.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from typing import Any, Callable, Sequence

__all__ = ["BenchError", "add_shape_options", "answer", "last_json", "run_json",
           "script_parser"]


class BenchError(RuntimeError):
    """A measuring subprocess failed; the message carries the end of its stderr."""


def last_json(stdout: str, what: str, stderr: str) -> dict[str, Any]:
    """The JSON object on the last line of a child's ``stdout`` (``what`` names the child)."""
    lines = stdout.strip().splitlines()
    try:
        return dict(json.loads(lines[-1]))
    except (IndexError, ValueError):
        raise BenchError(f"the {what} printed no result; its stderr ends:\n"
                         f"{stderr[-3000:]}") from None


def run_json(command: Sequence[str], env: dict[str, str], what: str) -> dict[str, Any]:
    """Run ``command``, a measuring child (``what`` names it in errors), and return the JSON
    object it printed last on stdout. A child that failed or printed no result is a
    ``BenchError`` carrying the end of its stderr."""
    proc = subprocess.run(list(command), env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BenchError(f"the {what} failed; its stderr ends:\n{proc.stderr[-3000:]}")
    return last_json(proc.stdout, what, proc.stderr)


def answer(child: Callable[[dict[str, Any]], dict[str, Any]], config: str) -> int:
    """The child's side: run ``child`` on the JSON object ``config`` and print its result as
    the last line of stdout (what ``run_json`` reads); 0, the exit status."""
    print(json.dumps(child(json.loads(config))), flush=True)
    return 0


def add_shape_options(parser: argparse.ArgumentParser, d: int, seq: int, batch: int) -> None:
    """``--d``, ``--seq`` and ``--batch`` (the model's width and the input's size), with
    these defaults."""
    parser.add_argument("--d", type=int, default=d, help="model width")
    parser.add_argument("--seq", type=int, default=seq, help="sequence length")
    parser.add_argument("--batch", type=int, default=batch, help="batch size")


def script_parser(doc: str | None, d: int, seq: int, batch: int, steps: int,
                  child_args: int = 1) -> argparse.ArgumentParser:
    """The command line of a script that measures in children: described by ``doc``'s first
    paragraph, ``--quick``, the run's size (``add_shape_options``), ``--steps`` (measured
    steps per child) and the hidden ``--child`` (``child_args`` values) its children are
    started with."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    parser.add_argument("--child", nargs=None if child_args == 1 else child_args,
                        help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="small shapes, few repeats")
    add_shape_options(parser, d, seq, batch)
    parser.add_argument("--steps", type=int, default=steps, help="measured steps per child")
    return parser
