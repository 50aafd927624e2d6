"""Tables for terminals and for logs: one description, drawn by ``rich`` either way.

Every table remotorch prints (profile reports, ``explain``, ``backends``,
``demo``) is a header and rows of strings. On a terminal it is drawn as a
``rich`` table (bold header, rule, numbers in colour); anywhere else (a
pipe, a file, a CI log) as plain text, no escape codes, no box characters:
the header, a dashed rule under each column, the rows, columns two spaces
apart, each line indented by ``indent``. ``rich`` lays out both; this module
only picks the style.
"""

from __future__ import annotations

import io
import sys
from collections.abc import Sequence
from typing import IO

from rich import box
from rich.console import Console, RenderableType
from rich.table import Table
from rich.text import Text

__all__ = ["is_terminal", "numeric", "table", "terminal_width", "to_text", "write"]


def is_terminal(file: IO[str] | None = None) -> bool:
    """Whether ``file`` (default stdout) is a terminal: only then are tables drawn with colour and lines."""
    file = file if file is not None else sys.stdout
    try:
        return bool(file.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed file
        return False


def terminal_width() -> int:
    """Columns of the terminal (100 when it cannot be told)."""
    import shutil

    return shutil.get_terminal_size((100, 24)).columns


def numeric(cell: str) -> bool:
    """A cell that reads as a number (or is empty, or ``-``): right-aligned."""
    text = cell.strip().lstrip("$").rstrip("%x")
    return text in ("", "-") or text.replace(".", "", 1).replace("e-", "", 1).replace("e+", "", 1) \
        .lstrip("-").isdigit()


def table(head: Sequence[str], rows: Sequence[Sequence[str]], *, terminal: bool, title: str | None = None,
          indent: int = 2) -> RenderableType:
    """A table of strings; columns whose cells are all numbers are right-aligned."""
    right = [all(numeric(r[i]) for r in rows) and bool(rows) for i in range(len(head))]
    if terminal:
        t = Table(title=title, title_justify="left", title_style="bold", box=box.SIMPLE_HEAD,
                  header_style="bold", pad_edge=False)
        for name, r in zip(head, right):
            t.add_column(name, justify="right" if r else "left", style="cyan" if r else None)
        for row in rows:
            t.add_row(*row)
        return t
    t = Table(box=None, show_header=False, pad_edge=False, padding=(0, 2, 0, 0))
    for r in right:
        t.add_column(justify="right" if r else "left", no_wrap=True)
    widths = [min(max(len(c) for c in col), max(len(col[0]), 60)) for col in zip(head, *rows)]
    for row in ([*head], ["-" * w for w in widths], *rows):
        t.add_row(*(Text(c) for c in row))
    return _Plain(t, title, indent)


class _Plain:
    """A plain table with its title line and indent (rendered by :func:`to_text`)."""

    def __init__(self, t: Table, title: str | None, indent: int) -> None:
        self.table, self.title, self.indent = t, title, indent


def to_text(*parts: RenderableType | str, terminal: bool, width: int | None = None) -> str:
    """Render tables and lines of text into one string (escape codes only when ``terminal``)."""
    if not terminal:
        lines: list[str] = []
        for part in parts:
            if isinstance(part, _Plain):
                lines += [part.title] if part.title else []
                lines += [" " * part.indent + line for line in _render(part.table, False, 100_000).splitlines()]
            else:
                lines += str(part).splitlines() or [""]
        return "\n".join(line.rstrip() for line in lines)
    return "\n".join(_render(p, True, width) for p in parts).rstrip("\n")


def _render(part: RenderableType | str, terminal: bool, width: int | None) -> str:
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=terminal, color_system="standard" if terminal else None,
                      width=width, highlight=False, emoji=False, markup=False)
    console.print(part, soft_wrap=not terminal)
    return buf.getvalue().rstrip("\n")


def write(*parts: RenderableType | str, file: IO[str] | None = None, terminal: bool | None = None) -> None:
    """Print tables and lines to ``file`` (default stdout): drawn on a terminal, plain elsewhere."""
    out = file if file is not None else sys.stdout
    term = is_terminal(out) if terminal is None else terminal
    print(to_text(*parts, terminal=term, width=terminal_width() if term else None), file=out, flush=True)
