"""Variants, references, comparison, classification against torch's checkpoint, shrinking.

Every variant runs a program's stage on fresh inputs (``Env``) after reseeding the global and
the explicit generator, and returns ``(outs, grads)`` in the layout of its reference; the
comparison is ``torch.equal`` (NaN equals NaN) on every output, every gradient and what the
run leaves behind (``Env.state``: the caller's RNG, the buffer, retained ``.grad``s, tensor
hook calls), plus a bound on how many times the block's Python ran (``Env.calls``). Sparse
gradients compare by layout, then coalesced indices and values.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import warnings
from typing import Any, Callable

import torch
import torch.utils.checkpoint as tcp
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import ckptfx
from ckptfx import checkpoint_policies as cp
from ckptfx.policies import Offload, decide

from .program import Env, Program

POLICIES: dict[str, Any] = {
    "default": None,
    "nothing_saveable": cp.nothing_saveable,
    "everything_saveable": cp.everything_saveable,
    "dots_saveable": cp.dots_saveable,
    "dots_no_batch": cp.dots_with_no_batch_dims_saveable,
    "only_names": cp.save_only_these_names("n0", "n2"),
    "all_names_but": cp.save_any_names_but_these("n1"),
    "both": cp.save_from_both_policies(cp.dots_saveable, cp.save_only_these_names("n0")),
    "offload_names": cp.save_and_offload_only_these_names(
        names_which_can_be_saved=["n0"], names_which_can_be_offloaded=["n1", "n2"]),
    "offload_dots": cp.offload_dot_with_no_batch_dims(offload_dst="cpu"),
}

_sid = itertools.count()


class Mismatch(Exception):
    """A variant's outputs or gradients are not bitwise the reference's."""


class TooManyRuns(Exception):
    """The block's Python ran more often than the variant allows."""


def autocast(prog: Program):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=prog.bf16)


def stage(fn: Callable[..., Any], prog: Program) -> Callable[..., list]:
    def run(p, x, idx):
        y, collected = x, []
        for _ in range(prog.ncalls):
            r = fn(p, y, idx)
            y = r[0]
            collected.extend(r[1:])
        return [y, *collected]
    return run


def floats(outs: list) -> list[torch.Tensor]:
    return [o for o in outs if o.is_floating_point() and o.requires_grad]


def cots(e: Env, outs: list) -> list[torch.Tensor]:
    return [e.cot.to(o.dtype) for o in floats(outs)]


def loss_of(e: Env, outs: list) -> torch.Tensor:
    return sum(((o.float() * e.cot).sum() for o in outs if o.is_floating_point()),
               torch.zeros(()))


def zeros_for_none(gs, leaves) -> list[torch.Tensor]:
    return [torch.zeros_like(t) if g is None else g for g, t in zip(gs, leaves)]


def det(outs) -> list:
    return [o.detach() for o in outs]


# ---------------------------------------------------------------- wrappers of the block
def wrap_ckpt(e: Env, early_stop: bool = True, context_fn=None):
    kw = {} if context_fn is None else {"context_fn": context_fn}
    return lambda p, x, idx: ckptfx.checkpoint(e.block, p, x, idx, early_stop=early_stop, **kw)


def wrap_remat(e: Env, policy: str, early_stop: bool = True):
    return ckptfx.remat(e.block, policy=POLICIES[policy], early_stop=early_stop)


def torch_policy(policy: Any):
    """A ckptfx policy as a torch SAC policy function (offload -> save)."""
    if policy is None:
        return lambda ctx, op, *a, **k: CheckpointPolicy.PREFER_RECOMPUTE

    def fn(ctx, op, *a, **k):
        d = decide(policy(ctx, op, *a, **k), op)
        if d is False:
            return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if isinstance(d, Offload) or d is True else d
    return fn


def sac_context(policy: Any):
    return functools.partial(create_selective_checkpoint_contexts, torch_policy(policy))


# ---------------------------------------------------------------- run shapes
def run_autograd(e: Env, wrapped) -> tuple[list, list]:
    """Forward under autocast, backward with fixed cotangents; grads of every leaf."""
    e.reseed()
    with autocast(e.prog):
        outs = stage(wrapped, e.prog)(e.p, e.x, e.idx)
        gs = torch.autograd.grad(floats(outs), e.leaves(), cots(e, outs), allow_unused=True)
    return det(outs), list(gs)


