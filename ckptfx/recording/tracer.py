"""Recording a remat'd block: its ATen ops, which saved tensors are kept, and a replay plan.

Rules (1b, 2 and 2b, on what the packs keep, are packs.py's; 3 and 3b, on the replay,
segment.py's)

1. The forward of a remat call runs under a ``Tracer``: a TorchDispatchMode that records each
   ATen op (after autocast, so a replay runs with autocast off) and a saved-tensor pack hook.
   Values are tracked by tensor identity: each op output is tagged with its *slot*; block
   inputs and tensors from outside (parameters, closures) get slots when first read.
   Autograd packs an op's saved inputs before the op reaches the mode and its saved outputs
   after, so every packed tensor is already tagged, or is an input or outside tensor.

4. The segment is replayed only if it is shown replayable; otherwise the frame re-runs the
   Python function (the kernel's default strategy). Not replayable: a buffer from
   ``torch.empty`` read before any recorded op wrote it (a custom kernel filled it; a view
   of it, such as the ``detach`` torch's factory adds when a reference to the new tensor is
   held, reads nothing), a write to an input or outside tensor, a write to a value after it
   was saved (packs.py Rule 1b), tensor subclasses, or autograd running inside the block
   (that re-run restores explicit generators too, to their state before the block's first
   draw).
   A block that is not replayable but whose live holders all stand for unwritten block
   inputs or recorded views of them (the policy kept everything else) has nothing to
   recompute: those are rebuilt from the saved inputs and no Python runs. An outside tensor
   modified in place between forward and backward is a ``CheckpointError``.
"""

from __future__ import annotations

import itertools
from typing import Any, Hashable

import torch
from torch.utils.checkpoint import SelectiveCheckpointContext

from ckptfx import _compat
from ckptfx._ops import OP_INFO
from ckptfx._ops import op_info as _op_info
from ckptfx._user_stack import user_call_site
from ckptfx.kernel import collectives
from ckptfx.kernel.frame import Frame
from ckptfx.policies.names import checkpoint_name
from ckptfx.policies.protocol import call_policy
from ckptfx.policies.tracer_stack import active_tracer, reporting
from ckptfx.policies.tracer_stack import tracer_stack as _stack
from ckptfx.recording.packs import PackSide, residual_unpack_hook
from ckptfx.recording.segment import (
    BLOCK_START,
    CPU_DEFAULT,
    DEVICE_BLOCK_START,
    RecordedOp,
    Segment,
    flatten_tree,
    output_leaves,
    rng_states,
)

__all__ = ["Segment", "Tracer", "active_tracer", "reporting", "residual_unpack_hook"]

aten = torch.ops.aten
_token = itertools.count()


# -- the tracer -----------------------------------------------------------------------------

_NAME_OP = checkpoint_name
_SAC_CTX = SelectiveCheckpointContext(is_recompute=False)


_NONE_WRITTEN: frozenset[int] = frozenset()
_graph_task_id = _compat.current_graph_task_id
_next_sequence_nr = _compat.next_sequence_nr


