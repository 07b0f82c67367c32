"""``vjp_split`` and ``grad_split``: the input-gradient pass (dx) and the weight-gradient pass
(dw) of one backward as two functions that share one replay of every checkpointed block.

Rules

1. The forward runs once, when the split is made, under a handle collector. The split owns the
   autograd graph: the outputs it returns are detached (like ``jax.vjp``'s primal output), so
   the graph lives exactly as long as the split has work to do.

2. dx registers every block of the forward to the session (unless a scheduler prefired them,
   ``dx_fn.prefire()``), then runs one ``autograd.grad`` for the inputs under
   ``recompute_session_ctx(key, retain_on_unpack=True)``; each block is replayed at its first
   unpack there, once, as a fused backward replays it (next to its use, not all blocks ahead
   of the backward: the replayed tensors are still in cache when read).
   Pre-hooks on the *intermediate* nodes (the nodes of the input path from which a weight path
   leaves) capture the gradients flowing into them. The engine computes only the edges it
   needs, so dx does only the input half of each node that has both.

3. dw runs the weight pass (``ckptfx.split.weight_pass``): one ``autograd.grad`` per parameter
   group (``ckptfx.split.weight_groups``), rooted at the intermediates with the captured gradients,
   so it executes only weight-gradient ops; dx + dw do the work of one fused backward.
   Where blocks are small (a rule on shapes, ``ckptfx.split.weight_calls``) the per-call cost
   outweighs that: dx is then a plain input backward (no groups, no capture hooks) and dw one
   plain weight backward from the outputs, which recomputes the input-path gradients that
   lead to weights; the gradients are the same bit for bit either way. Never under DDP or
   FSDP2, nor with a custom Function's backward in the graph (it would run twice).

4. Between dx and dw the session keeps only the replayed tensors dw will read (per-group pass;
   the whole pass reads them all): during dx the unpack hook drops a replayed tensor at its
   read by a torch node that dw will not execute (activation outputs, softmax probabilities,
   dropout masks), as a fused backward frees it, and logs the other reads; when dx ends the
   logged tensors read only by such nodes (a custom Function's, which may read its saved
   tensors twice) are dropped from the session's replay too (``ckptfx.split.weight_groups``, Rule
   2 there).

5. dw is the last consumer: in a ``finally`` it clears the session and drops the captured
   gradients, hooks and graph, also when it raises. A dx that fails after its arguments were
   checked releases everything too; bad arguments raise before anything changes.

6. The order is: split, optionally ``dx_fn.prefire()``, ``dx_fn`` once, ``dw_fn`` once. Any
   other order (dw before dx, dx or dw twice, prefire after dx, either while the other runs,
   anything after the session was cleared) raises ``ckptfx.CheckpointError`` (a
   ``RuntimeError``) saying what to call instead. A misplaced call changes nothing (a dw_fn
   called too early can still be called at the right time), except that a split whose session
   was cleared is released at the first call that finds it so.

The graph analysis (the weight groups) is weight_groups.py's; the primals as flat tensor
lists (flattening, the cotangent's check, packing the gradients) are primals.py's. Which split
owns which session key, and when a user's clear abandons one, is keys.py's.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Hashable, Iterable, Sequence

import optree
import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from ckptfx import lowering
from ckptfx.split import data_parallel
from ckptfx.split import keys as split_keys
from ckptfx.split.primals import (
    detach_tree,
    normalize_argnums,
    pack_like,
    check_cotangent,
    check_params,
    flatten_primals,
    pack_input_grads,
    pack_weight_grads,
)
from ckptfx.split.weight_groups import (Node, WeightGroup, plan_groups, trim_session,
                                        weight_pass_nodes)
from ckptfx.split import weight_calls
from ckptfx.split.weight_pass import weight_pass
from ckptfx.kernel.frame import CheckpointError, tls
from ckptfx.kernel.handles import RecomputeHandle, recompute_handle_collector_ctx
from ckptfx.kernel.session import (
    check_session_id,
    recompute_handle,
    recompute_session_ctx,
    register_handle,
)

__all__ = ["SplitInputFn", "SplitWeightFn", "grad_split", "vjp_split"]

# Rule 4 on/off (read by ckptfx.pipelining too); benchmarks turn it off to measure what
# trimming saves.
trim_enabled = True
# Rule 4's drop at the read (else only when dx ends); benchmarks measure what it saves.
_early_drop_enabled = True


# -- the split --------------------------------------------------------------------------------


def _check_fun(fun: Any, has_aux: Any, who: str) -> None:
    """A ``TypeError`` naming ``who`` for a ``fun`` that is not callable or a ``has_aux``
    that is not a bool (``grad_split`` checks them when made, before any call)."""
    if not callable(fun):
        raise TypeError(f"{who}: fun must be callable, got {type(fun).__name__}")
    if not isinstance(has_aux, bool):
        raise TypeError(f"{who}: has_aux must be a bool, got {type(has_aux).__name__}")


def _describe_output(out: Any) -> str:
    """``out`` for an error message, without a tensor's values: ``a torch.float32 tensor of
    shape (4, 8)``, ``a tuple of 2: (...)``."""
    if isinstance(out, torch.Tensor):
        return f"a {out.dtype} tensor of shape {tuple(out.shape)}"
    if isinstance(out, (tuple, list)):
        inner = ", ".join(_describe_output(o) for o in out[:4])
        return f"a {type(out).__name__} of {len(out)}: ({inner}{', ...' if len(out) > 4 else ''})"
    text = repr(out)
    return text if len(text) <= 80 else text[:77] + "..."


class _Split:
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
        _check_fun(fun, has_aux, who)
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
        self.captured: dict[Node, tuple[torch.Tensor | None, ...]] = {}
        self.groups: list[WeightGroup] = []
        # GradientEdges, or the tensors themselves for the whole weight pass (_weight_calls)
        self.out_edges: list[GradientEdge | torch.Tensor] = []
        self.cotangents: list[torch.Tensor | None] = []
        self.w_edges: list[GradientEdge | torch.Tensor] = []

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
            self.captured = {}
            self.groups = []
            self.out_edges = []
            self.cotangents = []
            self.outputs = []
            self.handles = []
            self.x = []
            self.weights = []
            self.w_edges = []
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
            # Small blocks: dw as one plain weight backward (Rule 3, _weight_calls). Its
            # edges are the tensors themselves (autograd finds them in C++).
            # A custom Function's backward in the graph forces the per-group pass: the whole
            # one would run it twice (Rule 2, _weight_calls).
            whole = (self.dp is None
                     and weight_calls.whole_backward_pays(self.cotangents, x_req, self.weights)
                     and weight_calls.whole_backward_safe(outputs))
            if whole:
                self.out_edges, self.w_edges = list(outputs), list(self.weights)
                self.groups = [weight_calls.whole_backward_group(len(outputs), len(self.weights))]
            else:
                out_edges = [get_gradient_edge(o) for o in outputs]
                x_nodes = {get_gradient_edge(t).node for t in x_req}
                w_edges = [get_gradient_edge(w) for w in self.weights]
                w_nodes = [e.node for e in w_edges]
                self.out_edges, self.w_edges = list(out_edges), list(w_edges)
                self.groups = plan_groups(out_edges, x_nodes, w_nodes)
                keep = weight_pass_nodes(
                    ((g.intermediates, [w_nodes[i] for i in g.weights]) for g in self.groups),
                    stop=x_nodes,
                )
            hooks = []
            captured = self.captured

            def capture(node: Node) -> Callable[..., None]:
                def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
                    captured[node] = grad_outputs
                return hook

            grads: Sequence[torch.Tensor | None] = [None] * len(x_req)
            try:
                for g in self.groups:
                    for node in g.intermediates:
                        hooks.append(node.register_prehook(capture(node)))
                if x_req and outputs:
                    log: list = []
                    with recompute_session_ctx(self.key, retain_on_unpack=True):
                        act = tls.activation
                        if not whole:
                            act.record(log, keep if trim_enabled and _early_drop_enabled
                                       else None)
                        try:
                            grads = torch.autograd.grad(
                                outputs, x_req, self.cotangents, retain_graph=True,
                                allow_unused=True,
                            )
                        except RuntimeError as err:
                            lowering.explain_donated_buffers(err, self.who)
                            raise
                        finally:
                            act.log = act.drop_unless = None
                    if self.session_obj is None and len(act.session.frames):
                        self.session_obj = act.session  # frames found lazily (no prefire)
                    if trim_enabled and not whole:  # the whole pass reads every tensor
                        trim_session(act.session, log, keep)
                    log.clear()
            finally:
                for h in hooks:
                    h.remove()
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
            wgrads = weight_pass(
                self.key, self.groups, self.captured, self.out_edges, self.cotangents,
                self.weights, self.param_slots, self.w_edges, self.dp,
            )
            if self.dp is not None:
                self.dp.reduce()  # FSDP2's reduce-scatter and reshard
            results = pack_weight_grads(self.w_specs, self.weights, wgrads)
            return pack_like(results, len(results) == 1)
        finally:
            self.release()

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


class _SplitFn:
    """A half of a ``vjp_split``: holds the split and knows its session."""

    __slots__ = ("_split",)
    _name = ""

    def __init__(self, split: _Split) -> None:
        self._split = split

    @property
    def session(self) -> Hashable:
        return self._split.key

    def __repr__(self) -> str:
        return f"<vjp_split {self._name}, session {self._split.key!r}, {self._split.state}>"


class SplitInputFn(_SplitFn):
    """``dx_fn`` of ``vjp_split``: ``dx_fn(cotangent)`` returns the input gradients.

    ``dx_fn.prefire()`` replays the checkpointed blocks for the session now (a scheduler may
    call it whenever it likes before dx_fn); ``dx_fn.session`` is the session key.
    """

    __slots__ = ()
    _name = "dx_fn"

    def prefire(self) -> None:
        self._split.prefire()

    def __call__(self, cotangent: Any) -> Any:
        return self._split.dx(cotangent)


class SplitWeightFn(_SplitFn):
    """``dw_fn`` of ``vjp_split``: ``dw_fn()`` returns the weight gradients and releases all."""

    __slots__ = ()
    _name = "dw_fn"

    def __call__(self) -> Any:
        return self._split.dw()


def vjp_split(
    fun: Callable[..., Any],
    *primals: Any,
    x_argnums: int | tuple[int, ...] = 0,
    session: Hashable | None = None,
    has_aux: bool = False,
    params: Iterable[torch.Tensor] | None = None,
) -> tuple[Any, ...]:
    """Run ``fun(*primals)`` now; return its output and a backward split in two.

    Returns ``(out, dx_fn, dw_fn)``, or ``(out, dx_fn, dw_fn, aux)`` with ``has_aux=True``
    (``fun`` then returns ``(out, aux)``). ``out`` and ``aux`` are detached: the split owns the
    graph, as ``jax.vjp`` does.

    - ``dx_fn(cotangent)``: ``cotangent`` has ``out``'s structure (a ``None`` leaf sends no
      gradient from that output). Returns the gradients of the primals at ``x_argnums`` (one
      pytree for an int, a tuple for a tuple), zeros where a tensor is unused, ``None`` for
      non-floating leaves. Runs once.
    - ``dw_fn()``: after ``dx_fn``, returns the gradients of the other primals (one pytree when
      there is one other primal, else a tuple in positional order) and accumulates into
      ``.grad`` the gradients of the ``params=`` tensors that require grad, as ``backward()``
      would. Runs once, and always releases the session, captured gradients and graph.
    - ``dx_fn.prefire()``: replay the checkpointed blocks now, for a scheduler that wants the
      replay earlier than dx (dx_fn does it otherwise).

    Data parallel (``ckptfx.split.data_parallel``): if ``fun`` runs FSDP2 (``fully_shard``) modules,
    replays see unsharded parameters, and ``dw_fn`` fills the sharded ``.grad`` of their
    parameters through FSDP's own reduce-scatter and reshards, bitwise as ``backward()``;
    ``params=`` may be the sharded parameters (``model.parameters()``). If it runs DDP
    modules, ``dw_fn``'s parameter gradients go through DDP's reducer (all-reduced and
    averaged as in DDP's backward); a ``DDP(static_graph=True)`` in its first iteration is
    refused with ``CheckpointError`` before any gradient is written. In both cases the
    wrapper's parameters are dw's whether or not they are passed as ``params=``.

    Any other order (``dw_fn`` before ``dx_fn``, either one twice, ``prefire`` after
    ``dx_fn``, a call after the session was cleared) raises ``ckptfx.CheckpointError``, a
    ``RuntimeError``, saying what to call instead.

    Every floating tensor among the primals is differentiated (like ``torch.func.vjp``); one
    that does not require grad is replaced by a detached alias that does. ``session`` is the
    key of the recompute session (any hashable; a fresh one when None); it must not be used by
    another split in flight. ``ckptfx.clear_recompute_session(session)`` abandons the split.

    Every ``ckptfx.checkpoint`` / ``remat`` block inside ``fun`` runs twice in all (forward and
    one replay), and dx + dw do the work of one fused backward. Between dx and dw the session
    holds only the replayed tensors dw reads (``ckptfx.recompute_session_stats()``). Where
    the blocks are small (a rule on shapes, ``ckptfx.split.weight_calls``; never under DDP or
    FSDP2) dw is instead one plain weight backward from the outputs, cheaper there than a
    call per weight group: it recomputes the input-path gradients that lead to weights (a
    tensor hook there runs in dx and again in dw; a custom Function anywhere in the graph
    forces the per-group pass, its backward running once) and the session holds every
    replayed tensor until dw. The gradients are the same, bit for bit.

    Example::

        out, dx_fn, dw_fn = ckptfx.vjp_split(stage, x, params=stage.parameters(), session=mb)
        dx = dx_fn(grad_from_next_stage)     # send dx upstream now
        ...
        dw_fn()                              # later: fills p.grad for stage.parameters()
    """
    split = _Split(fun, primals, {}, x_argnums, session, has_aux, params, "vjp_split")
    dx_fn, dw_fn = SplitInputFn(split), SplitWeightFn(split)
    if has_aux:
        return split.out, dx_fn, dw_fn, split.aux
    return split.out, dx_fn, dw_fn


def grad_split(
    fun: Callable[..., Any], *, x_argnums: int | tuple[int, ...] = 0, has_aux: bool = False
) -> tuple[Callable[..., Any], Callable[[Hashable], Any]]:
    """Split ``jax.value_and_grad(fun)`` into an input half and a weight half.

    ``fun`` returns a scalar tensor (with ``has_aux=True``: ``(scalar, aux)``). Returns
    ``(dx_fn, dw_fn)``:

    - ``dx_fn(*args, session, **kwargs)`` runs the forward and the input-gradient pass and
      returns ``(value, dx)`` (``((value, aux), dx)`` with aux), ``dx`` the gradients of the
      arguments at ``x_argnums`` (one pytree for an int, a tuple for a tuple). ``kwargs`` are
      passed to ``fun`` and not differentiated.
    - ``dw_fn(session)`` returns the gradients of the arguments not in ``x_argnums`` (one
      pytree when one argument remains, else a tuple in positional order) and releases the
      session. FSDP2 and DDP modules run by ``fun`` get their reduced ``.grad`` as with
      ``vjp_split``.

    Several sessions may be in flight at once (``dx(s1) dx(s2) dw(s1) dx(s3) ...``), on any
    threads. A session runs ``dx_fn`` then ``dw_fn`` once; afterwards its key may be reused.
    ``dw_fn`` of a session with no finished ``dx_fn`` waiting, or a second ``dx_fn`` of a
    session in flight, raises ``ckptfx.CheckpointError`` (a ``RuntimeError``).

    Example::

        dx_fn, dw_fn = ckptfx.grad_split(loss_fn, x_argnums=1)
        (loss, dx) = dx_fn(params, x, session=0)
        grads = dw_fn(0)
    """
    _check_fun(fun, has_aux, "grad_split")
    if isinstance(x_argnums, int) and not isinstance(x_argnums, bool):
        pass
    elif not isinstance(x_argnums, (tuple, list)) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in x_argnums
    ):
        raise TypeError(f"grad_split: x_argnums must be an int or a tuple of ints, got {x_argnums!r}")
    splits: dict[Hashable, _Split | None] = {}
    lock = threading.Lock()

    def dx_fn(*args: Any, session: Hashable, **kwargs: Any) -> Any:
        check_session_id(session, "grad_split dx_fn: session")
        with lock:
            if session in splits:
                raise CheckpointError(
                    f"grad_split dx_fn: session {session!r} is already in flight; call "
                    f"dw_fn({session!r}) before reusing it, or use another session key"
                )
            splits[session] = None  # reserved
        try:
            split = _Split(fun, args, kwargs, x_argnums, session, has_aux, None, "grad_split")
            outs = split.outputs
            if len(outs) != 1 or split.out_treedef.num_leaves != 1 or outs[0].numel() != 1:
                got = _describe_output(split.out)
                if not outs and isinstance(split.out, torch.Tensor) and split.out.numel() == 1:
                    got += " that does not require grad"
                split.release()
                pair = (not has_aux and isinstance(split.out, (tuple, list))
                        and len(split.out) == 2)
                raise TypeError(
                    "grad_split: fun must return a scalar tensor that requires grad"
                    + (" as the first element of (value, aux)" if has_aux else "")
                    + f", got {got}"
                    + ("; it returned a pair: if the second element is auxiliary data, pass "
                       "has_aux=True" if pair else "")
                )
            dx = split.dx(torch.ones_like(split.out))
        except BaseException:
            with lock:
                splits.pop(session, None)
            raise
        with lock:
            splits[session] = split
        value = (split.out, split.aux) if has_aux else split.out
        return value, dx

    def dw_fn(session: Hashable) -> Any:
        check_session_id(session, "grad_split dw_fn: session")
        with lock:
            running = session in splits and splits[session] is None
            split = splits.get(session)
            if split is not None:
                del splits[session]
        if running:
            raise CheckpointError(
                f"grad_split dw_fn: no dx_fn(..., session={session!r}) is waiting for its dw_fn "
                "yet: that dx_fn is still running; call dw_fn after it returns"
            )
        if split is None:
            raise CheckpointError(
                f"grad_split dw_fn: no dx_fn(..., session={session!r}) is waiting for its dw_fn "
                "(this session is unknown or already consumed); call dx_fn(*args, "
                f"session={session!r}) first: each dx_fn is followed by one dw_fn"
            )
        return split.dw()

    return dx_fn, dw_fn
