"""One split backward, ``Split``: its forward, prefire, input-gradient pass (dx) and weight-gradient
pass (dw), in the one order they may run, sharing one replay of every checkpointed block.

``vjp_split`` and ``grad_split`` (api.py) make a ``Split`` and hand out its two halves.

Rules

1. The forward runs once, when the split is made, under a handle collector. The split owns the
   autograd graph: the outputs it returns are detached (like ``jax.vjp``'s primal output), so
   the graph lives exactly as long as the split has work to do.

2. dx registers every block of the forward to the session (unless a scheduler prefired them,
   ``dx_fn.prefire()``), then runs one ``autograd.grad`` for the inputs in the session; each
   block is replayed at its first unpack there, once, as a fused backward replays it (next to
   its use, not all blocks ahead of the backward: the replayed tensors are still in cache when
   read). A post-hook on each *intermediate* node (the nodes of the input path from which a
   weight path leaves) captures what dw needs, after the user's hooks there have fired
   (``ckptfx.split.input_pass``). The engine computes only the edges it needs, so dx does only
   the input half of each built-in node that has both.

3. dw runs the weight pass (``ckptfx.split.weight_pass``): the intermediates' weight halves,
   computed from the captured gradients without their hooks, seed one weight backward that
   executes only weight-gradient ops; dx + dw do the work of one fused backward, and every
   hook fires once with a fused backward's gradients. Where blocks are small (a rule on
   shapes, ``ckptfx.split.weight_calls``), or where only it is exact (a post-hook on a
   built-in intermediate, a sum the weight pass would add in another order:
   ``ckptfx.split.input_pass`` Rule 2), dx is instead one fused backward for the inputs and
   the weights, and dw hands out the weight gradients it kept; never under DDP or FSDP2,
   which refuse the latter two. The gradients are the same bit for bit either way.

4. Between dx and dw the session keeps only the replayed tensors dw will read: during a
   per-group dx the unpack hook drops a replayed tensor at its read by a torch node that dw
   will not execute (activation outputs, softmax probabilities, dropout masks), as a fused
   backward frees it, and logs the other reads; when dx ends the logged tensors read only by
   such nodes (a custom Function's, which may read its saved tensors twice) are dropped from
   the session's replay too (``ckptfx.split.weight_groups``, Rule 2 there). The fused dx
   drops each replayed tensor at its read.

5. dw is the last consumer: in a ``finally`` it clears the session and drops the captured
   gradients, hooks and graph, also when it raises. A dx that fails after its arguments were
   checked releases everything too; bad arguments raise before anything changes.

6. The order is: split, optionally ``dx_fn.prefire()``, ``dx_fn`` once, ``dw_fn`` once. Any
   other order (dw before dx, dx or dw twice, prefire after dx, either while the other runs,
   anything after the session was cleared) raises ``ckptfx.CheckpointError`` (a
   ``RuntimeError``) saying what to call instead. A misplaced call changes nothing (a dw_fn
   called too early can still be called at the right time), except that a split whose session
   was cleared is released at the first call that finds it so.

The graph analysis is weight_groups.py's, dx's two forms input_pass.py's; the primals as flat
tensor lists (flattening, the cotangent's check, packing the gradients) are primals.py's.
Which split owns which session key, and when a user's clear abandons one, is keys.py's.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Hashable

import optree
import torch

from ckptfx import lowering
from ckptfx.kernel.frame import CheckpointError
from ckptfx.kernel.handles import RecomputeHandle, recompute_handle_collector_ctx
from ckptfx.kernel.session import (
    check_session_id,
    recompute_handle,
    register_handle,
)
from ckptfx.split import data_parallel
from ckptfx.split import keys as split_keys
from ckptfx.split.input_pass import InputPass, input_pass
from ckptfx.split.primals import (
    check_cotangent,
    check_params,
    detach_tree,
    flatten_primals,
    normalize_argnums,
    pack_input_grads,
    pack_like,
    pack_weight_grads,
)
from ckptfx.split.weight_pass import UNKNOWN, accumulate, storage_ptrs, weight_pass

__all__ = ["Split", "check_fun", "describe_output", "early_drop_enabled", "trim_enabled"]

# Rule 4 on/off (read by ckptfx.pipelining too); benchmarks turn it off to measure what
# trimming saves.
trim_enabled = True
# Rule 4's drop at the read (else only when dx ends); benchmarks measure what it saves.
early_drop_enabled = True


def check_fun(fun: Any, has_aux: Any, who: str) -> None:
    """A ``TypeError`` naming ``who`` for a ``fun`` that is not callable or a ``has_aux``
    that is not a bool (``grad_split`` checks them when made, before any call)."""
    if not callable(fun):
        raise TypeError(f"{who}: fun must be callable, got {type(fun).__name__}")
    if not isinstance(has_aux, bool):
        raise TypeError(f"{who}: has_aux must be a bool, got {type(has_aux).__name__}")


def describe_output(out: Any) -> str:
    """``out`` for an error message, without a tensor's values: ``a torch.float32 tensor of
    shape (4, 8)``, ``a tuple of 2: (...)``."""
    if isinstance(out, torch.Tensor):
        return f"a {out.dtype} tensor of shape {tuple(out.shape)}"
    if isinstance(out, (tuple, list)):
        inner = ", ".join(describe_output(o) for o in out[:4])
        return f"a {type(out).__name__} of {len(out)}: ({inner}{', ...' if len(out) > 4 else ''})"
    text = repr(out)
    return text if len(text) <= 80 else text[:77] + "..."


class Split:
    """State of one split: the graph, the session, the captured gradients (see Rules)."""

    def __init__(
        self,
        fun: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        x_argnums: Any,
        session: Hashable | None,
        has_aux: bool,
        params: Any,
        who: str,
    ) -> None:
        check_fun(fun, has_aux, who)
        names_a_primal = ((isinstance(x_argnums, int) and not isinstance(x_argnums, bool))
                          or (isinstance(x_argnums, (tuple, list)) and len(x_argnums) > 0))
        if not args and names_a_primal:  # x_argnums=() needs none: weight gradients only
            call = ("dx_fn(*args, session=...) with fun's arguments" if who == "grad_split"
                    else f"{who}(fun, *primals), as jax.vjp(fun, *primals)")
            raise TypeError(
                f"{who}: no primals given, but x_argnums={x_argnums!r} names one; call {call} "
                "(or pass x_argnums=() for weight gradients only)")
        nums, self.x_single = normalize_argnums(x_argnums, len(args))
        if session is None:
            session = split_keys.SplitKey()
        else:
            check_session_id(session, f"{who}: session")
        param_list = check_params(params, who)
        self.who = who
        self.key = session
        self.lock = threading.Lock()
        self.state = "forward"
        self.prefired = False
        # Set by _note_clear: the user cleared this split's key before any of its blocks
        # joined the session (nothing there for Session.cleared to say so).
        self.cleared_early = False
        self.session_obj: Any = None
        self.dp: data_parallel.DataParallel | None = None

        (call_args, self.x_specs, self.w_specs, self.x, self.weights, w_index,
         self.param_slots) = flatten_primals(args, nums, param_list, who)

        split_keys.claim(session, self, who)  # one unfinished split per key (its Rule 1)

        try:
            with data_parallel.observing() as seen, recompute_handle_collector_ctx() as handles, \
                    torch.enable_grad():
                res = fun(*call_args, **kwargs)
            # FSDP2 / DDP modules the forward ran (None in one process): see data_parallel.
            self.dp = seen if seen else None
            if self.dp is not None:
                self.dp.check_split(who)
                self.dp.adopt_params(self.weights, self.param_slots, w_index)
        except BaseException:
            self._forget()
            raise
        if has_aux:
            if not isinstance(res, (tuple, list)) or len(res) != 2:
                self._forget()
                raise TypeError(
                    f"{who}: with has_aux=True, fun must return a pair (output, aux), got "
                    f"{type(res).__name__}"
                )
            out, aux = res
            self.aux = detach_tree(aux)
        else:
            out, self.aux = res, None
        self.handles: list[RecomputeHandle] = handles
        if not handles:
            lowering.check_split_graph(
                [t for t in optree.tree_leaves(out, none_is_leaf=True)
                 if isinstance(t, torch.Tensor)], who)
        leaves, self.out_treedef = optree.tree_flatten(out, none_is_leaf=True)
        self.out_leaves_meta = [
            (i, leaf.shape) for i, leaf in enumerate(leaves)
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad
        ]
        self.outputs: list[torch.Tensor] = [leaves[i] for i, _ in self.out_leaves_meta]
        self.out = detach_tree(out)
        self.cotangents: list[torch.Tensor | None] = []
        self.passed: InputPass | None = None  # what dx computed and leaves dw
        self.shared: set[int] = set()  # data pointers of tensors the caller holds (dx's)

    # -- lifecycle ----------------------------------------------------------------------------

    def _forget(self) -> None:
        split_keys.forget(self.key, self)

    def release(self) -> None:
        """Drop everything (Rule 5); idempotent."""
        self.state = "done"
        try:
            self._clear_own_session()
            dp = getattr(self, "dp", None)
            if dp is not None:
                dp.abandon()  # after a reduce() this does nothing
        finally:
            self.dp = None
            self.passed = None
            self.shared = set()
            self.cotangents = []
            self.outputs = []
            self.handles = []
            self.x = []
            self.weights = []
            self.session_obj = None
            self._forget()

    def _clear_own_session(self) -> None:
        """Clear this split's session as the split itself (``split.keys``, Rule 3)."""
        split_keys.clear_as_owner(self.key, self)

    def abandoned(self) -> bool:
        """Cleared by the user before it finished (its key is free for a new split)."""
        obj = self.session_obj
        return self.cleared_early or (obj is not None and obj.cleared)

    def _check_not_cleared(self) -> None:
        if self.abandoned():
            self.release()
            raise CheckpointError(
                f"{self.who}: session {self.key!r} was cleared (clear_recompute_session) before "
                "this split finished; the split is abandoned and released. Make a new split "
                "for this micro-batch, and clear its session only after its dw_fn"
            )

    def prefire(self) -> None:
        """Replay every checkpointed block of the forward for this split's session now."""
        with self.lock:
            if self.state != "forward":
                raise CheckpointError(
                    f"{self.who}: prefire() must come before dx_fn; this split is past it "
                    f"(state: {self.state}). dx_fn replays what was not prefired by itself: "
                    "drop this prefire() call, or move it before dx_fn"
                )
            self._prefire()

    def _prefire(self, replay: bool = True) -> None:
        """Register every block to the session and, with ``replay``, replay it now."""
        self._check_not_cleared()
        if self.prefired:
            return
        try:
            if self.dp is not None:
                self.dp.before_replay()  # replays read unsharded FSDP parameters
            for h in self.handles:
                (recompute_handle if replay else register_handle)(h, self.key)
        except BaseException:
            # Leave nothing half-replayed: a retry starts from a clean session.
            self._clear_own_session()
            raise
        for h in self.handles:
            frame = h.frame
            if frame is not None and frame.session is not None:
                self.session_obj = frame.session
                break
        self.prefired = True

    # -- dx -----------------------------------------------------------------------------------

    def dx(self, cotangent: Any) -> Any:
        with self.lock:
            if self.state != "forward":
                raise CheckpointError(self._order_error("dx_fn"))
            cots = check_cotangent(cotangent, self.out_treedef, self.out_leaves_meta, self.who)
            self.state = "dx"
        try:
            self._prefire(replay=False)  # Rule 2: each block replays at its first unpack
            if self.dp is not None:
                self.dp.hold()
            used = [i for i, c in enumerate(cots) if c is not None]
            self.cotangents = [cots[i] for i in used]
            outputs = [self.outputs[i] for i in used]
            x_req = [t for t in self.x if t.requires_grad]
            # Rules 2-4 (input_pass.py): per group, or the fused pass where it pays or where
            # only it is exact.
            self.passed = passed = input_pass(
                self.key, outputs, self.cotangents, x_req, self.weights, self.dp is not None,
                self.who, trim_enabled, early_drop_enabled)
            if self.session_obj is None and passed.session is not None:
                self.session_obj = passed.session
            grads = passed.grads or [None] * len(x_req)
            for g in grads:  # dw never makes .grad alias what dx returned
                if g is not None:
                    self.shared.update(storage_ptrs(g) or (UNKNOWN,))
            self._check_not_cleared()
            results = pack_input_grads(self.x_specs, self.x, x_req, grads)
            with self.lock:
                self.state = "dx_done"
            return pack_like(results, self.x_single)
        except BaseException:
            self.release()
            raise

    # -- dw -----------------------------------------------------------------------------------

    def dw(self) -> Any:
        with self.lock:
            if self.state == "forward":
                self._check_not_cleared()  # abandoned before dx: say so, not "call dx"
            if self.state != "dx_done":
                raise CheckpointError(self._order_error("dw_fn"))
            self.state = "dw"
        try:
            self._check_not_cleared()
            passed = self.passed
            assert passed is not None
            if passed.mode == "fused":
                wgrads = passed.wgrads  # computed in dx (input_pass.py Rule 3)
            else:
                assert passed.plan is not None
                wgrads = weight_pass(
                    self.key, passed.plan, passed.captured, passed.out_edges,
                    self.cotangents, self.weights, self.param_slots, passed.w_edges, self.dp)
            self._accumulate(wgrads)
            if self.dp is not None:
                self.dp.reduce()  # FSDP2's reduce-scatter and reshard
            results = pack_weight_grads(self.w_specs, self.weights, wgrads)
            return pack_like(results, len(results) == 1)
        finally:
            self.release()

    def _accumulate(self, wgrads: list[torch.Tensor | None]) -> None:
        """The ``params=`` gradients into ``.grad`` (weight_pass.py Rule 2); under DDP the
        reducer wrote them."""
        if self.dp is not None and self.dp.ddp:
            return
        shared = self.shared
        for c in self.cotangents:
            if c is not None:
                shared.update(storage_ptrs(c) or (UNKNOWN,))
        passed = self.passed
        if passed is not None:
            for grads_in, outs in passed.captured.values():
                for t in (*grads_in, *outs):
                    if t is not None:
                        shared.update(storage_ptrs(t) or (UNKNOWN,))
        for i in self.param_slots:
            wg = wgrads[i]
            if wg is not None:
                accumulate(self.weights[i], wg, shared)

    def _order_error(self, fn: str) -> str:
        """What a call of ``fn`` in the wrong state says (Rule 6)."""
        state, key = self.state, self.key
        if state == "forward":
            return (f"{self.who}: dw_fn called before dx_fn for session {key!r}; call "
                    "dx_fn(cotangent) first, then dw_fn() (this split is unchanged)")
        if state in ("dx", "dw"):
            return (f"{self.who}: {fn} called while {state}_fn of session {key!r} is running; "
                    "the halves of one split run one at a time: call it after "
                    f"{state}_fn returns")
        if state == "dx_done":
            return (f"{self.who}: dx_fn already ran for session {key!r}; "
                    "call dw_fn next (dx_fn runs once per split)")
        return (f"{self.who}: session {key!r} is consumed (its dw_fn ran, or it failed or "
                "was cleared, which releases it); make a new split")
