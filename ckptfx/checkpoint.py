"""``ckptfx.checkpoint`` and ``ckptfx.checkpoint_wrapper``: torch's non-reentrant checkpoint,
on ckptfx's own kernel (frame.py), so that sessions and prefire work for it."""

from __future__ import annotations

import functools
import inspect
import types
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Mapping, TypeVar

import torch
import torch.utils.checkpoint as _torch_checkpoint
from torch import nn

from ckptfx import _compat, lowering
from ckptfx.kernel.forward import run_checkpointed
from ckptfx.kernel.frame import CheckpointError
from ckptfx.policies.checks import NameCheck, name_check, shared_name_check
from ckptfx.policies.contexts import checked_contexts
from ckptfx.policies.named import NothingSaveable, check_policy, nothing_saveable
from ckptfx.remat import RematOptions, call

__all__ = ["checkpoint", "checkpoint_wrapper", "noop_context_fn"]

# torch's own default, so ``context_fn is noop_context_fn`` holds for code written for torch.
noop_context_fn = _torch_checkpoint.noop_context_fn

_DETERMINISM_CHECKS = ("default", "none")


class _NoFunction:
    """``checkpoint``'s default for ``function``: none was given (a decorator call)."""

    def __repr__(self) -> str:
        return "<required>"


_NO_FUNCTION: Any = _NoFunction()


def check_use_reentrant(use_reentrant: Any, who: str) -> None:
    """ckptfx is non-reentrant only: ``use_reentrant`` may be False or None (torch's default
    value); True is a ``ValueError`` saying what to do instead, anything else a ``TypeError``."""
    if use_reentrant is False or use_reentrant is None:
        return
    if use_reentrant is True:
        torchs = ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper."
                  "checkpoint_wrapper" if who == "checkpoint_wrapper"
                  else f"torch.utils.checkpoint.{who}")
        raise ValueError(
            f"use_reentrant=True is not supported: ckptfx.{who} is non-reentrant only. Pass "
            f"use_reentrant=False (or omit it), or call {torchs} for the reentrant variant."
        )
    raise TypeError(
        f"use_reentrant must be a bool (False, or omitted: ckptfx is non-reentrant only), "
        f"got {type(use_reentrant).__name__} {use_reentrant!r}"
    )


