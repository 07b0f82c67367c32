"""Residual reports: which tensors a function keeps between its forward and its backward.

``saved_residuals(fun, *args)`` runs ``fun`` once with gradients on (every floating-point
tensor argument made a leaf that requires grad, as ``jax.vjp`` differentiates with respect to
all arguments) and lists what the backward would keep: for a remat'd ``fun`` what its policy
keeps, for a plain ``fun`` what autograd keeps (with any remat'd blocks inside it reported
under their own policies). It answers "why did remat not reduce my memory?".
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import optree
import torch
from torch import nn

from ckptfx._format import human_bytes
from ckptfx.budget import planner
from ckptfx.func_path.call import modules_read_by
from ckptfx.policies.checks import name_check
from ckptfx.policies.named import everything_saveable
from ckptfx.policies.tracer_stack import tracer_stack as _stack
from ckptfx.recording.tracer import Tracer
from ckptfx.remat import RematOptions, call, unwrap

__all__ = ["Residual", "print_saved_residuals", "saved_residuals"]

_SHORT = {
    torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
    torch.uint8: "u8", torch.bool: "bool", torch.complex64: "c64", torch.complex128: "c128",
}


@dataclasses.dataclass(frozen=True)
class Residual:
    """One tensor kept for the backward, as listed by ``saved_residuals``.

    Example::

        r = ckptfx.saved_residuals(block, params, x)[0]
        print(r)              # f32[8,16] from the argument x
        r.kind, r.nbytes      # ('argument', 512)

    Attributes:
        shape, dtype, device: of the kept tensor.
        nbytes: its size (a view counts its own elements: views of one storage, listed
            once each, share their memory; ``print_saved_residuals``' total counts each
            storage once).
        name: the ``checkpoint_name`` it carries, or None.
        kind: ``"argument"`` (an input, a parameter or another tensor from outside the
            block: kept anyway), ``"saved"`` (kept by the policy) or ``"offloaded"`` (kept
            in host memory).
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
    return [r for r, _ in _residuals(fun, args, kwargs)[0]]


# One storage as kept: ("storage", its identity, its bytes); an offloaded residual's host
# copy is one copy of its whole storage, shared by the views of it the block saved
# (ckptfx.offload Rule 2): ("offloaded", the storage's identity, its bytes).
_Storage = tuple[str, int, int]


def _residuals(fun: Callable[..., Any], args: tuple, kwargs: dict
               ) -> tuple[list[tuple[Residual, _Storage]], list[planner.Note]]:
    """``saved_residuals``, each with the storage it keeps alive, and the memory-budget
    notes of the call they are listed from (what a budget chose, and why)."""
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
    planner.take_notes()  # notes of earlier calls are not this report's
    report = _report(target, options, args, kwargs)
    notes = planner.take_notes()
    if any(note.planned_now for note in notes):
        # A memory budget planned in that call (and kept nothing, ckptfx.budget Rule 1): run
        # again to list what later calls keep. The plan is told once: by the planning
        # call's notes, which say that the list is a later call's.
        _release(report)
        report = _report(target, options, args, kwargs)
        planner.take_notes()
    leaves = optree.tree_leaves((args, kwargs), none_is_leaf=True)
    modules = _modules(fun, target, leaves)
    outside = _outside_names(target, modules)
    out: list[tuple[Residual, _Storage]] = []
    seen: set[tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype]] = set()
    for tracer, kind, x, slot, version in report:
        if kind == "argument":
            x = _root_tensor(tracer, slot, x)
        storage = x.untyped_storage()
        # By the storage's identity, not its address: zero-size and meta storages all sit
        # at address 0.
        key = (storage._cdata, x.storage_offset(), tuple(x.shape), tuple(x.stride()),
               x.dtype)
        if key in seen:
            continue
        seen.add(key)
        name, source = _source(tracer, kind, x, slot, version, outside)
        nbytes = x.numel() * x.element_size()
        held: _Storage = ("offloaded" if kind == "offloaded" and x.device.type != "cpu"
                          else "storage", storage._cdata, storage.nbytes())
        out.append((Residual(tuple(x.shape), x.dtype, x.device, nbytes, name, kind, source),
                    held))
    _release(report)
    return out, notes


def _release(report: list[tuple[Any, ...]]) -> None:
    """A recorder keeps the list it reports into until its forward ends; one whose forward
    did not end (it raised) still does, and the list's tensors hold the call's graph, whose
    saved-tensor hooks hold the recorder: a cycle through autograd's C++ graph that gc cannot
    see. Cut it, or the report leaks its call (and the host buffers of what it offloaded)."""
    for entry in report:
        entry[0].report = None
    report.clear()


def _report(target: Callable[..., Any], options: RematOptions, args: tuple, kwargs: dict
            ) -> list[tuple[Any, ...]]:
    report: list[tuple[Any, ...]] = []
    outer, _stack.report = _stack.report, report
    try:
        with torch.enable_grad():
            # a check of its own: the report says which policy names match nothing, however
            # often the block ran before (remat warns once per function)
            call(target, options, args, kwargs, names=name_check(options.policy))
    finally:
        _stack.report = outer
    return report


