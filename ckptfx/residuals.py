"""Residual reports: which tensors a function keeps between its forward and its backward.

``saved_residuals(fun, *args)`` runs ``fun`` once with gradients on (every floating-point
tensor argument made a leaf that requires grad, as ``jax.vjp`` differentiates with respect to
all arguments) and lists what the backward would keep: for a remat'd ``fun`` what its policy
keeps, for a plain ``fun`` what autograd keeps (with any remat'd blocks inside it reported
under their own policies). It answers "why did remat not reduce my memory?".
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import optree
import torch
from torch import nn

from .func import modules_read_by
from .policies import everything_saveable
from .remat import RematOptions, call, unwrap
from ._tracers import tracer_stack as _stack
from .trace import Tracer

__all__ = ["Residual", "print_saved_residuals", "saved_residuals"]

_SHORT = {
    torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
    torch.uint8: "u8", torch.bool: "bool", torch.complex64: "c64", torch.complex128: "c128",
}


@dataclasses.dataclass(frozen=True)
class Residual:
    """One tensor kept for the backward.

    Attributes:
        shape, dtype, device: of the kept tensor.
        nbytes: its size (a view counts its own elements).
        name: the ``checkpoint_name`` it carries, or None.
        kind: ``"argument"`` (an input or parameter, kept anyway), ``"saved"`` (kept by the
            policy) or ``"offloaded"`` (kept in host memory).
        source: where it came from, for a person: ``from the argument params['w1']``,
            ``output of aten.mm at model.py:12 (block)``, ``named 'attn' at model.py:20 (block)``.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    nbytes: int
    name: str | None
    kind: str
    source: str

    def __str__(self) -> str:
        dtype = _SHORT.get(self.dtype, str(self.dtype).replace("torch.", ""))
        return f"{dtype}[{','.join(map(str, self.shape))}] {self.source}"


def saved_residuals(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Residual]:
    """The tensors ``fun(*args, **kwargs)`` keeps between forward and backward.

    Example::

        >>> for r in ckptfx.saved_residuals(block, params, x):
        ...     print(r)
        f32[8,16] from the argument x
        f32[16,32] from the argument params['w1']
        f32[8,32] output of aten.mm at model.py:12 (block)
    """
    if not callable(fun):
        raise TypeError(f"fun must be callable, got {type(fun).__name__}")
    args, kwargs = optree.tree_map(_as_leaf, (args, kwargs), none_is_leaf=True)
    inner = unwrap(fun)
    owner = getattr(fun, "__self__", None)
    if inner is not None and owner is not None:  # a remat'd method, bound
        args = (owner, *args)
    if inner is None:
        inner = (fun, RematOptions(everything_saveable, True, (), frozenset()))
    target, options = inner
    report: list[tuple[Any, ...]] = []
    outer, _stack.report = _stack.report, report
    try:
        with torch.enable_grad():
            call(target, options, args, kwargs)
    finally:
        _stack.report = outer
    modules = modules_read_by(fun, optree.tree_leaves((args, kwargs), none_is_leaf=True))
    out: list[Residual] = []
    seen: set[tuple[int, int, tuple[int, ...], tuple[int, ...]]] = set()
    for tracer, kind, x, slot, version in report:
        if kind == "argument":
            x = _root_tensor(tracer, slot, x)
        key = (x.untyped_storage().data_ptr(), x.storage_offset(), tuple(x.shape),
               tuple(x.stride()))
        if key in seen:
            continue
        seen.add(key)
        name, source = _source(tracer, kind, x, slot, version, modules)
        out.append(Residual(tuple(x.shape), x.dtype, x.device, x.numel() * x.element_size(),
                            name, kind, source))
    return out


def print_saved_residuals(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Print ``saved_residuals`` one per line, then the total bytes (and, when the policy
    offloads, that torch.compile keeps those values on the device instead)."""
    residuals = saved_residuals(fun, *args, **kwargs)
    for r in residuals:
        print(r)
    total = sum(r.nbytes for r in residuals)
    extra = sum(r.nbytes for r in residuals if r.kind != "argument")
    if any(r.kind == "offloaded" for r in residuals):
        # torch's compiled checkpoint cannot offload (see ckptfx._compile, Rule 4)
        print("offloaded residuals stay in device memory when the block runs inside "
              "torch.compile")
    print(f"total: {len(residuals)} residuals, {_bytes(total)} "
          f"({_bytes(extra)} beyond the arguments)")


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _as_leaf(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and not x.requires_grad and (
            x.is_floating_point() or x.is_complex()):
        return x.detach().requires_grad_()
    return x


def _root_tensor(tracer: Tracer, slot: int, x: torch.Tensor) -> torch.Tensor:
    """The input or parameter an argument residual is (a view of)."""
    seg = tracer.seg
    if slot in seg.outside:
        return seg.outside[slot][0]
    if slot in seg.input_slots:
        return tracer.frame.inputs[seg.input_slots.index(slot)].unpack()
    return x


def _outside_name(t: torch.Tensor, modules: list[nn.Module]) -> str | None:
    for m in modules:
        for name, p in (*m.named_parameters(), *m.named_buffers()):
            if p is t:
                return name
    return None


def _source(tracer: Tracer, kind: str, x: torch.Tensor, slot: int, version: int,
            modules: list[nn.Module]) -> tuple[str | None, str]:
    seg = tracer.seg
    fn = tracer.frame.fn
    where = getattr(fn, "__qualname__", "block")
    if kind == "argument":
        if slot in seg.input_slots and tracer.input_names:
            return None, f"from the argument {tracer.input_names[seg.input_slots.index(slot)]}"
        t = seg.outside.get(slot, (x, 0))[0]
        name = _outside_name(t, modules)
        if name is not None:
            return None, f"from the parameter {name}"
        return None, f"from a tensor {where} read from outside its arguments"
    suffix = " (offloaded to host)" if kind == "offloaded" else ""
    named = tracer.names.get(slot)
    if named is not None:
        name, site = named
        return name, f"named {name!r} at {site}{suffix}"
    op_index = seg.writers[seg.base[slot]][version - 1] if version else seg.producer[slot]
    op = seg.ops[op_index]
    # A view of a kept value is reported as the value it views.
    while op.func._schema.returns and any(
            r.alias_info is not None and not r.alias_info.is_write for r in op.func._schema.returns
    ) and op.inputs:
        src_slot = op.inputs[0][1]
        if seg.producer[src_slot] < 0:
            break
        if src_slot in tracer.names:
            name, site = tracer.names[src_slot]
            return name, f"named {name!r} at {site}{suffix}"
        op = seg.ops[seg.producer[src_slot]]
    return None, f"output of {op.func.overloadpacket} at {op.site}{suffix}"

