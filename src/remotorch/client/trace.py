"""See the waiting: a Chrome-trace / Perfetto timeline of requests, replies, blocking reads and worker runs.

``with remotorch.trace("step.json"):`` records, for every session's streams,
on one clock (this process's ``perf_counter``):

* each request: when it was issued and sent (a track per worker link), and
  when its reply was read;
* every blocking wait, with the Python line that caused it (a read, or a
  full queue), on the track of the thread that waited;
* each graph run on the worker: its duration as the worker measured it,
  placed just before its reply left the worker (the reply's arrival minus
  half of the link's fastest round trip seen so far: the worker's clock is
  not this one).

The file opens in https://ui.perfetto.dev or ``chrome://tracing``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from . import origin as origins

ACTIVE: list[Tracer] = []  # the running trace() blocks, innermost last (hot paths test it, no call)
_lock = threading.Lock()


@dataclass
class Tracer:
    """Events of one ``trace()`` block."""

    path: str
    start: float = field(default_factory=time.perf_counter)
    events: list[dict] = field(default_factory=list)
    _sent: dict = field(default_factory=dict)  # id(launched) -> (link name, issue time)
    _fastest: dict = field(default_factory=dict)  # link name -> fastest round trip seen (s)

    def _us(self, t: float) -> float:
        return (t - self.start) * 1e6

    def issued(self, name: str, launched) -> None:
        now = time.perf_counter()
        self._sent[id(launched)] = (name, now)
        self.events.append(dict(name=launched.what, ph="i", s="t", ts=self._us(now), pid=1, tid=f"{name} requests",
                                args=dict(seq=launched.seq, bytes=launched.nbytes,
                                          line=origins.first_line(launched.origin))))

    def answered(self, name: str, launched) -> None:
        now = time.perf_counter()
        sent = self._sent.pop(id(launched), (name, now))[1]
        rtt = now - sent
        run_ms = getattr(launched.reply, "run_ms", 0.0) or 0.0
        if isinstance(run_ms, list):  # eager calls sent together (client.coalesce): their runs, all told
            run_ms = sum(run_ms)
        self._fastest[name] = min(self._fastest.get(name, rtt), max(rtt - run_ms / 1e3, 0.0))
        status = "failed" if launched.error is not None else "ok"
        self.events.append(dict(name=launched.what, ph="X", ts=self._us(sent), dur=rtt * 1e6, pid=1,
                                tid=f"{name} in flight", args=dict(seq=launched.seq, status=status)))
        if run_ms:
            end = now - self._fastest[name] / 2
            self.events.append(dict(name=launched.what, ph="X", ts=self._us(end - run_ms / 1e3),
                                    dur=run_ms * 1e3, pid=2, tid=f"{name} worker runs"))

    def waited(self, name: str, started: float, launched, where) -> None:
        now = time.perf_counter()
        self.events.append(dict(name=f"wait: {launched.what}", ph="X", ts=self._us(started),
                                dur=(now - started) * 1e6, pid=0, tid=threading.current_thread().name,
                                args=dict(line=origins.describe(where), link=name)))

    def write(self) -> None:
        names = [dict(name="process_name", ph="M", pid=p, args=dict(name=n))
                 for p, n in ((0, "python (blocking waits)"), (1, "requests"), (2, "workers"))]
        with open(self.path, "w", encoding="utf-8") as f:
            json.dump(dict(traceEvents=names + self.events, displayTimeUnit="ms"), f)


def current() -> Tracer | None:
    """The innermost active tracer, if a ``trace()`` block is running."""
    return ACTIVE[-1] if ACTIVE else None


@contextmanager
def trace(path: str | os.PathLike):
    """Record a timeline of every session's requests and waits into ``path`` (see the module docstring)."""
    tracer = Tracer(os.fspath(path))
    with _lock:
        ACTIVE.append(tracer)
    try:
        yield tracer
    finally:
        with _lock:
            ACTIVE.remove(tracer)
        tracer.write()
