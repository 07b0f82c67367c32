"""The split backward: ``vjp_split`` and ``grad_split``, dx and dw as two calls, one replay.

A zero-bubble pipeline runs a micro-batch's input gradients (dx) early and its weight
gradients (dw) later. Here the two share one recompute session, so each checkpointed block
is replayed once for both. Its files, bottom to top (imports point down, to the kernel and
the compile lowering):

- ``keys.py``: which split owns which session key;
- ``primals.py``: the primals as flat tensor lists, the cotangent's check, gradients packed
  back into pytrees;
- ``weight_groups.py``: where weight paths leave the input path (the intermediates), and which
  replayed tensors dx may drop;
- ``data_parallel.py``: FSDP2 and DDP under the split (unshard, hold, reduce as the wrapper
  would);
- ``weight_calls.py``: the fused pass where blocks are small, and the intermediates' weight
  halves computed without their hooks;
- ``input_pass.py``: dx, per group (capturing at the intermediates) or fused;
- ``weight_pass.py``: dw after a per-group dx, one weight backward, and ``.grad`` accumulated
  as ``backward()`` would (sparse gradients too);
- ``passes.py``: ``Split``, one split's forward, prefire, dx and dw, in their one order;
- ``api.py``: ``vjp_split`` and ``grad_split`` (re-exported here: ``ckptfx.split.vjp_split``).

Rules (passes.py's note gives the detail):

1. **One forward, one replay**: the forward runs when the split is made; dx registers its
   blocks to the session and dw reads the same replays (passes.py Rules 1-3).
2. **dw is the last consumer**: it clears the session in a ``finally``, also when it raises
   (passes.py Rule 5); any other order of calls raises before anything is computed (Rule 6).
3. **Hooks as in one fused backward**: every tensor hook, ``retain_grad`` and node hook on the
   graph fires once, with a fused backward's gradients (dw calls the intermediates without
   their hooks); where that cannot be split (a post-hook on a built-in intermediate) dx runs
   one fused backward instead (input_pass.py Rule 2).
4. **Data parallel as the wrapper would**: FSDP2 and DDP gradients are reduced bitwise as in
   their own backward, or the split refuses before writing any (data_parallel.py Rule 3).
"""

from ckptfx.split.api import SplitInputFn, SplitWeightFn, grad_split, vjp_split

__all__ = ["SplitInputFn", "SplitWeightFn", "grad_split", "vjp_split"]
