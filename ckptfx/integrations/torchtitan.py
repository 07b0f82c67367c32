"""ckptfx as a torchtitan activation-checkpointing choice.

torchtitan (``pip install torchtitan``) picks its activation checkpointing in its trainer
config, ``activation_checkpoint=FullAC.Config()`` (or ``SelectiveAC``, ``MemoryBudgetAC``),
and its ``parallelize_fn`` applies it with ``config.build(dump_folder=...).apply(model)``.
``CkptfxAC`` is one more such choice, checkpointing with ckptfx: a full checkpoint, a
``ckptfx.checkpoint_policies`` policy, or a whole-model memory budget. ``apply_ac`` does
the same for code that does not use torchtitan's config system, and ``pipeline_llm`` (or
``ckptfx_pipelining`` around any torchtitan pipelining function) builds the pipeline stages
as ``ckptfx.pipelining.PipelineStage``, so that under a zero-bubble schedule the input (I)
and weight (W) steps of a micro-batch share one replay of each block.

Rules:

1. **Where torchtitan's would.** The blocks are the children of the model's ``layers``
   container, the ones torchtitan's ``ActivationCheckpointing.apply`` wraps, each wrapped in
   place by ``ckptfx.checkpoint_wrapper``: the block stays the same object in the same slot
   (torch's wrapper, which torchtitan's ``FullAC`` uses, puts a new module there), so module
   paths and parameter names stay as they were, with no ``_checkpoint_wrapped_module``
   level, and the gradients are those of the model without checkpointing, bit for bit.
2. **What a block keeps.** ``policy`` is a ``ckptfx.checkpoint_policies`` policy (in a
   config, its name: ``"dots_saveable"``); ``memory_budget`` instead spreads a whole-model
   budget over the blocks (``ckptfx.memory_budget_policies``: they keep at most that fraction
   of what ``everything_saveable`` would); neither is a full checkpoint (only each block's
   inputs kept). ckptfx's budget runs in eager mode, unlike torchtitan's ``MemoryBudgetAC``,
   a setting of the compiler's partitioner.
3. **torch's checkpoint options carry over**: ``preserve_rng_state``, ``determinism_check``
   and ``debug`` of the config mean what they mean for torchtitan's ``FullAC``.
4. **Bad input fails before anything changes**: an unknown policy name, a policy factory, a
   policy together with a budget, a model without ``layers``, or a block already wrapped by
   torch's ``checkpoint_wrapper`` (two checkpoints of one block only add replays).
5. **Pipelining.** ``ckptfx_pipelining(fn)`` calls the pipelining function ``fn`` with
   torchtitan's pipeline module building ``ckptfx.pipelining.PipelineStage`` where it builds
   torch's stage: the module's name for the stage class is rebound for the call and
   restored after it, also on error, under a lock that serialises such calls (a stage
   another thread builds through that module meanwhile is ckptfx's too). The stage changes
   only the I and W steps of blocks that ckptfx checkpoints; others run as on torch's.
6. **Lazy.** ``import ckptfx`` and ``import ckptfx.integrations`` never import torchtitan;
   importing this module without torchtitan raises an ``ImportError`` that says how to
   install it.

Example (torchtitan's config system; the trainer's ``parallelize_fn`` applies it)::

    from ckptfx.integrations.torchtitan import CkptfxAC, pipeline_llm
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    def llama3_debugmodel_ckptfx():        # a config function, as in a config registry
        config = llama3_debugmodel()
        config.activation_checkpoint = CkptfxAC.Config(policy="dots_saveable")
        # or CkptfxAC.Config() (full), CkptfxAC.Config(memory_budget=0.3)
        config.model_spec.pipelining_fn = pipeline_llm   # zero-bubble: one replay for I and W
        return config

On torchtitan's command line (tyro) such a config stays ``CkptfxAC.Config``: tyro warns
that it is none of torchtitan's own choices and keeps it as the ``activation-checkpoint:config``
subcommand, after which its fields are set, e.g.
``activation-checkpoint:config --activation-checkpoint.policy nothing_saveable``.

Example (a model built by hand)::

    from ckptfx import checkpoint_policies as cp
    from ckptfx.integrations.torchtitan import apply_ac

    model = model_config.build()
    apply_ac(model, policy=cp.dots_saveable)     # or apply_ac(model, memory_budget=0.3)
    model(tokens).float().logsumexp(-1).mean().backward()

On CPU: torchtitan's language models attend with FlexAttention or varlen attention; torch
has no CPU backward for FlexAttention, so a CPU training run (ckptfx's own tests) swaps each
block's ``attention.inner_attention`` for torchtitan's ``ScaledDotProductAttention`` (causal).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import threading
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch.distributed.pipelining as _torch_pipelining
from torch import nn

from ckptfx.budget import memory_budget_policies
from ckptfx.checkpoint import checkpoint_wrapper
from ckptfx.pipelining import PipelineStage
from ckptfx.policies import Policy
from ckptfx.policies.budget_policy import MemoryBudget
from ckptfx.policies.named import check_policy, checkpoint_policies

_INSTALL = (
    "ckptfx.integrations.torchtitan needs torchtitan and the packages its modules import: "
    "pip install torchtitan tyro spmd_types (beside a torch that is not a nightly, install "
    "torchtitan with --no-deps so that pip keeps your torch)"
)

# By name (importlib), typed Any: the type checker does not read torchtitan, which has no
# type information and may be absent.
try:
    _tt_ac: Any = importlib.import_module("torchtitan.distributed.activation_checkpoint")
    _tt_pipeline: Any = importlib.import_module("torchtitan.distributed.pipeline_parallel")
    _tt_logger: Any = importlib.import_module("torchtitan.tools.logging").logger
except ImportError as error:  # pragma: no cover - the tests run with torchtitan installed
    raise ImportError(f"{_INSTALL} ({error})") from error

_ActivationCheckpointing: Any = _tt_ac.ActivationCheckpointing

__all__ = ["CkptfxAC", "apply_ac", "ckptfx_pipelining", "pipeline_llm"]

F = TypeVar("F", bound=Callable[..., Any])

_DETERMINISM_CHECKS = ("default", "none")


class CkptfxAC(_ActivationCheckpointing):
    """torchtitan activation checkpointing with ckptfx: full, a policy, or a memory budget.

    Chosen in torchtitan's trainer config as ``activation_checkpoint=CkptfxAC.Config(...)``;
    ``Config.build(dump_folder=...)`` makes the object whose ``apply(model)`` checkpoints the
    model's ``layers``, as torchtitan's ``parallelize_fn`` calls it (see the module
    docstring's Rules).

    Example::

        ac = CkptfxAC.Config(policy="dots_saveable").build(dump_folder="")
        ac.apply(model)       # each model.layers block checkpointed by ckptfx, in place
    """

    @dataclass(kw_only=True, slots=True)
    class Config(_ActivationCheckpointing.Config):
        """``policy``: the name of a ``ckptfx.checkpoint_policies`` policy
        (``"dots_saveable"``, ``"nothing_saveable"``, ...; from Python also a policy
        object, e.g. ``checkpoint_policies.save_only_these_names("attn")``); ``None``: a full
        checkpoint; a factory whose arguments all have defaults is called
        (``"offload_dot_with_no_batch_dims"``). ``memory_budget``: instead of a policy, the
        fraction in ``[0, 1]`` of what ``everything_saveable`` would keep that all the blocks
        together keep on the device; ``offload``, with it, the fraction they may keep in host
        memory besides (``memory_budget(fraction, offload=...)``). ``early_stop``: as in
        ``ckptfx.checkpoint``. The other fields are torchtitan's.

        Example::

            CkptfxAC.Config(memory_budget=0.3)
        """

        policy: str | None = None
        memory_budget: float | None = None
        offload: float | None = None
        early_stop: bool = True

        def __post_init__(self) -> None:
            _checked_options(self.policy, self.memory_budget, self.offload, self.early_stop,
                             self.determinism_check, self.debug, self.preserve_rng_state)

    def __init__(self, config: CkptfxAC.Config, dump_folder: str = "") -> None:
        super().__init__(config, dump_folder)
        self.config: CkptfxAC.Config = config

    def _wrap_block(self, module: nn.Module, *, base_fqn: str | None = None) -> nn.Module:
        """Checkpoint one block in place and return it (the same module). With a
        ``memory_budget``, a block wrapped alone keeps at most that fraction of its own."""
        c = self.config
        policy = _checked_options(c.policy, c.memory_budget, c.offload, c.early_stop,
                                  c.determinism_check, c.debug, c.preserve_rng_state)
        if c.memory_budget is not None:
            policy = checkpoint_policies.memory_budget(float(c.memory_budget),
                                                       float(c.offload or 0.0))
        _check_block(module, base_fqn or type(module).__name__)
        return _wrap(module, policy, c)

    def apply(self, model: nn.Module) -> None:
        """Checkpoint every block of ``model.layers`` in place.

        Example::

            CkptfxAC.Config().build(dump_folder="").apply(model)
        """
        c = self.config
        _apply(model, c.policy, c.memory_budget, c.offload, c)
        _tt_logger.info(f"Applied {type(self).__name__} activation checkpointing to the model")


def apply_ac(
    model: nn.Module,
    policy: Callable[..., Any] | str | None = None,
    *,
    memory_budget: float | None = None,
    offload: float | None = None,
    early_stop: bool = True,
    preserve_rng_state: bool = True,
    determinism_check: str = "default",
    debug: bool = False,
) -> nn.Module:
    """Checkpoint the blocks of a torchtitan model's ``layers`` with ckptfx, in place;
    returns ``model``. ``CkptfxAC`` without the config system.

    Args:
        model: a torchtitan model (or a pipeline stage's part of one): a module with a
            ``layers`` container of blocks.
        policy: a ``ckptfx.checkpoint_policies`` policy (or its name, or a torch
            selective-checkpoint policy function); ``None``: a full checkpoint.
        memory_budget: instead of ``policy``, a whole-model budget in ``[0, 1]`` (the blocks
            keep at most that fraction of what ``everything_saveable`` would).
        offload: with ``memory_budget``, the fraction of the same bytes they may keep in
            host memory besides (``ckptfx.memory_budget_policies(..., offload=)``).
        early_stop, preserve_rng_state, determinism_check, debug: as in
            ``ckptfx.checkpoint``.

    Raises:
        TypeError: a policy factory or a non-policy, or an option of the wrong type.
        ValueError: an unknown policy name, both ``policy`` and ``memory_budget``, a budget
            or offload outside ``[0, 1]``, ``offload`` without ``memory_budget``, no
            ``layers``, or a block torch already checkpoints.

    Example::

        from ckptfx import checkpoint_policies as cp
        from ckptfx.integrations.torchtitan import apply_ac

        apply_ac(model, policy=cp.dots_saveable)
        apply_ac(other_model, memory_budget=0.3)
    """
    options = _Options(early_stop=early_stop, preserve_rng_state=preserve_rng_state,
                       determinism_check=determinism_check, debug=debug)
    _apply(model, policy, memory_budget, offload, options)
    return model


def ckptfx_pipelining(pipelining_fn: F) -> F:
    """``pipelining_fn`` (a torchtitan ``ModelSpec.pipelining_fn``, e.g. ``pipeline_llm``
    or ``pipeline_vlm``), building its stages as ``ckptfx.pipelining.PipelineStage``.

    Under a zero-bubble schedule (``ZBVZeroBubble``, ``InterleavedZeroBubble``) the I and W
    steps of a micro-batch then share one replay of each block that ckptfx checkpoints
    (``CkptfxAC``); torch's stage replays such a block for I and again for each parameter
    group of W (but on the first stage, whose W step is one full backward).

    Example::

        from torchtitan.distributed.pipeline_parallel import pipeline_vlm

        model_spec.pipelining_fn = ckptfx_pipelining(pipeline_vlm)
    """
    if not callable(pipelining_fn):
        raise TypeError(f"pipelining_fn must be a callable (torchtitan's pipeline_llm or one "
                        f"like it), got {type(pipelining_fn).__name__}")

    @functools.wraps(pipelining_fn)
    def build(*args: Any, **kwargs: Any) -> Any:
        with _STAGE_LOCK:
            built = getattr(_tt_pipeline, "PipelineStage", None)
            if built is PipelineStage:  # already inside a ckptfx_pipelining call
                return pipelining_fn(*args, **kwargs)
            if built is not _torch_pipelining.PipelineStage:
                raise ValueError(
                    "ckptfx_pipelining: torchtitan's pipeline module builds "
                    f"{getattr(built, '__qualname__', built)!r}, not torch's PipelineStage; "
                    "ckptfx would replace another stage class. Build the stages with "
                    "ckptfx.pipelining.PipelineStage yourself")
            _tt_pipeline.PipelineStage = PipelineStage
            try:
                return pipelining_fn(*args, **kwargs)
            finally:
                _tt_pipeline.PipelineStage = built

    return build  # type: ignore[return-value]


# Reentrant: a pipelining function may call another one wrapped the same way.
_STAGE_LOCK = threading.RLock()

pipeline_llm = ckptfx_pipelining(_tt_pipeline.pipeline_llm)
"""torchtitan's ``pipeline_llm`` (a ``ModelSpec.pipelining_fn``) with ckptfx's stages.

Example::

    model_spec.pipelining_fn = ckptfx.integrations.torchtitan.pipeline_llm
"""


# -- internals ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Options:
    """torch's checkpoint options of ``apply_ac`` (the fields ``CkptfxAC.Config`` has too)."""

    early_stop: bool
    preserve_rng_state: bool
    determinism_check: str
    debug: bool


def _checked_options(policy: Any, memory_budget: Any, offload: Any, early_stop: Any,
                     determinism_check: Any, debug: Any, preserve_rng_state: Any) -> Any:
    """The policy ``policy`` names (or is), after every option is checked."""
    for name, value in (("early_stop", early_stop), ("debug", debug),
                        ("preserve_rng_state", preserve_rng_state)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    if determinism_check not in _DETERMINISM_CHECKS:
        raise ValueError(f"determinism_check must be one of {_DETERMINISM_CHECKS}, got "
                         f"{determinism_check!r}")
    if offload is not None and memory_budget is None:
        raise ValueError("offload is the host share of memory_budget: give memory_budget too "
                         "(or, with a policy, an offload policy such as "
                         "policy='offload_dot_with_no_batch_dims')")
    if memory_budget is not None:
        if policy is not None:
            raise ValueError("give policy or memory_budget, not both: a budget chooses each "
                             "block's policy itself")
        if isinstance(memory_budget, int) and not isinstance(memory_budget, bool):
            memory_budget = float(memory_budget)  # a config file's 0 or 1
        if isinstance(offload, int) and not isinstance(offload, bool):
            offload = float(offload)
        # their TypeError/ValueError name the fraction and the offload
        MemoryBudget(memory_budget, 0.0 if offload is None else offload)
        return None
    if isinstance(policy, str):
        return _policy_named(policy)
    if policy is not None:
        check_policy(policy, "policy")
    return policy


def _policy_named(name: str) -> Any:
    ready = sorted(n for n, v in vars(checkpoint_policies).items()
                   if not n.startswith("_") and isinstance(v, Policy))
    chosen = getattr(checkpoint_policies, name, None) if not name.startswith("_") else None
    if chosen is None:
        raise ValueError(f"policy: unknown policy {name!r}; expected the name of one of "
                         f"ckptfx.checkpoint_policies' policies: {', '.join(ready)}")
    if not isinstance(chosen, Policy) and callable(chosen) and all(
            p.default is not inspect.Parameter.empty
            for p in inspect.signature(chosen).parameters.values()):
        return chosen()  # a factory that needs no arguments: offload_dot_with_no_batch_dims
    if not isinstance(chosen, Policy):
        raise TypeError(
            f"policy={name!r} names a policy factory, which takes arguments: pass the policy "
            f"object from Python (policy=ckptfx.checkpoint_policies.{name}(...)), or one of "
            f"{', '.join(ready)}")
    return chosen


def _blocks_of(model: nn.Module) -> list[tuple[str, nn.Module]]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.Module):
        raise ValueError(
            f"model: {type(model).__name__} has no 'layers' container of blocks (torchtitan's "
            "models keep their transformer blocks in model.layers); for another model use "
            "ckptfx.apply_activation_checkpointing")
    return [(f"layers.{name}", block) for name, block in layers.named_children()]


def _check_block(block: nn.Module, fqn: str) -> None:
    if hasattr(block, "_checkpoint_wrapped_module"):
        raise ValueError(
            f"model.{fqn} is already checkpointed by torch's checkpoint_wrapper (torchtitan's "
            "FullAC or SelectiveAC): apply one activation checkpointing, not both")


def _wrap(block: nn.Module, policy: Any, options: Any) -> nn.Module:
    kwargs: dict[str, Any] = {
        "early_stop": options.early_stop, "preserve_rng_state": options.preserve_rng_state,
        "determinism_check": options.determinism_check, "debug": options.debug}
    if policy is not None:
        kwargs["policy"] = policy
    return checkpoint_wrapper(block, **kwargs)


def _apply(model: nn.Module, policy: Any, memory_budget: float | None, offload: float | None,
           options: Any) -> None:
    """Check everything, then wrap every block of ``model.layers`` in place."""
    resolved = _checked_options(policy, memory_budget, offload, options.early_stop,
                                options.determinism_check, options.debug,
                                options.preserve_rng_state)
    blocks = _blocks_of(model)
    for fqn, block in blocks:
        _check_block(block, fqn)
    policies: list[Any] = (
        memory_budget_policies([b for _, b in blocks], float(memory_budget),
                               float(offload or 0.0))
        if memory_budget is not None else [resolved] * len(blocks))
    for (_, block), block_policy in zip(blocks, policies):
        _wrap(block, block_policy, options)
