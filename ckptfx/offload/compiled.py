"""``offload_in_compile``: torch's partitioner moves what remat policies offload inside
``torch.compile``d graphs (``ckptfx.lowering``, Rule 4, says where this fits).

Rules

1. Nothing changes torch's config but an open ``offload_in_compile``: it patches
   ``torch._functorch.config`` with torch's own ``config.patch`` (per thread, as torch's
   config is) and puts every key back on exit, exception or not. Bad arguments raise before
   anything is patched.
2. The answer the compiled policy gives and the partitioner's settings come from one place,
   torch's config (``offloading_in_compile``): they cannot disagree.
3. The joint-graph pass (``_OffloadMarks``) turns each ``*_CPU_OFFLOAD`` tag into ``MUST_SAVE``
   (never recomputed, as outside the opt-in) and marks ``should_offload`` only where the
   partitioner can move the value: not a view, a getitem or a non-contiguous value (warned
   once per kind), and not a host value where the side stream's ops would need an
   accelerator. The pass the user had set runs first.
4. Values and gradients are those of the graph without the opt-in, bit for bit: only where
   a saved value lives between forward and backward changes.
"""

from __future__ import annotations

import contextlib
import math
import operator
import threading
import warnings
from typing import Any, Callable

import torch
import torch._functorch.config as _functorch_config
from torch.utils.checkpoint import CheckpointPolicy

from ckptfx.kernel.frame import CheckpointError

__all__ = ["CompileOffloadWarning", "offload_in_compile", "offloading_in_compile"]


class CompileOffloadWarning(UserWarning):
    """A remat policy asked to offload a value to host memory inside a ``torch.compile``d
    graph that keeps it in device memory instead: compiled outside ``offload_in_compile``
    (an ``Offload`` on an accelerator, once per process), or a value torch's partitioner
    does not move (a view, a non-contiguous value, an output of a multi-output op; once per
    process and kind).

    Example::

        import warnings
        warnings.simplefilter("error", ckptfx.CompileOffloadWarning)  # refuse instead
    """


_OFFLOAD_ANSWERS = frozenset(p for p in CheckpointPolicy if p.name.endswith("CPU_OFFLOAD"))
# torch's partitioner offload (private, torch 2.13): the keys offload_in_compile patches
_OFFLOAD_KEYS = ("enable_activation_offloading", "activation_offload_separate_stream",
                 "activation_offload_sink_wait", "activation_reload_prefetch",
                 "activation_offload_cpu_gpu_bw", "joint_custom_pass")
_kept_warned: set[str] = set()  # the kinds of value warned about (each once per process)


def offloading_in_compile() -> bool:
    """Whether compilations on this thread lower offloads now: ``offload_in_compile`` (or a
    ``config.patch`` with its pass) is open. Read from torch's config itself, so the policy's
    answer and the partitioner's settings cannot disagree."""
    return (bool(getattr(_functorch_config, "enable_activation_offloading", False))
            and isinstance(getattr(_functorch_config, "joint_custom_pass", None),
                           _OffloadMarks))


def _not_offloadable(node: torch.fx.Node) -> str | None:
    """Why torch's partitioner would not move ``node``'s value (its ``can_offload``; a graph
    output is the one case only the partitioner knows), or None."""
    if node.target is operator.getitem:
        return "an output of a multi-output op"
    if isinstance(node.target, torch._ops.OpOverload) and node.target.is_view:
        return "a view"  # every aliasing op, not only the partitioner's list: no copy of a base
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and not val.is_contiguous():
        return "a non-contiguous tensor"
    return None


def _warn_kept(node: torch.fx.Node, why: str) -> None:
    if why in _kept_warned:
        return
    _kept_warned.add(why)
    warnings.warn(
        f"ckptfx.offload_in_compile: the policy offloads the output of "
        f"{node.target}, {why}, which torch's partitioner does not move to the host: where "
        "the backward reads it, it stays in device memory. Offload the op that makes it "
        "(or a contiguous copy: a checkpoint_name'd value is one). (Warned once per process "
        "for each kind of value.)",
        CompileOffloadWarning,
        stacklevel=2,
    )


