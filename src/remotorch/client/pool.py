"""The workers of a session: one :class:`~remotorch.client.connection.Connection` each, with names and prices.

Ordinary calls run on a session's first worker; profiling runs the same graphs
on all of them, and a pipeline puts its stages on them. Each worker has a
connection of its own (one worker's slow reply never holds up another's),
named after the worker's health reply (``-2``, ``-3``… where names repeat).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence

from .. import errors
from .connection import Connection


def split_urls(url: str | Sequence[str] | None) -> list[str | None]:
    """A session's ``url`` argument as a list of worker URLs (``[None]``: the embedded worker)."""
    if url is None or isinstance(url, str):
        return [url]
    urls = list(url)
    if not urls or not all(isinstance(u, str) and u for u in urls):
        raise ValueError("Session needs a worker URL, a list of worker URLs, or None")
    if len(set(urls)) != len(urls):
        raise ValueError("the same worker URL is listed twice")
    return urls


class Pool:
    """Connections to a list of workers, created on first use, named after the workers."""

    def __init__(self, urls: list[str | None], make: Callable[[str | None], Connection],
                 prices: Mapping[str, float] | None = None) -> None:
        self.urls = urls
        self.prices = dict(prices or {})  # $ per hour by worker name, overriding what workers report
        self._make = make
        self._conns: list[Connection | None] = [None] * len(urls)
        self._named = False
        self._closed = False

    def get(self, i: int) -> Connection:
        """The connection to worker ``i`` (created, not yet connected, on first use)."""
        conn = self._conns[i]
        if self._closed:
            raise errors.WorkerUnavailableError("session is closed")
        if conn is None:
            conn = self._conns[i] = self._make(self.urls[i])
        return conn

    @property
    def opened(self) -> list[Connection]:
        """The connections made so far."""
        return [c for c in self._conns if c is not None]

    def all(self) -> list[Connection]:
        """Every worker's connection, named (asks each worker's health once: every worker must answer)."""
        conns = [self.get(i) for i in range(len(self.urls))]
        if not self._named:
            seen: dict[str, int] = {}
            for conn in conns:
                base = conn.info()["name"]
                seen[base] = seen.get(base, 0) + 1
                conn.name = base if seen[base] == 1 else f"{base}-{seen[base]}"
            self._named = True
        return conns

    def by_name(self, name: str) -> Connection:
        for conn in self.all():
            if conn.name == name:
                return conn
        raise KeyError(f"no worker named {name!r} in this session")

    def price_per_hour(self, name: str) -> float:
        """$ per hour of a worker: the ``prices`` entry, else what the worker reports."""
        if name in self.prices:
            return float(self.prices[name])
        return float(self.by_name(name).info().get("price_per_hour", 0.0))

    def close(self) -> None:
        self._closed = True
        for conn in self.opened:
            conn.close()


__all__ = ["Pool", "split_urls"]


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
        failures.sort(key=lambda f: (isinstance(f[1], errors.GroupError), f[0]))
        raise failures[0][1]
    return results
