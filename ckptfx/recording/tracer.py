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
   Memory handed outside the dispatcher (NumPy, DLPack, ``data_ptr``, storages; escapes.py),
   a ``set_`` alias, and a default dtype changed inside the block also make it not
   replayable.

   4b. A block that reads a tensor from outside and writes it in place (spectral norm's
   power-iteration vectors, read and then written; a counter written and then read) cannot
   be re-run: the re-run would read what the forward left, or its own second write. Its replay, where it would re-run the function, is a ``CheckpointError``
   (torch's checkpoint silently computes other gradients). A write that only the writing
   op read (a BatchNorm's running statistics) is fine: the re-run updates them again, as
   torch's does.

   4c. An enclosing frame (a ``ckptfx.checkpoint`` around this block) cannot see the
   block's ops: the explicit generators the block draws from are noted in its replay
   environment too, so its re-run starts them where this block's first draw found them and
   leaves the caller's states as they were (an early-stopped re-run would otherwise leave
   them half-drawn). Draws the enclosing block itself made from them first are its own,
   under torch's contract: not restored.

5. Generator state is checked, not assumed: a random op's generators are compared with the
   state the last draw from them left (or, for the block's first draw, the state the frame
   captured), so a state set between draws outside the dispatcher (``manual_seed``,
   ``set_rng_state``, ``fork_rng``, ``Generator.set_state``) is stored for the replay. An op
   outside ATen and prims that does not declare randomness (a custom op) is run between two
   reads of the CPU's and its device's default generator states: if it moved them it drew
   random numbers, and it replays from the states it started from.
"""

from __future__ import annotations

import itertools
from typing import Any

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
from ckptfx.recording.draws import Draws, generator_keys
from ckptfx.recording.escapes import EscapeWatch
from ckptfx.recording.packs import PackSide, residual_unpack_hook
from ckptfx.recording.segment import (
    RecordedOp,
    Segment,
    flatten_tree,
    output_leaves,
    outside_version,
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
        self.escapes = EscapeWatch(frame, seg, self.attr, self.root)
        self.outside_written: dict[int, tuple[Any, torch.Tensor]] = {}  # base -> first write
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
        self.hosts: dict[Any, Any] = {}  # (device, pinned) -> its offload HostGroup (packs.py)
        self.draws = Draws(frame.env, seg)  # what each random op replays from (Rule 5)
        self.default_dtype = frame.env.default_dtype  # read at every op (Rule 4)
        # The replay environment of the frame this block is nested in, if any: a re-run of
        # that frame runs this block's draws too, so it restores their generators, and puts
        # the caller's back after (Rule 4c).
        self.enclosing = _enclosing_env()
        # FSDP scopes and collectives (ckptfx.kernel.collectives), only where one can run.
        self.dist = collectives.Watch() if collectives.watch_needed() else None
        self.dist_log: Any = None
        for i, t in enumerate(inputs):
            if id(t) not in self.ids:
                self.ids[id(t)] = self._new_slot(-1, None, root=True)
            seg.input_slots.append(self.ids[id(t)])

    def _read_before(self, base: int, index: int | None) -> bool:
        """True if an op before op ``index`` (all ops: None) that did not write it read the
        argument or outside tensor ``base`` (or a view of it): a re-run of the block would
        read it as the block left it (Rule 4b). Asked only where the block writes such a
        tensor, which is rare."""
        seg = self.seg
        writers = set(seg.writers.get(base, ()))
        for i in range(len(seg.ops) if index is None else index):
            op = seg.ops[i]
            if i in writers or _op_info(op.func).view:  # a view reads no values
                continue
            if any(seg.base[s] == base for _, s, _ in op.inputs):
                return True
        return False

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
            self.seg.outside[slot] = (t, outside_version(t))
        return slot

    # the dispatch side -----------------------------------------------------------------

    def __enter__(self) -> "Tracer":
        _stack.tracers.append(self)
        self.escapes.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        _stack.tracers.pop()
        try:
            return super().__exit__(*exc)
        finally:
            self.escapes.__exit__(*exc)

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
            if func.overloadpacket is aten.set_:  # the tensor now shares another's storage
                seg.not_replayable(f"{func} made a tensor share another's storage")
            written = set()
            for i, name in info.writes:
                v = args[i] if i < len(args) else kwargs.get(name)
                if isinstance(v, torch.Tensor):
                    written.add(id(v))
                elif isinstance(v, (list, tuple)):
                    written.update(id(x) for x in v if isinstance(x, torch.Tensor))
                if self.hosts:  # a copy to the host may still read it (ckptfx.offload)
                    self._before_write(v)
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
                if device is None and (info.seeded or info.opaque):
                    device = a.device
        if _graph_task_id() != -1:
            seg.not_replayable("autograd ran inside the block")
        if torch.get_default_dtype() is not self.default_dtype:  # Rule 4
            seg.not_replayable(f"{func} ran under another default dtype than the block began with")
        rng = keys = before = None
        if info.seeded:  # only random ops take a generator (some positionally)
            gens = [a for a in args if isinstance(a, torch.Generator)]
            if kwargs.get("generator") is not None:
                gens.append(kwargs["generator"])
            for g in gens:
                self.frame.env.note_generator(g)  # for a replay that re-runs the function
                if self.enclosing is not None:
                    self.enclosing.note_generator(g)
            device = device or kwargs.get("device")
            keys = generator_keys(device, gens)
            rng = self.draws.states_for(len(seg.ops), device, gens, keys)
        elif info.opaque and not collective:  # Rule 5: did it draw random numbers?
            before = rng_states(device, [])
        out = func(*args, **kwargs)
        if keys is not None:
            self.draws.note_after(keys, gens)
        elif before is not None:
            rng = self.draws.opaque(device, before)
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
                        if seg.reread is None and self._read_before(base, index):
                            seg.reread = (func, t)
                        elif base in seg.outside:  # a read after it counts too: at finish
                            self.outside_written.setdefault(base, (func, t))
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
        self.draws.after = {}  # generator states: needed only while recording
        for base, write in self.outside_written.items():  # Rule 4b, reads after the write
            if self.seg.reread is None and self._read_before(base, None):
                self.seg.reread = write
        self.outside_written = {}
        # A replay checks that nothing outside the block moved since the block returned (its
        # own writes to a tensor from outside already make it re-run the function).
        outside = self.seg.outside
        for slot, (t, _) in outside.items():
            outside[slot] = (t, outside_version(t))
        if torch.get_default_dtype() is not self.frame.env.default_dtype:
            self.seg.not_replayable("the default dtype changed inside the block")
        self._keep_what_the_replay_reads()
        self.report = None  # its tensors hold the graph, which holds this: packs.py Rule 2c
        self.seg.hosts = tuple(self.hosts.values())
        self.frame.rerun = self.seg.replay
        # Replayed block inputs cost no memory of their own (for recompute_session_stats).
        self.frame.shared = frozenset(pos for pos, (slot, _) in self.seg.targets.items()
                                      if self.root[slot] >= 0)
        return self.seg


def finish_offload(tracer: Tracer, out: Any) -> None:
    """After ``finish``: the block's offload copies that still read one of its outputs
    (``out``, a pytree) hold the caller back until they are done (ckptfx.offload Rule 3)."""
    outputs = [t for t in output_leaves(out) if isinstance(t, torch.Tensor)]
    for group in tracer.hosts.values():
        group.finish(outputs)


def _enclosing_env() -> Any:
    """The replay environment of the frame whose forward packs this block's inputs (the
    saved-tensor hooks on top when the block starts): a kernel frame's or an enclosing
    recording's, else None."""
    owner = getattr(_compat.top_saved_tensors_pack_hook(), "__self__", None)
    if isinstance(owner, Frame):
        return owner.env
    if isinstance(owner, Tracer):
        return owner.frame.env
    return None