class _OffloadMarks:
    """``offload_in_compile``'s joint-graph pass (torch calls it before partitioning): each
    node tagged ``*_CPU_OFFLOAD`` becomes ``MUST_SAVE`` (as outside the opt-in: never
    recomputed) and, where the partitioner can move it, ``should_offload``. The pass that
    was set before runs first (``then``), so both see the graph the partitioner gets."""

    __slots__ = ("host_values", "then")

    def __init__(self, host_values: bool, then: Callable[..., Any] | None) -> None:
        self.host_values = host_values  # mark values already on the CPU (device_put mode)
        self.then = then

    def __call__(self, gm: torch.fx.GraphModule, joint_inputs: Any) -> torch.fx.GraphModule:
        if callable(self.then):
            gm = self.then(gm, joint_inputs)
        for node in gm.graph.nodes:
            if node.meta.get("recompute") not in _OFFLOAD_ANSWERS:
                continue
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            val = node.meta.get("val")
            why = _not_offloadable(node)
            if why is not None:
                if node.users:
                    _warn_kept(node, why)
            elif (isinstance(val, torch.Tensor)
                  and (val.device.type != "cpu" or self.host_values)):
                node.meta["should_offload"] = True
        return gm


class _OffloadInCompile(contextlib.ContextDecorator):
    """What ``offload_in_compile`` returns: each ``with`` patches torch's config for its
    duration and restores it on the way out, exception or not."""

    def __init__(self, changes: dict[str, Any]) -> None:
        self.changes = changes
        self.open = threading.local()  # .patches: one per open ``with`` on this thread

    def _patches(self) -> list[Any]:
        if not hasattr(self.open, "patches"):
            self.open.patches = []
        return self.open.patches

    def __enter__(self) -> None:
        before: Callable[..., Any] | None = _functorch_config.joint_custom_pass
        if isinstance(before, _OffloadMarks):  # nested opt-ins: one pass, the outer's chain
            before = before.then
        host_values = not self.changes["activation_offload_separate_stream"]
        patch = _functorch_config.patch(
            {**self.changes, "joint_custom_pass": _OffloadMarks(host_values, before)})
        patch.__enter__()
        self._patches().append(patch)

    def __exit__(self, *exc: Any) -> None:
        self._patches().pop().__exit__(*exc)


