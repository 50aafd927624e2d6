"""Progress bars for long work (large uploads, the demo, long profiles), drawn by ``rich`` on stderr.

A bar shows only where someone watches: stderr is a terminal, the
``remotorch`` logger lets warnings through (a program that set it to
``ERROR`` or quieter asked for silence), and nobody switched bars off
(``Session(progress=False)``, ``REMOTORCH_PROGRESS=0``). Elsewhere (pipes,
CI logs, tests) :func:`bar` is a no-op that costs one check.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import IO

from ..config import from_env

#: uploads at least this large show a bar (a 124M-parameter GPT-2 is about 500 MB)
UPLOAD_BAR_BYTES = 64 << 20

Advance = Callable[[int], None]


def wanted(stream: IO[str] | None = None) -> bool:
    """Whether a bar would be seen: ``stream`` (default stderr) is a terminal and nothing asked for quiet."""
    stream = stream if stream is not None else sys.stderr
    try:
        tty = bool(stream.isatty())
    except (AttributeError, ValueError):
        tty = False
    return tty and from_env().progress and logging.getLogger("remotorch").isEnabledFor(logging.WARNING)


@contextmanager
def bar(description: str, total: float | None, *, unit: str = "bytes", stream: IO[str] | None = None,
        enabled: bool | None = None) -> Iterator[Advance]:
    """A bar of ``total`` (bytes, or items with ``unit="items"``; None: unknown); yields ``advance(n)``.

    ``enabled`` None means :func:`wanted`; the bar disappears when done. It
    redraws four times a second from a thread of its own (rich's), so it
    takes little from the work it watches.
    """
    if not (wanted(stream) if enabled is None else enabled):
        yield _nothing
        return
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeRemainingColumn, TransferSpeedColumn)

    columns = [TextColumn("{task.description}"), BarColumn()]
    columns += ([DownloadColumn(), TransferSpeedColumn()] if unit == "bytes" else [MofNCompleteColumn()])
    columns.append(TimeRemainingColumn())
    console = Console(file=stream if stream is not None else sys.stderr, force_terminal=enabled or None)
    with Progress(*columns, console=console, transient=True, refresh_per_second=4) as progress:
        task = progress.add_task(description, total=total)
        yield lambda n: progress.advance(task, n)


def upload_bar(description: str, nbytes: int, *, enabled: bool | None = None,
               stream: IO[str] | None = None) -> AbstractContextManager[Advance]:
    """The bar of an upload: shown (where wanted, or as ``enabled`` says) from :data:`UPLOAD_BAR_BYTES` on."""
    return bar(description, nbytes, enabled=False if nbytes < UPLOAD_BAR_BYTES else enabled, stream=stream)


def _nothing(n: int) -> None:
    pass
