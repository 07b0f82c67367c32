"""The differential program fuzzer, fixed seeds (CI budget).

Each seed is a random block program (see program.py) run under every variant in harness.py
and compared bitwise with plain autograd (or the same torch.func transform of the plain
function); block runs are counted. A failure that torch's own checkpoint shares is reported,
not failed; a documented known failure (known.py) must still fail (xfail strict). Longer
runs: ``CKPTFX_FUZZ_SECONDS=300 python -m tests.fuzz``.
"""

from __future__ import annotations

import os

import pytest
import torch

from . import harness as h
from .known import FIXED, KNOWN
from .program import Program, Step, generate
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
