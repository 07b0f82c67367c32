"""``debug=True``: record the ops of the forward and of the replay, and show them on error."""

from __future__ import annotations

from typing import Any, NoReturn

from ckptfx._compat import TorchDispatchMode
from ckptfx._user_stack import user_call_site


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
    """The forward and replay op logs of one checkpoint call."""

    def __init__(self) -> None:
        self.forward = OpLog()
        self.replay = OpLog()

    def contexts(self) -> tuple[Any, Any]:
        return self.forward, self.replay

    def raise_with_logs(self, err: Exception) -> NoReturn:
        def fmt(log: OpLog) -> str:
            return "\n".join(f"  {i:4d}  {op}" for i, op in enumerate(log.ops)) or "  (none)"

        raise type(err)(
            f"{err}\n\nOps of the original forward:\n{fmt(self.forward)}\n\n"
            f"Ops of the replay:\n{fmt(self.replay)}\n\n"
            "The first line where the two lists differ is where the block stopped running the "
            "same ops (data-dependent control flow, global state, or randomness not captured)."
        ) from err
