"""``ckptfx.remat``: JAX-style rematerialization of a pure block, chosen by policy.

Each call of a remat'd function is one kernel ``Frame`` (so collectors, prefire, sessions,
``grad_split`` and the GraphTask fallback work unchanged) whose forward runs under a
``Tracer`` (tracer.py): the policy decides per op what the backward keeps, and the replay
rebuilds only what was not kept, from the recorded ops, or by re-running the function when
the recording cannot be shown faithful. A block whose policy keeps nothing is recorded on
its first call per signature only; later calls may run unrecorded, replayed by re-running
the function (ckptfx.recording.unrecorded; ``always_record=True`` records every call).

Nesting rule (differs from JAX, where the outer policy wins): each remat'd block's own policy
decides what that block keeps; an inner block's inputs are values of the outer block, kept
or recomputed under the outer policy. This is torch's nesting rule for checkpoints, and it
keeps a block's memory behaviour the same wherever it is called from.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from typing import Any, Callable, Sequence, TypeVar

import optree
import torch

from ckptfx import _compat, lowering
from ckptfx.budget.planner import tracer_for
from ckptfx.func_path.call import call_function_path
from ckptfx.kernel.frame import Frame, refuse_new_frame_in_scheduled_replay, unpack_hook
from ckptfx.kernel.function_replay import rerun_function
from ckptfx.kernel.handles import collect, uncollect
from ckptfx.kernel.refill import first_node, plain_saves, scope_on_top
from ckptfx.policies.budget_policy import MemoryBudget
from ckptfx.policies.checks import (
    NameCheck,
    is_policy_like,
    name_check,
    positional_policy_message,
)
from ckptfx.policies.named import NothingSaveable, check_policy
from ckptfx.policies.tracer_stack import reporting
from ckptfx.recording.packs import residual_unpack_hook
from ckptfx.recording.tracer import Tracer, finish_offload
from ckptfx.recording.unrecorded import plan_for

__all__ = ["remat"]

F = TypeVar("F", bound=Callable[..., Any])


@dataclasses.dataclass(frozen=True)
class RematOptions:
    policy: Any
    early_stop: bool
    static_argnums: tuple[int, ...]
    static_argnames: frozenset[str]
    always_record: bool = False


def remat(
    fun: F | None = None,
    *,
    policy: Callable[..., Any] | None = None,
    early_stop: bool = True,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    always_record: bool = False,
    prevent_cse: bool = True,
) -> Any:
    """Make ``fun`` rematerialize: keep only what ``policy`` allows, recompute the rest.

    ``fun`` takes and returns pytrees (dicts, lists, tuples, namedtuples, registered
    dataclasses) of tensors and Python values. Use it as ``@remat``, ``@remat(policy=...)``,
    on ``nn.Module.forward`` methods, and under ``torch.func.functional_call``.

    Args:
        fun: the block. Must be a function of its arguments (parameters it reads from a
            module or a closure are fine; they must not be modified in place between forward
            and backward, which is checked: every tensor a recorded call read, and for a
            later unrecorded call the tensors of the block's modules, closure and globals,
            not tensors reached through other objects). Python state it reads (a module attribute, a
            config value) must not change between a call's forward and its backward either:
            a call whose replay re-runs the function (see ``always_record``) reads it again,
            as torch's checkpoint does, and nothing can check a Python value.
        policy: a ``ckptfx.checkpoint_policies`` policy, or any torch selective-checkpoint
            policy function ``(ctx, op, *args, **kwargs) -> bool | CheckpointPolicy``.
            ``None`` (default) keeps nothing but the inputs the backward needs.
            Collectives (c10d and functional collectives, ops passed to
            ``ckptfx.register_collective``) are kept whatever the policy, unless it answers
            ``CheckpointPolicy.MUST_RECOMPUTE`` for them: a replay never re-runs one. FSDP2's
            all-gathers (a remat around an FSDP2 module call) are outside the recording: the
            block reads the unsharded parameters as it reads any parameter.
        early_stop: when the block must be re-run as a Python function (a recording that
            cannot be shown faithful is not replayed op by op; see the guide's "How remat
            replays"), stop once every needed tensor exists (never changes a gradient).
        static_argnums: positional indices of arguments that are Python values baked into
            the recording (never tensors).
        static_argnames: keyword names of such arguments.
        always_record: record every call. By default a block whose policy keeps nothing
            (``nothing_saveable``, ``memory_budget(0.0)``) is recorded on its first call
            per argument signature only: if that recording shows a Python re-run would be
            exact (no explicit ``torch.Generator``, no in-place writes to inputs, ...),
            later calls run as ``ckptfx.checkpoint`` runs (no dispatch mode in the
            forward: torch's checkpoint's speed) and their replay re-runs the block's
            Python, checked as a checkpoint's is (the guide's "How remat replays"). Blocks
            reading a tensor from a closure or a global, a tied weight, or a cast made
            before the block stay recorded. Pass True where the block's Python must not run
            in the backward, where it reads Python state that may change before the
            backward, or where a later call may draw from an explicit generator the first
            did not (its replay would raise a ``CheckpointError``).
        prevent_cse: accepted for code written for ``jax.checkpoint``; eager PyTorch does
            no common-subexpression elimination that could merge a replay with the
            forward, so it changes nothing (a bool, as in JAX).

    Bad input is refused at once, with what to write instead: a policy passed where the
    function goes (``remat(cp.dots_saveable)``: write ``remat(policy=cp.dots_saveable)``)
    and an un-called policy factory (``policy=cp.save_only_these_names``: call it with the
    names) are a ``TypeError``.

    With a name-based policy (``save_only_these_names`` and friends), the first forward of
    the block that completes with grad enabled checks the policy's names against those its
    ``checkpoint_name`` calls used (those of blocks nested inside, which have their own
    policy, do not count): names it did not use have no effect, and are reported in one
    ``ckptfx.UnusedNameWarning`` per remat'd function (later calls are not checked).

    Example::

        import ckptfx
        from ckptfx import checkpoint_policies as cp

        @ckptfx.remat(policy=cp.dots_saveable)
        def block(params, x):
            h = torch.relu(x @ params["w1"])
            return h @ params["w2"]

        loss = block(params, x).sum()
        loss.backward()                      # relu recomputed from the kept matmul output
        ckptfx.print_saved_residuals(block, params, x)
    """
    if fun is not None and is_policy_like(fun):
        raise TypeError(positional_policy_message(fun))
    if policy is not None:
        check_policy(policy, "policy")
    if not isinstance(early_stop, bool):
        raise TypeError(f"early_stop must be a bool, got {type(early_stop).__name__}")
    if not isinstance(always_record, bool):
        raise TypeError(f"always_record must be a bool, got {type(always_record).__name__}")
    if not isinstance(prevent_cse, bool):
        raise TypeError(f"prevent_cse must be a bool, got {type(prevent_cse).__name__}")
    nums = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
    names = (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames)
    for n in nums:
        if not isinstance(n, int) or isinstance(n, bool):
            raise TypeError(f"static_argnums must be ints, got {n!r}")
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"static_argnames must be strings, got {name!r}")
    if isinstance(policy, NothingSaveable):
        policy = None  # the same, without asking a policy per op
    options = RematOptions(policy, early_stop, nums, frozenset(names), always_record)
    if fun is None:
        return functools.partial(_decorate, options=options)
    return _decorate(fun, options=options)


def _decorate(fun: F, *, options: RematOptions) -> F:
    if not callable(fun):
        raise TypeError(f"remat needs a callable, got {type(fun).__name__}")
    _check_static_against_signature(fun, options)

    names = name_check(options.policy)
    lowered = lowering.Lowered(fun, options.policy)
    compiled = _compat.is_compiled_callable(fun)
    learnt: dict[Any, Any] = {}  # what first calls taught (ckptfx.recording.unrecorded, Rule 2)

    @functools.wraps(fun)
    def remat_call(*args: Any, **kwargs: Any) -> Any:
        if _compat.is_compiling():  # dynamo traces this call: torch's checkpoint op
            return lowered(args, kwargs)
        if compiled:  # checkpointed whole (lowering.py, Rule 6)
            return lowering.call_compiled(fun, options.policy, options.early_stop, args,
                                          kwargs)
        return call(fun, options, args, kwargs, names, learnt)

    remat_call.__ckptfx_remat__ = (fun, options)  # type: ignore[attr-defined]
    return remat_call  # type: ignore[return-value]


def _check_static_against_signature(fun: Callable[..., Any], options: RematOptions) -> None:
    if not options.static_argnums:
        return
    try:
        params = inspect.signature(fun).parameters.values()
    except (TypeError, ValueError):
        return
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return
    n = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
    for i in options.static_argnums:
        if not -n <= i < n:
            raise ValueError(
                f"static_argnums {i} is out of range for {getattr(fun, '__name__', fun)} "
                f"with {n} positional parameters"
            )


def _split_static(options: RematOptions, args: tuple[Any, ...], kwargs: dict[str, Any]
                  ) -> tuple[tuple[Any, ...], dict[str, Any], dict[int, Any], dict[str, Any]]:
    static_pos: dict[int, Any] = {}
    for i in options.static_argnums:
        if not -len(args) <= i < len(args):
            raise ValueError(f"static_argnums {i} is out of range for a call with "
                             f"{len(args)} positional arguments")
        j = i % len(args)
        if isinstance(args[j], torch.Tensor):
            raise ValueError(f"static_argnums {i} points at a tensor; static arguments must "
                             "be Python values (pass tensors as ordinary arguments)")
        static_pos[j] = args[j]
    static_kw = {}
    for k in options.static_argnames:
        if k in kwargs:
            if isinstance(kwargs[k], torch.Tensor):
                raise ValueError(f"static_argnames {k!r} points at a tensor; static arguments "
                                 "must be Python values")
            static_kw[k] = kwargs[k]
    if static_pos:
        args = tuple(None if i in static_pos else a for i, a in enumerate(args))
    if static_kw:
        kwargs = {k: v for k, v in kwargs.items() if k not in static_kw}
    return args, kwargs, static_pos, static_kw


class _FlatCall:
    """One call's arguments as a flat list of tensors, and the block as a function of them.

    A call with only tensor positional arguments and no static ones (``block(x)``, the common
    case) is already flat: the block is called as is and no pytree is built unless a
    torch.func path asks for one (``pytree``).
    """

    __slots__ = ("fun", "tensors", "fn", "_pytree")

    def __init__(self, fun: Callable[..., Any], options: RematOptions, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> None:
        self.fun = fun
        if (not kwargs and not options.static_argnums and not options.static_argnames
                and all(isinstance(a, torch.Tensor) for a in args)):
            self.tensors = list(args)
            self.fn = fun
            self._pytree: tuple[Any, ...] | None = None
            return
        dyn_args, dyn_kwargs, static_pos, static_kw = _split_static(options, args, kwargs)
        leaves, spec = optree.tree_flatten((dyn_args, dyn_kwargs), none_is_leaf=True)
        positions = [j for j, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        self.tensors = [leaves[j] for j in positions]
        for j in positions:
            leaves[j] = None  # the frame owns the tensors (saved inputs); the closure must not

        def restore(a: tuple[Any, ...], k: dict[str, Any]
                    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
            if static_pos:
                a = tuple(static_pos.get(i, v) for i, v in enumerate(a))
            if static_kw:
                k = {**k, **static_kw}
            return a, k

        def flat_fun(*ts: torch.Tensor) -> Any:
            filled = list(leaves)
            for j, t in zip(positions, ts):
                filled[j] = t
            a, k = restore(*optree.tree_unflatten(spec, filled))
            return fun(*a, **k)

        flat_fun.__qualname__ = getattr(fun, "__qualname__", "remat")
        flat_fun.__ckptfx_fun__ = fun  # type: ignore[attr-defined]  # for residual reports
        self.fn = flat_fun
        self._pytree = (leaves, spec, positions, restore, dyn_args, dyn_kwargs)

    def pytree(self) -> tuple[Any, ...]:
        """(leaves without tensors, spec, tensor positions, restore, dynamic args, kwargs)."""
        if self._pytree is None:
            n = len(self.tensors)
            _, spec = optree.tree_flatten((tuple(self.tensors), {}), none_is_leaf=True)
            self._pytree = ([None] * n, spec, list(range(n)), _no_statics,
                            tuple(self.tensors), {})
        return self._pytree

    def function_path(self, policy: Any) -> Any:
        leaves, spec, positions, restore, _, _ = self.pytree()
        return call_function_path(self.fun, policy, leaves, spec, positions, self.tensors,
                                  restore)


def _no_statics(a: tuple[Any, ...], k: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return a, k


def call(fun: Callable[..., Any], options: RematOptions, args: tuple[Any, ...],
         kwargs: dict[str, Any], names: NameCheck | None = None,
         learnt: dict[Any, Any] | None = None) -> Any:
    """One remat call: flatten, trace under a new frame (or run it unrecorded:
    ckptfx.recording.unrecorded), return the outputs.

    ``names`` (the remat'd function's unused-name check) watches the ``checkpoint_name``
    calls of this forward until one forward has completed, then warns once if needed.
    ``learnt`` is the remat'd function's cache for ckptfx.recording.unrecorded (None: the one
    ``fun`` has, found from ``fun``)."""
    if names is None or names.done or not torch.is_grad_enabled():
        return _call(fun, options, args, kwargs, learnt)
    scope = names.open()
    try:
        out = _call(fun, options, args, kwargs, learnt)
    finally:
        names.close(scope)
    names.finish(scope, fun)
    return out


def _call(fun: Callable[..., Any], options: RematOptions, args: tuple[Any, ...],
          kwargs: dict[str, Any], learnt: dict[Any, Any] | None) -> Any:
    if not torch.is_grad_enabled():
        if options.static_argnums or options.static_argnames:
            _split_static(options, args, kwargs)  # bad static arguments raise all the same
        return fun(*args, **kwargs)
    flat = _FlatCall(fun, options, args, kwargs)
    refuse_new_frame_in_scheduled_replay("a remat'd block")
    if _compat.functorch_level() > 0:
        return flat.function_path(options.policy)
    tensors = flat.tensors
    refill = scope_on_top()  # a ckptfx.refill_outputs() context around this block, if any
    with plain_saves(refill):
        frame = Frame(flat.fn, tuple(tensors), {}, rerun=rerun_function,
                      early_stop=options.early_stop)
    plan = plan_for(fun, options.policy, options.always_record, flat.fn, tensors, args, kwargs,
                    learnt)
    tracer: Tracer | None = None
    pack: Callable[[torch.Tensor], Any]
    unpack: Callable[[Any], torch.Tensor]
    mode: Any
    if plan is not None and plan.unrecorded:  # ckptfx.recording.unrecorded: a plain kernel frame
        pack, unpack, mode = frame.pack, unpack_hook, _NO_MODE
    else:
        names = None
        if reporting():
            _, _, _, _, dyn_args, dyn_kwargs = flat.pytree()
            names = argument_names(fun, dyn_args, dyn_kwargs)
        if isinstance(options.policy, MemoryBudget):  # a memory budget plans
            tracer = tracer_for(options.policy, fun, args, kwargs, tensors)(frame, tensors, names)
        else:
            tracer = Tracer(frame, tensors, options.policy, names)
        pack, unpack, mode = tracer.pack, residual_unpack_hook, tracer
        if plan is not None:
            pack = plan.recording_pack(tracer)
    if plan is not None:
        plan.start(frame)
    handles = collect(frame)
    first = first_node() if refill is not None else None
    if unpack is unpack_hook and handles is not None:  # frame.py Rule 4b
        unpack = frame.reads.__getitem__
    _compat.push_saved_tensors_hooks(pack, unpack)
    try:
        with mode:
            out = flat.fn(*tensors)
    except RuntimeError as err:
        _compat.pop_saved_tensors_hooks()  # on every error path: leave no hooks behind
        uncollect(handles, frame)
        if not _compat.is_saved_tensors_hooks_refusal(err):
            raise
        # The block uses torch.func.grad/vjp inside, which refuses saved-tensor hooks: run it
        # as one autograd.Function instead (same RNG start, so the same values).
        if frame.env.cpu_rng is not None:
            torch.set_rng_state(frame.env.cpu_rng)
        return flat.function_path(options.policy)
    except BaseException:
        _compat.pop_saved_tensors_hooks()
        uncollect(handles, frame)
        raise
    else:
        _compat.pop_saved_tensors_hooks()
    frame.forward_finished()
    if tracer is not None:
        tracer.finish()
        if tracer.hosts:
            finish_offload(tracer, out)
    if plan is not None:
        plan.finish(frame, tracer)
    if refill is not None:
        refill.register(frame, out, tensors, tracer, first)
    return out


_NO_MODE = contextlib.nullcontext()


def unwrap(fun: Callable[..., Any]) -> tuple[Callable[..., Any], RematOptions] | None:
    """The function and options behind a remat'd function, or None for a plain one."""
    return getattr(fun, "__ckptfx_remat__", None)


def argument_names(fun: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
                   ) -> list[str]:
    """A readable name per tensor leaf, in flattening order: ``params['w1']``, ``x``."""
    if isinstance(fun, torch.nn.Module):  # remat(module): its forward names the arguments
        fun = fun.forward
    try:
        params = [p.name for p in inspect.signature(fun).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    paths, leaves, _ = optree.tree_flatten_with_path((args, kwargs), none_is_leaf=True)
    names = []
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, torch.Tensor):
            continue
        where, key, *rest = path
        if where == 0:
            head = params[key] if key < len(params) else f"args[{key}]"
        else:
            head = str(key)
        names.append(head + "".join(f"[{k!r}]" for k in rest))
    return names
