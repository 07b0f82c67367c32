"""One-line integration: checkpoint a model's repeated blocks with ckptfx.

``apply_activation_checkpointing(model)`` is ckptfx's counterpart of
``torch.distributed.algorithms._checkpoint.checkpoint_wrapper.apply_activation_checkpointing``,
with the blocks found for you (this ``__init__``: any model, Hugging Face and timm ones
included). Integrations with a framework of their own are submodules:

- ``torchtitan.py`` (``ckptfx.integrations.torchtitan``): ckptfx as a torchtitan
  activation-checkpointing choice (``CkptfxAC``, ``apply_ac``) and ckptfx's pipeline stages
  for torchtitan's pipelining (``pipeline_llm``).

Rules:

1. **Which blocks.** ``check_fn(module)`` when given; otherwise, in this order, the first
   that finds any: Hugging Face ``GradientCheckpointingLayer``s (the decoder/encoder
   layers), the modules in timm's ``blocks`` containers, the modules of the model's largest
   ``nn.ModuleList`` whose modules all have one type; other lists of repeated blocks that
   this last rule leaves plain (an encoder-decoder's second stack) are named in a warning
   with the ``check_fn`` that takes them all. Only the outermost matches are wrapped (a
   checkpoint inside a checkpoint only adds replays), never the model itself.
2. **How.** Hugging Face layers through their own hook (``gradient_checkpointing`` and
   ``_gradient_checkpointing_func``, the attributes ``model.gradient_checkpointing_enable``
   sets), so that Hugging Face keeps doing what it does around a checkpointed layer: no
   checkpointing in eval mode, the KV cache dropped in training (a replay would append to it
   twice), module hooks (FSDP2's) outside the replay. Every other block through
   ``checkpoint_wrapper``, which changes the module's class in place.
3. **What stays the same.** Parameter names and ``state_dict`` keys, ``isinstance``,
   ``torch.save(model)`` / ``torch.load`` and the gradients, bit for bit.
4. **Bad input fails before anything changes**: a bad policy, a ``check_fn`` that is not
   callable or matches nothing, or a model with no repeated blocks.
5. **Hugging Face's switch keeps ckptfx.** On a Hugging Face model, ckptfx also answers the
   model's ``activation_checkpointing_enable`` (and the deprecated
   ``gradient_checkpointing_enable``), which ``Trainer`` calls for
   ``activation_checkpointing=True``: instead of putting torch's checkpoint in ckptfx's
   place, it applies ckptfx again, with the policy given in the keyword arguments
   (``{"policy": ...}``, or ``memory_budget``, ``early_stop``) or else the one applied
   before; ``every_n_layers`` picks the layers as Hugging Face does. What ckptfx does not
   do there (reentrant checkpointing, Hugging Face's ``offload``, other checkpoint
   options) is refused with an error naming it, before anything changes.
6. **Framework submodules load on demand.** Importing ``ckptfx`` or ``ckptfx.integrations``
   imports no framework; ``ckptfx.integrations.torchtitan`` is imported by name (or on first
   access of the attribute), and without its framework it raises an ``ImportError`` that
   says what to install.
"""

from __future__ import annotations

import functools
import importlib
import sys
import types
import warnings
from typing import Any, Callable, TypeVar, Union

from torch import nn

from ckptfx.budget.planner import memory_budget_policies
from ckptfx.checkpoint import checkpoint, checkpoint_wrapper
from ckptfx.policies.budget_policy import MemoryBudget
from ckptfx.policies.named import check_policy, checkpoint_function_error

__all__ = ["apply_activation_checkpointing", "find_blocks"]

# Rule 6: the framework submodules, imported on first access (as optree's integrations are).
_SUBMODULES = frozenset({"torchtitan"})


def __getattr__(name: str) -> types.ModuleType:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")  # binds the attribute too
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_SUBMODULES})

M = TypeVar("M", bound=nn.Module)


