"""Random block programs: representation, generator, Python rendering.

A program is a list of steps over a pool of float values of shape (B, D). ``v0`` is the
block's input ``x``; step k writes ``v{k+1}``. A step is an op from ``OPS`` and indices into
the pool (``srcs``) plus op choices (``arg``: a parameter name, a checkpoint name, ...). The
block is rendered as Python source, so the program that runs is the program that is printed
(the shrinker prints exactly what failed).

Block signature: ``block(p, x, idx)`` with ``p`` a dict of weights, ``idx`` a long tensor of
row indices; closures (``cw`` a weight that requires grad, ``buf`` a buffer, ``gen`` an
explicit generator) come from the namespace the source is executed in. The block returns a
tuple ``(y, *extra)``: ``y`` the last value, ``extra`` earlier values and integer outputs.
A *stage* calls the block ``ncalls`` times, feeding ``y`` back (shared weights across calls).
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import torch
import torch.nn.functional as F

import ckptfx

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

# Ops where torch's own checkpoint is known to differ; used only to pick classification.
RANDOM_OPS = {"dropout", "dropout_t", "rand_like", "randn", "bernoulli", "rrelu", "gen_randn",
              "sdpa_dropout"}


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

    def render(self) -> str:
        """The block as Python source."""
        lines = ["def block(p, x, idx):", "    ints = []", "    v0 = x"]
        for k, s in enumerate(self.steps):
            _, tmpl = OPS[s.op]
            names = dict(zip("abc", (f"v{i}" for i in s.srcs)))
            body = tmpl.format(w=f"p[{s.arg!r}]" if s.op != "name" else "", n=repr(s.arg))
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
        return (f"# ncalls={self.ncalls} bf16={self.bf16} seed={self.seed}\n" + self.render())

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
    ops = list(OPS)
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
    return Program(steps, extra, ncalls=rng.choice((1, 1, 2)), bf16=rng.random() < 0.3,
                   seed=rng.randrange(2**31))


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
        ns: dict[str, Any] = {"torch": torch, "F": F, "ckptfx": ckptfx, "B": B, "D": D,
                              "cw": self.cw, "buf": self.buf, "gen": self.gen}
        exec(compile(prog.render(), "<fuzz program>", "exec"), ns)
        self.calls = 0
        raw = ns["block"]

        def block(p, x, idx):
            self.calls += 1
            return raw(p, x, idx)

        self.block = block

    def reseed(self) -> None:
        torch.manual_seed(self.prog.seed)
        self.gen.manual_seed(self.prog.seed + 1)

    def leaves(self) -> list[torch.Tensor]:
        return [self.x, *self.p.values(), self.cw]
