"""Zero-bubble pipelining that replays each checkpointed block once per micro-batch.

``ckptfx.pipelining.PipelineStage`` is a drop-in for
``torch.distributed.pipelining.PipelineStage`` (same constructor). With torch's own stage, a
zero-bubble schedule's input step (I) and weight step (W) are separate backward calls, so every
checkpointed block in the stage is replayed once for I and once per parameter group for W.
This stage gives each (stage, micro-batch) one recompute session:

1. forward (F): the checkpointed calls of the micro-batch are collected;
2. input step (I): the session is prefired (each block replayed once), then torch's own input
   step runs inside ``recompute_session_ctx(session, retain_on_unpack=True)``; when it ends,
   the replayed tensors that only the input gradients needed are dropped (see ``ckptfx.split``);
3. weight step (W): torch's own weight step runs in the same session (every parameter group
   reads the one replay), and the session is cleared in a ``finally``.

Full backward steps (B), the first stage (whose I step does nothing; its W step is one full
backward) and stages built with ``dw_builder`` run natively: one backward call replays each
block once anyway. Gradients are torch's own (the same ``stage_backward_input`` and
``stage_backward_weight`` run), so they are bitwise equal to the same schedule without
checkpointing.

Metadata inference. Without ``input_args``/``output_args``, torch (>= 2.13) infers each
stage's tensor metadata on the first step: one forward of the stage module on a stand-in
input, then, for a stage whose inputs require grad (every stage but the first), one
``autograd.grad`` whose results it reads for their metadata only. Through a checkpointed
block that backward is a full replay, the one extra run per block of the first step. This
stage skips it when the inference forward ran ckptfx checkpoints and every input and output
is a plain tensor: the gradient metadata of a plain tensor is its own shape, stride and dtype,
torch's rule in its static mode and in its traced stage. DTensors and other tensor subclasses
(whose gradient placements only a real backward tells), stages without ckptfx checkpoints, and
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (which checks every runtime gradient against the inferred
stride) keep torch's real backward. So each checkpointed block runs twice per micro-batch on
every step, plus, on the first step, the one inference forward torch's stage runs without
checkpointing too; with ``input_args`` and ``output_args`` given there is no inference run.

FSDP2-sharded stage modules: before the I step's prefire the stage's FSDP2 parameter groups
are unsharded (torch's stage keeps them unsharded until its reduce-grad step), so replays read
full parameters. Measured (``examples/fsdp_pipeline.py``, 2 stages x 2-way FSDP2, gloo):
losses and gradients bitwise equal to torch's stage without checkpointing, 2 runs per block
per micro-batch under ScheduleZBVZeroBubble and ScheduleInterleavedZeroBubble.

This module imports ``torch.distributed``; import it explicitly
(``import ckptfx.pipelining``).

Example::

    from ckptfx.pipelining import PipelineStage
    from torch.distributed.pipelining import ScheduleZBVZeroBubble

    for block in model_chunk.blocks:
        ckptfx.checkpoint_wrapper(block)
    stages = [PipelineStage(chunk, idx, num_stages, device) for idx, chunk in my_chunks]
    schedule = ScheduleZBVZeroBubble(stages, n_microbatches=8, loss_fn=loss_fn)
    schedule.step(x, target=y)
"""

from __future__ import annotations

import itertools
from typing import Any, Hashable

import torch
import torch.distributed.pipelining as _tpp

from ckptfx import _compat
from ckptfx.kernel.frame import tls
from ckptfx.kernel.fsdp import unshard_fsdp_modules
from ckptfx.kernel.handles import RecomputeHandle, recompute_handle_collector_ctx
from ckptfx.kernel.session import (
    clear_recompute_session,
    recompute_handle,
    recompute_session_ctx,
)
from ckptfx.split import passes as split_passes
from ckptfx.split.weight_groups import trim_session, weight_pass_nodes

__all__ = ["PipelineStage"]

_stage_counter = itertools.count()


class _StageKey:
    """Part of every session id of one stage object, so two stages never share a session."""

    __slots__ = ("n", "stage_index")

    def __init__(self, stage_index: int) -> None:
        self.n = next(_stage_counter)
        self.stage_index = stage_index

    def __repr__(self) -> str:
        return f"<ckptfx stage {self.stage_index} #{self.n}>"


