"""ckptfx under ``torch.compile``: remat lowered to torch's checkpoint op with an equivalent
policy, ckptfx.checkpoint's context there, and the warnings where a compiled graph cannot do
what ckptfx's frames do (sessions, offload, policies over compiled code).

Rules

1. When dynamo traces a remat'd call, the call becomes
   ``torch.utils.checkpoint.checkpoint(fun, *args, use_reentrant=False, context_fn=...)``,
   which dynamo turns into its checkpoint higher-order op; the context is torch's
   selective-checkpoint context for a ``CompiledPolicy`` wrapping the block's policy, so the
   partitioner keeps what the policy keeps and recomputes the rest. ckptfx's recorder,
   frames and hooks never enter the graph (no graph break, nothing of ckptfx traced).
   ``policy=None`` (and ``nothing_saveable``) recomputes everything, as torch's plain
   checkpoint does. ``ckptfx.checkpoint`` under compile is the same op with the user's
   ``context_fn`` (or one that recomputes everything), wrapped as in Rule 1b.
1b. Random numbers: AOT autograd (aot_eager, inductor) traces the checkpoint op and the
   compiler replays its random ops. Dynamo's ``eager`` backend runs the op as torch's eager
   checkpoint with ``preserve_rng_state=False`` (torch 2.13), so a dropout mask would be
   drawn anew in the recomputation and the gradient silently wrong, also for torch's own
   checkpoint. The context made here sees that case (it is built outside any tracing) and
   has the recomputation start from the forward's CPU and accelerator generator states.
   Another limit of that eager run is torch's and is loud: its selective-checkpoint cache
   matches ops by call index, so under autocast a weight shared by two checkpointed blocks
   (whose cast the forward took from autocast's cache) is one more cast in the
   recomputation, a ``RuntimeError`` ("not found in storage"); aot_eager and inductor trace
   the casts and are exact.
2. ``CompiledPolicy`` answers in torch's terms: a keep is ``MUST_SAVE`` (the partitioner may
   not override it; it saves only what the backward reads, so a keep stays a permission),
   a recompute ``PREFER_RECOMPUTE``. Foreign (torch) policies' enum answers pass unchanged.
3. Names reach the compiled graph as the op ``ckptfx::checkpoint_name`` (policies/name_op.py); the
   compiled policy shows it to ckptfx's policies as ``checkpoint_name`` with ``name=``, as
   the eager recorder does. Foreign policies never see it (recomputed: a copy).
4. Offload. torch (2.13) tags a compiled checkpoint's nodes with the policy's answers, and
   its partitioner moves a saved value to the host only when its config enables offloading
   and the node is marked ``should_offload``; nothing in torch marks a ``*_CPU_OFFLOAD``
   tag. So ``CompiledPolicy`` answers an ``Offload`` (torch SAC's ``*_CPU_OFFLOAD`` answers
   are one) with ``MUST_CPU_OFFLOAD`` only where ``offload_in_compile``
   (``ckptfx.offload.compiled``) is open on the thread and torch is compiling; its
   joint-graph pass then makes each such tag ``MUST_SAVE`` and marks it, and the
   partitioner copies it out in the forward and back in the backward (on a side stream,
   ``separate_stream``, or with ``device_put``). The opt-in patches torch's config with
   torch's ``config.patch`` (restored exactly; per thread, as torch's config is) and runs
   the user's ``joint_custom_pass`` first; a graph keeps what it was compiled with, so the
   opt-in acts on the compilations (recompilations too) made inside it. Everywhere else an
   ``Offload`` is ``MUST_SAVE``, kept in device memory: outside the opt-in, on dynamo's
   ``eager`` backend (torch's eager checkpoint, run without tracing), under
   ``Offload.min_bytes`` (as eager remat keeps it), and for what the partitioner never
   moves (views, getitems, non-contiguous values, graph outputs). A value on an
   accelerator kept outside the opt-in gets one ``CompileOffloadWarning`` naming it; the
   pass warns once per kind about views, getitems and non-contiguous values. A value in
   host memory has nowhere to go: the side stream's ops need an accelerator, so there it is
   left as it is, and ``device_put`` to the CPU returns the tensor itself.
5. Sessions, prefire and ``vjp_split`` share one replay between backward calls through
   ckptfx's frames; a checkpoint lowered into a compiled graph has none (its recomputation
   is part of the graph's one backward node). When dynamo lowers a ckptfx checkpoint or
   remat while a collector or a session is open on the thread, and when ``vjp_split``
   meets a compiled region's backward with no ckptfx frame outside it, a
   ``CompiledReplayWarning`` names the cause and the order that works (compile each block,
   checkpoint it with ckptfx outside), once per process.
6. ``remat(f)`` of a compiled ``f`` (what ``torch.compile`` returns, or a module after
   ``module.compile()``) checkpoints the compiled call whole, as ``ckptfx.checkpoint``
   does: its inputs are kept and the replay runs its compiled code again, so values and
   gradients are those of the compiled code and sessions replay it once. The policy cannot
   see inside compiled code: a policy that keeps anything gets one
   ``CompiledBlockWarning`` (remat the uncompiled function and compile around it to apply
   it). A compiled function called *inside* a remat'd block runs eagerly, recorded like
   the rest of the block (torch does not compile under a dispatch mode).
7. Under compile remat does not check unused policy names (``UnusedNameWarning`` is an
   eager check: the first eager forward of the block makes it) and ``early_stop`` has no
   effect (torch's compiled checkpoint replays the graph the partitioner chose).
8. A recomputation that runs other ops than its forward (a Hugging Face decoder layer given
   its KV cache appends to it again) fails in torch's selective-checkpoint mode with an
   error that names neither cause nor fix; where the op runs eagerly (a graph break inside
   the block, as transformers' ``kernels`` layers make) it is re-raised as a
   ``CheckpointError`` that names the cache and the fix (``_MismatchNamed``).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, Callable

import torch
import torch.utils.checkpoint as _torch_checkpoint
from torch.utils.checkpoint import (
    CheckpointPolicy,
    create_selective_checkpoint_contexts,
)

from ckptfx import _compat
from ckptfx.kernel import replay_env
from ckptfx.kernel.forward import run_checkpointed
from ckptfx.kernel.frame import CheckpointError, tls
from ckptfx.kernel.handles import collecting
from ckptfx.offload.compiled import (CompileOffloadWarning, offload_in_compile,
                                    offloading_in_compile)
from ckptfx.policies.name_op import NAME_OP
from ckptfx.policies.named import NothingSaveable
from ckptfx.policies.names import checkpoint_name
from ckptfx.policies.protocol import Offload, Policy, call_policy, decide

__all__ = ["CompileOffloadWarning", "CompiledBlockWarning", "CompiledPolicy",
           "CompiledReplayWarning", "Lowered", "check_split_graph", "note_lowered",
           "offload_in_compile"]

# Keyword names torch's checkpoint takes for itself: a block keyword argument with one of
# these names is bound into the function instead of passed through.
_CHECKPOINT_KEYWORDS = frozenset({"use_reentrant", "context_fn", "determinism_check",
                                  "debug", "preserve_rng_state", "early_stop"})


class CompiledReplayWarning(UserWarning):
    """A checkpoint inside a ``torch.compile``d graph is used with recompute sessions,
    prefire or ``vjp_split``, which cannot share its replay between backward calls (the
    recomputation is part of the compiled graph's one backward node): each backward call
    that reads it recomputes it. Compile each block and checkpoint it with ckptfx outside
    (``ckptfx.checkpoint(torch.compile(block), x)``) for one replay per micro-batch.
    Issued once per process and cause.

    Example::

        # warns: the whole model is one graph around its checkpoints
        out, dx_fn, dw_fn = ckptfx.vjp_split(torch.compile(model), params, x)
        # one replay per block: compile each block, checkpoint it outside
        for block in model.blocks:
            block.compile()
            ckptfx.checkpoint_wrapper(block)
    """


_ORDER_THAT_WORKS = (
    "For one replay per block and micro-batch, compile each block and checkpoint the "
    "compiled block with ckptfx (the torchtitan order): "
    "ckptfx.checkpoint(torch.compile(block), x), or ckptfx.checkpoint_wrapper(block) after "
    "block.compile(). (Warned once per process.)"
)
_replay_warned: set[str] = set()  # the causes warned about (each once per process)


def _warn_replay(cause: str, message: str) -> None:
    if cause in _replay_warned:
        return
    _replay_warned.add(cause)
    warnings.warn(f"{message} {_ORDER_THAT_WORKS}", CompiledReplayWarning, stacklevel=3)


@_compat.run_at_trace_time
def note_lowered(what: str) -> bool:
    """Called by dynamo while it lowers ``what`` (a ckptfx checkpoint or remat) into a
    compiled graph: warn if a collector or a recompute session is open on this thread,
    whose frames this call will not join (Rule 5). Returns False (a constant)."""
    if collecting() or tls.activation is not None:
        _warn_replay(
            "lowered",
            f"ckptfx: torch.compile traced {what} inside a recompute_handle_collector_ctx or "
            "a recompute session: inside a compiled graph the call is torch's checkpoint, "
            "which gives no handle to prefire and whose recomputation runs again in every "
            "backward call that reads it (dx and each dw)."
        )
    return False


def check_split_graph(outputs: list[torch.Tensor], who: str) -> None:
    """Warn (Rule 5) if ``outputs`` were computed through a compiled region whose backward
    no ckptfx frame schedules: the input-gradient call runs all of it, weight gradients
    included, so nothing is left for the weight call to do later."""
    if _compat.any_node(outputs, _compat.is_compiled_backward_node):
        _warn_replay(
            "split",
            f"ckptfx.{who}: the outputs come from a torch.compile'd region with no "
            "ckptfx checkpoint outside it. Its backward is one autograd node, so the "
            "input-gradient call runs all of it, the weight gradients included, and the "
            "weight-gradient call only hands them out: the split defers no work (a "
            "zero-bubble schedule gains nothing). To split, compile each block and "
            "checkpoint around it (ckptfx.checkpoint(torch.compile(block), x))."
        )


def explain_donated_buffers(err: RuntimeError, who: str) -> None:
    """Raise ``CheckpointError`` with what to do if ``err`` is AOT autograd's refusal to run
    a compiled block's backward twice (its saved buffers were donated to its outputs when
    its first backward ran without ``retain_graph``); else return."""
    if _compat.is_donated_buffer_refusal(err):
        raise CheckpointError(
            f"ckptfx.{who}: a torch.compile'd block's backward was compiled with donated "
            "buffers (its first backward ran without retain_graph, e.g. a plain .backward() "
            "step), so it cannot run in the input-gradient call and again in the "
            "weight-gradient call. Set torch._functorch.config.donated_buffer = False before "
            "the block's first backward, or make its first backward a split one."
        ) from err


class CompiledBlockWarning(UserWarning):
    """``remat`` of a ``torch.compile``d function with a policy that keeps values: the
    policy cannot see the compiled code's ops, so the call is checkpointed whole (inputs
    kept, the compiled code replayed). Issued once per process.

    Example::

        fast = torch.compile(block)
        ckptfx.remat(fast, policy=cp.dots_saveable)(x)   # warns: the block is kept whole
        ckptfx.remat(block, policy=cp.dots_saveable)     # inside torch.compile(model): honoured
    """


_block_warned = [False]


def call_compiled(fun: Callable[..., Any], policy: Any, early_stop: bool,
                  args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """One eager call of ``remat(fun)`` for a compiled ``fun`` (Rule 6)."""
    if (policy is not None and not isinstance(policy, NothingSaveable)
            and torch.is_grad_enabled() and not _block_warned[0]):
        _block_warned[0] = True
        warnings.warn(
            f"ckptfx.remat: {getattr(fun, '__name__', type(fun).__name__)} is a "
            "torch.compile'd function, whose ops the policy cannot see: the call is "
            "checkpointed whole (its inputs kept, its compiled code replayed in the "
            "backward). To apply the policy, remat the uncompiled function and compile the "
            "model around it: torch.compile(model) with @ckptfx.remat(policy=...) blocks. "
            "(Warned once per process.)",
            CompiledBlockWarning,
            stacklevel=3,
        )
    return run_checkpointed(fun, args, kwargs, early_stop=early_stop)


_offload_warned = [False]


def _warn_offload(op: Any) -> None:
    if _offload_warned[0]:
        return
    _offload_warned[0] = True
    warnings.warn(
        f"ckptfx.remat under torch.compile: the policy offloads the output of {op} to host "
        "memory, which this compiled graph keeps in device memory instead (more device "
        "memory than the policy meant): it was compiled outside "
        "ckptfx.offload_in_compile() (or by dynamo's eager backend). Compile inside "
        "`with ckptfx.offload_in_compile():` (around the first call, where torch "
        "compiles; aot_eager or inductor) to have torch's partitioner move it to the host, "
        "or run the block eagerly. (Warned once per process.)",
        CompileOffloadWarning,
        stacklevel=2,
    )


def _on_accelerator(args: tuple, kwargs: dict[str, Any]) -> bool:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor) and a.device.type not in ("cpu", "meta"):
            return True
    return False


def _below(ctx: Any, min_bytes: int) -> bool:
    """Whether every tensor the op made (torch's context has them as ``op_output``) is
    smaller than ``Offload.min_bytes``; a symbolic size (dynamic shapes) counts as large."""
    outputs = getattr(ctx, "op_output", None)
    tensors = [t for t in (outputs if isinstance(outputs, (tuple, list)) else (outputs,))
               if isinstance(t, torch.Tensor)]
    if not min_bytes or not tensors:
        return False
    sizes = [t.numel() * t.element_size() for t in tensors]
    return all(isinstance(n, int) and n < min_bytes for n in sizes)


@dataclasses.dataclass(frozen=True)
class CompiledPolicy:
    """A ckptfx or torch policy as a torch selective-checkpoint policy for compiled graphs
    (Rules 2-4). Frozen, so dynamo can guard on it as a constant.

    Example::

        ctx = functools.partial(torch.utils.checkpoint.create_selective_checkpoint_contexts,
                                CompiledPolicy(checkpoint_policies.dots_saveable))
    """

    policy: Callable[..., Any]

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        policy = self.policy
        if op is NAME_OP:
            if not isinstance(policy, Policy):
                return CheckpointPolicy.PREFER_RECOMPUTE
            x, name = args[0], args[1]
            decision = call_policy(policy, ctx, checkpoint_name, (x,), {"name": name})
        elif isinstance(policy, Policy):
            decision = call_policy(policy, ctx, op, args, kwargs)
        else:
            raw = policy(ctx, op, *args, **kwargs)
            if isinstance(raw, CheckpointPolicy) and "OFFLOAD" not in raw.name:
                return raw
            decision = decide(raw, op)
        if decision is False:
            return CheckpointPolicy.PREFER_RECOMPUTE
        if isinstance(decision, Offload):
            if _below(ctx, getattr(decision, "min_bytes", 0)):
                return CheckpointPolicy.MUST_SAVE  # too small to copy: kept, as eager remat
            if offloading_in_compile() and _compat.is_compiling():
                return CheckpointPolicy.MUST_CPU_OFFLOAD  # marked by _OffloadMarks (Rule 4)
            if _on_accelerator(args, kwargs):
                _warn_offload(op)
        return CheckpointPolicy.MUST_SAVE


def _always_recompute(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


class _SameRandomNumbers:
    """Wraps the recompute context of a compiled checkpoint run eagerly: the recomputation
    starts from the generator states the forward started from (it is made just before the
    forward runs), and the caller's states are put back after it (Rule 1b)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.cpu = torch.get_rng_state()
        self.device: tuple[Any, int, torch.Tensor] | None = None
        device_type = replay_env.accelerator_type()
        if device_type is not None:
            mod = torch.get_device_module(device_type)
            if mod.is_initialized():
                index = mod.current_device()
                self.device = (mod, index, mod.get_rng_state(index))
        self.caller: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    def __enter__(self) -> None:
        dev = self.device
        self.caller.append((torch.get_rng_state(),
                            None if dev is None else dev[0].get_rng_state(dev[1])))
        torch.set_rng_state(self.cpu)
        if dev is not None:
            dev[0].set_rng_state(dev[2], dev[1])
        self.inner.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        try:
            return self.inner.__exit__(*exc)
        finally:
            cpu, device = self.caller.pop()
            torch.set_rng_state(cpu)
            if device is not None and self.device is not None:
                self.device[0].set_rng_state(device, self.device[1])


def _contexts(inner: Callable[[], tuple[Any, Any]], replay_rng: bool) -> tuple[Any, Any]:
    """The contexts of one compiled checkpoint call: ``inner``'s, and, where the checkpoint
    op runs eagerly (dynamo's eager backend; at run time, so nothing is being compiled),
    the forward's random numbers in the recomputation (Rule 1b)."""
    forward, recompute = inner()
    if torch.compiler.is_compiling():  # compiled: torch takes dispatch modes only
        return forward, recompute
    if replay_rng:
        recompute = _SameRandomNumbers(recompute)
    return forward, _MismatchNamed(recompute)


class _MismatchNamed:
    """Rule 8: a recomputation that ran other ops than its forward fails in torch's
    selective-checkpoint mode with "... encountered during backward but not found in
    storage"; re-raised as a ``CheckpointError`` that names the usual cause and the fix."""

    __slots__ = ("inner",)

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __enter__(self) -> Any:
        return self.inner.__enter__()

    def __exit__(self, kind: Any, err: Any, tb: Any) -> Any:
        suppressed = self.inner.__exit__(kind, err, tb)
        if (not suppressed and isinstance(err, RuntimeError)
                and "encountered during backward but not found in storage" in str(err)):
            raise CheckpointError(
                "ckptfx: the recomputation of a block checkpointed inside torch.compile (a "
                "remat'd block or ckptfx.checkpoint, which become torch's checkpoint op "
                f"there) ran other ops than its forward ({err}). A Hugging Face decoder "
                "layer given its KV cache does this (use_cache on: the replay appends to the "
                "cache again): train with use_cache=False (model(..., use_cache=False), or "
                "model.config.use_cache = False), or checkpoint the layers with "
                "ckptfx.apply_activation_checkpointing(model, policy=...), which drops the "
                "cache in training as Hugging Face's own checkpointing does. Otherwise the "
                "block reads state that changed between its forward and its backward."
            ) from err
        return suppressed


def context_fn(policy: Any) -> Callable[[], tuple[Any, Any]]:
    """The ``context_fn`` for torch's checkpoint equivalent to ``policy`` (Rules 1, 1b)."""
    if policy is None or isinstance(policy, NothingSaveable):
        inner = functools.partial(create_selective_checkpoint_contexts, _always_recompute)
    else:
        inner = functools.partial(create_selective_checkpoint_contexts,
                                  CompiledPolicy(policy))
    return functools.partial(_contexts, inner, True)


def checkpoint_context_fn(user_context_fn: Any, preserve_rng_state: bool) -> Any:
    """``ckptfx.checkpoint``'s ``context_fn`` under compile: the user's (or recompute
    everything), with the random-number replay of Rule 1b when ``preserve_rng_state``."""
    if user_context_fn is _torch_checkpoint.noop_context_fn:
        user_context_fn = functools.partial(create_selective_checkpoint_contexts,
                                            _always_recompute)
    return functools.partial(_contexts, user_context_fn, preserve_rng_state)


class Lowered:
    """One remat'd function as dynamo sees it: a call of torch's checkpoint (Rule 1).

    Made once, when the function is decorated (outside any trace), so the context function
    is a constant dynamo can guard on.
    """

    __slots__ = ("fun", "context_fn")

    def __init__(self, fun: Callable[..., Any], policy: Any) -> None:
        self.fun = fun
        self.context_fn = context_fn(policy)

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return lower(self.fun, self.context_fn, args, kwargs, "a ckptfx.remat block")


def lower(fun: Callable[..., Any], context: Callable[[], tuple[Any, Any]],
          args: tuple[Any, ...], kwargs: dict[str, Any], what: str) -> Any:
    """Call ``fun`` as torch's checkpoint op with ``context`` (while dynamo traces)."""
    note_lowered(what)
    if kwargs and not _CHECKPOINT_KEYWORDS.isdisjoint(kwargs):
        fun = functools.partial(fun, **kwargs)
        kwargs = {}
    return _torch_checkpoint.checkpoint(fun, *args, use_reentrant=False, context_fn=context,
                                        **kwargs)


# policy -> its context function, made outside compiled code: dynamo takes a context
# function only as a constant it finds, not one built while it traces.
_POLICY_CONTEXTS: dict[Any, Callable[[], tuple[Any, Any]]] = {}


def policy_context_fn(policy: Any) -> Callable[[], tuple[Any, Any]]:
    """``context_fn(policy)``, made once per policy (``ckptfx.checkpoint(policy=)`` and
    ``checkpoint_wrapper(policy=)`` make it at their first eager call or at wrapping, so
    that compiled calls find it)."""
    try:
        found = _POLICY_CONTEXTS.get(policy)
    except TypeError:  # an unhashable policy: made per call
        return context_fn(policy)
    if found is None:
        found = _POLICY_CONTEXTS[policy] = context_fn(policy)
    return found
