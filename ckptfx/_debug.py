"""``debug=True``: record the ops of the forward and of the replay, and show them on error."""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any, NoReturn

from ._compat import TorchDispatchMode


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_TORCH_MARKERS = (os.sep + "torch" + os.sep, os.sep + "contextlib.py")
# Libraries whose frames sit between the user's call and a checkpointed block's forward
_LIBRARY_MARKERS = (*_TORCH_MARKERS, os.sep + "transformers" + os.sep)
_USER_FILES_IN_PACKAGE = (os.path.join(_PACKAGE_DIR, "cli.py"),)  # the demo's blocks


def _not_users(filename: str, markers: tuple[str, ...]) -> bool:
    """A file of ckptfx (but the demo's) or of a library ``markers`` name."""
    return ((filename.startswith(_PACKAGE_DIR) and filename not in _USER_FILES_IN_PACKAGE)
            or any(m in filename for m in markers))


def user_call_site(skip_dirs: tuple[str, ...] = ()) -> str:
    """``file:line (function)`` of the innermost stack entry outside torch and ckptfx."""
    for entry in reversed(traceback.extract_stack()):
        name = entry.filename
        if _not_users(name, _TORCH_MARKERS):
            continue
        if skip_dirs and name.startswith(skip_dirs):
            continue
        return f"{os.path.basename(name)}:{entry.lineno} ({entry.name})"
    return "<unknown>"


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning raised by this function's caller point at the
    user's code: the innermost frame outside ckptfx, torch and transformers (a checkpointed
    module's forward is reached through ``nn.Module.__call__`` and Hugging Face's layers)."""
    frame = sys._getframe(1)
    level = 1
    while frame.f_back is not None:
        if not _not_users(frame.f_code.co_filename, _LIBRARY_MARKERS):
            break
        frame = frame.f_back
        level += 1
    return level


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
