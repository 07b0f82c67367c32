"""The differential program fuzzer, fixed seeds (CI budget).

Each seed is a random block program (see program.py) run under every variant in harness.py
and compared bitwise with plain autograd (or the same torch.func transform of the plain
function); block runs are counted. A failure that torch's own checkpoint shares is reported,
not failed; a documented known failure (known.py) must still fail (xfail strict). Longer
runs: ``CKPTFX_FUZZ_SECONDS=300 python -m tests.fuzz``.
"""

from __future__ import annotations

import collections
import os
import random

import pytest
import torch

from . import harness as h
from .known import FIXED, KNOWN
from .program import BASE_OPS, FAMILIES, OPS, Program, Step, _step_args, generate
from .run import Summary, fuzz_program

pytestmark = pytest.mark.filterwarnings("ignore")

N_SEEDS = int(os.environ.get("CKPTFX_FUZZ_CI_SEEDS", 240))
CHUNK = 60


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: intra-op threads only add contention on a loaded machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("first", range(0, N_SEEDS, CHUNK))
def test_fixed_seeds_are_exact(first: int) -> None:
    s = Summary()
    for seed in range(first, min(first + CHUNK, N_SEEDS)):
        fuzz_program(seed, s, shrink=False)
    new = s.new()
    if new:
        f = new[0]
        shrunk = h.shrink(h.VARIANTS_BY_NAME[f.variant], generate(f.seed), (f.category, f.detail))
        pytest.fail(f"{len(new)} new failure(s); first: seed={f.seed} {f.variant}: "
                    f"{f.category}: {f.detail}\nminimal program:\n{shrunk.describe()}\n"
                    + s.report())
    assert s.ok > 0.9 * s.runs, s.report()


@pytest.mark.parametrize("known", KNOWN, ids=[k.id for k in KNOWN])
def test_documented_limit_is_refused(known) -> None:
    """The shrunk program of each documented limit gets its CheckpointError, nothing else."""
    r = h.check(h.VARIANTS_BY_NAME[known.variant], known.program)
    assert r is not None and known.matches(known.program, known.variant, *r), (
        f"{r}\n{known.program.describe()}")


@pytest.mark.parametrize("fixed", FIXED, ids=[f[0].split(":")[0] for f in FIXED])
def test_fixed_failure_stays_exact(fixed) -> None:
    _, variant, prog = fixed
    r = h.check(h.VARIANTS_BY_NAME[variant], prog)
    assert r is None, f"{r}\n{prog.describe()}"


def test_shared_limit_is_classified_not_failed() -> None:
    """An explicit generator under checkpoint: torch's checkpoint is wrong the same way, so
    the fuzzer reports the shared limit; remat replays the recorded numbers, exactly."""
    prog = Program([Step("gen_randn", (0,)), Step("sin", (1,))], [])
    ck = h.VARIANTS_BY_NAME["checkpoint(early_stop=True)"]
    r = h.check(ck, prog)
    assert r is not None and r[0] == "wrong"
    assert h.same_failure(r, h.torch_failure(ck, prog))
    assert "explicit torch.Generator" in h.describe_shared(prog)
    assert h.check(h.VARIANTS_BY_NAME["remat(default)"], prog) is None


def test_fuzzer_catches_and_shrinks_a_wrong_variant() -> None:
    """The fuzzer is not blind: a checkpoint that does not restore the RNG state
    (preserve_rng_state=False) gives wrong dropout gradients; the shrinker keeps the dropout."""
    import ckptfx

    bad = h.Variant("checkpoint(preserve_rng_state=False)", lambda e: h.run_autograd(
        e, lambda p, x, i: ckptfx.checkpoint(e.block, p, x, i, preserve_rng_state=False)),
        "autograd")
    prog = Program([Step("tanh", (0,)), Step("matmul", (1,), "w0"), Step("dropout", (2,)),
                    Step("sin", (3,)), Step("add", (4, 1))], [], ncalls=2)
    r = h.check(bad, prog)
    assert r is not None and r[0] == "wrong"
    small = h.shrink(bad, prog, r)
    assert [s.op for s in small.steps] == ["dropout"] and small.ncalls == 1
    assert "F.dropout(v0, 0.3, True)" in small.render()


def test_counts_block_runs() -> None:
    """A variant that runs the block more often than allowed is reported."""
    def twice(e):
        h.run_autograd(e, e.block)
        return h.run_autograd(e, e.block)

    v = h.Variant("twice", twice, "autograd", max_runs=1)
    assert h.check(v, Program([Step("sin", (0,))], []))[0] == "runs"


def test_program_renders_and_runs() -> None:
    prog = generate(3)
    assert prog.render().startswith("def block(p, x, idx):")
    e = h.Env(prog)
    out = e.block(e.p, e.x, e.idx)
    assert torch.is_tensor(out[0]) and e.calls == 1


NEW_OPS = [op for op in OPS if op not in BASE_OPS]


def test_families_are_generated() -> None:
    """Every issue-36 family (and each of its ops) is drawn often: several times in the CI
    seeds, so in a 60 s run too; a program without a family has only the base ops."""
    fams = collections.Counter(generate(s).family for s in range(N_SEEDS))
    assert all(fams[f] >= 5 for f in FAMILIES), fams
    ops = {st.op for s in range(1000) for st in generate(s).steps}
    assert set(NEW_OPS) <= ops, set(NEW_OPS) - ops
    plain = [generate(s) for s in range(200)]
    assert all(st.op in BASE_OPS for p in plain if not p.family for st in p.steps)


@pytest.mark.parametrize("op", NEW_OPS)
def test_family_op_renders_and_runs(op: str) -> None:
    """Each family op renders and runs under plain autograd, and the harness runs it under
    ckptfx (exactness is the fuzz run's business: the library's fixes land separately)."""
    arity = OPS[op][0]
    prog = Program([Step("tanh", (0,)), Step(op, (1,) * arity, _step_args(op, random.Random(0))),
                    Step("sin", (2,))], [1], ncalls=2)
    e = h.Env(prog)
    assert torch.is_tensor(e.block(e.p, e.x, e.idx)[0])
    ref = h.outcome(h.REFS["two_pass"], prog)[0]
    assert not isinstance(ref, BaseException), h.kind_of(ref)
    for name in ("remat(default)", "vjp_split remat(dots_saveable)", "session checkpoint"):
        r = h.check(h.VARIANTS_BY_NAME[name], prog)
        assert r is None or r[0] != "invalid", r


def test_func_twice_family_runs() -> None:
    """Twice under torch.func.grad with the stage's outputs as aux: the reference has the
    value and the aux outputs (both calls' extra values)."""
    prog = Program([Step("dropout", (0,)), Step("matmul", (1,), "w0")], [1], ncalls=2, aux=True,
                   family="func_twice")
    got = h.outcome(h.REFS["func_grad"], prog)[0]
    assert not isinstance(got, BaseException), h.kind_of(got)
    assert len(got[0]) == 1 + 3  # value, y, and v1 of each call
    r = h.check(h.VARIANTS_BY_NAME["torch.func.grad remat(default)"], prog)
    assert r is None or r[0] != "invalid", r
    assert "aux=True" in prog.describe()
