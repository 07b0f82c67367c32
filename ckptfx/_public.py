"""Public names at home: each public name reports the module users import it from.

Base module: imports nothing of ckptfx. The public modules (``ckptfx``, ``ckptfx.policies``,
``ckptfx.budget``) call ``report_home`` on the names they export, as httpx does, so
``ckptfx.CheckpointError.__module__`` is ``"ckptfx"``, not the file that defines it, and
pickles name a path that survives moving a file.
"""

from __future__ import annotations

import typing
from typing import Any, Iterable

__all__ = ["report_home"]


def report_home(module: str, objects: Iterable[Any]) -> None:
    """Set ``__module__`` of each class and function in ``objects`` to ``module``.

    A class's own annotations are resolved first, where they were written: with
    ``from __future__ import annotations`` they are strings that ``typing.get_type_hints``
    evaluates in the namespace of ``cls.__module__``, which after the change would be the
    public module, where ``Hashable`` or ``torch`` may not be defined. Annotations that cannot
    be resolved (names imported only for type checking) are left as they are.
    """
    for obj in objects:
        if isinstance(obj, type):
            own = obj.__dict__.get("__annotations__")
            if own and any(isinstance(v, str) for v in own.values()):
                try:
                    hints = typing.get_type_hints(obj, include_extras=True)
                except Exception:  # a name only imported under TYPE_CHECKING: leave the strings
                    hints = {}
                obj.__annotations__ = {name: hints.get(name, v) for name, v in own.items()}
        obj.__module__ = module