def print_saved_residuals(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Print ``saved_residuals`` one per line, then the total bytes; for blocks under a
    ``memory_budget``, first what the budget chose and why (bytes kept, FLOPs recomputed).

    Example::

        >>> ckptfx.print_saved_residuals(ckptfx.remat(layer, policy=cp.dots_saveable), h)
        f32[2,8,32] from the argument hidden_states
        f32[32,32] from the parameter self_attn.q_proj.weight
        f32[16,64] output of aten.mm at modeling_llama.py:164 (forward)
        total: 3 residuals, 10.0 KiB (4.0 KiB beyond the arguments)

    The total is memory: a storage that several listed views share counts once (their
    lines after the first say so), and whole, but for an argument's, which counts what is
    listed of it. When the policy offloads, a last line says
    that under torch.compile those values stay on the device instead.
    """
    listed, notes = _residuals(fun, args, kwargs)
    for note in notes:
        print(note.text)
    first_line: dict[_Storage, int] = {}  # storage -> the line that listed it first
    for line, (r, storage) in enumerate(listed, 1):
        shared = first_line.setdefault(storage, line)
        print(r if shared == line else f"{r} (same storage as line {shared})")
    # Memory, not the sum of the lines: a storage the block's residuals keep counts once,
    # and whole (a view keeps all of its storage alive). An argument's storage is the
    # caller's, kept anyway, and may be far bigger than what the block reads of it (a
    # slice, one parameter of a flat buffer): it counts what is listed of it.
    arguments = {storage for r, storage in listed if r.kind == "argument"}
    total = extra = 0
    for storage in first_line:
        if storage in arguments:
            total += min(storage[2], sum(r.nbytes for r, s in listed if s == storage))
        else:
            total += storage[2]
            extra += storage[2]
    if any(r.kind == "offloaded" and r.device.type == "cpu" for r, _ in listed):
        print("on the CPU, offloaded residuals stay where they are (host memory already): "
              "they take the memory they would if kept")
    if any(r.kind == "offloaded" for r, _ in listed):
        # torch's compiled checkpoint offloads only when asked (see ckptfx.lowering, Rule 4)
        print("offloaded residuals stay in device memory when the block runs inside "
              "torch.compile, unless it was compiled inside ckptfx.offload_in_compile()")
    n, storages = len(listed), len(first_line)
    print(f"total: {n} residual{'s' * (n != 1)}"
          + (f" in {storages} storage{'s' * (storages != 1)}" if storages != n else "")
          + f", {human_bytes(total)} ({human_bytes(extra)} beyond the arguments)")


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


def _modules(fun: Callable[..., Any], target: Callable[..., Any], leaves: list[Any]
             ) -> list[nn.Module]:
    """The modules the reported function can read parameters from: those of ``fun`` (the
    remat'd wrapper) and of the function it wraps (a module, a bound method, or a
    ``functools.partial`` binding the module, as Hugging Face passes its layers)."""
    found = [*modules_read_by(fun, leaves), *modules_read_by(target, leaves)]
    while isinstance(target, functools.partial):
        bound = optree.tree_leaves((target.args, target.keywords),
                                   none_is_leaf=True)
        target = target.func
        found += modules_read_by(target, bound)
        found += [m for m in bound if isinstance(m, nn.Module)]
    unique: list[nn.Module] = []
    for m in found:
        if not any(m is u for u in unique):
            unique.append(m)
    return unique


def _outside_names(target: Callable[..., Any], modules: list[nn.Module]) -> dict[int, str]:
    """How to name each tensor the block reads without it being an argument, by identity:
    ``the parameter self_attn.q_proj.weight`` (qualified from the outermost module), ``the
    argument position_embeddings[0]`` (bound by ``functools.partial``), ``the closure
    variable w``."""
    names: dict[int, str] = {}

    def add(t: Any, name: str) -> None:
        if isinstance(t, torch.Tensor):
            names.setdefault(id(t), name)

    for m in modules:
        for name, p in m.named_parameters():
            add(p, f"the parameter {name}")
        for name, b in m.named_buffers():
            add(b, f"the buffer {name}")
    fn: Any = target
    while isinstance(fn, functools.partial):
        for key, value in fn.keywords.items():
            paths, leaves, _ = optree.tree_flatten_with_path(value, none_is_leaf=True)
            for path, leaf in zip(paths, leaves):
                add(leaf, "the argument " + key + "".join(f"[{k!r}]" for k in path))
        fn = fn.func
    code = getattr(fn, "__code__", None)
    for var, cell in zip(getattr(code, "co_freevars", ()), getattr(fn, "__closure__", None) or ()):
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        paths, leaves, _ = optree.tree_flatten_with_path(value, none_is_leaf=True)
        for path, leaf in zip(paths, leaves):
            add(leaf, "the closure variable " + var + "".join(f"[{k!r}]" for k in path))
    return names


def _source(tracer: Tracer, kind: str, x: torch.Tensor, slot: int, version: int,
            outside: dict[int, str]) -> tuple[str | None, str]:
    seg = tracer.seg
    fn = tracer.frame.fn
    where = getattr(fn, "__qualname__", "block")
    if kind == "argument":
        if slot in seg.input_slots and tracer.input_names:
            return None, f"from the argument {tracer.input_names[seg.input_slots.index(slot)]}"
        t = seg.outside.get(slot, (x, 0))[0]
        name = outside.get(id(t))
        inner = getattr(fn, "__ckptfx_fun__", fn)
        if name is None and isinstance(inner, functools.partial):
            # bound to the block's own function (Hugging Face's layers pass their keyword
            # arguments to checkpointing in a functools.partial)
            name = _outside_names(inner, []).get(id(t))
        if name is not None:
            return None, f"from {name}"
        return None, (f"from a tensor that {where} reads from outside: not an argument, a "
                      "closure variable, or a parameter or buffer of its module (a global?)")
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

