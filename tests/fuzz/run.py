"""The fuzzer's driver: ``python -m tests.fuzz`` (or ``python tests/fuzz/run.py``).

Runs generated programs under every variant until ``CKPTFX_FUZZ_SECONDS`` (default 60) have
passed or ``--programs N`` were run, from ``--seed S`` on, and prints each new failure
(shrunk) and a summary. Exit status 1 when a failure was found that is neither a documented
known failure (known.py) nor a limit shared with torch's checkpoint.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import sys
import time
import warnings

if __package__ in (None, ""):  # python tests/fuzz/run.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    __package__ = "tests.fuzz"

from . import harness as h  # noqa: E402
from .known import known_failure  # noqa: E402
from .program import Program, generate  # noqa: E402


@dataclasses.dataclass
class Finding:
    seed: int
    variant: str
    category: str
    detail: str
    shared: str | None = None  # the limit shared with torch's checkpoint
    known: str | None = None  # the documented known failure
    shrunk: Program | None = None
    family: str = ""  # the program's issue-36 family ("" for a base program)


@dataclasses.dataclass
class Summary:
    programs: int = 0
    runs: int = 0  # (program, variant) pairs checked
    ok: int = 0
    invalid: int = 0  # the reference itself raised (not a program for that variant)
    seconds: float = 0.0
    findings: list[Finding] = dataclasses.field(default_factory=list)
    families: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def counts(self) -> dict[str, int]:
        c = collections.Counter()
        for f in self.findings:
            if f.shared:
                c["shared-with-torch"] += 1
            elif f.known:
                c["known"] += 1
            else:
                c[f.category] += 1
        return c

    def new(self) -> list[Finding]:
        return [f for f in self.findings if not f.shared and not f.known]

    def report(self) -> str:
        c = self.counts()
        kinds = collections.Counter(f"{f.variant}: {re.sub(r'[0-9]+', 'N', f.detail[:90])}"
                                    for f in self.findings
                                    if f.category == "error" and not f.shared and not f.known)
        known = collections.Counter(f.known for f in self.findings if f.known)
        shared = collections.Counter(f.shared for f in self.findings if f.shared)
        where = collections.defaultdict(set)
        for f in self.findings:
            if f.shared:
                where[f.shared].add(f.variant)
        lines = [
            f"programs: {self.programs}   variants: {len(h.VARIANTS)}   runs: {self.runs}   "
            f"({self.seconds:.0f} s)",
            f"exact: {self.ok}   not a program for the variant (reference raised): {self.invalid}",
            f"wrong results: {c['wrong']}   block ran too often: {c['runs']}   "
            f"errors: {c['error']}   shared-with-torch: {c['shared-with-torch']}   "
            f"documented refusals: {c['known']}",
        ]
        if kinds:
            lines.append("errors by kind:")
            lines += [f"  {n} x {k}" for k, n in kinds.most_common()]
        if known:
            lines.append("refused with a CheckpointError naming the fix (tests/fuzz/known.py): "
                         + ", ".join(f"{k}: {n}" for k, n in sorted(known.items())))
        if shared:
            lines.append("shared with torch.utils.checkpoint (documented limit, not a failure):")
            lines += [f"  {n} x {k}\n      in: {', '.join(sorted(where[k]))}"
                      for k, n in shared.most_common()]
        if self.families:
            lines.append("program families (issue 36):")
            for fam, n in sorted(self.families.items()):
                new = [f for f in self.new() if f.family == fam]
                shared = sum(1 for f in self.findings if f.family == fam and f.shared)
                lines.append(f"  {fam or 'base'}: {n} programs, {len(new)} new failures "
                             f"({len({f.seed for f in new})} programs, "
                             f"{len({f.variant for f in new})} variants), "
                             f"{shared} shared with torch")
        return "\n".join(lines)


def fuzz_program(seed: int, summary: Summary, shrink: bool = True, out=None,
                 variants=None) -> list[Finding]:
    prog = generate(seed)
    found: list[Finding] = []
    summary.programs += 1
    summary.families[prog.family] += 1
    shrunk_kinds: set[tuple[str, str]] = set()
    for v in variants or h.VARIANTS:
        summary.runs += 1
        r = h.check(v, prog)
        if r is None:
            summary.ok += 1
            continue
        if r[0] == "invalid":
            summary.invalid += 1
            continue
        f = Finding(seed, v.name, r[0], r[1], known=known_failure(prog, v.name, r[0], r[1]),
                    family=prog.family)
        if not f.known:
            t = h.torch_failure(v, prog)
            if t is not None and h.same_failure(r, t):
                f.shared = h.describe_shared(prog)
            elif r[0] == "wrong" and h.generator_limit_applies(v, prog, r[1]):
                f.shared = h.SHARED_LIMITS["gen_randn"]
        if shrink and not f.shared and not f.known:
            key = (r[0], r[1].split(":")[0] if r[0] == "error" else h.what_differs(r[1]))
            f.shrunk = h.shrink(v, prog, r) if key not in shrunk_kinds else None
            shrunk_kinds.add(key)
            if out is not None:
                print(f"\nFAILURE seed={seed} variant={v.name}"
                      f"{f' family={prog.family}' if prog.family else ''}: {r[0]}: {r[1]}",
                      file=out)
                if f.shrunk is not None:
                    print("minimal program:\n" + f.shrunk.describe(), file=out)
        found.append(f)
    summary.findings += found
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seed", type=int, default=0, help="first program seed")
    ap.add_argument("--programs", type=int, default=None, help="stop after N programs")
    ap.add_argument("--seconds", type=float,
                    default=float(os.environ.get("CKPTFX_FUZZ_SECONDS", 60)))
    ap.add_argument("--no-shrink", action="store_true")
    a = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    import torch

    torch.set_num_threads(1)
    s = Summary()
    t0 = time.monotonic()  # stops the loop only; never decides a result
    seed = a.seed
    while (a.programs is None or s.programs < a.programs) and (
            a.programs is not None or time.monotonic() - t0 < a.seconds):
        fuzz_program(seed, s, shrink=not a.no_shrink, out=sys.stdout)
        seed += 1
        s.seconds = time.monotonic() - t0
    s.seconds = time.monotonic() - t0
    print("\n" + s.report())
    return 1 if s.new() else 0


if __name__ == "__main__":
    sys.exit(main())
