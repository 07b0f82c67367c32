"""The primals of a split as flat tensor lists: which tensors dx differentiates (the inputs at
``x_argnums``), which dw differentiates (the other primals and ``params=``, the weights), the
cotangent's check against the output, and the gradients packed back into the primals' pytrees.

Rules

1. Every floating tensor among the primals is differentiated (as ``jax.vjp`` and
   ``torch.func.vjp`` do); one that does not require grad is replaced by a detached alias that
   does. A tensor is either an input (dx's) or a weight (dw's), never both.

2. A gradient that does not flow is zeros of the tensor's shape; a non-floating leaf's is
   ``None``. One ``x_argnums`` int gives one pytree, a tuple gives a tuple.
"""

from __future__ import annotations

from typing import Any, Sequence

import optree
import torch

__all__ = ["check_cotangent", "check_params", "flatten_primals", "pack_input_grads",
           "pack_weight_grads", "weight_slot"]

Spec = tuple[Any, list[int | None]]  # (treedef, slots) of one primal


def _differentiable(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def normalize_argnums(x_argnums: Any, n: int, name: str = "x_argnums"
                      ) -> tuple[tuple[int, ...], bool]:
    single = isinstance(x_argnums, int) and not isinstance(x_argnums, bool)
    nums = (x_argnums,) if single else x_argnums
    if not isinstance(nums, (tuple, list)) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in nums
    ):
        raise TypeError(f"{name} must be an int or a tuple of ints, got {x_argnums!r}")
    out = []
    for i in nums:
        if not -n <= i < n:
            raise ValueError(
                f"{name}={x_argnums!r} is out of range for {n} positional argument(s)"
            )
        out.append(i % n)
    if len(set(out)) != len(out):
        raise ValueError(f"{name}={x_argnums!r} names an argument twice")
    return tuple(out), single


def pack_like(results: list[Any], single: bool) -> Any:
    if single:
        return results[0]
    return tuple(results)


def detach_tree(tree: Any) -> Any:
    return optree.tree_map(
        lambda v: v.detach() if isinstance(v, torch.Tensor) else v, tree, none_is_leaf=True
    )


def check_params(params: Any, who: str) -> list[torch.Tensor]:
    """The ``params=`` of a split as a list of tensors."""
    param_list: list[torch.Tensor] = []
    if params is not None:
        if isinstance(params, torch.Tensor):
            params = [params]
        try:
            param_list = list(params)
        except TypeError:
            raise TypeError(
                f"{who}: params must be an iterable of tensors (e.g. module.parameters()), "
                f"got {type(params).__name__}"
            ) from None
        for p in param_list:
            if not isinstance(p, torch.Tensor):
                raise TypeError(
                    f"{who}: params must contain tensors only, got a {type(p).__name__}"
                )
    return param_list


def weight_slot(weights: list[torch.Tensor], index: dict[int, int], t: torch.Tensor) -> int:
    """The position of ``t`` in a split's ``weights``, found by identity through ``index``
    (``id`` -> position), appended to both if new: a tensor passed twice is one weight."""
    i = index.get(id(t))
    if i is None:
        i = index[id(t)] = len(weights)
        weights.append(t)
    return i


def flatten_primals(
    args: tuple[Any, ...], nums: tuple[int, ...], param_list: list[torch.Tensor], who: str
) -> tuple[list[Any], list[Spec], list[Spec], list[torch.Tensor], list[torch.Tensor],
           dict[int, int], list[int]]:
    """Flatten the primals (Rule 1): ``(call_args, x_specs, w_specs, x, weights, w_index,
    param_slots)``; ``w_index`` maps ``id`` of a weight to its index in ``weights``, and
    ``param_slots`` are the indices of the ``params=`` tensors that require grad."""
    # Flatten the primals; make every floating tensor differentiable (as jax.vjp and
    # torch.func.vjp do), aliasing those that do not require grad.
    call_args = list(args)
    x_specs: list[Spec] = []  # (treedef, slots) per x arg
    w_specs: list[Spec] = []
    x: list[torch.Tensor] = []
    weights: list[torch.Tensor] = []
    w_index: dict[int, int] = {}
    for pos, arg in enumerate(args):
        is_x = pos in nums
        leaves, treedef = optree.tree_flatten(arg, none_is_leaf=True)
        slots: list[int | None] = []
        new_leaves = []
        for leaf in leaves:
            if not _differentiable(leaf):
                slots.append(None)
                new_leaves.append(leaf)
                continue
            if not leaf.requires_grad:
                leaf = leaf.detach().requires_grad_()
            if is_x:
                slots.append(len(x))
                x.append(leaf)
            else:
                slots.append(weight_slot(weights, w_index, leaf))
            new_leaves.append(leaf)
        (x_specs if is_x else w_specs).append((treedef, slots))
        call_args[pos] = optree.tree_unflatten(treedef, new_leaves)
    param_slots: list[int] = []
    for p in param_list:
        if not p.requires_grad:
            continue
        i = weight_slot(weights, w_index, p)
        if i not in param_slots:
            param_slots.append(i)
    if {id(t) for t in x} & w_index.keys():
        raise ValueError(
            f"{who}: a tensor passed at x_argnums is also passed as a weight (another "
            "primal or params=); a tensor is either differentiated by dx_fn or by dw_fn"
        )
    return call_args, x_specs, w_specs, x, weights, w_index, param_slots


def check_cotangent(
    cotangent: Any, out_treedef: Any, out_leaves_meta: list[tuple[int, Any]], who: str
) -> list[torch.Tensor | None]:
    """The cotangent's leaves for the outputs that require grad, checked against the output."""
    leaves, treedef = optree.tree_flatten(cotangent, none_is_leaf=True)
    if treedef != out_treedef:
        raise ValueError(
            f"{who}: cotangent must have the structure of the output ({out_treedef}), "
            f"got {treedef}"
        )
    cots: list[torch.Tensor | None] = []
    for i, shape in out_leaves_meta:
        c = leaves[i]
        if c is not None and not isinstance(c, torch.Tensor):
            raise TypeError(
                f"{who}: cotangent leaf {i} must be a tensor (or None), got "
                f"{type(c).__name__}"
            )
        if c is not None and c.shape != shape:
            raise ValueError(
                f"{who}: cotangent leaf {i} has shape {tuple(c.shape)}, expected "
                f"{tuple(shape)} (the output's shape)"
            )
        cots.append(c)
    return cots


def pack_input_grads(
    x_specs: list[Spec], x: list[torch.Tensor], x_req: list[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
) -> list[Any]:
    """dx's gradients in the pytrees of the primals at ``x_argnums`` (Rule 2)."""
    by_id = {id(t): g for t, g in zip(x_req, grads)}
    flat = [
        (by_id.get(id(t)) if by_id.get(id(t)) is not None else torch.zeros_like(t))
        for t in x
    ]
    results = []
    for treedef, slots in x_specs:
        results.append(
            optree.tree_unflatten(treedef, [None if s is None else flat[s] for s in slots])
        )
    return results


def pack_weight_grads(
    w_specs: list[Spec], weights: list[torch.Tensor], wgrads: list[torch.Tensor | None]
) -> list[Any]:
    """dw's gradients in the pytrees of the other primals (Rule 2)."""
    results = []
    for treedef, slots in w_specs:
        leaves: list[torch.Tensor | None] = []
        for s in slots:
            if s is None:
                leaves.append(None)
            else:
                wg = wgrads[s]
                leaves.append(wg if wg is not None else torch.zeros_like(weights[s]))
        results.append(optree.tree_unflatten(treedef, leaves))
    return results