class Tracer(PackSide, _compat.TorchDispatchMode):
    """Records a remat forward into a ``Segment`` and packs its saved tensors (Rules 1-2; the
    packing is packs.py's ``PackSide``)."""

    def __init__(self, frame: Frame, inputs: list[torch.Tensor], policy: Any,
                 input_names: list[str] | None = None) -> None:
        super().__init__()
        self.frame = frame
        self.policy = policy
        self.report = _stack.report
        self.sites = self.report is not None
        self.input_names = input_names
        self.attr = f"_ckptfx_{next(_token)}"
        self.seg = seg = Segment()
        self.decision: list[Any] = []      # slot -> True / MUST_SAVE (keep), False, Offload
        self.root: list[int] = []          # slot -> input/outside slot it views, or -1
        self.ids: dict[int, int] = {}      # id of input/outside tensor -> slot
        self.uninit: set[int] = set()      # base slots from torch.empty not yet written
        self.packed_bases: set[int] = set()
        # Packs of values since the last dispatch, settled at the next one (packs.py Rule 1b):
        # (holder position, slot, version, tensor, autograd sequence number, kept object or
        # None).
        self.recent: list[tuple[int, int, int, torch.Tensor, int, Any]] = []
        self.dispatch_seq = -1  # the autograd sequence number the last op dispatched at
        self.refresh: list[Any] = []  # kept objects whose tensor an op just filled
        self.names: dict[int, tuple[str, str | None]] = {}
        # (slot, version) -> (tensor, its expected _version, decision): every value the policy
        # lets keep, held until ``finish`` picks those the replay reads (packs.py Rule 2b).
        self.held: dict[tuple[int, int], tuple[torch.Tensor, int, Any]] = {}
        self.pinned = frame.env.device_type is not None
        # Generator key -> the last random op that drew from it, and op -> its keys
        # (segment.py Rule 3b).
        self.last_draw: dict[Hashable, int] = {}
        self.draw_keys: dict[int, frozenset[Any]] = {}
        self.drawn_types: set[str] = set()  # device types drawn on so far, by any generator
        # FSDP scopes and collectives (ckptfx.kernel.collectives), only where one can run.
        self.dist = collectives.Watch() if collectives.watch_needed() else None
        self.dist_log: Any = None
        for i, t in enumerate(inputs):
            if id(t) not in self.ids:
                self.ids[id(t)] = self._new_slot(-1, None, root=True)
            seg.input_slots.append(self.ids[id(t)])

    def _generator_states(self, index: int, device: Any, gens: list[torch.Generator]) -> Any:
        """What random op ``index`` replays its generators from (segment.py Rule 3b): nothing
        when the random op before it drew from the same generators and nothing else drew from
        them in between (the replay runs that op first and continues from where it left them),
        ``BLOCK_START`` for the block's first draw from the CPU generator and
        ``(DEVICE_BLOCK_START, index)`` for its first draw from a device's default generator
        (the frame captured those states when the block started), else the states
        themselves."""
        if gens:
            keys: frozenset[Hashable] = frozenset(id(g) for g in gens)
        else:
            if isinstance(device, str):
                device = torch.device(device)
            dev = device if isinstance(device, torch.device) else torch.device("cpu")
            keys = frozenset({_default_key(dev.type, dev.index)})
        prev = {self.last_draw.get(k) for k in keys}
        for k in keys:
            self.last_draw[k] = index
        self.draw_keys[index] = keys
        # A block-start state serves only the block's first draw on that device type by any
        # name: an explicit generator may be the default one under another Python object.
        types = {g.device.type for g in gens} or {dev.type}
        first_of_type = not (types & self.drawn_types)
        self.drawn_types |= types
        if len(prev) == 1:
            p = next(iter(prev))
            if p is not None and self.draw_keys[p] == keys:
                self.seg.rng_prev[index] = p
                return None
            if p is None and first_of_type:
                env = self.frame.env
                if keys == CPU_DEFAULT and env.cpu_rng is not None:
                    return BLOCK_START
                (key,) = keys if len(keys) == 1 else (None,)
                if (isinstance(key, tuple) and key[1] == env.device_type
                        and any(i == key[2] for i, _ in env.device_rng)):
                    return (DEVICE_BLOCK_START, key[2])
        states = rng_states(device, gens)
        if states[1] is not None:
            self.seg.rng_devices.add(states[1][1])
        return states

    def _new_slot(self, producer: int, base: int | None, root: bool = False) -> int:
        seg = self.seg
        slot = len(seg.producer)
        seg.producer.append(producer)
        seg.base.append(slot if base is None else base)
        self.decision.append(False)
        self.root.append(slot if root else -1)
        return slot

    def _slot(self, t: torch.Tensor) -> int:
        slot = t.__dict__.get(self.attr)
        if slot is not None:
            return slot
        slot = self.ids.get(id(t))
        if slot is None:  # a tensor from outside the block: a parameter, a closure, a constant
            slot = self.ids[id(t)] = self._new_slot(-1, None, root=True)
            self.seg.outside[slot] = (t, t._version)
        return slot

    # the dispatch side -----------------------------------------------------------------

    def __enter__(self) -> "Tracer":
        _stack.tracers.append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        _stack.tracers.pop()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        dist = self.dist
        collective = False
        if dist is not None:
            if self.dist_log is not None and self.dist_log.pending:
                self.dist_log.settle()
            if dist.outside(func, args):  # FSDP's own op: outside the block
                return dist.run(func, args, kwargs)
            collective = collectives.is_collective(func)
        seg = self.seg
        info = OP_INFO.get(func) or _op_info(func)
        leaves, spec = flatten_tree(args, kwargs)
        written: set[int] | frozenset[int] = _NONE_WRITTEN
        if info.writes:
            written = set()
            for i, name in info.writes:
                v = args[i] if i < len(args) else kwargs.get(name)
                if isinstance(v, torch.Tensor):
                    written.add(id(v))
                elif isinstance(v, (list, tuple)):
                    written.update(id(x) for x in v if isinstance(x, torch.Tensor))
        if self.refresh:
            self._refresh()
        seq = _next_sequence_nr()
        own = self._settle(written, seq) if self.recent else None
        self.dispatch_seq = seq
        inputs = []
        device = None
        attr, ids, base_of, writers, uninit = self.attr, self.ids, seg.base, seg.writers, self.uninit
        for j, a in enumerate(leaves):
            if isinstance(a, torch.Tensor):
                ta = type(a)
                if ta is not torch.Tensor and ta is not torch.nn.Parameter:
                    seg.not_replayable(f"{func} got a tensor subclass ({ta.__name__})")
                    seg.subclass = True
                slot = a.__dict__.get(attr)
                if slot is None:
                    slot = ids.get(id(a))
                    if slot is None:
                        slot = self._slot(a)
                base = base_of[slot]
                # A view (torch.empty_like's detach, when a reference to the new tensor is
                # held) reads no values.
                if uninit and base in uninit and id(a) not in written and not info.alias:
                    seg.not_replayable(
                        f"{func} read a torch.empty buffer that no recorded op wrote (a custom "
                        "kernel or an out-of-dispatcher write filled it)")
                w = writers.get(base)
                inputs.append((j, slot, len(w) if w else 0))
                leaves[j] = None
                if device is None and info.seeded:
                    device = a.device
        if _graph_task_id() != -1:
            seg.not_replayable("autograd ran inside the block")
        rng = None
        if info.seeded:  # only random ops take a generator (some positionally)
            gens = [a for a in args if isinstance(a, torch.Generator)]
            if kwargs.get("generator") is not None:
                gens.append(kwargs["generator"])
            for g in gens:
                self.frame.env.note_generator(g)  # for a replay that re-runs the function
            rng = self._generator_states(len(seg.ops), device or kwargs.get("device"), gens)
        out = func(*args, **kwargs)
        index = len(seg.ops)
        op = RecordedOp(func, spec, leaves, inputs, rng,
                 user_call_site() if self.sites else None)
        seg.ops.append(op)
        if collective:
            decision = collectives.collective_decision(self.policy, _SAC_CTX, func, args, kwargs)
            if decision is not False:
                seg.collectives.add(index)
            if self.dist_log is None:  # for a fallback re-run of the function
                self.dist_log = collectives.log_for(self.frame)
            self.dist_log.record(func, args, kwargs, out)

        for i, name in info.writes:  # versions move on for every value this op rewrote
            v = args[i] if i < len(args) else kwargs.get(name)
            for t in (v if isinstance(v, (list, tuple)) else (v,)):
                if isinstance(t, torch.Tensor):
                    slot = self._slot(t)
                    base = seg.base[slot]
                    seg.writers.setdefault(base, []).append(index)
                    self.uninit.discard(base)
                    if seg.producer[base] < 0:
                        seg.not_replayable(f"{func} writes in place to a block input or an "
                                           "outside tensor")
                    if base in self.packed_bases:
                        seg.not_replayable(f"{func} writes in place to a value autograd saved")
        if own:
            self._own_inputs_written(own, args, kwargs)

        if not collective:
            decision = None
        decisions, roots = self.decision, self.root
        out_leaves = output_leaves(out)
        for j, o in enumerate(out_leaves):
            if not isinstance(o, torch.Tensor):
                continue
            slot = o.__dict__.get(attr)
            if slot is None:
                slot = ids.get(id(o))
            if slot is None:  # a new value: ``_new_slot`` inlined (every op output comes here)
                slot = len(base_of)
                base = slot
                root = -1
                if info.alias and inputs:  # shares the input's storage: and its versions
                    src = inputs[0][1]
                    base = base_of[src]
                    root = roots[src]
                seg.producer.append(index)
                base_of.append(base)
                decisions.append(False)
                roots.append(root)
                o.__dict__[attr] = slot
                if info.empty:
                    uninit.add(slot)
                if info.view and inputs and decisions[inputs[0][1]] is not False:
                    decisions[slot] = decisions[inputs[0][1]]
                    op.outs.append((j, slot))
                    continue
            op.outs.append((j, slot))
            if collective:
                decisions[slot] = decision
                if decision is not False:
                    self._hold(slot, o, decision, id(o) in written)
            elif self.policy is not None:
                if decision is None:
                    decision = call_policy(self.policy, _SAC_CTX, func, args, kwargs)
                decisions[slot] = decision
                if decision is not False:
                    self._hold(slot, o, decision, id(o) in written)
        return out

    def name(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """``checkpoint_name`` inside this trace: the value of ``x`` carries the name.

        ``x`` itself is returned (no new tensor, no recorded op): a view would change what
        autocast caches and so the numerics, and the function re-run by a fallback replay,
        where ``checkpoint_name`` is a plain identity, must run the same ops.
        """
        slot = self._slot(x)
        self.names[slot] = (name, user_call_site() if self.sites else None)
        if self.policy is not None and self.root[slot] < 0:  # arguments are kept anyway
            decision = call_policy(self.policy, _SAC_CTX, _NAME_OP, (x,), {"name": name})
            if decision is not False:
                self.decision[slot] = decision
                self._hold(slot, x, decision)
        return x

    def finish(self) -> Segment:
        """End of the forward: hand the segment to the frame as its replay strategy."""
        if self.refresh:
            self._refresh()
        if self.dist_log is not None:
            self.dist_log.settle()
        self.recent = []
        self._keep_what_the_replay_reads()
        self.frame.rerun = self.seg.replay
        # Replayed block inputs cost no memory of their own (for recompute_session_stats).
        self.frame.shared = frozenset(pos for pos, (slot, _) in self.seg.targets.items()
                                      if self.root[slot] >= 0)
        return self.seg


def _default_key(device_type: str, index: int | None) -> tuple[str, str, int | None]:
    """The key of a device's default generator, however a draw named it: ``"cuda"`` and
    ``"cuda:0"`` are one generator when device 0 is current (the CPU has one, index None)."""
    if device_type != "cpu" and index is None:
        index = torch.get_device_module(device_type).current_device()
    return ("default", device_type, index)

