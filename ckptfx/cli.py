"""The ``ckptfx`` command (also ``python -m ckptfx``).

    ckptfx demo                        gradient parity and replay counts on a transformer block
    ckptfx residuals [MODULE:FUNCTION --shape B,S,D] [--policy NAME[:ARGS]]
                                       what remat keeps of a block (yours, or the demo's)
    ckptfx bench [--quick] [--out DIR] peak memory, tokens/s and split replays, measured

Parsing is argparse; the output goes through ``ckptfx._term`` (rich when installed). Bad
input is a usage error (exit status 2, the message names the argument and what it expects,
no traceback); a failed measurement exits with status 1 and the failing process's message.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import inspect
import io
import os
import sys
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

import ckptfx
from ckptfx._format import human_bytes
from ckptfx._term import note, rule, table
from ckptfx.bench.sweep import BenchError

__all__ = ["main", "parse_policy", "parse_shape"]

DESCRIPTION = ("ckptfx: JAX-style rematerialization for PyTorch, with a split backward that "
               "replays each checkpointed block once.")
EPILOG = """examples:
  ckptfx demo
  ckptfx residuals                                   the demo block, policy dots_saveable
  ckptfx residuals mymodel:Block --shape 2,128,256 --policy save_only_these_names:attn
  ckptfx bench --quick --out bench-results           about a minute on 2 CPU cores
  ckptfx bench --out bench-results                   the full sweep (README's table)
"""


class UsageError(ValueError):
    """Bad command-line input; ``main`` turns it into argparse's usage error (exit 2)."""


# -- the demo block ---------------------------------------------------------------------------


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
    from ckptfx.bench.split import count_split_replays

    p = {k: v.requires_grad_() for k, v in _block_params().items()}
    x = torch.randn(2, 16, 32, requires_grad=True)
    runs = [0]

    def counted(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        runs[0] += 1
        return _block(p, x)

    def grads(fn: Callable[..., torch.Tensor]) -> list[torch.Tensor]:
        runs[0] = 0
        torch.manual_seed(0)
        return list(torch.autograd.grad(fn(p, x).square().sum(), [x, *p.values()]))

    ref = grads(counted)
    cp = ckptfx.checkpoint_policies
    rows = []
    for label, fn, policy in [
        ("no checkpoint", counted, None),
        ("ckptfx.checkpoint", lambda p, x: ckptfx.checkpoint(counted, p, x), None),
        ("remat(nothing_saveable)", ckptfx.remat(counted), cp.nothing_saveable),
        ("remat(dots_saveable)", ckptfx.remat(counted, policy=cp.dots_saveable),
         cp.dots_saveable),
    ]:
        same = all(torch.equal(a, b) for a, b in zip(ref, grads(fn)))
        n = runs[0]
        kept = "-"
        if policy is not None:
            res = ckptfx.saved_residuals(ckptfx.remat(_block, policy=policy), p, x)
            kept = human_bytes(sum(r.nbytes for r in res))
        rows.append([label, str(n), kept, "True" if same else "False"])
    rule("ckptfx demo: a transformer block with dropout, d=32, batch 2 x seq 16")
    table("forward + backward against plain autograd", ("variant", "function runs",
          "kept for backward", "bitwise equal"), rows, right=(1, 2))
    note("(remat replays the ops it recorded in this first call, so the Python function "
         "runs once; later calls of a block that keeps nothing run unrecorded and re-run it, "
         "as torch's checkpoint does; 'kept' is saved_residuals' total)")

    params = list(p.values())
    blocks = [lambda h: _block(p, h)]
    split_rows = []
    for k in (1, 2, 4):
        c = count_split_replays(blocks, params, x, k)
        split_rows.append([str(k), f"{c.torch_replays:g}", f"{c.ckptfx_replays:g}",
                           "True" if c.bitwise_equal else "False"])
    table("split backward, dx then k dw calls: replays of the block per micro-batch (counted)",
          ("k dw calls", "torch checkpoint", "ckptfx session", "bitwise equal"), split_rows,
          right=(0, 1, 2))


# -- residuals ------------------------------------------------------------------------------


def parse_shape(text: str) -> tuple[int, ...]:
    """``"2,16,32"`` -> ``(2, 16, 32)``; anything else is a ``UsageError``."""
    parts = [s.strip() for s in text.split(",")]
    if not all(s.isdigit() and int(s) > 0 for s in parts):
        raise UsageError(f"--shape expects comma-separated positive integers such as "
                         f"2,16,32 (batch, sequence, features), got {text!r}")
    return tuple(int(s) for s in parts)


def _value(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


# What the usage error shows after the colon for a factory that takes other than names
_FACTORY_EXAMPLES = {
    "memory_budget": "0.3",
    "save_and_offload_only_these_names":
        "names_which_can_be_saved=attn,names_which_can_be_offloaded=mlp",
}


def parse_policy(spec: str) -> Any:
    """``NAME`` or ``NAME:ARGS`` -> a ``checkpoint_policies`` policy.

    ``ARGS`` are comma-separated; ``key=value`` is a keyword argument, ``+`` joins several
    names into one list (``save_and_offload_only_these_names:names_which_can_be_saved=a+b,
    names_which_can_be_offloaded=c``); numbers are read as numbers
    (``memory_budget:0.5``)."""
    from ckptfx.policies import Policy

    name, _, arg_text = spec.partition(":")
    cp = ckptfx.checkpoint_policies
    known = sorted(k for k in vars(cp) if not k.startswith("_"))
    chosen = getattr(cp, name, None)
    if chosen is None:
        raise UsageError(f"--policy: unknown policy {name!r}; expected one of "
                         f"{', '.join(known)} (factories take arguments after a colon: "
                         "save_only_these_names:attn,mlp)")
    if isinstance(chosen, Policy):
        if arg_text:
            raise UsageError(f"--policy: {name} takes no arguments; write --policy {name}")
        return chosen
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in arg_text.split(","))):
        key, eq, value = item.partition("=")
        if eq:
            kwargs[key] = ([n for n in value.split("+") if n] if key.startswith("names_")
                           else _value(value))
        else:
            args.append(_value(item))
    if chosen is cp.save_from_both_policies:  # its arguments are policies, named
        values = [getattr(cp, a, None) if isinstance(a, str) else None for a in args]
        if kwargs or len(args) != 2 or not all(isinstance(v, Policy) for v in values):
            raise UsageError(
                f"--policy: {name} takes two policies without arguments, by name: "
                f"--policy {name}:dots_saveable,everything_saveable (a factory with its own "
                f"arguments cannot be nested on the command line: call "
                f"ckptfx.print_saved_residuals from Python for that); got {arg_text!r}")
        return chosen(*values)
    sig = inspect.signature(chosen)
    # Shown without annotations: the user writes strings and numbers, not types.
    sig = sig.replace(parameters=[q.replace(annotation=q.empty) for q in sig.parameters.values()],
                      return_annotation=sig.empty)
    needs_args = any(q.kind is q.VAR_POSITIONAL or q.default is q.empty
                     for q in sig.parameters.values())
    if needs_args and not args and not kwargs:
        example = _FACTORY_EXAMPLES.get(name, "attn,mlp")
        raise UsageError(f"--policy: {name} is a factory that needs arguments {sig}; write "
                         f"them after a colon, e.g. --policy {name}:{example}")
    try:
        return chosen(*args, **kwargs)
    except (TypeError, ValueError) as err:
        raise UsageError(f"--policy: {name}{sig} refused the arguments {arg_text!r}: "
                         f"{err}") from None


def _import_target(target: str) -> tuple[Any, str]:
    """``MODULE:FUNCTION`` -> the object; MODULE is a module name or a .py path."""
    mod_name, colon, attr = target.partition(":")
    if not colon or not mod_name or not attr:
        raise UsageError(f"TARGET expects MODULE:FUNCTION (a module name importable from the "
                         f"current directory, or a path to a .py file, then the block's "
                         f"name), got {target!r}")
    try:
        if mod_name.endswith(".py") or os.sep in mod_name:
            path = os.path.abspath(mod_name)
            if not os.path.isfile(path):
                raise UsageError(f"TARGET: no file {mod_name!r} (MODULE:FUNCTION with MODULE "
                                 "a path to a .py file or a module name)")
            spec = importlib.util.spec_from_file_location(
                os.path.splitext(os.path.basename(path))[0], path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path and "" not in sys.path:
                sys.path.insert(0, os.getcwd())  # as `python -m` would: the user's own files
            module = importlib.import_module(mod_name)
    except UsageError:
        raise
    except ModuleNotFoundError as err:
        raise UsageError(f"TARGET: cannot import module {mod_name!r} ({err}); MODULE is a "
                         "module name importable from the current directory or a path to a "
                         ".py file") from None
    except Exception as err:  # noqa: BLE001  (the user's module failed: say how, no traceback)
        raise UsageError(f"TARGET: importing {mod_name!r} raised {type(err).__name__}: "
                         f"{err}") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            found = sorted(k for k, v in vars(module).items()
                           if callable(v) and not k.startswith("_"))
            raise UsageError(f"TARGET: module {mod_name!r} has no {attr!r}; callables there: "
                             f"{', '.join(found) or '(none)'}")
        obj = getattr(obj, part)
    return obj, attr


def _block_of(obj: Any, attr: str) -> Callable[..., Any]:
    """A module class is built with no arguments; a module or function is used as it is."""
    if isinstance(obj, type) and issubclass(obj, nn.Module):
        try:
            return obj()
        except TypeError as err:
            raise UsageError(f"TARGET: {attr}() cannot be built without arguments ({err}); "
                             f"point at a function that builds it, or at a function of the "
                             f"inputs (def block(x): ...)") from None
    if not callable(obj):
        raise UsageError(f"TARGET: {attr} is a {type(obj).__name__}, not a function or an "
                         "nn.Module")
    return obj


def residuals(target: str | None, shapes: Sequence[str], policy_spec: str) -> None:
    """Print what ``remat(policy)`` keeps of ``target`` called on random inputs."""
    policy = parse_policy(policy_spec)
    if target is None:
        if shapes:
            raise UsageError("--shape goes with a MODULE:FUNCTION target; without one the "
                             "report is of the demo block")
        note(f"remat(policy={policy_spec}) of a transformer block keeps:")
        ckptfx.print_saved_residuals(ckptfx.remat(_block, policy=policy), _block_params(),
                                     torch.randn(2, 16, 32))
        return
    if not shapes:
        raise UsageError("--shape is required with a MODULE:FUNCTION target, e.g. --shape "
                         "2,16,32 (one --shape per input tensor)")
    dims = [parse_shape(s) for s in shapes]
    obj, attr = _import_target(target)
    block = _block_of(obj, attr)
    torch.manual_seed(0)
    inputs = [torch.randn(d) for d in dims]
    desc = ", ".join("f32[" + ",".join(map(str, d)) + "]" for d in dims)
    report = io.StringIO()
    try:
        with contextlib.redirect_stdout(report):  # printed only once the block has run
            ckptfx.print_saved_residuals(ckptfx.remat(block, policy=policy), *inputs)
    except Exception as err:  # noqa: BLE001  (the block refused the inputs: no traceback)
        raise UsageError(f"calling {attr}({desc}) raised {type(err).__name__}: {err}; check "
                         "--shape (one per input tensor)") from None
    note(f"remat(policy={policy_spec}) of {target} on ({desc}) keeps:")
    print(report.getvalue(), end="")


# -- bench ----------------------------------------------------------------------------------


def _bench(args: argparse.Namespace) -> None:
    from ckptfx import bench
    from ckptfx.bench.variants import VARIANTS

    if args.rounds is not None and args.rounds < 1:
        raise UsageError(f"--rounds expects a positive integer, got {args.rounds}")
    if args.overhead:
        for flag, given in (("--out", args.out), ("--variants", args.variants),
                            ("--full", args.full), ("--markdown", args.markdown)):
            if given:
                raise UsageError(f"{flag} belongs to the decoder benchmark; --overhead takes "
                                 f"--quick, --only and --rounds")
        if args.device != "cpu":
            raise UsageError("--overhead measures CPU time on one thread: drop --device")
        from ckptfx.bench import overhead
        overhead.run(args.only, args.quick or args.tiny, args.rounds)
        return
    if args.only is not None or args.rounds is not None:
        raise UsageError("--only and --rounds belong to --overhead")
    mode = "tiny" if args.tiny else "quick" if args.quick else "full"
    variants = None
    if args.variants:
        variants = [v.strip() for v in args.variants.split(",") if v.strip()]
        unknown = [v for v in variants if v not in VARIANTS]
        if unknown:
            raise UsageError(f"--variants: unknown {', '.join(map(repr, unknown))}; expected "
                             f"comma-separated names from: {', '.join(VARIANTS)}")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise UsageError(f"--device expects a torch device such as cpu or cuda, got "
                         f"{args.device!r}") from None
    acc = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    if device.type != "cpu" and (acc is None or acc.type != device.type):
        raise UsageError(f"--device {args.device}: no {device.type} device here (available: "
                         f"cpu{', ' + acc.type if acc is not None else ''})")
    if args.threads < 1:
        raise UsageError(f"--threads expects a positive integer, got {args.threads}")
    if args.jobs < 0:
        raise UsageError(f"--jobs expects 0 (one per core) or a positive integer, got "
                         f"{args.jobs}")
    if args.out is not None:
        _check_out_dir(args.out)  # before the run, not after it with the results lost
    bench.bench(mode, args.out, args.device, variants, args.threads, args.markdown, args.jobs)


def _check_out_dir(out: str) -> None:
    """``--out DIR`` must be a directory ckptfx can write, or be creatable in one."""
    path = os.path.abspath(out)
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise UsageError(f"--out {out}: exists and is not a directory")
        where = path
    else:
        where = os.path.dirname(path)
        while not os.path.exists(where):
            where = os.path.dirname(where)
        if not os.path.isdir(where):
            raise UsageError(f"--out {out}: {where} is not a directory")
    if not os.access(where, os.W_OK | os.X_OK):
        raise UsageError(f"--out {out}: cannot write in {where}")


# -- the parser -----------------------------------------------------------------------------


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(prog="ckptfx", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version",
                        version=f"ckptfx {ckptfx.__version__} (torch {torch.__version__})")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    subs = {"demo": sub.add_parser(
        "demo", help="gradient parity and replay counts on a transformer block",
        description="Gradient parity (torch.equal against plain autograd) and counted runs of "
                    "a transformer block under ckptfx.checkpoint and remat, then a split "
                    "backward (dx + k dw calls) with torch's replay count beside ckptfx's.")}
    r = subs["residuals"] = sub.add_parser(
        "residuals", help="what remat keeps of a block: yours, or the demo's",
        description="Print the residuals (the tensors the backward keeps) of "
                    "remat(block, policy) on random inputs, one line each, then the total.")
    r.add_argument("target", nargs="?", metavar="MODULE:FUNCTION",
                   help="your block: a function of the inputs, an nn.Module class (built "
                        "with no arguments) or instance; MODULE is a module name or a .py "
                        "path. Default: the demo's transformer block")
    r.add_argument("--shape", action="append", default=[], metavar="B,S,D",
                   help="shape of an input tensor (repeat for several inputs)")
    r.add_argument("--policy", default="dots_saveable", metavar="NAME[:ARGS]",
                   help="a checkpoint_policies name, e.g. nothing_saveable, or a factory with "
                        "arguments, e.g. save_only_these_names:attn,mlp (default: "
                        "dots_saveable)")
    b = subs["bench"] = sub.add_parser(
        "bench", help="peak memory, tokens/s and split replays, measured",
        description="Measure each checkpointing variant on a Llama-style decoder: peak "
                    "memory of a training step (fresh subprocess per variant), median step "
                    "time and tokens/s (variants alternated in one process), gradient "
                    "parity, and replays per micro-batch of a split backward.")
    size = b.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true",
                      help="small shapes: about a minute on 2 CPU cores")
    size.add_argument("--full", action="store_true", help="the full sweep (default)")
    size.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # tests' smoke
    b.add_argument("--out", metavar="DIR",
                   help="write results.json, table.md and PNG plots (needs matplotlib) here")
    b.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    b.add_argument("--variants", metavar="A,B",
                   help="comma-separated variant names (default: all that fit the device)")
    b.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    b.add_argument("--jobs", type=int, default=0,
                   help="memory subprocesses at a time (default: one per core, at most 4)")
    b.add_argument("--markdown", action="store_true",
                   help="also print the headline table as markdown")
    b.add_argument("--overhead", action="store_true",
                   help="instead: per-call overhead where blocks are small (remat's forward, "
                        "the split backward), ratios to torch in one run")
    b.add_argument("--only", choices=("remat", "split", "vjp256"),
                   help="with --overhead: one part only")
    b.add_argument("--rounds", type=int, help="with --overhead: rounds per figure")
    return parser, subs


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``ckptfx`` console script."""
    parser, subs = _parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "demo":
            demo()
        elif args.command == "residuals":
            residuals(args.target, args.shape, args.policy)
        else:
            _bench(args)
    except UsageError as err:
        subs[args.command].error(str(err))  # usage, the message, exit status 2
    except BenchError as err:
        print(f"ckptfx {args.command}: {err}", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
