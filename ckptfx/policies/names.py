"""``checkpoint_name``: the tag a remat'd block gives a value, and which tags a forward used.

Rules:

1. **An identity outside a remat forward.** ``checkpoint_name(x, name)`` returns ``x``
   itself unless a recorder is active on this thread (tracer_stack.py); inside one it hands
   the name to the innermost recorder, which decides (by policy) whether to keep the value.
   Under ``torch.compile`` it is a graph op instead (name_op.py).
2. **Scopes record, they do not judge.** Each remat'd forward whose policy refers to names
   opens a ``NameScope`` (checks.py's ``NameCheck``); ``checkpoint_name`` records a name
   in the innermost scope only when it runs at that block's own tracer depth (a nested
   block has its own policy). Whether an unused name deserves a warning is decided above,
   where the policy can be described.

This module sits below the policy protocol (``policies.protocol``), which asks ckptfx's own
policies about the op ``checkpoint_name``, and knows nothing of policies itself.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ckptfx.policies import name_op
from ckptfx.policies.tracer_stack import active_tracer
from ckptfx.policies.tracer_stack import tracer_stack as _stack

__all__ = ["NameScope", "checkpoint_name"]


def checkpoint_name(x: Any, name: str) -> Any:
    """Tag ``x`` with ``name`` for the name-based policies and the residual report.

    An identity: outside a ``remat`` forward it returns ``x`` itself. Inside one, the
    value becomes visible to ``save_only_these_names`` and friends, and a saved residual
    is reported as ``named 'name' at file:line``. A name-based policy naming a value that
    no ``checkpoint_name`` of the block's forward uses gets one ``ckptfx.UnusedNameWarning``
    per remat'd function (see ``remat``). Under ``torch.compile`` it is an op of the graph
    (a copy of ``x``) that the compiled policy reads the name from.

    Example::

        @ckptfx.remat(policy=ckptfx.checkpoint_policies.save_only_these_names("attn"))
        def block(x):
            a = ckptfx.checkpoint_name(attention(x), "attn")
            return mlp(a)
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    if torch.compiler.is_compiling():  # an op the compiled policy sees (policies/name_op.py)
        return name_op.tag(x, name) if isinstance(x, torch.Tensor) else x
    tracer = active_tracer()
    if tracer is None:
        return x
    scopes = name_scopes.stack
    if scopes:
        scopes[-1].saw(name)
    if not isinstance(x, torch.Tensor):
        return x
    return tracer.name(x, name)


class _NameScopes(threading.local):
    def __init__(self) -> None:
        self.stack: list[NameScope] = []


name_scopes = _NameScopes()


class NameScope:
    """The names ``checkpoint_name`` used in one forward of one remat'd block.

    ``depth`` is the number of tracers active when the block started: the block's own
    tracer is the next one, and a ``checkpoint_name`` seen under a deeper tracer belongs to
    a block nested inside (which has its own policy).
    """

    __slots__ = ("depth", "seen")

    def __init__(self) -> None:
        self.depth = len(_stack.tracers)
        self.seen: set[str] = set()

    def saw(self, name: str) -> None:
        if len(_stack.tracers) == self.depth + 1:
            self.seen.add(name)
