"""Eager calls queued back to back leave as one message (``Runs``, protocol.md §18.4).

An eager torch call on a value kept on a worker (:mod:`remotorch.client.eager`)
is one small ``Run``; a loop of them, each its own message, would cost each a
header, a MAC, a write and a reply to read, where the call itself is a few
microseconds of the worker's time. So the stream keeps such calls as they
are queued (:class:`Coalesced`: each call's ``Run``, its frames, and the
housekeeping due before it) and sends them as one ``Runs``, answered by one
``RunsReply``:

* when :data:`BATCH_RUNS` calls or :data:`BATCH_BYTES` of frames are waiting,
  or the first waited :data:`BATCH_AGE_S` by the time another is queued;
* before any other request (a graph call, a fetch, an upload) and any wait (a
  read, :meth:`~remotorch.client.stream.Stream.sync`). (Not from the
  heartbeat thread: their replies' callbacks would run there. A program
  that queues eager calls and then does something else for a long time
  leaves them queued until its next request or read: at worst the worker
  runs them then.)

The worker runs them in order, as the requests they would have been, so
nothing else changes: each call keeps its own record
(:class:`~remotorch.client.launched.Launched`), its reply or its failure (named
with the line that issued it), and its placeholders.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence

from .. import errors
from ..codec import messages as m
from . import trace
from .launched import Launched

BATCH_RUNS = 64  # calls in one message at most
BATCH_BYTES = 1 << 20  # bytes of the calls' frames (local tensors they take) in one message at most
BATCH_AGE_S = 0.002  # a call waits no longer than this for the next one to join it (once one is queued)


class Coalesced:
    """Eager calls queued and not sent yet (see the module docstring)."""

    __slots__ = ("runs", "frames", "counts", "housekeeping", "subs", "nbytes", "since")

    def __init__(self) -> None:
        self.runs: list = []
        self.frames: list = []
        self.counts: list[int] = []
        self.housekeeping: list = []
        self.subs: list[Launched] = []
        self.nbytes = 0
        self.since = time.perf_counter()

    def add(self, body: m.Run, frames: Sequence, launched: Launched, pending: m.Pending | None) -> bool:
        """Queue one call: its ``Run``, its frames, and the housekeeping due before it; whether the
        calls should leave now (see the module docstring)."""
        self.runs.append(body)
        self.subs.append(launched)
        self.housekeeping.append(pending)
        self.counts.append(len(frames))
        if frames:
            self.frames.extend(frames)
            self.nbytes += sum(memoryview(f).nbytes for f in frames)
        return (len(self.runs) >= BATCH_RUNS or self.nbytes >= BATCH_BYTES
                or time.perf_counter() - self.since >= BATCH_AGE_S)

    def message(self, fail: Callable[[Launched, errors.RemoteError], None],
                name: str = "") -> tuple[m.Runs, list, Launched]:
        """The ``Runs`` request, its frames, and its own record, whose reply answers each call
        (``fail(call, error)`` records a call's failure, as the stream does a request's; ``name``:
        the link's, on trace tracks)."""
        frames = self.counts if any(self.counts) else []
        housekeeping = self.housekeeping if any(p is not None for p in self.housekeeping) else []
        body = m.Runs(self.runs, frames, housekeeping)
        subs = self.subs
        launched = Launched(f"{len(subs)} eager call(s)", expect=m.RunsReply, queued=False)
        launched.subs = subs
        launched.on_reply = lambda reply, out: _answer(subs, reply, out, fail, name)
        return body, self.frames, launched

    def sent(self, launched: Launched, name: str) -> None:
        """The message went: each call takes its place in the stream (its sequence number, its time)."""
        tracer = trace.current() if trace.ACTIVE else None
        for sub in self.subs:
            sub.seq, sub.sent_at = launched.seq, launched.sent_at
            if tracer is not None:
                tracer.issued(name, sub)


def fail_each(launched: Launched, exc: errors.RemoteError, fail: Callable[[Launched, errors.RemoteError], None]) -> None:
    """The message of several calls failed as a whole (not sent, not answered): so did each call."""
    launched.error = exc
    for sub in launched.subs:
        if not sub.done:
            fail(sub, copy.copy(exc))
            sub.done = True


def _answer(subs: list[Launched], reply: m.RunsReply, frames: list,
            fail: Callable[[Launched, errors.RemoteError], None], name: str) -> None:
    """Hand each call its reply (an empty brief one, unless the worker said more) or its failure."""
    if len(reply.run_ms) != len(subs) or not all(0 <= i < len(subs) for i in reply.said):
        raise errors.ProtocolError("worker answered eager calls with replies that do not match them")
    tracer = trace.current() if trace.ACTIVE else None
    said, run_ms = reply.said, reply.run_ms
    for i, sub in enumerate(subs):
        own = said.get(i) if said else None
        if own is None and tracer is None:
            quiet = sub.on_quiet
            if quiet is not None:  # (a prepared call whose worker said nothing: its outputs are kept)
                quiet(run_ms[i])
                sub.done = True
                continue
        try:
            if type(own) is m.ErrorReply:
                raise errors.from_reply(own.kind, own.message, own.traceback, graphs=own.graphs,
                                        tensors=own.tensors, handles=own.handles, slots=own.slots,
                                        optims=own.optims, bindings=own.bindings)
            sub.reply, sub.frames = (own if own is not None else m.RunReply([], reply.run_ms[i])), frames
            if sub.on_reply is not None:
                sub.on_reply(sub.reply, frames)
        except errors.RemoteError as exc:
            fail(sub, exc)
        finally:
            sub.done = True
            if tracer is not None:
                tracer.answered(name, sub)
