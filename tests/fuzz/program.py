"""Random block programs: representation, generator, Python rendering.

A program is a list of steps over a pool of float values of shape (B, D). ``v0`` is the
block's input ``x``; step k writes ``v{k+1}``. A step is an op from ``OPS`` and indices into
the pool (``srcs``) plus op choices (``arg``: a parameter name, a checkpoint name, ...). The
block is rendered as Python source, so the program that runs is the program that is printed
(the shrinker prints exactly what failed).

Block signature: ``block(p, x, idx)`` with ``p`` a dict of weights, ``idx`` a long tensor of
row indices; closures (``cw`` a weight that requires grad, ``buf`` a buffer, ``gen`` an
explicit generator, ``keep``/``count`` for retained gradients and hook calls, the modules
``lstm``/``lstm2``/``gru``/``emb`` when the program calls them) come from the namespace the
source is executed in. The block returns a tuple ``(y, *extra)``: ``y`` the last value,
``extra`` earlier values and integer outputs. A *stage* calls the block ``ncalls`` times,
feeding ``y`` back (shared weights across calls).

A seed's base program is drawn from ``BASE_OPS`` exactly as before the issue-36 families;
a second stream of the seed then adds a family (``FAMILIES``, with probability
``FAMILY_WEIGHT``): RNG state changed inside the block, a custom op drawing in its kernel,
numpy writes to an intermediate, retain_grad and tensor hooks, two calls under torch.func
with aux, recurrent modules, sparse embedding gradients.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import torch
import torch.nn.functional as F

import ckptfx

from . import custom_ops  # noqa: F401  (registers ckptfx_fuzz::fused_dropout)

B, D = 4, 8
PARAMS = ("w0", "w1", "w2", "b0")  # w*: (D, D); b0: (D,)
NAMES = ("n0", "n1", "n2")

# op -> (arity, template). Sources are a, b, c; {w} a weight expression, {n} a name.
# A template is one or more lines; the last assigns ``out``. ``ints`` collects integer outputs.
OPS: dict[str, tuple[int, str]] = {
    # elementwise
    "sin": (1, "out = torch.sin(a)"),
    "tanh": (1, "out = torch.tanh(a)"),
    "relu": (1, "out = torch.relu(a)"),
    "gelu": (1, "out = F.gelu(a)"),
    "silu": (1, "out = F.silu(a)"),
    "sigmoid": (1, "out = torch.sigmoid(a)"),
    "leaky": (1, "out = torch.where(a > 0, a, a * 0.1)"),
    "clamp": (1, "out = a.clamp(-1.0, 1.0) * 1.5"),
    "rsqrt": (1, "out = a * torch.rsqrt(a * a + 1.0)"),
    "scale": (1, "out = a * 0.75 + 0.25"),
    "add": (2, "out = a + b"),
    "mul": (2, "out = a * b"),
    "sub_div": (2, "out = (a - b) / (b.abs() + 1.0)"),
    "maximum": (2, "out = torch.maximum(a, b)"),
    "addcmul": (3, "out = torch.addcmul(a, b, c, value=0.5)"),
    # reductions / normalisation
    "softmax": (1, "out = torch.softmax(a, -1)"),
    "log_softmax": (1, "out = F.log_softmax(a, -1)"),
    "layer_norm": (1, "out = F.layer_norm(a, (D,), p['b0'], None)"),
    "center": (1, "out = a - a.mean(-1, keepdim=True)"),
    "norm": (1, "out = a / (a.norm(dim=-1, keepdim=True) + 1.0)"),
    "cumsum": (1, "out = a.cumsum(-1) * 0.1"),
    "logsumexp": (2, "out = b - a.logsumexp(-1, keepdim=True)"),
    # dots
    "matmul": (1, "out = a @ {w}"),
    "linear": (1, "out = F.linear(a, {w}, p['b0'])"),
    "closure_mm": (1, "out = a @ cw"),
    "bmm": (1, "out = torch.bmm(a.view(2, B // 2, D), {w}.expand(2, D, D)).view(B, D)"),
    "attn": (2, "out = torch.softmax(a @ b.t() * 0.3, -1) @ b"),
    "matmul3d": (1, "out = (a.reshape(2, B // 2, D) @ {w}).reshape(B, D)"),
    "sdpa": (3, "out = F.scaled_dot_product_attention(a.view(1, B, D), b.view(1, B, D), "
                "c.view(1, B, D)).view(B, D)"),
    "sdpa_causal": (2, "out = F.scaled_dot_product_attention(a.view(1, 2, B // 2, D), "
                       "b.view(1, 2, B // 2, D), b.view(1, 2, B // 2, D), is_causal=True)"
                       ".reshape(B, D)"),
    # views
    "t_noncontig": (1, "out = a.t().contiguous().t() * 1.0"),
    "t_view": (1, "out = torch.sin(a.t()).t()"),
    "slice_cat": (2, "out = torch.cat([a, b], 0)[1::2]"),
    "half_cat": (2, "out = torch.cat([a[:, : D // 2], b[:, D // 2 :]], -1)"),
    "reshape": (1, "out = a.reshape(2, -1).flip(0).reshape(B, D)"),
    "transpose3d": (1, "out = a.view(2, B // 2, D).transpose(0, 1).reshape(B, D)"),
    "expand_sum": (1, "out = a.unsqueeze(0).expand(3, B, D).sum(0)"),
    "chunk": (1, "c0, c1 = a.chunk(2, -1)\nout = torch.cat([c1 * c0, c0], -1)"),
    "roll": (1, "out = a.roll(1, -1) + a.flip(0)"),
    # in-place on intermediates
    "add_": (2, "out = a * 1.0\nout.add_(b)"),
    "mul_view_": (1, "out = a.clone()\nout[:, : D // 2].mul_(2.0)"),
    "relu_": (1, "out = a.exp() * 0.5\nout.relu_()"),
    "sigmoid_": (1, "out = a * 2.0\nout.sigmoid_()"),
    "clamp_": (1, "out = a + 0.0\nout.clamp_(-0.5, 0.5)"),
    "masked_fill_": (2, "out = a * 1.0\nout.masked_fill_(b > 0.5, 0.0)"),
    "index_add_": (2, "out = a * 1.0\nout.index_add_(0, idx, b.to(out.dtype))"),
    "mm_add_": (1, "out = a.reshape(2, B // 2, D) @ {w}\nout.add_(0.5)\nout = out.reshape(B, D)"),
    "t_add_": (2, "out = a.t() * 1.0\nout.add_(b.t())\nout = out.t()"),
    # random
    "dropout": (1, "out = F.dropout(a, 0.3, True)"),
    "dropout_t": (1, "out = F.dropout(a.t(), 0.5, True).t()"),
    "rand_like": (1, "out = a + torch.rand_like(a) * 0.1"),
    "randn": (1, "out = a + torch.randn(B, D, dtype=a.dtype) * 0.1"),
    "bernoulli": (1, "out = a * torch.bernoulli(torch.full_like(a, 0.5))"),
    "rrelu": (1, "out = F.rrelu(a, training=True)"),
    "gen_randn": (1, "out = a + torch.randn(B, D, generator=gen) * 0.1"),
    "sdpa_dropout": (2, "out = F.scaled_dot_product_attention(a.view(1, B, D), b.view(1, B, D), "
                        "b.view(1, B, D), dropout_p=0.3).view(B, D)"),
    # integer tensors
    "index_rows": (1, "out = a[idx] * 1.0"),
    "index_select": (1, "out = a.index_select(0, idx.flip(0))"),
    "gather": (1, "k = a.argsort(-1)\nout = a.gather(-1, k) + a"),
    "embed": (1, "out = a + {w}[idx]"),
    "argmax_out": (1, "ints.append(a.argmax(-1))\nout = a * 1.0"),
    "count_out": (1, "ints.append((a > 0).sum(-1))\nout = a + 0.0"),
    # buffers and kept factory values
    "buffer": (1, "out = (a - buf) * 1.0"),
    "empty_like": (1, "out = torch.empty_like(a)\nout.copy_(torch.tanh(a))"),
    "zeros_index_add": (2, "out = torch.zeros_like(a).index_add_(0, idx, b.to(a.dtype)) + a"),
    # names
    "name": (1, "out = ckptfx.checkpoint_name(a, {n})"),
}

# The ops the base generator picks from (uniformly, as before the families were added: a seed
# that draws no family generates the program it always did).
BASE_OPS: tuple[str, ...] = tuple(OPS)

# Program families (issue 36), each added to a program by ``add_family``; {k} is an integer
# (a seed) kept in the step's ``arg``. Closures: ``gen`` (explicit generator), ``keep`` (marks a
# tensor whose ``.grad`` is compared), ``count`` (a tensor hook counting its calls), modules
# ``lstm``, ``lstm2``, ``gru``, ``emb`` (made per run when the program uses them).
OPS.update({
    # 1. RNG state changed inside the block
    "seed_dropout": (1, "torch.manual_seed({k})\nout = F.dropout(a, 0.3, True)"),
    "rng_restore": (1, "st = torch.get_rng_state()\nout = F.dropout(a, 0.3, True)\n"
                       "torch.set_rng_state(st)\nout = out + F.dropout(a, 0.3, True) * 0.5"),
    "fork_seed": (1, "with torch.random.fork_rng(devices=[]):\n    torch.manual_seed({k})\n"
                     "    out = F.dropout(a, 0.3, True)"),
    "gen_seed": (1, "gen.manual_seed({k})\nout = a + torch.randn(B, D, generator=gen) * 0.1"),
    "gen_seed_restore": (1, "gen.manual_seed({k})\ngs = gen.get_state()\n"
                            "r = torch.rand(B, D, generator=gen)\ngen.set_state(gs)\n"
                            "out = a * (torch.rand(B, D, generator=gen) > 0.3) + r"),
    "gen_restore": (1, "gs = gen.get_state()\nr = torch.rand(B, D, generator=gen)\n"
                       "gen.set_state(gs)\nout = a * (torch.rand(B, D, generator=gen) > 0.3) + r"),
    # 2. a custom op whose kernel draws (custom_ops.py)
    "fused_dropout": (1, "y, m = torch.ops.ckptfx_fuzz.fused_dropout(a, 0.3)\n"
                         "out = y + a * m * 0.1"),
    # 3. an intermediate written outside the dispatcher (numpy), before or after a use saves it
    "np_poke": (1, "out = a.float() * 1.0\nout.detach().numpy()[0, 0] = 5.0\nout = torch.sin(out)"),
    "np_imul": (1, "out = a.float() * 1.0\narr = out.detach().numpy()\narr *= 2\n"
                   "out = out * out"),
    "np_from_": (1, "out = a.float() * 1.0\ntorch.from_numpy(out.detach().numpy()).mul_(0.5)\n"
                    "out = torch.sin(out)"),
    "np_poke_after": (1, "out = a.float() * 1.0\ns = torch.sin(out)\n"
                         "out.detach().numpy()[:, 0] = 5.0\nout = s"),
    # 4. retain_grad and tensor hooks on intermediates (on the weight path)
    "retain": (1, "out = a @ {w}\nout.retain_grad()\nkeep(out)\nout = torch.sin(out)"),
    "hook_scale": (1, "out = a @ {w}\nout.register_hook(lambda g: g * 0.5)\nout = torch.tanh(out)"),
    "hook_count": (1, "out = a @ {w}\nout.register_hook(count)\nout = torch.tanh(out)"),
    # 6. recurrent modules (batch_first, batch 2 x sequence B // 2)
    "lstm": (1, "out = lstm(a.reshape(2, B // 2, D))[0].reshape(B, D)"),
    "lstm2": (1, "out = lstm2(a.reshape(2, B // 2, D))[0].reshape(B, D)"),  # 2 layers, dropout
    "gru": (1, "out = gru(a.reshape(2, B // 2, D))[0].reshape(B, D)"),
    "gru_h0": (2, "out = gru(a.reshape(2, B // 2, D), b[:2].unsqueeze(0).to(a.dtype))[0]"
                  ".reshape(B, D)"),
    # 7. sparse gradients (nn.Embedding(sparse=True), its weight a parameter of the split)
    "embed_sparse": (1, "out = a + emb(idx)"),
    "embed_sparse2": (2, "out = a * emb(idx.flip(0)) + b"),
})

# family -> the ops it inserts (func_twice: a program-level shape, see add_family)
FAMILIES: dict[str, tuple[str, ...]] = {
    "rng_state": ("seed_dropout", "rng_restore", "fork_seed", "gen_seed", "gen_seed_restore",
                  "gen_restore"),
    "custom_op": ("fused_dropout",),
    "numpy_write": ("np_poke", "np_imul", "np_from_", "np_poke_after"),
    "hooks": ("retain", "hook_scale", "hook_count"),
    "func_twice": ("dropout", "rand_like", "bernoulli", "seed_dropout", "matmul"),
    "recurrent": ("lstm", "lstm2", "gru", "gru_h0"),
    "sparse": ("embed_sparse", "embed_sparse2"),
}
# Probability that a seed's program gets a family (drawn from its own stream, so the base
# program is unchanged): 0.45 / 7 families is about 6% of programs each, a dozen or more per
# family in a 60 s run.
FAMILY_WEIGHT = 0.45

# closure modules: name -> the ops that call it
MODULE_OPS = {"lstm": ("lstm",), "lstm2": ("lstm2",), "gru": ("gru", "gru_h0"),
              "emb": ("embed_sparse", "embed_sparse2")}

# Ops where torch's own checkpoint is known to differ; used only to pick classification.
RANDOM_OPS = {"dropout", "dropout_t", "rand_like", "randn", "bernoulli", "rrelu", "gen_randn",
              "sdpa_dropout", "seed_dropout", "rng_restore", "fork_seed", "gen_seed",
              "gen_seed_restore", "gen_restore", "fused_dropout", "lstm2"}


@dataclasses.dataclass
class Step:
    op: str
    srcs: tuple[int, ...]
    arg: str = ""


@dataclasses.dataclass
class Program:
    steps: list[Step]
    extra: list[int]  # pool indices returned besides the last value
    ncalls: int = 1
    bf16: bool = False
    seed: int = 0  # RNG seed of each run
    aux: bool = False  # torch.func.grad runs return the stage's outputs as aux (has_aux=True)
    family: str = ""  # the issue-36 family added to the program (a label, for reports)

    def render(self) -> str:
        """The block as Python source."""
        lines = ["def block(p, x, idx):", "    ints = []", "    v0 = x"]
        for k, s in enumerate(self.steps):
            _, tmpl = OPS[s.op]
            names = dict(zip("abc", (f"v{i}" for i in s.srcs)))
            body = tmpl.format(w=f"p[{s.arg!r}]" if s.op != "name" else "", n=repr(s.arg),
                               k=s.arg)
            for ln in body.split("\n"):
                for var, v in names.items():
                    ln = _subst(ln, var, v)
                ln = _subst(ln, "out", f"v{k + 1}")
                lines.append("    " + ln)
        last = f"v{len(self.steps)}"
        extra = "".join(f"v{i}, " for i in self.extra)
        lines.append(f"    return ({last}, {extra}*ints)")
        return "\n".join(lines) + "\n"

    def describe(self) -> str:
        more = "".join(f" {f}={getattr(self, f)!r}" for f in ("aux", "family")
                       if getattr(self, f))
        return (f"# ncalls={self.ncalls} bf16={self.bf16} seed={self.seed}{more}\n"
                + self.render())

    def insert(self, j: int, op: str, srcs: tuple[int, ...], arg: str = "") -> "Program":
        """The program with a step before step j (``srcs`` index values up to v{j}); the next
        step reads the new value where it read v{j}, so the new step is on the path."""
        assert all(i <= j for i in srcs)

        def remap(i: int) -> int:
            return i + 1 if i > j else i

        steps = [Step(s.op, tuple(remap(i) for i in s.srcs), s.arg) for s in self.steps]
        if j < len(steps):
            nxt = steps[j]
            steps[j] = Step(nxt.op, tuple(j + 1 if i == j else i for i in nxt.srcs), nxt.arg)
        steps.insert(j, Step(op, srcs, arg))
        return dataclasses.replace(self, steps=steps, extra=[remap(i) for i in self.extra])

    def modules(self) -> list[str]:
        """The closure modules the program calls."""
        ops = {s.op for s in self.steps}
        return [m for m, users in MODULE_OPS.items() if ops & set(users)]

    def remove(self, j: int) -> "Program | None":
        """The program without step j (its uses read its first source instead)."""
        if not self.steps:
            return None
        keep = self.steps[j].srcs[0]

        def remap(i: int) -> int:
            if i == j + 1:
                return keep
            return i - 1 if i > j + 1 else i

        steps = [Step(s.op, tuple(remap(i) for i in s.srcs), s.arg)
                 for k, s in enumerate(self.steps) if k != j]
        extra = sorted({remap(i) for i in self.extra} - {len(steps)})
        return dataclasses.replace(self, steps=steps, extra=extra)


def _subst(line: str, var: str, new: str) -> str:
    import re

    return re.sub(rf"\b{var}\b", new, line)


def generate(seed: int, max_steps: int = 10) -> Program:
    rng = random.Random(seed)
    n = rng.randint(1, max_steps)
    ops = list(BASE_OPS)
    steps: list[Step] = []
    for k in range(n):
        op = rng.choice(ops)
        arity, tmpl = OPS[op]
        # mostly chain on recent values, sometimes reach back (values used several times)
        srcs = tuple(max(0, k - rng.choice((0, 0, 0, 1, 2, k))) for _ in range(arity))
        arg = ""
        if "{w}" in tmpl:
            arg = rng.choice(PARAMS[:3])
        elif op == "name":
            arg = rng.choice(NAMES)
        steps.append(Step(op, srcs, arg))
    extra = sorted({rng.randrange(1, n + 1) for _ in range(rng.choice((0, 0, 1, 2)))} - {n})
    prog = Program(steps, extra, ncalls=rng.choice((1, 1, 2)), bf16=rng.random() < 0.3,
                   seed=rng.randrange(2**31))
    frng = random.Random(f"ckptfx-fuzz-family:{seed}")  # its own stream: the base is unchanged
    if frng.random() < FAMILY_WEIGHT:
        prog = add_family(prog, frng.choice(list(FAMILIES)), frng)
    return prog


def _step_args(op: str, rng: random.Random) -> str:
    tmpl = OPS[op][1]
    if "{w}" in tmpl:
        return rng.choice(PARAMS[:3])
    if "{k}" in tmpl:
        return str(rng.randrange(1000))
    if op == "name":
        return rng.choice(NAMES)
    return ""


def add_family(prog: Program, family: str, rng: random.Random) -> Program:
    """``prog`` with one or two steps of ``family`` inserted at random places, each read by a
    later step or returned (func_twice: besides, the stage calls the block twice, feeding its
    output back, and torch.func.grad runs return the outputs as aux)."""
    if family == "func_twice":
        prog = dataclasses.replace(prog, ncalls=2, aux=True)
    for _ in range(rng.choice((1, 1, 2))):
        op = rng.choice(FAMILIES[family])
        j = rng.randint(0, len(prog.steps))
        srcs = tuple(rng.choice((j, j, rng.randint(0, j))) for _ in range(OPS[op][0]))
        prog = prog.insert(j, op, srcs, _step_args(op, rng))
        if j + 1 < len(prog.steps) and all(j + 1 not in s.srcs for s in prog.steps[j + 1:]):
            prog.extra = sorted({*prog.extra, j + 1})  # unread: returned, so it is on the path
    return dataclasses.replace(prog, family=family)


class Env:
    """Inputs and closures of one program run: fresh each time (gradients never leak between
    variants)."""

    def __init__(self, prog: Program) -> None:
        g = torch.Generator().manual_seed(1234)
        self.p = {f"w{i}": (torch.randn(D, D, generator=g) / D**0.5).requires_grad_()
                  for i in range(3)}
        self.p["b0"] = (torch.randn(D, generator=g) * 0.1).requires_grad_()
        self.x = torch.randn(B, D, generator=g).requires_grad_()
        self.idx = torch.randint(0, B, (B,), generator=g)
        self.cw = (torch.randn(D, D, generator=g) / D**0.5).requires_grad_()
        self.buf = torch.randn(B, D, generator=g) * 0.1
        self.gen = torch.Generator()
        self.cot = torch.randn(B, D, generator=g)
        self.prog = prog
        self.kept: list[torch.Tensor] = []  # intermediates whose .grad is compared
        self.hooked: list[int] = []  # calls of the counting tensor hook
        self.mods = {name: _module(name) for name in prog.modules()}
        ns: dict[str, Any] = {"torch": torch, "F": F, "ckptfx": ckptfx, "B": B, "D": D,
                              "cw": self.cw, "buf": self.buf, "gen": self.gen,
                              "keep": self._keep, "count": self._count, **self.mods}
        exec(compile(prog.render(), "<fuzz program>", "exec"), ns)
        self.calls = 0
        raw = ns["block"]

        def block(p, x, idx):
            self.calls += 1
            return raw(p, x, idx)

        self.block = block

    def _keep(self, t: torch.Tensor) -> None:
        """Compare ``t.grad`` after the run: only the forward's tensors (the stage's first
        ``ncalls`` runs of the block; a replay that runs the Python again keeps nothing)."""
        if self.calls <= self.prog.ncalls:
            self.kept.append(t)

    def _count(self, grad: torch.Tensor) -> None:
        self.hooked.append(1)

    def reseed(self) -> None:
        torch.manual_seed(self.prog.seed)
        self.gen.manual_seed(self.prog.seed + 1)
        self.kept.clear()
        self.hooked.clear()

    def closure_leaves(self) -> list[torch.Tensor]:
        """Weights the block reads from its namespace: ``cw`` and the modules' parameters."""
        return [self.cw, *(q for m in self.mods.values() for q in m.parameters())]

    def leaves(self) -> list[torch.Tensor]:
        return [self.x, *self.p.values(), *self.closure_leaves()]

    def state(self) -> list[torch.Tensor]:
        """What a run leaves behind besides outputs and gradients: the caller's RNG (global
        and explicit generator), the buffer, the ``.grad`` of retained intermediates, the
        counting hook's calls."""
        return [torch.get_rng_state(), self.gen.get_state(), self.buf.clone(),
                *(t.grad for t in self.kept), torch.tensor(len(self.hooked))]


def _module(name: str) -> torch.nn.Module:
    """A closure module with fixed weights (its own generator: the other inputs are as
    before)."""
    mod = {"lstm": lambda: torch.nn.LSTM(D, D, batch_first=True),
           "lstm2": lambda: torch.nn.LSTM(D, D, num_layers=2, dropout=0.25, batch_first=True),
           "gru": lambda: torch.nn.GRU(D, D, batch_first=True),
           "emb": lambda: torch.nn.Embedding(B + 2, D, sparse=True)}[name]()
    g = torch.Generator().manual_seed(4321)
    with torch.no_grad():
        for q in mod.parameters():
            q.copy_(torch.randn(q.shape, generator=g) * 0.3)
    return mod
