"""A ckptfx policy as torch's selective-checkpoint ``context_fn``.

Used where ckptfx hands a call with a policy to torch's own checkpoint (under
``torch.compile``, which traces torch's checkpoint and not ckptfx's hooks). torch's
selective checkpoint knows no offloading and never sees ``checkpoint_name`` (an identity
outside a ckptfx recording), so: an offload becomes a keep on the device (more memory, the
same gradients) and a name-based policy keeps nothing (torch's own default, full
recomputation). Gradients are the same either way; only what is kept differs.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, ContextManager

from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .policies import MUST_SAVE, call_policy

__all__ = ["TorchPolicyFn", "selective_context_fn"]


@dataclasses.dataclass(frozen=True)
class TorchPolicyFn:
    """``policy`` answering in torch's ``CheckpointPolicy`` values (a frozen dataclass, so
    that dynamo can hold it as a constant).

    Example::

        fn = TorchPolicyFn(checkpoint_policies.dots_saveable)
        fn(ctx, torch.ops.aten.mm.default, a, b)   # CheckpointPolicy.PREFER_SAVE
    """

    policy: Callable[..., Any]

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        decision = call_policy(self.policy, ctx, op, args, kwargs)
        if decision is MUST_SAVE:
            return CheckpointPolicy.MUST_SAVE
        if decision is False:
            return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.PREFER_SAVE  # True, or an offload kept on the device


# policy -> its context_fn, built outside compiled code: dynamo accepts a ``functools.partial``
# context_fn only as a constant it finds, not one built while it traces.
_CONTEXT_FNS: dict[Any, Callable[[], tuple[ContextManager[Any], ContextManager[Any]]]] = {}


def selective_context_fn(policy: Callable[..., Any]
                         ) -> Callable[[], tuple[ContextManager[Any], ContextManager[Any]]]:
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint`` that keeps what ``policy``
    keeps (offloads kept on the device): a ``functools.partial``, the form of
    ``context_fn`` dynamo accepts, made once per policy (eager calls of ``checkpoint`` and
    ``checkpoint_wrapper`` make it before any compiled call needs it).

    Example::

        torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False,
                                          context_fn=selective_context_fn(cp.dots_saveable))
    """
    try:
        found = _CONTEXT_FNS.get(policy)
    except TypeError:  # an unhashable policy: made per call
        return functools.partial(create_selective_checkpoint_contexts, TorchPolicyFn(policy))
    if found is None:
        found = functools.partial(create_selective_checkpoint_contexts, TorchPolicyFn(policy))
        _CONTEXT_FNS[policy] = found
    return found
