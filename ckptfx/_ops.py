"""Facts about ATen ops read from their schemas and tags, cached per OpOverload."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["OpInfo", "op_info"]

aten = torch.ops.aten
_EMPTY_OPS = frozenset({
    aten.empty.memory_format, aten.empty_like.default, aten.empty_strided.default,
    aten.new_empty.default, aten.new_empty_strided.default,
})
_SEEDED = torch.Tag.nondeterministic_seeded
_KNOWN = frozenset({"aten", "prims"})  # namespaces whose ops declare their randomness
# Ops that return an alias of their input although their schema does not say so: a write
# through the result rewrites the input (matmul's _unsafe_view of its mm), so they count as
# aliases (not views: the policy still decides on them) in remat's version bookkeeping.
_UNANNOTATED_VIEWS = frozenset({
    aten._unsafe_view.default, aten.unsafe_split.Tensor,
    aten.unsafe_split_with_sizes.default, aten.unsafe_chunk.default,
})


class OpInfo:
    """``seeded``: draws from a generator; ``writes``: (position, name) of the arguments it
    writes in place; ``view``: returns an alias of an input; ``alias``: a view, or an op that
    returns an alias although its schema does not say so; ``empty``: allocates without
    initialising; ``opaque``: an op outside ATen and prims (a custom op) that does not declare
    itself random: whether it draws random numbers is not known from its schema."""

    __slots__ = ("seeded", "writes", "view", "alias", "empty", "opaque")

    def __init__(self, func: Any) -> None:
        schema = func._schema
        # Tagged random, or given a generator (a custom op's ``Generator?`` argument: it is
        # there to be drawn from, whatever the tags say).
        self.seeded = _SEEDED in func.tags or any(
            str(a.type) in ("Generator", "Optional[Generator]") for a in schema.arguments)
        self.writes = tuple(
            (i, a.name) for i, a in enumerate(schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        )
        self.view = any(r.alias_info is not None and not r.alias_info.is_write
                        for r in schema.returns)
        self.alias = self.view or func in _UNANNOTATED_VIEWS
        self.empty = func in _EMPTY_OPS
        self.opaque = not self.seeded and getattr(func, "namespace", "aten") not in _KNOWN


OP_INFO: dict[Any, OpInfo] = {}


def op_info(func: Any) -> OpInfo:
    info = OP_INFO.get(func)
    if info is None:
        info = OP_INFO[func] = OpInfo(func)
    return info
