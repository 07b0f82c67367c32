"""The proof frame.py Rule 6b asks for: the last op that saved a tensor of a checkpointed
block writes none of its arguments, so the replay's early stop needs no dispatch mode.

Found after the forward from the outputs' autograd graph: the node with the sequence number
the last packs read (``_node_of``), checked to be the node that saved the last packed object
(``_holds``: sequence numbers are per thread, autograd hands out what a pack hook returned),
and judged by the ATen op its class names (``node_never_writes_an_input``). Every doubt
answers False: the frame keeps its watch.
"""

from __future__ import annotations

import re
from typing import Any

import optree
import torch

__all__ = ["last_op_writes_nothing", "node_never_writes_an_input"]

aten = torch.ops.aten


def last_op_writes_nothing(outputs: Any, seq: int, packed: Any) -> bool:
    """True if the node numbered ``seq`` below ``outputs`` saved ``packed`` and its op
    provably writes none of its arguments."""
    node = _node_of(outputs, seq)
    return node is not None and node_never_writes_an_input(node) and _holds(node, packed)


_NODE_WALK = 64  # nodes the walk visits at most


def _node_of(outputs: Any, seq: int) -> Any:
    """The autograd node with sequence number ``seq`` reachable from ``outputs``, or None.

    Edges point to nodes made earlier (smaller numbers), so the walk prunes below ``seq``.
    Run once per checkpointed forward, on a graph just made: the common case (one tensor
    out, the saving op a node or two below it) is a short path with no set or generator, and
    a node reached twice is only visited twice (the walk is bounded either way)."""
    if isinstance(outputs, torch.Tensor):
        stack = [outputs.grad_fn]
    else:
        leaves = (outputs if isinstance(outputs, (tuple, list))
                  else optree.tree_leaves(outputs, none_is_leaf=True))
        stack = [t.grad_fn for t in leaves if isinstance(t, torch.Tensor)]
    visits = 0
    while stack and visits < _NODE_WALK:
        node = stack.pop()
        if node is None:
            continue
        visits += 1
        n = node._sequence_nr()
        if n == seq:
            return node
        if n > seq:
            for child, _ in node.next_functions:
                stack.append(child)
    return None


# node class -> its ``_raw_saved_*`` attributes, the one that held the last pack first
_RAW_SAVED: dict[type, tuple[str, ...]] = {}


def _holds(node: Any, packed: Any) -> bool:
    """True if ``node`` saved ``packed`` (what a pack hook returned for it): the node is the
    op that made that pack, whatever its sequence number says (numbers are per thread)."""
    cls = type(node)
    names = _RAW_SAVED.get(cls)
    if names is None:
        names = _RAW_SAVED[cls] = tuple(n for n in dir(node) if n.startswith("_raw_saved_"))
    for name in names:
        saved = getattr(node, name)
        for st in saved if isinstance(saved, (list, tuple)) else (saved,):
            if st is not None and st.data is packed:
                if name is not names[0]:
                    # Nodes of one class keep their last pack in the same place: look there
                    # first next time (a new tuple: a reader elsewhere keeps the old one).
                    _RAW_SAVED[cls] = (name, *(n for n in names if n is not name))
                return True
    return False


_CAMEL = re.compile(r"(?<!^)(?=[A-Z])")
_NODE_SAFE: dict[type, bool] = {}


def node_never_writes_an_input(node: Any) -> bool:
    """True if the op behind autograd ``node`` provably writes none of its arguments in place
    (bar an ``out=``), so it cannot fill a tensor it saved: the early stop of frame.py Rule 6
    needs no dispatch mode to watch it. Only torch's generated C++ nodes are judged, by name
    (``RreluWithNoiseBackward0`` is ``aten.rrelu_with_noise``, whose ``noise`` is written);
    any node whose op cannot be named that way (custom Functions, compiled code, names that
    do not map back) is False: the caller keeps watching. Cached per node class."""
    cls = type(node)
    safe = _NODE_SAFE.get(cls)
    if safe is None:
        safe = _NODE_SAFE[cls] = _judge(cls)
    return safe


def _judge(cls: type) -> bool:
    if cls.__module__ != "builtins":  # a Python-defined node (autograd.Function, compile)
        return False
    m = re.fullmatch(r"([A-Z][A-Za-z0-9]*?)Backward\d*", cls.__name__)
    if m is None:
        return False
    packet = getattr(aten, _CAMEL.sub("_", m.group(1)).lower(), None)
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return False
    for name in packet.overloads():
        for a in getattr(packet, name)._schema.arguments:
            if a.alias_info is not None and a.alias_info.is_write and not a.is_out:
                return False
    return True