def run_two_pass(e: Env, wrapped) -> tuple[list, list]:
    """dx (retain) then dw, two plain backward calls: the reference of the session variants
    (a tensor hook on the way to both runs in each call, as it does in plain autograd)."""
    e.reseed()
    with autocast(e.prog):
        outs = stage(wrapped, e.prog)(e.p, e.x, e.idx)
        fo, co = floats(outs), cots(e, outs)
        dx = torch.autograd.grad(fo, [e.x], co, retain_graph=True, allow_unused=True)
        dw = torch.autograd.grad(fo, e.leaves()[1:], co, allow_unused=True)
    return det(outs), [*dx, *dw]


def run_session(e: Env, wrapped) -> tuple[list, list]:
    """Collector + prefire + dx (retain) + dw (last consumer) under one recompute session."""
    e.reseed()
    sid = ("fuzz", next(_sid))
    with autocast(e.prog):
        with ckptfx.recompute_handle_collector_ctx() as handles:
            outs = stage(wrapped, e.prog)(e.p, e.x, e.idx)
        fo, co = floats(outs), cots(e, outs)
        try:
            for h in handles:
                ckptfx.recompute_handle(h, sid)
            with ckptfx.recompute_session_ctx(sid, retain_on_unpack=True):
                dx = torch.autograd.grad(fo, [e.x], co, retain_graph=True, allow_unused=True)
            with ckptfx.recompute_session_ctx(sid, retain_on_unpack=False):
                dw = torch.autograd.grad(fo, e.leaves()[1:], co, allow_unused=True)
        finally:
            ckptfx.clear_recompute_session(sid)
    return det(outs), [*dx, *dw]


def run_later_call(e: Env, wrapped) -> tuple[list, list]:
    """A remat'd function's later call: a first forward + backward teaches it the block
    (ckptfx.recording.unrecorded: a block that keeps nothing runs unrecorded from then on), then the run
    that counts (its block runs only)."""
    run_autograd(e, wrapped)
    e.calls = 0
    return run_autograd(e, wrapped)


def run_vjp_split(e: Env, wrapped) -> tuple[list, list]:
    e.reseed()
    with autocast(e.prog):
        out, dx_fn, dw_fn = ckptfx.vjp_split(stage(wrapped, e.prog), e.p, e.x, e.idx,
                                             x_argnums=1, params=e.closure_leaves())
        ct = [e.cot.to(o.dtype) if o.is_floating_point() else None for o in out]
        dx = dx_fn(ct)
        dw_p, _ = dw_fn()
    closure = [torch.zeros_like(q) if q.grad is None else q.grad for q in e.closure_leaves()]
    return det(out), [dx, *dw_p.values(), *closure]


def ref_vjp_split(e: Env) -> tuple[list, list]:
    outs, gs = run_autograd(e, e.block)
    return outs, zeros_for_none(gs, e.leaves())


def run_grad_split(e: Env, wrapped) -> tuple[list, list]:
    e.reseed()
    fn = stage(wrapped, e.prog)
    sid = ("fuzz-gs", next(_sid))
    with autocast(e.prog):
        dx_fn, dw_fn = ckptfx.grad_split(lambda p, x, idx: loss_of(e, fn(p, x, idx)),
                                         x_argnums=1)
        value, dx = dx_fn(e.p, e.x, session=sid, idx=e.idx)
        dw = dw_fn(sid)
    return [value.detach()], zeros_for_none([dx, *dw.values()], _inputs(e))


def _inputs(e: Env) -> list[torch.Tensor]:
    return [e.x, *e.p.values()]


def ref_grad_split(e: Env) -> tuple[list, list]:
    e.reseed()
    with autocast(e.prog):
        loss = loss_of(e, stage(e.block, e.prog)(e.p, e.x, e.idx))
        gs = torch.autograd.grad(loss, _inputs(e), allow_unused=True)
    return [loss.detach()], zeros_for_none(gs, _inputs(e))


def _func_inputs(e: Env):
    p = {k: v.detach() for k, v in e.p.items()}
    return p, e.x.detach()


def run_func_grad(e: Env, wrapped) -> tuple[list, list]:
    e.reseed()
    fn = stage(wrapped, e.prog)
    p, x = _func_inputs(e)
    with autocast(e.prog):
        if e.prog.aux:  # the stage's outputs come back as aux
            def f(p, x):
                outs = fn(p, x, e.idx)
                return loss_of(e, outs), outs
            g, (value, aux) = torch.func.grad_and_value(f, argnums=(0, 1), has_aux=True)(p, x)
            return [value.detach(), *det(aux)], [*g[0].values(), g[1]]
        g, value = torch.func.grad_and_value(
            lambda p, x: loss_of(e, fn(p, x, e.idx)), argnums=(0, 1))(p, x)
    return [value.detach()], [*g[0].values(), g[1]]


