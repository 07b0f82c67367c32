"""Every private torch API ckptfx touches, in one place.

A torch upgrade that moves one of these should need a change here only. Each name is
looked up once, at import, and a missing one fails loudly with the torch version named.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode as _TorchDispatchMode


# Whether torch.distributed has a default process group: read by every checkpoint forward
# and prefire, where is_initialized()'s class-property chain shows. c10d's state object is
# looked up on each call: torch may replace it (its threaded test harness does).
def _default_pg_reader() -> Callable[[], bool]:
    if not torch.distributed.is_available():
        return lambda: False
    c10d = torch.distributed.distributed_c10d
    if hasattr(getattr(c10d, "_world", None), "default_pg"):  # torch >= 2.0
        return lambda: c10d._world.default_pg is not None
    return c10d.is_initialized


# ``torch.distributed.is_available() and torch.distributed.is_initialized()``: the reader
# itself, not a function calling it (one Python call per checkpoint forward, not two).
distributed_initialized: Callable[[], bool] = _default_pg_reader()


def skip_dynamo(code: Any) -> None:
    """Mark a code object so that dynamo never compiles it, nor the frames it calls.

    A compiled function that runs where one of ckptfx's dispatch modes is active is run
    eagerly by torch (a mode on the stack makes dynamo skip the frame), but the mode's own
    handler is called with the mode popped: without this mark dynamo would compile the
    handler itself (and trace ckptfx's recorder). The mark is a per-code flag read by the
    C frame evaluator, free at run time, unlike ``torch._dynamo.disable``'s wrapper.
    """
    from torch._C._dynamo import eval_frame as _ef

    _ef.set_code_exec_strategy(
        code, _ef._FrameExecStrategy(_ef._FrameAction.SKIP, _ef._FrameAction.SKIP))


class TorchDispatchMode(_TorchDispatchMode):
    """Base of ckptfx's dispatch modes. torch wraps every subclass's ``__torch_dispatch__`` in
    a dynamo-disable shim that costs a few microseconds per op; ckptfx's handlers opt out of
    the shim and mark their code as never compiled instead (``skip_dynamo``), which costs
    nothing per op."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        handler = cls.__dict__.get("__torch_dispatch__")
        if handler is not None and hasattr(handler, "__code__"):
            skip_dynamo(handler.__code__)


class TorchFunctionMode(torch.overrides.TorchFunctionMode):
    """Base of ckptfx's function modes: their handlers are never compiled (``skip_dynamo``),
    as the dispatch modes' are."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        handler = cls.__dict__.get("__torch_function__")
        if handler is not None and hasattr(handler, "__code__"):
            skip_dynamo(handler.__code__)


TORCH_VERSION = torch.__version__

# torch's selective-checkpoint internals (torch.utils.checkpoint, 2.4 and later): the caching
# (forward) and cached (replay) modes and the entry that means "run the op again"; None where
# a torch lacks them.
SAC_CACHING_MODE: Any = getattr(torch.utils.checkpoint, "_CachingTorchDispatchMode", None)
SAC_CACHED_MODE: Any = getattr(torch.utils.checkpoint, "_CachedTorchDispatchMode", None)
SAC_RECOMPUTE: Any = getattr(torch.utils.checkpoint, "_RECOMPUTE", None)


def checkpoint_debug_enabled() -> bool | None:
    """torch's global ``set_checkpoint_debug_enabled`` switch (None: defer to ``debug=``)."""
    return getattr(torch.utils.checkpoint, "_checkpoint_debug_enabled", None)


def with_inplace_or_view() -> Any:
    """A guard that dispatches through ADInplaceOrView again where a mode excluded it (a
    ``detach`` made there then shares its source's version counter)."""
    return torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False)


# Dispatch below the autograd keys on this thread (ops run, nothing is recorded), with grad
# mode left as it is: a context manager.
below_autograd: Callable[[], Any] = torch._C._AutoDispatchBelowAutograd


def _require(owner: Any, name: str) -> Any:
    try:
        return getattr(owner, name)
    except AttributeError:  # pragma: no cover - depends on the installed torch
        raise ImportError(
            f"ckptfx needs {getattr(owner, '__name__', owner)}.{name}, which torch "
            f"{TORCH_VERSION} does not have; ckptfx supports torch>=2.9"
        ) from None


# Saved-tensor hooks, pushed and popped without the Python context-manager object
# (the forward of every checkpoint call goes through here).
push_saved_tensors_hooks: Callable[[Callable, Callable], None] = _require(
    torch._C._autograd, "_push_saved_tensors_default_hooks"
)
pop_saved_tensors_hooks: Callable[[], None] = _require(
    torch._C._autograd, "_pop_saved_tensors_default_hooks"
)