def check_options(
    *,
    context_fn: Any = noop_context_fn,
    determinism_check: Any = "default",
    debug: Any = False,
    preserve_rng_state: Any = True,
    early_stop: Any = True,
    policy: Any = None,
) -> None:
    """Raise ``TypeError``/``ValueError`` naming the first bad checkpoint option."""
    for name, value in (("debug", debug), ("preserve_rng_state", preserve_rng_state),
                        ("early_stop", early_stop)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    if determinism_check not in _DETERMINISM_CHECKS:
        raise ValueError(
            f"determinism_check must be one of {list(_DETERMINISM_CHECKS)}, "
            f"got {determinism_check!r}"
        )
    if not callable(context_fn):
        raise TypeError(
            "context_fn must be a callable returning (forward_context, recompute_context), "
            f"got {type(context_fn).__name__}"
        )
    if debug and context_fn is not noop_context_fn:
        raise ValueError(
            "debug=True records ops with its own contexts and cannot be combined with a custom "
            "context_fn; drop one of them"
        )
    if policy is not None:
        check_policy(policy, "policy")
        if context_fn is not noop_context_fn:
            raise ValueError(
                "policy= and context_fn= both choose what the checkpoint keeps; pass one of "
                "them (a torch selective-checkpoint policy function works as policy= too)"
            )
        if debug:
            raise ValueError(
                "debug=True traces the plain checkpoint's replay; with policy= the block is "
                "recorded op by op and never re-run blindly. Drop debug=True, and use "
                "ckptfx.print_saved_residuals(ckptfx.remat(fn, policy=...), *args) to see "
                "what the policy keeps"
            )


def checkpoint(
    function: Callable[..., Any] = _NO_FUNCTION,
    *args: Any,
    use_reentrant: bool | None = False,
    context_fn: Callable[[], tuple[ContextManager, ContextManager]] = noop_context_fn,
    determinism_check: str = "default",
    debug: bool = False,
    preserve_rng_state: bool = True,
    early_stop: bool = True,
    policy: Callable[..., Any] | None = None,
    **kwargs: Any,
) -> Any:
    """Checkpoint a block: save only its inputs, replay it in backward to get the rest.

    Same contract as ``torch.utils.checkpoint.checkpoint(function, *args,
    use_reentrant=False, ...)``, on ckptfx's kernel:

    - Each tensor autograd saves inside ``function`` is replaced by a holder; the first
      unpack in a backward call replays ``function`` once for that call (its GraphTask) and
      hands each replayed tensor out once. ``retain_graph=True`` backward replays again each
      time. Inside ``ckptfx.recompute_session_ctx`` the replay is shared across backward
      calls of the session instead (see ``ckptfx.recompute_session_ctx``).
    - Nesting follows torch: an inner checkpoint owns its saved tensors, its inputs are saved
      by the parent, and a replay starts as if no checkpoint were active.
    - The replay restores the forward's CPU and accelerator RNG state (devices of positional
      and keyword tensor arguments) and its autocast state, then puts the caller's RNG back.
      As with torch, an explicit ``torch.Generator`` the block draws from (``generator=g``)
      is not restored, since the kernel does not see the block's ops: the replay would draw
      other numbers. ``ckptfx.remat`` records such generators and replays them exactly.
    - Under ``torch.no_grad``/``inference_mode`` the function just runs and nothing is saved.
    - With ``policy=`` the call is a ``ckptfx.remat`` call: the policy decides per op what
      the backward keeps, and only the rest is recomputed (see ``remat``). The RNG is then
      always restored and every replay is checked op by op, so ``preserve_rng_state`` and
      ``determinism_check`` have nothing left to switch off. Under ``torch.compile`` it is
      lowered as a remat'd block is: torch's checkpoint op with a selective-checkpoint
      policy equivalent to ``policy`` (``checkpoint_name`` tags included; values it would
      offload are kept on the device, unless compiled inside ``ckptfx.offload_in_compile``).
    - Inside a ``torch.func`` transform (``grad``, ``vjp``, ``jacrev``, where saved-tensor
      hooks cannot run and torch's checkpoint fails, and ``vmap``/``jvp``), a call without
      ``policy=`` runs as ``policy=checkpoint_policies.nothing_saveable``: remat's
      torch.func path, which recomputes everything, with the same gradients bit for bit.
      Under ``grad``/``vjp``/``jacrev``, ``context_fn=`` and ``debug=True`` have nothing to
      run in and raise ``CheckpointError`` (pass a selective-checkpoint policy function as
      ``policy=``); under ``vmap``/``jvp`` they run as a plain checkpoint.
    - Under ``torch.compile`` (dynamo tracing this call) it is torch's checkpoint op, with
      random numbers replayed on every backend (see ``ckptfx.lowering``); it joins no
      recompute session (a ``CompiledReplayWarning`` says so). To keep sessions, prefire
      and ``vjp_split``, compile the block and checkpoint the compiled block:
      ``checkpoint(torch.compile(block), x)`` replays its compiled code.
    - Collectives are not replayed (unlike torch): where ``torch.distributed`` is initialized
      (or an op was passed to ``ckptfx.register_collective``) the forward logs the outputs
      of each c10d / functional collective in the block, and the replay, which re-runs the
      Python function, is answered from that log instead of calling them again, so ranks
      cannot desynchronise by replaying different collectives. A replay that calls another
      collective than the forward raises ``CheckpointError``. FSDP2's own all-gathers are
      not the block's and run as usual. See ``ckptfx.kernel.collectives``.

    Args:
        function: the block; called as ``function(*args, **kwargs)``. Outputs may be any
            structure (tensors, dicts, lists, non-tensors).
        use_reentrant: must be False (or None): ckptfx is non-reentrant only.
        context_fn: returns ``(forward_ctx, recompute_ctx)``, entered around the forward and
            each replay; anything but a pair of context managers is a ``TypeError`` naming
            ``context_fn``, raised in the forward before anything is saved (torch fails
            later, some results only in the backward). torch's
            ``create_selective_checkpoint_contexts`` works as with torch, and exactly where
            torch's does not: a value its cache holds that the block, or the caller after
            the forward, then writes in place is recomputed by the replay rather than
            handed out written (torch refuses it as "mutated", or, for a write through
            matmul's ``_unsafe_view`` alias that its version check cannot see, gives wrong
            gradients). See ``ckptfx.policies.contexts``.
        determinism_check: ``"default"`` checks the count and the shape, dtype and device of
            every tensor saved by the replay against the forward; ``"none"`` checks nothing.
        debug: on a replay mismatch, add the forward's and the replay's op traces to the
            error (which then says debug is why, in place of the tip to turn it on). As for
            torch's checkpoint, ``torch.utils.checkpoint.set_checkpoint_debug_enabled(True)``
            or ``(False)``, active when the block runs forward, overrides ``debug``
            (``None`` defers to it), and turned on that way debug refuses a custom
            ``context_fn`` (``ValueError``). Calls that run as ``remat`` (``policy=``, or
            inside a ``torch.func`` transform) replay recorded ops with nothing to trace and
            ignore the switch. Under ``torch.compile`` the call is torch's checkpoint op,
            which torch 2.13 refuses under ``set_checkpoint_debug_enabled(True)`` as it
            refuses its own (``ValueError``: its compiled op always passes a
            ``context_fn``).
        preserve_rng_state: restore RNG for the replay (needed for dropout parity).
        early_stop: stop the replay once every saved tensor is recomputed, where torch's
            stops (in the pack of the last saved tensor: the same ops run, on any machine and
            under any load). Per call (torch's global ``set_checkpoint_early_stop`` does not
            change it). It never changes a gradient: an op that fills a tensor it saved
            (``nn.RReLU``) is let finish first, where torch 2.13 stops before it.
        policy: what to keep, as in ``remat(policy=...)``: a ``ckptfx.checkpoint_policies``
            policy or a torch selective-checkpoint policy function. Not together with
            ``context_fn`` or ``debug=True`` (a ``ValueError``). Being an option of
            ``checkpoint``, the name ``policy`` is not passed on to ``function``.

    Example::

        import ckptfx
        out = ckptfx.checkpoint(block, x, mask=mask)
        out.sum().backward()

        # keep the matmul outputs, recompute the rest (for a whole Hugging Face model:
        # ckptfx.apply_activation_checkpointing(model, policy=cp.dots_saveable))
        from ckptfx import checkpoint_policies as cp
        out = ckptfx.checkpoint(block, x, policy=cp.dots_saveable)

        # the curried form (torch's after 2.13, torch_remat's): options first, then the
        # function, then its arguments; also a decorator
        out = ckptfx.checkpoint(early_stop=False)(block)(x, mask=mask)
    """
    if function is _NO_FUNCTION:  # checkpoint(**cfg)(fn)(*args): torch's curried form
        return _curried(kwargs, use_reentrant=use_reentrant, context_fn=context_fn,
                        determinism_check=determinism_check, debug=debug,
                        preserve_rng_state=preserve_rng_state, early_stop=early_stop,
                        policy=policy)
    if use_reentrant is not False:
        check_use_reentrant(use_reentrant, "checkpoint")
    if not callable(function):
        raise TypeError(f"function must be callable, got {type(function).__name__}")
    if (policy is None and context_fn is noop_context_fn and debug is False
            and preserve_rng_state is True and early_stop is True
            and determinism_check == "default"):  # the defaults need no check (a hot path)
        options = DEFAULT_OPTIONS
    else:
        options = _checked_options(context_fn, determinism_check, debug, preserve_rng_state,
                                   early_stop, policy)
    if not args and not kwargs:  # a function of no arguments, or checkpoint used as remat
        try:
            return run(function, args, kwargs, policy, options)
        except TypeError as err:
            if (hasattr(err, "add_note") and "required positional argument" in str(err)
                    and not _callable_without_arguments(function)):
                err.add_note(
                    "ckptfx.checkpoint(function, *args) calls function(*args) now, as torch's "
                    "checkpoint does, and none were given. To make a checkpointed function "
                    "to call later (jax.checkpoint's way, or as a decorator), use "
                    "ckptfx.remat(function, policy=...) or @ckptfx.remat(policy=...)")
            raise
    return run(function, args, kwargs, policy, options)


def _checked_options(context_fn: Any, determinism_check: Any, debug: Any,
                     preserve_rng_state: Any, early_stop: Any, policy: Any
                     ) -> Mapping[str, Any]:
    check_options(context_fn=context_fn, determinism_check=determinism_check, debug=debug,
                  preserve_rng_state=preserve_rng_state, early_stop=early_stop, policy=policy)
    return {"context_fn": context_fn, "determinism_check": determinism_check, "debug": debug,
            "preserve_rng_state": preserve_rng_state, "early_stop": early_stop}


def _curried(unknown: dict[str, Any], **cfg: Any) -> Callable[[Callable[..., Any]],
                                                               Callable[..., Any]]:
    """``checkpoint(**cfg)``: what takes the function, torch's curried form (also a decorator:
    ``@ckptfx.checkpoint(policy=...)``). The options are checked here, at once, and the
    function's own keyword arguments (even one named ``policy`` or ``debug``) go to it."""
    if unknown:
        raise TypeError(
            f"checkpoint() got keyword arguments {sorted(unknown)} but no function: in the "
            "curried form checkpoint(**options)(function)(*args, **kwargs) the options are "
            "checkpoint's own (use_reentrant, context_fn, determinism_check, debug, "
            "preserve_rng_state, early_stop, policy); the function's keyword arguments go "
            "to the last call")
    if cfg["use_reentrant"] is not False:
        check_use_reentrant(cfg["use_reentrant"], "checkpoint")
    policy = cfg["policy"]
    options = _checked_options(cfg["context_fn"], cfg["determinism_check"], cfg["debug"],
                               cfg["preserve_rng_state"], cfg["early_stop"], policy)

    def configure(function: Callable[..., Any]) -> Callable[..., Any]:
        if not callable(function):
            raise TypeError(f"function must be callable, got {type(function).__name__}")

        @functools.wraps(function)
        def checkpointed(*args: Any, **kwargs: Any) -> Any:
            return run(function, args, kwargs, policy, options)
        return checkpointed
    return configure


def _callable_without_arguments(function: Callable[..., Any]) -> bool:
    try:
        inspect.signature(function).bind()
    except TypeError:
        return False
    except ValueError:  # no signature to read
        return True
    return True


def run(function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
        policy: Any, options: Mapping[str, Any], names: NameCheck | None = None) -> Any:
    """A checkpoint call, its options checked (``options``: ``checkpoint``'s keyword
    options but ``policy``; ``names``: a ``checkpoint_wrapper``'d module's name check), for
    ``checkpoint`` and ``checkpoint_wrapper`` alike: with a policy (inside a torch.func
    transform, also without one) a ``remat`` call; under ``torch.compile`` torch's
    checkpoint; else the kernel's, with torch's global ``set_checkpoint_debug_enabled``
    applied over ``debug`` and a custom ``context_fn`` called through ``checked_contexts``
    (its result checked, torch's selective-checkpoint cache guarded against later writes)."""
    compiling = _compat.is_compiling()
    if policy is None and _compat.functorch_level(compiling) > 0:
        policy = policy_under_func(options.get("context_fn", noop_context_fn),
                                   options.get("debug", False))
    if policy is not None:
        if names is None and not compiling:  # checkpoint(fn, policy=...): the block's check
            names = shared_name_check(function, policy)
        return run_with_policy(function, args, kwargs, policy=policy,
                               early_stop=options.get("early_stop", True), names=names)
    if compiling:
        return torch_fallback(function, args, kwargs, **options)
    # torch's global switch (set_checkpoint_debug_enabled), read per call as torch does
    debug_everywhere = _compat.checkpoint_debug_enabled()
    if debug_everywhere is not None and debug_everywhere is not options.get("debug", False):
        options = with_global_debug(options, debug_everywhere)
    if options is DEFAULT_OPTIONS:  # no keywords to parse: the common call
        return run_checkpointed(function, args, kwargs)
    context_fn = options.get("context_fn", noop_context_fn)
    if context_fn is not noop_context_fn:  # its result checked, SAC caches guarded
        options = {**options, "context_fn": functools.partial(checked_contexts, context_fn)}
    return run_checkpointed(function, args, kwargs, **options)


def with_global_debug(options: Mapping[str, Any], enabled: bool) -> Mapping[str, Any]:
    """``options`` with ``debug`` set by ``torch.utils.checkpoint.set_checkpoint_debug_enabled``
    (``enabled``, not None), which overrides the per-call ``debug=`` as it does for torch's
    checkpoint; like torch, debug turned on this way refuses a custom ``context_fn``."""
    if enabled and options.get("context_fn", noop_context_fn) is not noop_context_fn:
        raise ValueError(
            "torch.utils.checkpoint.set_checkpoint_debug_enabled(True) turns debug on for "
            "this checkpoint, and debug records ops with its own contexts: it cannot be "
            "combined with a custom context_fn. Run this call outside that context (or "
            "inside set_checkpoint_debug_enabled(None), which defers to debug=), or drop "
            "context_fn"
        )
    return {**options, "debug": enabled}


def policy_under_func(context_fn: Any, debug: bool) -> Any:
    """The policy of a checkpoint call without one inside a ``torch.func`` transform, or
    None to run it as a plain checkpoint. Where saved-tensor hooks are off (``grad``,
    ``vjp``, ``jacrev``: torch's checkpoint fails there) and also under ``vmap``/``jvp``
    with autograd outside them, a call with no options runs as ``nothing_saveable``, which
    recomputes everything, as the plain checkpoint does, through remat's torch.func path
    (the same gradients, bitwise). With a ``context_fn`` or ``debug=True`` the plain
    checkpoint runs where the hooks are on, and a ``CheckpointError`` says what to pass
    where they are off. Without grad the function just runs: no policy needed."""
    if not torch.is_grad_enabled():
        return None
    if context_fn is noop_context_fn and not debug:
        return nothing_saveable
    if _compat.saved_tensors_hooks_enabled():
        return None
    if context_fn is not noop_context_fn:
        raise CheckpointError(
            "ckptfx.checkpoint with context_fn= was called inside a torch.func transform "
            "(grad, vjp, jacrev, ...) that refuses saved-tensor hooks, so the contexts "
            "cannot choose what to keep. Pass the selective-checkpoint policy function as "
            "policy= instead of create_selective_checkpoint_contexts(...), or a "
            "ckptfx.checkpoint_policies policy"
        )
    raise CheckpointError(
        "ckptfx.checkpoint(debug=True) was called inside a torch.func transform (grad, vjp, "
        "jacrev, ...): there the block is recorded op by op and replayed exactly, so there "
        "is no re-run to debug. Drop debug=True"
    )


def torch_fallback(function: Callable[..., Any], args: tuple[Any, ...],
                   kwargs: dict[str, Any], **options: Any) -> Any:
    """Hand the call to torch's checkpoint (under ``torch.compile``, which traces that one),
    with the context of ``ckptfx.lowering.checkpoint_context_fn`` (dynamo's eager backend
    would otherwise recompute with new random numbers)."""
    lowering.note_lowered("ckptfx.checkpoint")
    options.pop("debug", None)  # op traces of a compiled graph's replay: none to show
    options["context_fn"] = lowering.checkpoint_context_fn(
        options.get("context_fn", noop_context_fn), options.get("preserve_rng_state", True))
    return _torch_checkpoint.checkpoint(function, *args, use_reentrant=False, **options,
                                        **kwargs)


def run_with_policy(function: Callable[..., Any], args: tuple[Any, ...],
                    kwargs: dict[str, Any], *, policy: Callable[..., Any], early_stop: bool,
                    names: NameCheck | None = None) -> Any:
    """A checkpoint call with a policy: one ``remat`` call (options already checked).

    ``names`` is the unused-name check: a ``checkpoint_wrapper``'d module's own, or for a
    bare ``checkpoint(fn, policy=...)`` call the block's shared one (``shared_name_check``:
    each call may pass a new function, as Hugging Face passes a new ``functools.partial``
    per layer call).
    """
    if _compat.is_compiling():  # as remat under compile (ckptfx.lowering, Rule 1)
        return lowering.lower(function, lowering.policy_context_fn(policy), args, kwargs,
                              "ckptfx.checkpoint(policy=...)")
    lowering.policy_context_fn(policy)  # made now, outside compiled code, for compiled calls
    # nothing_saveable is remat's own default (None), without asking a policy per op
    decide = None if isinstance(policy, NothingSaveable) else policy
    return call(function, RematOptions(decide, early_stop, (), frozenset()), args, kwargs,
                names)


# checkpoint()'s keyword options when all are left at their defaults, read from the one place
# that holds them (run_checkpointed's signature), so a default call can skip passing them
DEFAULT_OPTIONS: Mapping[str, Any] = types.MappingProxyType({
    name: p.default for name, p in inspect.signature(run_checkpointed).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY})


# -- checkpoint_wrapper ---------------------------------------------------------------------

M = TypeVar("M", bound=nn.Module)
_WRAPPED_CLASSES: dict[type, type] = {}


if TYPE_CHECKING:  # the mixin only ever comes before an nn.Module subclass
    _MixinBase = nn.Module
else:
    _MixinBase = object


class _CheckpointedModule(_MixinBase):
    """Mixin of the classes made by ``checkpoint_wrapper`` (always before an
    ``nn.Module`` subclass in their bases)."""

    _ckptfx_options: dict[str, Any]
    _ckptfx_names: NameCheck | None
    _ckptfx_original_class: type

    def __reduce_ex__(self, protocol: Any) -> Any:
        # The generated class cannot be found by name; the original one can, and the
        # subclass is made again from it (torch.save(model) / torch.load, pickle).
        return (_new_checkpointed, (self._ckptfx_original_class,), self.__getstate__())

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        inner = self._ckptfx_original_class.forward.__get__(self)  # type: ignore[attr-defined]
        options = self._ckptfx_options  # with a policy, read for early_stop only
        return run(inner, args, kwargs, options.get("policy"), options,
                   self.__dict__.get("_ckptfx_names"))


def _new_checkpointed(cls: type) -> Any:
    """Unpickling: a bare instance of ``cls``'s checkpointed subclass (state comes next)."""
    return object.__new__(_wrapped_class(cls))


def _forward_of(cls: type) -> Callable[..., Any]:
    """The mixin's forward as a function of this class's own: the same code (no extra
    call per forward), with ``cls.forward``'s signature and docstring (``__wrapped__``), so
    ``inspect.signature(module.forward)`` and residual reports name the arguments as the
    plain module does."""
    shared = _CheckpointedModule.forward
    forward = types.FunctionType(shared.__code__, shared.__globals__, "forward",
                                 shared.__defaults__, shared.__closure__)
    original = cls.forward  # type: ignore[attr-defined]
    forward.__qualname__ = f"Checkpointed{cls.__name__}.forward"
    forward.__doc__ = original.__doc__
    forward.__wrapped__ = original  # type: ignore[attr-defined]
    return forward


def _wrapped_class(cls: type) -> type:
    sub = _WRAPPED_CLASSES.get(cls)
    if sub is None:
        # The original module name on purpose: torch.fx keeps a torch.nn module a leaf by
        # its class's __module__, so a wrapped nn.Linear stays one call_module node (under
        # ckptfx's name fx would trace into the checkpoint's machinery). Pickling does not
        # look the class up by name (__reduce_ex__ above).
        sub = type(f"Checkpointed{cls.__name__}", (_CheckpointedModule, cls),
                   {"_ckptfx_original_class": cls, "__module__": cls.__module__,
                    "forward": _forward_of(cls)})
        _WRAPPED_CLASSES[cls] = sub
    return sub


def checkpoint_wrapper(module: M, **checkpoint_kwargs: Any) -> M:
    """Make ``module``'s forward run under ``ckptfx.checkpoint``; returns the same module.

    The module is changed in place (its class becomes a subclass of its own class, as
    ``torch.nn.utils.parametrize`` does), so parameter names, ``state_dict`` keys, hooks and
    ``isinstance`` checks are all unchanged, and ``torch.save(model)`` / ``torch.load``
    work. ``checkpoint_kwargs`` are the keyword options of ``ckptfx.checkpoint``
    (``context_fn``, ``determinism_check``, ``debug``, ``preserve_rng_state``,
    ``early_stop``, ``policy``), checked now; ``context_fn``'s result and torch's global
    ``set_checkpoint_debug_enabled`` are read at each call. With ``policy=`` each call is a
    ``ckptfx.remat`` call of the module's forward, and a name-based policy whose names the
    forward never uses warns once per module. Calling it again updates the options. ``unwrap_checkpoint(module)``
    restores the plain module.

    Example::

        for block in model.blocks:
            ckptfx.checkpoint_wrapper(block)
        # or keep the matmul outputs and recompute only the cheap ops:
        ckptfx.checkpoint_wrapper(model.blocks[0], policy=cp.dots_saveable)
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    accepted = ("context_fn", "determinism_check", "debug", "preserve_rng_state", "early_stop",
                "use_reentrant", "policy")
    unknown = set(checkpoint_kwargs) - set(accepted)
    if unknown:
        torchs = {"checkpoint_impl", "checkpoint_fn"} & unknown
        raise TypeError(
            f"checkpoint_wrapper got unknown checkpoint options {sorted(unknown)}; it takes "
            f"{', '.join(accepted)}"
            + (f" ({' and '.join(sorted(torchs))} of torch's checkpoint_wrapper has no "
               "counterpart: ckptfx's always applies ckptfx.checkpoint)" if torchs else ""))
    check_use_reentrant(checkpoint_kwargs.pop("use_reentrant", False), "checkpoint_wrapper")
    check_options(**checkpoint_kwargs)
    if checkpoint_kwargs.get("policy", 0) is None:
        del checkpoint_kwargs["policy"]  # policy=None: the plain checkpoint
    if not isinstance(module, _CheckpointedModule):
        module.__class__ = _wrapped_class(type(module))
    # Through __dict__: nn.Module.__setattr__ would look for parameters and submodules.
    module.__dict__["_ckptfx_options"] = dict(checkpoint_kwargs)
    module.__dict__["_ckptfx_names"] = name_check(checkpoint_kwargs.get("policy"))
    if "policy" in checkpoint_kwargs:  # made now, outside compiled code, for compiled calls
        lowering.policy_context_fn(checkpoint_kwargs["policy"])
    return module


def unwrap_checkpoint(module: M) -> M:
    """Undo ``checkpoint_wrapper`` in place; returns the same module.

    Only ``module`` itself is unwrapped: one that is not wrapped is returned unchanged, and
    so are its submodules (to unwrap every wrapped block of a model, call it on each of
    ``model.modules()``).

    Example::

        ckptfx.checkpoint_wrapper(block)
        ...
        ckptfx.unwrap_checkpoint(block)   # plain forward again
        for m in model.modules():          # every wrapped module of a model
            ckptfx.unwrap_checkpoint(m)
    """
    if isinstance(module, _CheckpointedModule):
        module.__class__ = module._ckptfx_original_class
        module.__dict__.pop("_ckptfx_options", None)
        module.__dict__.pop("_ckptfx_names", None)
    return module