def run_func_jvp(e: Env, wrapped) -> tuple[list, list]:
    e.reseed()
    fn = stage(wrapped, e.prog)
    p, x = _func_inputs(e)
    g = torch.Generator().manual_seed(99)
    tp = {k: torch.randn(v.shape, generator=g) for k, v in p.items()}
    tx = torch.randn(x.shape, generator=g)
    with autocast(e.prog):
        outs, touts = torch.func.jvp(lambda p, x: fn(p, x, e.idx), (p, x), (tp, tx))
    return det(outs), [None if t is None else t.detach() for t in touts]


# ---------------------------------------------------------------- the variant table
class Variant:
    def __init__(self, name: str, run: Callable[[Env], tuple[list, list]], ref: str,
                 max_runs: int = 2, torch_analog: Callable[[Env], tuple[list, list]] | None = None,
                 exact_runs: bool = False):
        self.name, self.run, self.ref, self.max_runs = name, run, ref, max_runs
        self.torch_analog, self.exact_runs = torch_analog, exact_runs


def _torch_ckpt(early_stop: bool = True, policy: Any = "none", two_pass: bool = False):
    def analog(e: Env):
        kw = {} if policy == "none" else {"context_fn": sac_context(policy)}
        wrapped = lambda p, x, idx: tcp.checkpoint(e.block, p, x, idx, use_reentrant=False, **kw)  # noqa: E731
        with tcp.set_checkpoint_early_stop(early_stop):
            return (run_two_pass if two_pass else run_autograd)(e, wrapped)
    return analog


REFS: dict[str, Callable[[Env], tuple[list, list]]] = {
    "autograd": lambda e: run_autograd(e, e.block),
    "vjp": ref_vjp_split,
    "two_pass": lambda e: run_two_pass(e, e.block),
    "loss": ref_grad_split,
    "func_grad": lambda e: run_func_grad(e, e.block),
    "func_jvp": lambda e: run_func_jvp(e, e.block),
}


def build_variants() -> list[Variant]:
    V: list[Variant] = []
    for es in (True, False):
        V.append(Variant(f"checkpoint(early_stop={es})",
                         lambda e, es=es: run_autograd(e, wrap_ckpt(e, es)), "autograd",
                         torch_analog=_torch_ckpt(es)))
    V.append(Variant("checkpoint(context_fn=SAC dots)",
                     lambda e: run_autograd(e, wrap_ckpt(e, context_fn=sac_context(cp.dots_saveable))),
                     "autograd", torch_analog=_torch_ckpt(True, cp.dots_saveable)))
    for name, pol in POLICIES.items():
        V.append(Variant(f"remat({name})", lambda e, n=name: run_autograd(e, wrap_remat(e, n)),
                         "autograd", torch_analog=_torch_ckpt(True, pol)))
    V.append(Variant("remat(nothing_saveable, early_stop=False)",
                     lambda e: run_autograd(e, wrap_remat(e, "nothing_saveable", False)),
                     "autograd", torch_analog=_torch_ckpt(False, cp.nothing_saveable)))
    V.append(Variant("remat(default), a later call",
                     lambda e: run_later_call(e, wrap_remat(e, "default")),
                     "autograd", torch_analog=_torch_ckpt(True, None)))
    V.append(Variant("checkpoint(remat(dots_saveable))",
                     lambda e: run_autograd(e, lambda p, x, i: ckptfx.checkpoint(
                         wrap_remat(e, "dots_saveable"), p, x, i)),
                     "autograd", max_runs=3, torch_analog=_torch_ckpt()))
    V.append(Variant("remat(dots_saveable)(checkpoint)",
                     lambda e: run_autograd(e, ckptfx.remat(
                         lambda p, x, i: ckptfx.checkpoint(e.block, p, x, i),
                         policy=cp.dots_saveable)),
                     "autograd", max_runs=3, torch_analog=_torch_ckpt()))
    V.append(Variant("session checkpoint", lambda e: run_session(e, wrap_ckpt(e)), "two_pass",
                     torch_analog=_torch_ckpt(two_pass=True)))
    for pol in ("default", "dots_saveable", "only_names"):
        V.append(Variant(f"session remat({pol})", lambda e, pol=pol: run_session(e, wrap_remat(e, pol)),
                         "two_pass", torch_analog=_torch_ckpt(True, POLICIES[pol], two_pass=True)))
    V.append(Variant("vjp_split checkpoint", lambda e: run_vjp_split(e, wrap_ckpt(e)), "vjp",
                     torch_analog=_torch_ckpt()))
    V.append(Variant("vjp_split remat(dots_saveable)",
                     lambda e: run_vjp_split(e, wrap_remat(e, "dots_saveable")), "vjp",
                     torch_analog=_torch_ckpt(True, cp.dots_saveable)))
    V.append(Variant("grad_split checkpoint", lambda e: run_grad_split(e, wrap_ckpt(e)), "loss",
                     torch_analog=_torch_ckpt()))
    V.append(Variant("grad_split remat(default)",
                     lambda e: run_grad_split(e, wrap_remat(e, "default")), "loss",
                     torch_analog=_torch_ckpt(True, None)))
    for pol in ("default", "dots_saveable", "everything_saveable", "only_names"):
        V.append(Variant(f"torch.func.grad remat({pol})",
                         lambda e, pol=pol: run_func_grad(e, wrap_remat(e, pol)), "func_grad"))
    for pol in ("default", "dots_saveable"):
        V.append(Variant(f"torch.func.jvp remat({pol})",
                         lambda e, pol=pol: run_func_jvp(e, wrap_remat(e, pol)), "func_jvp",
                         max_runs=1, exact_runs=True))
    return V


