"""``debug=True``: record the ops of the forward and of the replay, and show them on error.

Debug is on for a checkpoint call when it passed ``debug=True``, or when torch's global
``torch.utils.checkpoint.set_checkpoint_debug_enabled(True)`` was active at its forward (the
global, when not None, overrides ``debug=`` either way, as it does for torch's checkpoint;
``ckptfx.checkpoint.run`` applies it). A replay error raised with debug on carries both op
lists and says why they are there, in place of the tip that suggests turning debug on.
"""

from __future__ import annotations

from typing import Any, NoReturn

import torch.utils.checkpoint as _torch_checkpoint

from ckptfx._compat import TorchDispatchMode
from ckptfx._user_stack import user_call_site
from ckptfx.kernel.frame import DEBUG_TIP


class OpLog(TorchDispatchMode):
    """Records each ATen op with the user line that called it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __enter__(self) -> "OpLog":
        self.ops = []
        return super().__enter__()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        self.ops.append(f"{func}  at {user_call_site()}")
        return func(*args, **(kwargs or {}))


class DebugLogs:
    """The forward and replay op logs of one checkpoint call, made at its forward."""

    def __init__(self) -> None:
        self.forward = OpLog()
        self.replay = OpLog()
        # What turned debug on, for the error to name: torch's global switch, if it is on
        # now (it overrides debug=), else the call's own debug=True.
        self.switched_on_by = (
            "torch.utils.checkpoint.set_checkpoint_debug_enabled(True) was active when the "
            "block ran forward"
            if getattr(_torch_checkpoint, "_checkpoint_debug_enabled", None)
            else "debug=True was passed to ckptfx.checkpoint (or checkpoint_wrapper)")

    def contexts(self) -> tuple[Any, Any]:
        return self.forward, self.replay

    def raise_with_logs(self, err: Exception) -> NoReturn:
        def fmt(log: OpLog) -> str:
            return "\n".join(f"  {i:4d}  {op}" for i, op in enumerate(log.ops)) or "  (none)"

        message = str(err)
        if message.endswith(DEBUG_TIP):  # debug is on already: no tip to turn it on
            message = message[: -len(DEBUG_TIP)].rstrip("\n")
        raise type(err)(
            f"{message}\n\nOps of the original forward:\n{fmt(self.forward)}\n\n"
            f"Ops of the replay:\n{fmt(self.replay)}\n\n"
            "The first line where the two lists differ is where the block stopped running the "
            "same ops (data-dependent control flow, global state, or randomness not captured).\n"
            "You are seeing these op lists because checkpoint debugging is on for this block: "
            f"{self.switched_on_by}."
        ) from err
