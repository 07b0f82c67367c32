"""The terminal of the ``ckptfx`` command: rich tables, progress bars and colour when ``rich``
is installed (the ``cli`` extra), plain text otherwise.

Rules:

1. Everything the command prints goes through this module, so the two renderings stay one
   concept: a table is a title, a header row and rows of strings in both.
2. Without rich the command works the same and says once per process, on stderr, how to get
   the nicer output (``pip install "ckptfx[cli]"``); what it prints on stdout is identical
   in content.
3. The rich console is created per call on the current ``sys.stdout`` (not at import), so
   redirections made after import (pytest's capture, ``contextlib.redirect_stdout``) see
   the output.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from typing import Any, Iterator, Sequence

__all__ = ["Progress", "have_rich", "note", "progress", "rule", "table"]

INSTALL_HINT = 'pip install "ckptfx[cli]"'
_hinted = False


def have_rich() -> bool:
    """True when rich is importable and not switched off by ``CKPTFX_PLAIN=1``."""
    if os.environ.get("CKPTFX_PLAIN") == "1":
        return False
    return importlib.util.find_spec("rich") is not None


def _hint_once() -> None:
    global _hinted
    if not _hinted:
        _hinted = True
        print(f"(plain output: {INSTALL_HINT} for tables, colour and progress bars)",
              file=sys.stderr)


def _console() -> Any:
    from rich.console import Console

    # A pipe or a file gets wide lines (rich would assume 80 columns): tables stay one row
    # per line in logs.
    width = None if sys.stdout.isatty() else 160
    return Console(file=sys.stdout, highlight=False, soft_wrap=True, width=width)


def note(text: str, style: str = "") -> None:
    """Print one line (``style`` is a rich style such as ``"bold green"``; ignored in plain)."""
    if have_rich():
        _console().print(text, style=style or None, markup=False)
    else:
        _hint_once()
        print(text)


def rule(title: str) -> None:
    """A section heading."""
    if have_rich():
        _console().rule(title, style="cyan")
    else:
        _hint_once()
        print(f"\n== {title} ==")


def table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]],
          right: Sequence[int] = ()) -> None:
    """Print a table; the columns whose indices are in ``right`` are right-aligned."""
    if have_rich():
        from rich.table import Table

        t = Table(title=title, title_justify="left", header_style="bold")
        for i, h in enumerate(header):
            t.add_column(h, justify="right" if i in right else "left", no_wrap=i == 0)
        for r in rows:
            t.add_row(*r)
        _console().print(t)
        return
    _hint_once()
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(str(c).rjust(w) if i in right else str(c).ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    print(title)
    print(line(header))
    print(line(["-" * w for w in widths]))
    for r in rows:
        print(line(r))


class Progress:
    """A progress bar over ``total`` steps; ``advance(label)`` after each one."""

    def __init__(self, bar: Any, task: Any, total: int) -> None:
        self._bar, self._task, self._total, self._done = bar, task, total, 0

    def advance(self, label: str) -> None:
        self._done += 1
        if self._bar is not None:
            self._bar.update(self._task, advance=1, description=label)
        else:
            # Plain text: one line per step, so a log shows how far a run got.
            print(f"  [{self._done}/{self._total}] {label}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def progress(description: str, total: int) -> Iterator[Progress]:
    """A progress bar on stderr (rich), or one line per step on stderr (plain)."""
    if not have_rich():
        _hint_once()
        print(f"{description} ({total} steps)", file=sys.stderr, flush=True)
        yield Progress(None, None, total)
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        TextColumn,
        TimeElapsedColumn,
    )
    from rich.progress import Progress as RichProgress

    with RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=Console(file=sys.stderr),
                      transient=False) as bar:
        task = bar.add_task(description, total=total)
        yield Progress(bar, task, total)