def apply_activation_checkpointing(
    model: M,
    policy: Callable[..., Any] | None = None,
    check_fn: Callable[[nn.Module], bool] | None = None,
    *,
    memory_budget: float | None = None,
    offload: float | None = None,
    early_stop: bool = True,
) -> M:
    """Checkpoint ``model``'s repeated blocks in place; returns ``model``.

    Args:
        model: any ``nn.Module``: a Hugging Face transformers model, a timm model, or your
            own (its blocks in an ``nn.ModuleList``, or say which with ``check_fn``).
        policy: what each block keeps, as in ``ckptfx.remat(policy=...)``: a
            ``ckptfx.checkpoint_policies`` policy or a torch selective-checkpoint policy
            function. ``None`` (default): a plain ``ckptfx.checkpoint`` of each block
            (only its inputs kept, everything else recomputed).
        check_fn: ``check_fn(module) -> bool`` picks the modules to wrap (the outermost
            matches; the model itself is never wrapped); a module class, or a tuple of
            classes, picks their instances (``check_fn=LlamaDecoderLayer``). ``None``
            (default) finds the repeated blocks as ``find_blocks`` does.
        memory_budget: instead of ``policy``, a whole-model budget in ``[0, 1]``: the
            blocks together keep at most that fraction of what ``everything_saveable``
            would keep in them, spread over the blocks where it saves the most recompute
            (``ckptfx.memory_budget_policies``; 0.0 keeps nothing, 1.0 everything).
        offload: with ``memory_budget``, the fraction of the same bytes the blocks may keep
            in host memory besides (``memory_budget(fraction, offload=...)``: values that
            would be recomputed go to the host instead, copied beside the computation).
            ``None`` (default) offloads nothing. With a ``policy``, offload with an offload
            policy instead (``checkpoint_policies.offload_dot_with_no_batch_dims()``).
        early_stop: as in ``ckptfx.checkpoint``.

    Raises:
        TypeError: ``model`` is not a module, ``check_fn`` is not callable, ``policy``
            is not a policy, or ``memory_budget`` or ``offload`` is not a number.
        ValueError: no block was found, ``check_fn`` matched no module, ``memory_budget``
            or ``offload`` is outside ``[0, 1]``, both ``policy`` and ``memory_budget``
            were given, or ``offload`` without ``memory_budget``.

    Calling it again updates the policy of the blocks it finds. Each block can be undone
    with ``ckptfx.unwrap_checkpoint`` (Hugging Face models:
    ``model.gradient_checkpointing_disable()``).

    Example::

        import ckptfx
        from ckptfx import checkpoint_policies as cp
        from transformers import AutoConfig, AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained("gpt2"))
        ckptfx.apply_activation_checkpointing(model, policy=cp.dots_saveable)
        model(input_ids, labels=input_ids).loss.backward()

        # a budget instead of a policy: keep at most 30% of what saving everything would
        ckptfx.apply_activation_checkpointing(model, memory_budget=0.3)

        # and 20% more of it in host memory, where it saves recomputing
        ckptfx.apply_activation_checkpointing(model, memory_budget=0.3, offload=0.2)

        # your own model: say which modules are the blocks
        ckptfx.apply_activation_checkpointing(net, check_fn=lambda m: isinstance(m, MyBlock))
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if policy is not None:
        error = checkpoint_function_error(
            policy, "policy", ". (torch's apply_activation_checkpointing takes a "
            "checkpoint_wrapper_fn second; ckptfx's second argument is the policy, and "
            "check_fn= chooses the blocks.)")
        if error is not None:
            raise error
        check_policy(policy, "policy")
    if isinstance(check_fn, type) or (isinstance(check_fn, tuple) and check_fn
                                      and all(isinstance(c, type) for c in check_fn)):
        # A class (what FSDP's ModuleWrapPolicy takes) means its instances; called as a
        # check_fn it would build one module per submodule.
        block_classes = check_fn
        check_fn = lambda m: isinstance(m, block_classes)  # noqa: E731
    if check_fn is not None and not callable(check_fn):
        raise TypeError(
            "check_fn must be a callable taking a module and returning a bool (e.g. "
            f"lambda m: isinstance(m, MyBlock)), got {type(check_fn).__name__}"
        )
    if not isinstance(early_stop, bool):
        raise TypeError(f"early_stop must be a bool, got {type(early_stop).__name__}")
    if memory_budget is not None and policy is not None:
        raise ValueError(
            "apply_activation_checkpointing takes policy= or memory_budget=, not both: a "
            "budget chooses each block's policy itself"
        )
    if offload is not None and memory_budget is None:
        raise ValueError(
            "apply_activation_checkpointing: offload= is the host share of memory_budget=; "
            "pass memory_budget= too, or, with a policy, offload with an offload policy "
            "(ckptfx.checkpoint_policies.offload_dot_with_no_batch_dims())"
        )
    if memory_budget is not None:
        # the fraction's and the offload's checks, before anything changes
        MemoryBudget(memory_budget, 0.0 if offload is None else offload)
    if check_fn is None:
        blocks, by_largest_list = _find_blocks(model)
        if by_largest_list:
            left = _other_repeated_blocks(model, blocks)
            if left:
                shown = ", ".join(f"{name} ({len(m)} x {type(m[0]).__name__})"
                                  for name, m in left)
                names = list(dict.fromkeys(
                    t.__name__ for t in (type(blocks[0]), *(type(m[0]) for _, m in left))))
                kinds = names[0] if len(names) == 1 else f"({', '.join(names)})"
                warnings.warn(
                    f"apply_activation_checkpointing checkpoints the {len(blocks)} "
                    f"{type(blocks[0]).__name__} modules of the largest nn.ModuleList and "
                    f"leaves these repeated blocks plain: {shown}. To checkpoint them too, "
                    f"say which modules are blocks: check_fn=lambda m: isinstance(m, "
                    f"{kinds})",
                    stacklevel=2,
                )
    else:
        blocks = _outermost(model, lambda m: bool(check_fn(m)))
        if not blocks:
            raise ValueError(
                f"check_fn matched no submodule of {type(model).__name__} (the model itself "
                "is never wrapped: use ckptfx.checkpoint_wrapper(model) for that)"
            )
    policies: list[Any] = (memory_budget_policies(blocks, memory_budget, offload or 0.0)
                           if memory_budget is not None else [policy] * len(blocks))
    layer_class = _hf_layer_class()
    hf = [(b, p) for b, p in zip(blocks, policies)
          if layer_class is not None and isinstance(b, layer_class)]
    if hf:
        _enable_hf(model, hf, early_stop)
        _KeepCkptfx.install(model, {"policy": policy, "check_fn": check_fn,
                                    "memory_budget": memory_budget, "offload": offload,
                                    "early_stop": early_stop})
    for block, block_policy in zip(blocks, policies):
        if not (layer_class is not None and isinstance(block, layer_class)):
            options: dict[str, Any] = {"early_stop": early_stop}
            if block_policy is not None:
                options["policy"] = block_policy
            checkpoint_wrapper(block, **options)
    return model


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks ``apply_activation_checkpointing`` wraps when given no
    ``check_fn``, in model order.

    The first of these that finds any: Hugging Face ``GradientCheckpointingLayer``s; for a
    timm model, the modules of its ``blocks`` containers (``nn.Sequential`` or
    ``nn.ModuleList`` attributes named ``blocks``, as in ViT, Swin, ConvNeXt); else the
    modules of the model's largest ``nn.ModuleList`` or ``nn.ModuleDict`` (torchtitan keeps
    its blocks in one) whose modules all have one type (the first such on a tie). A ``ValueError`` says what to pass when there is none.

    Example::

        >>> [type(b).__name__ for b in ckptfx.integrations.find_blocks(llama)]
        ['LlamaDecoderLayer', 'LlamaDecoderLayer']
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return _find_blocks(model)[0]


def _find_blocks(model: nn.Module) -> tuple[list[nn.Module], bool]:
    """``find_blocks``, and whether the largest-list rule (the last one) found them."""
    layer_class = _hf_layer_class()
    if layer_class is not None:
        found = _outermost(model, lambda m: isinstance(m, layer_class))
        if found:
            return found, False
    if type(model).__module__.split(".")[0] == "timm":
        containers = [m for m in model.modules()
                      if isinstance(getattr(m, "blocks", None), (nn.Sequential, nn.ModuleList))]
        members = {id(b) for c in containers for b in c.blocks}  # type: ignore[union-attr]
        found = _outermost(model, lambda m: id(m) in members)
        if found:
            return found, False
    best = _largest_list(model)
    if best is None:
        example = "MyBlock"
        seen = ""
        # The largest nn.Sequential of one block class of the user's (not torch's own
        # containers: isinstance(m, Sequential) would match the Sequential around them)
        candidates = [(len(m), name, m) for name, m in model.named_modules()
                      if isinstance(m, nn.Sequential) and len(m) >= 2
                      and len({type(b) for b in m}) == 1
                      and not type(m[0]).__module__.startswith("torch.")
                      and next(iter(m[0].children()), None) is not None]
        if candidates:
            _, name, m = max(candidates, key=lambda c: c[0])
            example = type(m[0]).__name__
            seen = (f" (its nn.Sequential {name!r} holds {len(m)} {example} modules: "
                    "a Sequential's modules are found only in timm models)")
        raise ValueError(
            f"apply_activation_checkpointing found no repeated blocks in "
            f"{type(model).__name__}: no Hugging Face GradientCheckpointingLayer, no timm "
            f"'blocks', and no nn.ModuleList or nn.ModuleDict of modules of one "
            f"type{seen}. Say which modules "
            f"to checkpoint: check_fn=lambda m: isinstance(m, {example})"
        )
    return _members(best), True


_Container = Union[nn.ModuleList, nn.ModuleDict]


def _members(container: _Container) -> list[nn.Module]:
    """The modules of an ``nn.ModuleList`` or the values of an ``nn.ModuleDict``."""
    if isinstance(container, nn.ModuleDict):
        return list(container.values())
    return list(container)


def _one_type_lists(model: nn.Module) -> list[_Container]:
    """The ``nn.ModuleList``s and ``nn.ModuleDict``s whose modules all have one type."""
    return [m for m in model.modules()
            if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and len(m) > 0
            and len({type(b) for b in _members(m)}) == 1]


def _largest_list(model: nn.Module) -> _Container | None:
    best: _Container | None = None
    for m in _one_type_lists(model):
        if best is None or len(m) > len(best):
            best = m
    return best


def _other_repeated_blocks(model: nn.Module, blocks: list[nn.Module]
                           ) -> list[tuple[str, list[nn.Module]]]:
    """The other lists of repeated blocks (two or more modules of one type that have
    submodules of their own) that ``blocks``, found by the largest-list rule, leave out
    (an encoder-decoder's second stack), with their names."""
    covered = {id(m) for b in blocks for m in b.modules()}
    chosen = {id(b) for b in blocks}
    names = {id(m): name for name, m in model.named_modules()}
    left = []
    for m in _one_type_lists(model):
        members = _members(m)
        if (len(m) >= 2 and id(m) not in covered
                and not any(id(b) in chosen for b in m.modules())  # not around the blocks
                and next(iter(members[0].children()), None) is not None):
            left.append((names.get(id(m), "?"), members))
    return left


def _outermost(model: nn.Module, match: Callable[[nn.Module], bool]) -> list[nn.Module]:
    """The submodules that match and have no matching ancestor below ``model``."""
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if match(child):
                found.append(child)
            else:
                visit(child)

    visit(model)
    return found


def _hf_layer_class() -> type | None:
    """transformers' ``GradientCheckpointingLayer``, if transformers is already imported (a
    model built with it must have imported it; ckptfx does not import transformers)."""
    layers = sys.modules.get("transformers.modeling_layers")
    layer_class = getattr(layers, "GradientCheckpointingLayer", None)
    return layer_class if isinstance(layer_class, type) else None


def _enable_hf(model: nn.Module, layers: list[tuple[nn.Module, Any]], early_stop: bool
               ) -> None:
    """Turn on Hugging Face's own checkpointing of ``layers`` (each with its policy), with
    ckptfx's checkpoint.

    The flag is also set on the other modules that carry it (the model classes, e.g.
    ``GPT2Model``), which read it to drop the KV cache in training, as
    ``gradient_checkpointing_enable`` does.
    """
    def func(policy: Any) -> Callable[..., Any]:
        options: dict[str, Any] = {"early_stop": early_stop}
        if policy is not None:
            options["policy"] = policy
        return functools.partial(checkpoint, **options)

    chosen = {id(layer): func(policy) for layer, policy in layers}
    shared = func(layers[0][1]) if len({id(p) for _, p in layers}) == 1 else func(None)
    layer_class = _hf_layer_class()
    for m in model.modules():
        if not hasattr(m, "gradient_checkpointing"):
            continue
        if layer_class is not None and isinstance(m, layer_class) and id(m) not in chosen:
            continue
        setattr(m, "_gradient_checkpointing_func", chosen.get(id(m), shared))
        setattr(m, "gradient_checkpointing", True)


class _KeepCkptfx:
    """A Hugging Face model's ``activation_checkpointing_enable`` (and
    ``gradient_checkpointing_enable``) once ckptfx checkpoints it (Rule 5). An object of a
    module-level class, not a closure, so that the model still pickles."""

    _NAMES = ("activation_checkpointing_enable", "gradient_checkpointing_enable")
    _OWN = ("policy", "memory_budget", "offload", "early_stop")

    def __init__(self, model: nn.Module, applied: dict[str, Any]) -> None:
        self.model = model
        self.applied = applied

    @classmethod
    def install(cls, model: nn.Module, applied: dict[str, Any]) -> None:
        keeper = cls(model, applied)
        for name in cls._NAMES:
            if callable(getattr(type(model), name, None)):
                object.__setattr__(model, name, keeper)

    def __call__(self, activation_checkpointing_kwargs: dict[str, Any] | None = None,
                 every_n_layers: int = 1, offload: bool = False, *,
                 gradient_checkpointing_kwargs: dict[str, Any] | None = None) -> None:
        kwargs = dict(activation_checkpointing_kwargs or gradient_checkpointing_kwargs or {})
        if kwargs.pop("use_reentrant", False):
            raise ValueError(
                "activation_checkpointing_kwargs: use_reentrant=True asks for torch's "
                "reentrant checkpoint; ckptfx checkpoints this model (applied by "
                "ckptfx.apply_activation_checkpointing) and has no reentrant variant. Drop "
                "use_reentrant, or set it to False")
        unknown = sorted(k for k in kwargs if k not in self._OWN)
        if unknown:
            raise TypeError(
                f"activation_checkpointing_kwargs: {unknown} are not options of ckptfx's "
                "checkpointing of this model (it takes policy, memory_budget, offload and "
                "early_stop; ckptfx.apply_activation_checkpointing applied it)")
        if offload:
            raise ValueError(
                "offload=True is Hugging Face's save_on_cpu around torch's checkpoint; with "
                "ckptfx choose what goes to host memory with a policy instead, e.g. "
                "activation_checkpointing_kwargs={'policy': "
                "ckptfx.checkpoint_policies.offload_dot_with_no_batch_dims()}")
        if not isinstance(every_n_layers, int) or every_n_layers < 1:
            raise ValueError(f"every_n_layers must be a positive int, got {every_n_layers!r}")
        options = {k: v for k, v in self.applied.items() if k != "check_fn"}
        if "policy" in kwargs or "memory_budget" in kwargs:
            options["policy"] = options["memory_budget"] = options["offload"] = None
        options.update(kwargs)
        check_fn = self.applied["check_fn"]
        model = self.model
        if every_n_layers != 1:
            check_fn = _every_nth_layer(model, every_n_layers, check_fn)
        # Hugging Face's own flags first, off everywhere, so layers left out this time (a
        # new every_n_layers) run plain
        for m in model.modules():
            if hasattr(m, "gradient_checkpointing"):
                setattr(m, "gradient_checkpointing", False)
        apply_activation_checkpointing(model, check_fn=check_fn, **options)
        # the keeper that applied it again holds the layers chosen this time: keep the
        # options and the blocks the user chose instead
        self.install(model, {**options, "check_fn": self.applied["check_fn"]})
        # as Hugging Face's enable does: the embeddings' output requires grad, so that
        # frozen embeddings (PEFT) still pass gradients to the checkpointed layers
        if (getattr(model, "main_input_name", None) == "input_ids"
                or getattr(model, "_hf_peft_config_loaded", False)):
            enable = getattr(model, "enable_input_require_grads", None)
            if callable(enable):
                enable()


def _every_nth_layer(model: nn.Module, n: int, check_fn: Callable[[nn.Module], bool] | None
                     ) -> Callable[[nn.Module], bool]:
    """Hugging Face's ``every_n_layers``: of the model's layers in module order, those whose
    index is a multiple of ``n``."""
    layer_class = _hf_layer_class()
    layers = [m for m in model.modules() if layer_class is not None and isinstance(m, layer_class)
              and (check_fn is None or check_fn(m))]
    chosen = {id(m) for i, m in enumerate(layers) if i % n == 0}
    return lambda m: id(m) in chosen
