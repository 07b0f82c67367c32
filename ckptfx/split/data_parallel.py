"""Data-parallel wrappers (FSDP2, DDP) under the split backward and under prefire.

A plain ``loss.backward()`` through an FSDP2 (``fully_shard``) or DDP module does more than
compute gradients: autograd hooks unshard FSDP's parameters before a module's backward,
reduce-scatter (FSDP2) or all-reduce (DDP) the gradients after it, and reshard. The split
backward (``vjp_split``, ``grad_split``) computes gradients with ``autograd.grad`` in two
passes and replays checkpointed blocks ahead of the backward (prefire), so without help it
would replay against sharded parameters, and dw would write no reduced gradient at all.

Rules

1. A split's forward runs under ``observing()``: while it runs (on the splitting thread, and
   only when ``torch.distributed`` is initialized) a module forward pre-hook notes every FSDP2
   and DDP module called. Nothing is observed, and nothing costs, in a single process.

2. FSDP2. Before any replay of the split's blocks, every parameter group of the observed FSDP
   trees is unsharded (FSDP's own pre-backward does the same, later). From dx until dw ends
   the groups neither reduce nor reshard (as torch's pipeline stage sets them), so dw reads
   unsharded parameters and accumulates into the unsharded ``.grad`` the graph owns. After
   dw the user's flags come back and FSDP's own ``post_backward`` of every group runs, then
   the root's final callback: the reduce-scatter, gradient division and resharding are
   FSDP's, so the sharded gradients are bitwise those of a plain backward. The parameters of
   the observed FSDP modules get gradients whether or not they were passed as ``params=``,
   as ``backward()`` would give them.

3. DDP. dw's weight passes run with ``torch.autograd.backward(..., inputs=params)`` so each
   parameter's gradient goes through its ``AccumulateGrad`` node, whose hook is DDP's
   reducer: it buckets, all-reduces and averages exactly as in DDP's own backward (the
   reducer launches a bucket when its last gradient is ready and finishes when all are).
   The parameters of observed DDP modules are dw's parameters whether passed or not. A DDP
   configuration whose reduction the split cannot reproduce raises ``CheckpointError``
   before any gradient is written (``check_split``).

4. A split that fails or is abandoned gives the FSDP groups back as it found them: flags
   restored, training state reset by FSDP's final callback with reduction off, parameters
   resharded. No gradient is reduced for it.

A scheduler's own prefire of a module's block unshards its FSDP2 trees too: ``ckptfx.kernel.fsdp``
(Rule 1 there), whose helpers read the states and groups for both.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch

from ckptfx import _compat
from ckptfx.kernel.frame import CheckpointError
from ckptfx.kernel.fsdp import add_fsdp_states, param_groups, unshard, wrapper_classes
from ckptfx.split.primals import weight_slot

__all__ = ["DataParallel", "observing"]


class DataParallel:
    """The FSDP2 states and DDP modules one split's forward ran through (Rule 1)."""

    def __init__(self) -> None:
        self.fsdp_states: list[Any] = []
        self.ddp: list[Any] = []
        self._held: list[tuple[Any, tuple[bool, bool]]] | None = None
        self._last: list[tuple[Any, bool]] = []

    def __bool__(self) -> bool:
        return bool(self.fsdp_states or self.ddp)

    def note(self, module: Any) -> None:
        fsdp_cls, ddp_cls = wrapper_classes()
        if isinstance(module, fsdp_cls):
            add_fsdp_states(self.fsdp_states, module)
        elif isinstance(module, ddp_cls) and all(m is not module for m in self.ddp):
            self.ddp.append(module)

    # -- parameters ---------------------------------------------------------------------------

    def _groups(self) -> list[Any]:
        return param_groups(self.fsdp_states)

    def implicit_params(self) -> list[torch.Tensor]:
        """The parameters dw fills besides ``params=``: those of observed DDP modules and
        the unsharded ones of observed FSDP groups (Rules 2, 3)."""
        out: list[torch.Tensor] = []
        for m in self.ddp:
            out.extend(p for p in m.parameters() if p.requires_grad)
        for g in self._groups():
            out.extend(u for _, u in _compat.fsdp_group_params(g) if u.requires_grad)
        return out

    def adopt_params(self, weights: list[torch.Tensor], param_slots: list[int],
                     index: dict[int, int]) -> None:
        """dw's parameters under FSDP2 / DDP: the graph's (unsharded) tensors for those given
        as ``params=``, plus the wrappers' own (Rules 2, 3). ``weights`` is the split's
        weight list, ``param_slots`` the positions dw accumulates into ``.grad``, ``index``
        id(tensor) -> position; all three are updated in place."""
        for i in param_slots:
            weights[i] = p = self.graph_param(weights[i])
            index.setdefault(id(p), i)
        for p in self.implicit_params():
            i = weight_slot(weights, index, p)
            if i not in param_slots:
                param_slots.append(i)

    @staticmethod
    def accumulate_through_ddp(weights: list[torch.Tensor], param_slots: list[int],
                               w_edges: list[Any], group: list[int], edges: list[Any],
                               seeds: list[torch.Tensor | None], last: bool) -> list[Any]:
        """One weight pass of the weights at positions ``group`` whose parameters accumulate
        through their AccumulateGrad nodes, where DDP's reducer hooks are (Rule 3). Weights
        that are primals, not parameters, are read back from ``.grad`` (theirs restored);
        a parameter's result is None (the reducer wrote its ``.grad``)."""
        params = set(param_slots)
        stash = {i: weights[i].grad for i in group if i not in params}
        for i in stash:
            weights[i].grad = None
        try:
            torch.autograd.backward(edges, seeds, retain_graph=not last,
                                    inputs=[w_edges[i] for i in group])
            return [None if i in params else weights[i].grad for i in group]
        finally:
            for i, old in stash.items():
                weights[i].grad = old

    def graph_param(self, p: torch.Tensor) -> torch.Tensor:
        """The tensor the autograd graph holds for ``p``: FSDP's unsharded parameter for a
        sharded one, ``p`` itself otherwise."""
        for g in self._groups():
            for sharded, unsharded in _compat.fsdp_group_params(g):
                if sharded is p:
                    return unsharded
        return p

    def check_split(self, who: str) -> None:
        """Refuse what the split cannot reduce as the wrapper would (Rule 3)."""
        for m in self.ddp:
            if _compat.ddp_delays_all_reduce(m):
                raise CheckpointError(
                    f"{who}: the forward ran a DistributedDataParallel(static_graph=True) module "
                    "in its first iteration, where DDP delays its all-reduce to the end of the "
                    "backward pass that reaches its output (here dx, before dw has computed "
                    "any weight gradient). Run the first step with a plain backward(), or use "
                    "static_graph=False; no gradient was written"
                )

    # -- FSDP2 lifecycle (Rules 2, 4) ---------------------------------------------------------

    def before_replay(self) -> None:
        """Unshard every observed FSDP group, so a replay reads full parameters."""
        unshard(self.fsdp_states)

    def hold(self) -> None:
        """From dx to the end of dw: no reduction, no resharding (idempotent)."""
        if self._held is not None or not self.fsdp_states:
            return
        self._held = [(g, _compat.fsdp_group_flags(g)) for g in self._groups()]
        self._last = [(s, _compat.fsdp_is_last_backward(s)) for s in self.fsdp_states]
        for g, _ in self._held:
            _compat.fsdp_set_group_flags(g, (False, False))
        for s, _ in self._last:
            _compat.fsdp_set_is_last_backward(s, False)

    def _restore(self) -> None:
        for g, flags in self._held or ():
            _compat.fsdp_set_group_flags(g, flags)
        for s, last in self._last:
            _compat.fsdp_set_is_last_backward(s, last)
        self._held = None
        self._last = []

    def _root(self) -> Any:
        for s in self.fsdp_states:
            if getattr(s, "_is_root", False):
                return s
        return self.fsdp_states[0]

    def reduce(self) -> None:
        """After dw: FSDP's own post-backward and final callback, with the user's flags."""
        if self._held is None:
            return
        self._restore()
        for s in reversed(self.fsdp_states):
            for g in reversed(_compat.fsdp_param_groups(s)):
                _compat.fsdp_post_backward(g)
        _compat.fsdp_final_callback(self._root())

    def abandon(self) -> None:
        """A split that ends without dw: reset FSDP's state, reduce nothing, reshard."""
        if self._held is None:
            return
        try:
            _compat.fsdp_final_callback(self._root())  # flags still off: nothing reduced
            for g, _ in self._held:
                g.reshard()
        finally:
            self._restore()


@contextlib.contextmanager
def observing() -> Iterator[DataParallel | None]:
    """Note the FSDP2 and DDP modules called on this thread inside the block (Rule 1)."""
    if not _compat.distributed_initialized():
        yield None
        return
    seen = DataParallel()
    owner = threading.get_ident()

    def hook(module: Any, args: Any) -> None:
        if threading.get_ident() == owner:
            seen.note(module)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()