# The saved-tensor hooks on top of this thread's stack now, as (pack, unpack), or None.
_top_saved_tensors_hooks: Callable[[bool], Any] = _require(
    torch._C._autograd, "_top_saved_tensors_default_hooks"
)


def top_saved_tensors_pack_hook() -> Any:
    """The pack hook on top of the saved-tensor hooks stack, or None when it is empty."""
    top = _top_saved_tensors_hooks(False)
    return None if top is None else top[0]


# A SavedVariable made by hand: packs the tensor under the hooks active now (so an inner
# checkpoint's inputs become saved tensors of its parent) and unpacks through them.
make_saved_tensor: Callable[..., Any] = _require(torch._C._autograd, "_make_saved_tensor")
SavedTensor: Any = _require(torch._C._autograd, "SavedTensor")

# Backward identity: the GraphTask running now (-1 outside backward), torch's
# GraphExecGroup when the user opened one, and the autograd node being executed.
current_graph_task_id: Callable[[], int] = _require(torch._C, "_current_graph_task_id")
get_graph_exec_group: Callable[[], Any] = _require(torch._C, "_get_graph_exec_group")
current_autograd_node: Callable[[], Any] = _require(torch._C, "_current_autograd_node")

# State autograd carries into the threads that run a backward. A GraphTask captures its
# caller's thread-local state when it is made (grad mode, autocast, dispatch keys, and a map of
# Python objects), and each thread that runs its nodes, autograd's device threads included,
# runs under that copy; a threading.local or a ContextVar set by the caller is not carried.
# A key stashed in that map while a backward starts is seen by every thread of it.
_stash_obj: Callable[[str, Any], None] = _require(torch._C, "_stash_obj_in_tls")
_stashed_obj: Callable[[str], Any] = _require(torch._C, "_get_obj_in_tls")
has_carried: Callable[[str], bool] = _require(torch._C, "_is_key_in_tls")
_remove_obj: Callable[[str], None] = _require(torch._C, "_remove_obj_from_tls")


def carry(key: str, obj: Any) -> None:
    """Stash ``obj`` under ``key`` in the state autograd carries into its threads, until
    ``uncarry(key)`` (which must come before this thread exits: the entry needs the GIL to
    be freed)."""
    _stash_obj(key, obj)


def carried(key: str) -> Any:
    """What ``carry`` stashed under ``key`` on this thread, or on the thread whose backward
    this thread runs now; None if nothing is."""
    return _stashed_obj(key) if has_carried(key) else None


def uncarry(key: str) -> None:
    """Remove ``key`` (erased, not set to None: see ``carry``)."""
    if has_carried(key):
        _remove_obj(key)


# The sequence number autograd gives the next node it makes on this thread. Every tensor an
# op saves is packed after the op's node was made and before the next one, so all packs of
# one op read the same number (frame.py, Rule 6).
next_sequence_nr: Callable[[], int] = _require(torch._C._autograd, "_get_sequence_nr")


def detach_unrecorded(t: torch.Tensor) -> torch.Tensor:
    """``t.detach()`` that no TorchDispatchMode records (autograd still gives the alias
    ``t``'s version counter, so in-place writes to ``t`` stay visible on it)."""
    with torch._C._DisableTorchDispatch():
        return t.detach()


def device_context_mode() -> Any:
    """The innermost ``torch.device(...)`` context active now, or None."""
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._device import DeviceContext

    for mode in reversed(_get_current_function_mode_stack()):
        if isinstance(mode, DeviceContext):
            return mode
    return None


def top_dispatch_mode() -> Any:
    """The innermost TorchDispatchMode pushed on this thread, or None."""
    n = torch._C._len_torch_dispatch_stack()
    return torch._C._get_dispatch_stack_at(n - 1) if n else None


# How many TorchFunctionModes are pushed on this thread (a C call, for hot paths).
function_mode_count: Callable[[], int] = torch._C._len_torch_function_stack


def has_function_modes() -> bool:
    return bool(function_mode_count())


# Whether dynamo is tracing: torch's own function, not a wrapper around it (asked by every
# checkpoint call; dynamo answers it by identity while tracing)
is_compiling: Callable[[], bool] = torch.compiler.is_compiling


