"""``vjp_split`` and ``grad_split``: the input-gradient pass (dx) and the weight-gradient pass
(dw) of one backward as two functions that share one replay of every checkpointed block.

The functions check their arguments, make a ``Split`` (passes.py, whose Rules say what dx and
dw do, what they keep between them, and in which order they may run) and hand out its two
halves, ``SplitInputFn`` and ``SplitWeightFn``.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Hashable, Iterable

import torch

from ckptfx.kernel.frame import CheckpointError
from ckptfx.kernel.session import (
    check_session_id,
)
from ckptfx.split.passes import Split, check_fun, describe_output

__all__ = ["SplitInputFn", "SplitWeightFn", "grad_split", "vjp_split"]


class _SplitFn:
    """A half of a ``vjp_split``: holds the split and knows its session."""

    __slots__ = ("_split",)
    _name = ""

    def __init__(self, split: Split) -> None:
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
    holds only the replayed tensors dw reads (``ckptfx.recompute_session_stats()``). Hooks see
    one fused backward: a tensor hook, ``retain_grad()`` (the ``.grad`` it leaves) or a node's
    pre- or post-hook on the graph fires once, with the gradients ``torch.autograd.grad`` of
    the inputs and weights together would give it, and a custom ``autograd.Function``'s
    backward runs once. Where the blocks are small (a rule on shapes,
    ``ckptfx.split.weight_calls``; never under DDP or FSDP2) dx is instead that one fused
    backward: it computes the weight gradients too and keeps them for ``dw_fn``, which only
    hands them out; so is it where a post-hook sits on a built-in node that a weight gradient
    leaves (which sees that weight gradient in a fused backward; under DDP or FSDP2 such a hook
    is refused with ``CheckpointError``). The gradients are the same, bit for bit. Sparse
    weight gradients (``nn.Embedding(sparse=True)``) reach ``.grad`` as ``backward()`` leaves
    them.

    Example::

        out, dx_fn, dw_fn = ckptfx.vjp_split(stage, x, params=stage.parameters(), session=mb)
        dx = dx_fn(grad_from_next_stage)     # send dx upstream now
        ...
        dw_fn()                              # later: fills p.grad for stage.parameters()
    """
    split = Split(fun, primals, {}, x_argnums, session, has_aux, params, "vjp_split")
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
    check_fun(fun, has_aux, "grad_split")
    if isinstance(x_argnums, int) and not isinstance(x_argnums, bool):
        pass
    elif not isinstance(x_argnums, (tuple, list)) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in x_argnums
    ):
        raise TypeError(f"grad_split: x_argnums must be an int or a tuple of ints, got {x_argnums!r}")
    splits: dict[Hashable, Split | None] = {}
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
            split = Split(fun, args, kwargs, x_argnums, session, has_aux, None, "grad_split")
            outs = split.outputs
            if len(outs) != 1 or split.out_treedef.num_leaves != 1 or outs[0].numel() != 1:
                got = describe_output(split.out)
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
