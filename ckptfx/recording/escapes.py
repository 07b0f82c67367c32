"""Block values whose memory leaves the dispatcher while a block is recorded.

A recording sees every write made through ATen ops, and no other. NumPy (``t.numpy()``,
``np.asarray(t)``), DLPack (``t.__dlpack__()``), raw pointers (``t.data_ptr()``) and storages
(``t.untyped_storage()``) hand out a block value's memory to code that can write it where the
recorder cannot see: a replay from the recording would recompute the value without that
write. So while a block is recorded, ``EscapeWatch`` (a torch function mode, pushed by the
tracer) marks the segment not replayable as soon as one of these is called on a value the
block made, and the frame re-runs the Python function instead, which repeats the write
(tracer.py Rule 4), to its end: the write may come after its last saved tensor.

Only the block's own values count: a parameter or an input handed to NumPy is read by the
replay as it is then, as by torch's checkpoint.
"""

from __future__ import annotations

from typing import Any

import torch

from ckptfx import _compat

__all__ = ["EscapeWatch"]

_T = torch.Tensor
# The Tensor methods through which code outside the dispatcher can reach a tensor's memory.
_ESCAPES: dict[Any, str] = {
    _T.numpy: "Tensor.numpy()",
    _T.__array__: "NumPy's array conversion",
    _T.__dlpack__: "DLPack",
    _T.data_ptr: "Tensor.data_ptr()",
    _T.untyped_storage: "Tensor.untyped_storage()",
    _T.storage: "Tensor.storage()",
}


class EscapeWatch(_compat.TorchFunctionMode):
    """Calls ``seg.not_replayable`` when a value the block being recorded made (tagged with
    ``attr``, not a view of an argument or outside tensor) escapes the dispatcher."""

    def __init__(self, frame: Any, seg: Any, attr: str, root: list[int]) -> None:
        super().__init__()
        self.frame = frame
        self.seg = seg
        self.attr = attr
        self.root = root  # slot -> the argument or outside tensor it views, or -1

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        how = _ESCAPES.get(func)
        slot = args[0].__dict__.get(self.attr) if how is not None and args else None
        if slot is not None and self.root[slot] < 0:
            self.seg.not_replayable(
                f"{how} gave code outside the dispatcher a block value's memory: a write "
                "there is invisible to the recording")
            # The write may come after the block's last saved tensor (a value saved and then
            # written through NumPy): the re-run must reach it, as the forward did.
            self.frame.early_stop = False
        return func(*args, **(kwargs or {}))