def run_at_trace_time(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``fn`` so that dynamo calls it for real while it traces (once per compilation)
    and uses its result as a constant, with no graph break (``torch._dynamo``'s
    ``assume_constant_result``, without importing dynamo)."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


def is_donated_buffer_refusal(err: BaseException) -> bool:
    """True for AOT autograd's refusal to run a backward compiled with donated buffers
    under ``retain_graph=True``."""
    return "compiled with non-empty donated buffers" in str(err)


def is_compiled_callable(fn: Any) -> bool:
    """True for what ``torch.compile`` returns (a compiled function or ``OptimizedModule``)
    and for a module compiled in place by ``module.compile()``."""
    if getattr(fn, "_torchdynamo_orig_callable", None) is not None:
        return True
    if getattr(fn, "_compiled_call_impl", None) is not None:
        return True
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(fn, eval_frame.OptimizedModule)


def is_compiled_backward_node(node: Any) -> bool:
    """True for the autograd node of a ``torch.compile``d region (AOT autograd's)."""
    return type(node).__name__ == "CompiledFunctionBackward"


def any_node(tensors: Sequence[torch.Tensor], pred: Callable[[Any], bool]) -> bool:
    """True if ``pred`` holds for an autograd node in the history of ``tensors`` (each node
    visited once, iteratively: graphs are deep). Nodes are their own keys: autograd hands out
    one Python object per live node."""
    stack = [t.grad_fn for t in tensors if t.grad_fn is not None]
    seen = set(stack)
    while stack:
        node = stack.pop()
        if pred(node):
            return True
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                stack.append(child)
    return False


# False inside torch.func's grad, vjp and jacrev (they refuse saved-tensor hooks); True
# under plain autograd, vmap, jvp and functionalize.
saved_tensors_hooks_enabled: Callable[[], bool] = _require(
    torch._C._autograd, "_saved_tensors_hooks_is_enabled")


_FUNCTORCH_FRONT = torch._C.DispatchKey.FuncTorchDynamicLayerFrontMode
_dispatch_key_included: Callable[[Any], bool] = torch._C._dispatch_tls_is_dispatch_key_included


def functorch_level(compiling: bool | None = None) -> int:
    """Nesting depth of active torch.func transforms (0 under plain autograd).

    Asking functorch for its level creates the thread's functorch state, which from then on
    every autograd node run on that thread copies (torch saves and restores the thread-local
    state around each node): about 6 K more instructions per node under callgrind, 8% of a
    small backward, 0.43 M per step of the split benchmark (``ckptfx bench --overhead``), in
    every backward of the process. While any transform is active functorch keeps its front
    dispatch key in the thread's included set (it adds it with the first layer and removes it
    with the last), so that key answers "none" without touching the state. (Dynamo cannot
    trace that read; it models functorch's level itself.) ``compiling``: ``is_compiling()``,
    where the caller has asked already."""
    if compiling is None:
        compiling = torch.compiler.is_compiling()
    if not compiling and not _dispatch_key_included(_FUNCTORCH_FRONT):
        return 0
    level = torch._C._functorch.maybe_current_level()
    return 0 if level is None else level


def functorch_tensor_level(t: torch.Tensor) -> int:
    """The transform level of ``t``'s outermost functorch wrapper, or -1 for a plain tensor."""
    return torch._C._functorch.maybe_get_level(t)


def functorch_top_transform() -> str | None:
    """The innermost active torch.func transform: "grad" (grad, vjp, jacrev's vjp), "jvp",
    "vmap" or "functionalize"; None under plain autograd."""
    interpreter = torch._C._functorch.peek_interpreter_stack()
    if interpreter is None:
        return None
    return interpreter.key().name.lower()


@contextlib.contextmanager
def functorch_vmaps_popped(tensors: Sequence[torch.Tensor]) -> Iterator[int]:
    """Pop the vmap transforms on top of the stack that none of ``tensors`` is batched by (a
    vmap entered after those tensors were made: jacrev's vmap over a backward), pushing them
    back on exit. Yields how many were popped."""
    from torch._C._functorch import (  # private: the interpreter stack of torch.func
        peek_interpreter_stack,
        pop_dynamic_layer_stack,
        push_dynamic_layer_stack,
    )
    popped: list[Any] = []
    try:
        while True:
            top = peek_interpreter_stack()
            if top is None or top.key().name.lower() != "vmap":
                break
            level = top.level()
            if any(_batched_at(t, level) for t in tensors):
                break
            popped.append(pop_dynamic_layer_stack())
        yield len(popped)
    finally:
        while popped:
            push_dynamic_layer_stack(popped.pop())


def _batched_at(t: torch.Tensor, level: int) -> bool:
    """Whether ``t`` or a functorch wrapper inside it is batched by the vmap of ``level``."""
    ft = torch._C._functorch
    while ft.is_functorch_wrapped_tensor(t):
        if ft.is_batchedtensor(t) and ft.maybe_get_level(t) == level:
            return True
        t = ft.get_unwrapped(t)
    return False


def functorch_unwrap_level(t: torch.Tensor, level: int) -> torch.Tensor:
    """``t`` without its grad-transform wrapper of ``level`` (lower levels' wrappers kept)."""
    return torch._C._functorch._unwrap_for_grad(t, level)


def node_sequence_nr(node: Any) -> int:
    """The autograd sequence number of a graph node (creation order on its thread)."""
    return node._sequence_nr()


def functorch_unwrap(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor under every functorch wrapper of ``t``."""
    while torch._C._functorch.is_functorch_wrapped_tensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    return t


def import_npu() -> bool:
    """Import torch_npu when it is installed (it registers the ``npu`` device)."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    importlib.import_module("torch_npu")
    return True


def reparametrize_module(module: Any, tensors: dict[str, Any]) -> Any:
    """Context manager: ``module``'s parameters and buffers named in ``tensors`` replaced."""
    from torch.nn.utils.stateless import _reparametrize_module

    return _reparametrize_module(module, tensors)


def is_saved_tensors_hooks_refusal(err: BaseException) -> bool:
    """True for torch.func's refusal to run under saved-tensor hooks."""
    return "don't yet support saved tensor hooks" in str(err)


# torch.distributed.pipelining.PipelineStage's dynamic metadata inference (torch >= 2.13) runs
# once, on the first step, before any micro-batch: a real forward of each stage module through
# ``_compute_outputs``, then, stage by stage in reverse, one ``autograd.grad`` through
# ``_compute_input_grads`` whose results it reads for their metadata only (shape, stride, dtype,
# DTensor placements). ckptfx.pipelining overrides the two where the base class has them.
PIPELINE_INFERENCE_FORWARD = "_compute_outputs"
PIPELINE_INFERENCE_INPUT_GRADS = "_compute_input_grads"


def pipeline_stage_has_metadata_inference(stage_cls: type) -> bool:
    """True where ``stage_cls`` (torch's PipelineStage) infers metadata by a real forward
    and backward through the two methods above."""
    return all(
        callable(getattr(stage_cls, name, None))
        for name in (PIPELINE_INFERENCE_FORWARD, PIPELINE_INFERENCE_INPUT_GRADS)
    )


def pipeline_stage_runtime_validate(stage: Any) -> bool:
    """True where a pipeline stage checks every runtime tensor against its inferred
    metadata (``TORCH_DISTRIBUTED_DEBUG=DETAIL``)."""
    return bool(getattr(stage, "_runtime_validate", False))


# -- FSDP2 (fully_shard) internals, for kernel/fsdp.py and split/data_parallel.py ---------------
# A state (``FSDPState``) owns parameter groups (``FSDPParamGroup``); each group all-gathers
# (``unshard``), reduce-scatters (``post_backward``) and frees (``reshard``) its parameters;
# the root's final callback ends a backward. The flags below are what FSDPModule's public
# setters (set_requires_gradient_sync, set_reshard_after_backward, set_is_last_backward) write.


def fsdp_state_of(module: Any) -> Any:
    """The FSDP2 state of a ``fully_shard``-ed module, or None."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state

    return _get_module_fsdp_state(module)


def fsdp_all_states(state: Any) -> list[Any]:
    """Every FSDP2 state of the tree ``state`` belongs to (filled at the root's lazy init)."""
    states = list(getattr(state._state_ctx, "all_states", ()) or ())
    return states if states else [state]


def fsdp_param_groups(state: Any) -> list[Any]:
    return list(state._fsdp_param_groups)


def fsdp_group_params(group: Any) -> list[tuple[Any, Any]]:
    """(sharded parameter, unsharded parameter) of each parameter of a group that has been
    unsharded at least once (the unsharded one is what the autograd graph holds)."""
    out = []
    for fp in group.fsdp_params:
        unsharded = getattr(fp, "_unsharded_param", None)
        if unsharded is not None:
            out.append((fp.sharded_param, unsharded))
    return out


def fsdp_unshard(group: Any) -> None:
    if not group.is_unsharded:
        group.unshard()
        group.wait_for_unshard()


def fsdp_group_flags(group: Any) -> tuple[bool, bool]:
    return group.reduce_grads, group.reshard_after_backward


def fsdp_set_group_flags(group: Any, flags: tuple[bool, bool]) -> None:
    group.reduce_grads, group.reshard_after_backward = flags


def fsdp_is_last_backward(state: Any) -> bool:
    return state._state_ctx.is_last_backward


def fsdp_set_is_last_backward(state: Any, value: bool) -> None:
    state._state_ctx.is_last_backward = value


def fsdp_post_backward(group: Any) -> None:
    group.post_backward()


def fsdp_final_callback(state: Any) -> None:
    state._root_post_backward_final_callback()


def ddp_delays_all_reduce(module: Any) -> bool:
    """True for a DDP(static_graph=True) module before its first backward: its output's
    ``_DDPSink`` queues the whole all-reduce at the end of the backward pass that reaches it."""
    return bool(getattr(module, "static_graph", False)) and not getattr(
        module, "_static_graph_delay_allreduce_enqueued", True
    )