def offload_in_compile(*, separate_stream: bool = True, sink_wait: bool = False,
                       prefetch: bool = False,
                       bandwidth_gbps: float | None = None) -> _OffloadInCompile:
    """Have ``torch.compile`` offload what remat policies offload: the graphs compiled inside
    this context move the values a policy answers ``Offload`` for (and torch's
    ``*_CPU_OFFLOAD`` answers) to host memory in the forward and back in the backward, with
    torch's partitioner offload (a private torch 2.13 feature). Outside it they stay in
    device memory, with a ``CompileOffloadWarning`` (``ckptfx.lowering``, Rule 4).

    torch compiles at a function's first call, so open the context around that call, or
    around the whole loop (a new input shape compiles again, and a graph compiled outside
    keeps its values on the device). It patches ``torch._functorch.config`` (the keys
    ``enable_activation_offloading``, ``activation_offload_*``, ``activation_reload_prefetch``
    and ``joint_custom_pass``, whose earlier value still runs, before ckptfx's pass) with
    torch's ``config.patch`` and puts every key back on exit, also when the body raises.
    torch's config is per thread: compilations on other threads are not affected. Backends
    that run AOT autograd lower it (``aot_eager``, ``inductor``); dynamo's ``eager`` backend
    keeps the values on the device.

    The partitioner moves only the values the backward reads that are not views, outputs of
    multi-output ops, non-contiguous or graph outputs; the others stay on the device (a
    ``CompileOffloadWarning`` names the first three kinds). A value already in host memory
    stays where it is, and one under ``Offload.min_bytes`` on the device, as in eager remat.
    Where the host copy lives is torch's choice (pinned memory with ``separate_stream``,
    pageable without), not ``Offload.dst``; ``Offload.prefetch`` is the eager path's.

    Args:
        separate_stream: copy on a side stream (torch's ``ao.offload``/``ao.reload``), else
            with a plain ``device_put`` on the compute stream. Needs an accelerator with
            streams; values on the CPU are then left out (there the copy would fail).
        sink_wait: let the forward run on while the copies finish: the waits move to the
            end of each forward graph, which holds the device copies until then (good for
            per-block compiles, no saving for a whole-model graph). Needs ``separate_stream``.
        prefetch: start each reload early enough in the backward to hide it behind compute;
            where is chosen from op times measured while compiling, so the backward graph's
            order (never its values) can differ between runs. Needs ``separate_stream``, and
            CUDA: torch 2.13 times the ops with ``torch.cuda`` (elsewhere its compile fails).
        bandwidth_gbps: the host-device bandwidth (GB/s) prefetch plans with (torch's
            default, 50, if None). Needs ``prefetch``.

    Example::

        policy = ckptfx.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=["attn"], names_which_can_be_offloaded=["mlp"])
        model = torch.compile(Model(block=ckptfx.remat(block, policy=policy)))
        with ckptfx.offload_in_compile():    # prefetch=True too, on CUDA
            for batch in loader:              # the first step compiles: "mlp" values go
                model(batch).sum().backward() # to the host, "attn" ones stay
    """
    for name, flag in (("separate_stream", separate_stream), ("sink_wait", sink_wait),
                       ("prefetch", prefetch)):
        if not isinstance(flag, bool):
            raise TypeError(f"offload_in_compile: {name} must be a bool, got "
                            f"{type(flag).__name__}")
    if (sink_wait or prefetch) and not separate_stream:
        raise ValueError("offload_in_compile: sink_wait and prefetch move the side stream's "
                         "waits and reloads: they need separate_stream=True")
    if bandwidth_gbps is not None:
        if isinstance(bandwidth_gbps, bool) or not isinstance(bandwidth_gbps, (int, float)):
            raise TypeError(f"offload_in_compile: bandwidth_gbps must be a number (GB/s) or "
                            f"None, got {type(bandwidth_gbps).__name__}")
        if not (math.isfinite(bandwidth_gbps) and bandwidth_gbps > 0):
            raise ValueError(f"offload_in_compile: bandwidth_gbps must be a positive finite "
                             f"number of GB/s, got {bandwidth_gbps!r}")
        if not prefetch:
            raise ValueError("offload_in_compile: bandwidth_gbps is read by prefetch only: "
                             "pass prefetch=True")
    if prefetch and not torch.cuda.is_available():
        raise ValueError("offload_in_compile: prefetch=True needs CUDA: torch 2.13 plans the "
                         "reloads by timing ops with torch.cuda (on another accelerator its "
                         "compile fails); leave prefetch=False, or use sink_wait=True")
    missing = [k for k in _OFFLOAD_KEYS if not hasattr(_functorch_config, k)]
    if missing:
        raise CheckpointError(
            f"ckptfx.offload_in_compile needs torch's partitioner offload (torch "
            f"2.13): torch {torch.__version__} has no torch._functorch.config.{missing[0]}. "
            "Without it compiled graphs keep offloaded values in device memory.")
    changes: dict[str, Any] = {"enable_activation_offloading": True,
                               "activation_offload_separate_stream": separate_stream,
                               "activation_offload_sink_wait": sink_wait,
                               "activation_reload_prefetch": prefetch}
    if bandwidth_gbps is not None:
        changes["activation_offload_cpu_gpu_bw"] = float(bandwidth_gbps)
    return _OffloadInCompile(changes)