class PipelineStage(_tpp.PipelineStage):
    """``torch.distributed.pipelining.PipelineStage`` whose I and W steps share one replay.

    Same constructor and behaviour as torch's stage; only the split backward of checkpointed
    blocks changes (see the module docstring). ``session_id(mb)`` is the recompute session of
    micro-batch ``mb`` of this stage, e.g. for ``ckptfx.recompute_session_stats()`` between
    the I and W steps.

    Example::

        from torch.distributed.pipelining import ScheduleZBVZeroBubble
        from ckptfx.pipelining import PipelineStage

        stages = [PipelineStage(module, stage_index=i, num_stages=n, device=device)
                  for i, module in my_stage_modules]     # blocks checkpointed by ckptfx
        schedule = ScheduleZBVZeroBubble(stages, n_microbatches=4, loss_fn=loss_fn)
        schedule.step(x, target=y)       # each block replayed once per micro-batch
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ckptfx_key = _StageKey(self.stage_index)
        self._ckptfx_handles: dict[int, list[RecomputeHandle]] = {}
        self._ckptfx_live: set[Hashable] = set()

    def session_id(self, microbatch: int) -> Hashable:
        """The recompute session id of ``microbatch`` on this stage.

        Example::

            stats = ckptfx.recompute_session_stats().get(stage.session_id(0))
        """
        return (self._ckptfx_key, microbatch)

    # -- F ------------------------------------------------------------------------------------

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        """torch's forward of one micro-batch, noting the checkpointed blocks it ran (their
        handles), so that its backward can replay each of them once."""
        with recompute_handle_collector_ctx() as handles:
            out = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        if handles:
            self._ckptfx_handles[fwd_chunk_id] = handles
        else:
            self._ckptfx_handles.pop(fwd_chunk_id, None)
        return out

    # -- I (or B) -----------------------------------------------------------------------------

    def backward_one_chunk(
        self,
        bwd_chunk_id: int,
        loss: Any = None,
        full_backward: bool = True,
        last_backward: bool = False,
    ) -> None:
        """torch's input-gradient step (I) of one micro-batch, or its full backward. For a
        split step over checkpointed blocks, the blocks are prefired for the micro-batch's
        session and I reads their replay, retained for the weight step (W) that follows."""
        handles = self._ckptfx_handles.pop(bwd_chunk_id, None)
        if (
            full_backward
            or not handles
            or not self.has_backward
            or self.dw_builder is not None
            or self.is_first  # torch's I step does nothing there; W is one full backward
        ):
            return super().backward_one_chunk(
                bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward
            )
        sid = self.session_id(bwd_chunk_id)
        if sid in self._ckptfx_live:  # a stale session of an earlier step: start clean
            self._clear(sid)
        self._ckptfx_live.add(sid)
        log: list = []
        try:
            # Replays read full parameters: unshard FSDP2 modules first, as FSDP's own
            # pre-backward would (ckptfx.split.data_parallel).
            unshard_fsdp_modules(self.submod)
            for h in handles:
                recompute_handle(h, sid)
            with recompute_session_ctx(sid, retain_on_unpack=True):
                act = tls.activation
                act.record(log)
                try:
                    super().backward_one_chunk(
                        bwd_chunk_id, loss=loss, full_backward=False, last_backward=last_backward
                    )
                finally:
                    act.log = None
            state = self.backward_state.get(bwd_chunk_id)
            groups = state[1] if state is not None else None
            if groups and split_passes.trim_enabled:
                keep = weight_pass_nodes((g["intermediates"], g["params"]) for g in groups)
                trim_session(act.session, log, keep)
        except BaseException:
            self._clear(sid)
            raise
        finally:
            log.clear()

    # -- W ------------------------------------------------------------------------------------

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
        """torch's weight-gradient step (W) of one micro-batch, reading the replay its I step
        made (no second replay), then clearing the micro-batch's session."""
        sid = self.session_id(bwd_chunk_id)
        if sid not in self._ckptfx_live:
            return super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
        try:
            with recompute_session_ctx(sid, retain_on_unpack=True):
                super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
        finally:
            self._clear(sid)

    # -- housekeeping -------------------------------------------------------------------------

    def _clear(self, sid: Hashable) -> None:
        self._ckptfx_live.discard(sid)
        clear_recompute_session(sid)

    # -- metadata inference (torch >= 2.13, first step; installed below) ----------------------

    def _ckptfx_inference_forward(self, *args: Any, **kwargs: Any) -> Any:
        """torch's inference forward, noting whether it ran ckptfx checkpoints."""
        base = getattr(super(), _compat.PIPELINE_INFERENCE_FORWARD)
        with recompute_handle_collector_ctx() as handles:
            out = base(*args, **kwargs)
        self._ckptfx_inference_checkpointed = bool(handles)
        return out

    def _ckptfx_inference_input_grads(
        self, outputs: Any, inputs: Any, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor | None, ...]:
        """torch's inference backward, or, where it would only replay ckptfx checkpoints to
        learn what a plain tensor's metadata already says, stand-ins with that metadata."""
        checkpointed = getattr(self, "_ckptfx_inference_checkpointed", False)
        self._ckptfx_inference_checkpointed = False
        wanted = [isinstance(t, torch.Tensor) and t.requires_grad for t in inputs]
        if (
            not checkpointed
            or _compat.pipeline_stage_runtime_validate(self)
            or not all(_is_plain(t) for t in outputs)
            or not all(_is_plain(t) for t, w in zip(inputs, wanted) if w)
        ):
            base = getattr(super(), _compat.PIPELINE_INFERENCE_INPUT_GRADS)
            return base(outputs, inputs, *args, **kwargs)
        # Meta tensors (no storage) with the input's shape and dtype, which autograd enforces
        # on a gradient, and the input's stride. A custom backward may return a gradient of
        # another stride: across ranks torch cannot send that one (gloo refuses a
        # non-contiguous tensor) while the input's stride is the contiguous one of its recv
        # buffer; on one rank the stride is read only by DETAIL validation, handled above.
        return tuple(
            torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta") if w else None
            for t, w in zip(inputs, wanted)
        )

    def clear_runtime_states(self) -> None:
        """torch's reset between steps; also drops this stage's handles and sessions."""
        for sid in list(getattr(self, "_ckptfx_live", ())):
            self._clear(sid)
        if hasattr(self, "_ckptfx_handles"):
            self._ckptfx_handles.clear()
        super().clear_runtime_states()


def _is_plain(t: Any) -> bool:
    return type(t) in (torch.Tensor, torch.nn.Parameter)


if _compat.pipeline_stage_has_metadata_inference(_tpp.PipelineStage):
    setattr(PipelineStage, _compat.PIPELINE_INFERENCE_FORWARD,
            PipelineStage._ckptfx_inference_forward)
    setattr(PipelineStage, _compat.PIPELINE_INFERENCE_INPUT_GRADS,
            PipelineStage._ckptfx_inference_input_grads)
