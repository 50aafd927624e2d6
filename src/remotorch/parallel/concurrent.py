"""Calls to several workers at once: one thread each, every result, the most telling failure."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from ..errors import GroupError


def run_all(calls: Sequence[Callable[[], object]]) -> list:
    """Run every call at once (one thread each; a single call runs here) and return their results in order.

    Raises once all have returned, never leaving a call behind. Of several
    failures it raises the first that is not a ``GroupError``: when a worker
    dies mid-collective, the others report the broken group, but the dead
    worker's own error says what happened.
    """
    if len(calls) == 1:
        return [calls[0]()]
    results: list = [None] * len(calls)
    failures: list[tuple[int, BaseException]] = []

    def run(i: int, call: Callable[[], object]) -> None:
        try:
            results[i] = call()
        except BaseException as exc:  # raised below, on the caller's thread
            failures.append((i, exc))
    threads = [threading.Thread(target=run, args=(i, c), daemon=True) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        failures.sort(key=lambda f: (isinstance(f[1], GroupError), f[0]))
        raise failures[0][1]
    return results