VARIANTS = build_variants()
VARIANTS_BY_NAME = {v.name: v for v in VARIANTS}


# ---------------------------------------------------------------- comparison
def _eq(u: torch.Tensor | None, v: torch.Tensor | None) -> bool:
    if u is None or v is None:
        return u is None and v is None
    if u.dtype != v.dtype or u.shape != v.shape or u.layout != v.layout:
        return False
    if u.is_sparse:
        u, v = u.coalesce(), v.coalesce()
        return torch.equal(u.indices(), v.indices()) and _eq(u.values(), v.values())
    if u.is_floating_point():
        nu, nv = torch.isnan(u), torch.isnan(v)
        return torch.equal(nu, nv) and torch.equal(u.masked_fill(nu, 0), v.masked_fill(nv, 0))
    return torch.equal(u, v)


def compare(got: tuple[list, ...], ref: tuple[list, ...]) -> str | None:
    """None when bitwise equal, else what differs (outputs, gradients, then ``Env.state``)."""
    for what, a, b in zip(("output", "gradient", "state"), got, ref):
        if len(a) != len(b):
            return f"{what}s: {len(a)} vs {len(b)} tensors"
        for i, (u, v) in enumerate(zip(a, b)):
            if not _eq(u, v):
                name = f"{what} {i}" + (f" ({_state_name(i, len(a))})" if what == "state" else "")
                if u is None or v is None:
                    return f"{name}: {'None' if u is None else 'tensor'} vs " \
                           f"{'None' if v is None else 'tensor'}"
                if what == "state" and not 2 < i < len(a) - 1:  # not a retained .grad
                    return f"{name} differs"
                diff = ((u.double() - v.double()).abs().max().item()
                        if u.shape == v.shape and u.layout == v.layout == torch.strided
                        else f"{u.layout} vs {v.layout}" if u.layout != v.layout else "shape")
                return f"{name} differs (max abs diff {diff}, {u.dtype} vs {v.dtype})"
    return None


def _state_name(i: int, n: int) -> str:
    names = {0: "the caller's RNG state afterwards", 1: "the explicit generator's state afterwards",
             2: "the buffer", n - 1: "the counting hook's calls"}
    return names.get(i, f"the .grad of retained intermediate {i - 3}")


def outcome(fn: Callable[[Env], tuple[list, list]], prog: Program) -> tuple[Any, int]:
    """((outputs, gradients, state) or the exception raised, block runs)."""
    e = Env(prog)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            outs, grads = fn(e)
            return (outs, grads, e.state()), e.calls
    except Exception as ex:  # noqa: BLE001 - the fuzzer records every failure
        return ex, e.calls


def kind_of(ex: BaseException) -> str:
    msg = str(ex).strip().split("\n")[0]
    return f"{type(ex).__name__}: {msg[:160]}"


_ref_cache: dict[tuple[int, str], Any] = {}


def reference(prog: Program, ref: str) -> Any:
    key = (id(prog), ref)
    if key not in _ref_cache:
        if len(_ref_cache) > 64:
            _ref_cache.clear()
        _ref_cache[key] = (prog, outcome(REFS[ref], prog)[0])
    return _ref_cache[key][1]


