"""Where the user's code is: the innermost stack entry outside ckptfx, torch and the libraries
between a user's call and a checkpointed block (for warnings' ``stacklevel`` and for op logs).

Base module: imports nothing of ckptfx.
"""

from __future__ import annotations

import os
import sys
import traceback

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
