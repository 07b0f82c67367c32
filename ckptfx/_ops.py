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


class OpInfo:
    """``seeded``: draws from a generator; ``writes``: (position, name) of the arguments it
    writes in place; ``view``: returns an alias of an input; ``empty``: allocates without
    initialising."""

    __slots__ = ("seeded", "writes", "view", "empty")

    def __init__(self, func: Any) -> None:
        schema = func._schema
        self.seeded = _SEEDED in func.tags
        self.writes = tuple(
            (i, a.name) for i, a in enumerate(schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        )
        self.view = any(r.alias_info is not None and not r.alias_info.is_write
                        for r in schema.returns)
        self.empty = func in _EMPTY_OPS


_OP_INFO: dict[Any, OpInfo] = {}


def op_info(func: Any) -> OpInfo:
    info = _OP_INFO.get(func)
    if info is None:
        info = _OP_INFO[func] = OpInfo(func)
    return info