def check(variant: Variant, prog: Program) -> tuple[str, str] | None:
    """None if the variant agrees with its reference, else (category, detail); category is
    'wrong' (a mismatch), 'error' (it raised where the reference did not), 'runs' (block
    ran too often) or 'invalid' (the reference itself raised: not a program)."""
    ref = reference(prog, variant.ref)
    if isinstance(ref, BaseException):
        return "invalid", kind_of(ref)
    got, calls = outcome(variant.run, prog)
    if isinstance(got, BaseException):
        return "error", kind_of(got)
    diff = compare(got, ref)
    if diff is not None:
        return "wrong", diff
    n = prog.ncalls
    limit = variant.max_runs * n
    if calls > limit or (variant.exact_runs and calls != limit) or calls < n:
        return "runs", f"block ran {calls} times for {n} call(s) (allowed {limit})"
    return None


def same_failure(a: tuple[str, str] | None, b: tuple[str, str] | None) -> bool:
    if a is None or b is None:
        return a is b
    if a[0] != b[0]:
        return False
    if a[0] == "error":
        return a[1].split(":")[0] == b[1].split(":")[0]
    return what_differs(a[1]) == what_differs(b[1])


def what_differs(detail: str) -> str:
    """Of a 'wrong' detail: 'values' (outputs or gradients) or the named ``Env.state`` entry
    (a retained .grad, the hook calls, the RNG afterwards...)."""
    if detail.startswith("state"):
        return detail[detail.find("("):detail.find(")") + 1] or "state count"
    return "values"


def torch_failure(variant: Variant, prog: Program) -> tuple[str, str] | None:
    """How torch's own checkpoint fares on the same program (None: exact, or no analog)."""
    if variant.torch_analog is None:
        return None
    ref = reference(prog, "autograd")
    got, _ = outcome(variant.torch_analog, prog)
    if isinstance(got, BaseException):
        return "error", kind_of(got)
    diff = compare(got, ref)
    return None if diff is None else ("wrong", diff)


# What torch's checkpoint is known to get wrong; the fuzzer names the limit it hit.
SHARED_LIMITS = {
    "gen_randn": "explicit torch.Generator under checkpoint: the replay draws new numbers",
}
SHARED_LIMITS["gen_restore"] = SHARED_LIMITS["gen_randn"]
# ops that draw from the explicit generator at the state it has when the replay runs
GENERATOR_DRAWS = {"gen_randn", "gen_restore"}


def generator_limit_applies(variant: Variant, prog: Program, detail: str = "") -> bool:
    """An explicit generator under a variant that runs torch's kind of checkpoint (it has a
    torch analog): the replay draws new numbers, so a wrong result is the shared limit even
    where torch's own replay happened to draw values that left the gradient unchanged (the
    draw order of two replays can differ between the two kernels). Not for a difference in
    hooks or retained gradients: new numbers do not explain those."""
    return (variant.torch_analog is not None and bool(GENERATOR_DRAWS & {s.op for s in prog.steps})
            and what_differs(detail) in ("values", "(the explicit generator's state afterwards)"))


def describe_shared(prog: Program) -> str:
    ops = {s.op for s in prog.steps}
    hits = [msg for op, msg in SHARED_LIMITS.items() if op in ops]
    return hits[0] if hits else "torch's checkpoint fails this program the same way"


def shrink(variant: Variant, prog: Program, failure: tuple[str, str],
           budget: int = 150) -> Program:
    """Remove steps (and simplify flags) while the variant fails the same way."""
    tries = 0

    def still(p: Program) -> bool:
        nonlocal tries
        tries += 1
        return same_failure(check(variant, p), failure)

    changed = True
    while changed and tries < budget:
        changed = False
        for cand in (
            [dataclasses.replace(prog, extra=[])] if prog.extra else []
        ) + ([dataclasses.replace(prog, ncalls=1)] if prog.ncalls > 1 else []) + (
            [dataclasses.replace(prog, bf16=False)] if prog.bf16 else []
        ) + ([dataclasses.replace(prog, aux=False)] if prog.aux else []):
            if tries < budget and still(cand):
                prog, changed = cand, True
        for j in reversed(range(len(prog.steps))):
            if len(prog.steps) <= 1 or tries >= budget or j >= len(prog.steps):
                continue
            cand = prog.remove(j)
            if cand is not None and still(cand):
                prog, changed = cand, True
    return prog


@contextlib.contextmanager
def quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
