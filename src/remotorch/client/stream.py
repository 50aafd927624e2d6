"""The ordered stream of requests to one worker: sent without waiting, answered in order.

Across a network the cost that matters is a round trip waited for, not bytes
or microseconds. So a request is written to the socket when it is issued
and, unless the caller needs its reply now, not waited for: it is a
:class:`Launched` call, whose reply is read later, in order (the worker runs
each session's requests one at a time, in the order sent, and answers them
in that order). Only a read waits: a value Python reads, a request whose
answer the caller needs, :meth:`Stream.sync`, or a full queue. Since every
request is already on its way when the read is issued, a read costs one
round trip, whatever was issued before it. (Eager calls on kept values are
the exception to "written when issued": those queued back to back leave
together, as one message, :mod:`remotorch.client.coalesce`.)

Each request carries a sequence number. The worker remembers, for the
session's lease, the last one it ran and the replies not yet acknowledged
(the envelope's ``ack``): when the connection drops with requests in flight,
the stream reconnects, re-attaches and sends them again, and the worker
answers those it already ran from its memory instead of running them twice.
An optimizer step is never applied twice. A worker that lost the session
(it restarted, or the lease ran out) fails every request in flight, naming
each.

Errors arrive late but exactly. A read of anything a failed request was to
make raises its error, naming what failed and the Python line that issued it
(:mod:`remotorch.client.origin`); a request that failed only because it used
that raises the first one's error (the root). A failure nobody read is raised
at the next :meth:`Stream.sync` (``session.synchronize()``, ``close()``), and,
for requests that make no value (an optimizer step, an upload), at the next
read on the stream. Once raised, it is not raised again: the session goes on.

The queue is bounded (:class:`QueueLimits`): requests and bytes in flight, and
optimizer steps ahead of the worker (beyond those the link holds); replies are
read while a request is written. ``blocking=True`` (``REMOTORCH_LAUNCH_BLOCKING=1``)
waits for every reply at once, as ``CUDA_LAUNCH_BLOCKING`` does.
"""

from __future__ import annotations

import copy
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .. import errors
from . import origin as origins
from . import trace
from .coalesce import Coalesced, fail_each
from .depth import StepPipe
from .launched import Launched, root

log = logging.getLogger(__name__)

PROMPT_S = 5e-4  # a first read this soon after its call was sent, nothing sent since: "at once"


@dataclass(frozen=True)
class QueueLimits:
    """How far the client may run ahead of the worker (the queue's bound).

    ``requests`` and ``nbytes``: requests sent and not yet answered, and their
    bytes (kept for a replay after a dropped connection); ``steps``: optimizer
    steps (a training loop's iterations) ahead of the worker: not yet
    answered, beyond those the link itself holds (on their way there, or
    answered and on their way back: the round trip over the loop's pace, see
    :mod:`remotorch.client.depth`). On loopback that is steps not yet answered.
    """

    requests: int = 256
    nbytes: int = 256 << 20
    steps: int = 4


class Stream:
    """The requests of one link, in order (see the module docstring).

    ``post(header, frames)`` writes one message; ``collect()`` reads the
    oldest reply; ``ready()`` reads one if a whole reply is here already
    (else None); ``reconnect()`` opens a new connection and re-attaches,
    returning whether the worker still holds the session. ``encode(body,
    seq)`` makes a request's header; ``parse(header, expect)`` a reply
    (raising its ``RemoteError``).
    """

    def __init__(self, *, post, collect, ready, reconnect, encode, parse, exchange=None,
                 limits: QueueLimits | None = None, blocking: bool = False) -> None:
        self._post, self._collect, self._ready = post, collect, ready
        self._exchange = exchange  # post and collect in one, while nothing else is in flight (call)
        self._reconnect, self._encode, self._parse = reconnect, encode, parse
        self.limits = limits or QueueLimits()
        self.blocking = blocking
        self.seq = 0
        self.acked = 0  # the last sequence number whose reply was read
        self.inflight: deque[Launched] = deque()
        self._bytes = 0
        self._steps = 0
        self.pipe = StepPipe()  # the steps the link holds: allowed beyond ``limits.steps``
        self._room_waited = 0.0  # seconds spent waiting for room in the queue, all told
        self.unreported: list[Launched] = []  # failed, and not raised yet
        self.failed_objects: dict[tuple, Launched] = {}  # objects failed calls were to make
        self.reads = 0  # values read from the worker, one round trip at most each (fixed by the program)
        self.blocking_reads = 0  # of those, the ones that waited (a reply already here costs none)
        self.queue_waits = 0  # waits because the queue was full
        self.requests_queued = 0  # requests sent without waiting
        self.name = ""  # the worker's, on trace tracks
        # before a wait: a request to send first and wait for too (the random generator's state), or None
        self.before_wait: Callable[[], Launched | None] | None = None
        self.coalesced: Coalesced | None = None  # eager calls kept to leave together (client.coalesce)

    # ------------------------------------------------------------------ sending
    def queue(self, body, frames: Sequence, launched: Launched, pending) -> Launched:
        """An eager call: kept to leave with the next ones as one message (:mod:`remotorch.client.coalesce`),
        with ``pending``, the housekeeping due before it."""
        if self.coalesced is None:
            self.coalesced = Coalesced()
        self.requests_queued += 1
        if self.coalesced.add(body, frames, launched, pending):  # (full: it leaves now)
            self.flush()
        return launched

    def flush(self, seq: int = 0) -> None:
        """Send the eager calls kept to leave together, if there are any (one message; ``seq``: the
        number kept for it, else the next)."""
        batch, self.coalesced = self.coalesced, None
        if batch is None:
            return
        body, frames, launched = batch.message(self._failed, self.name)
        try:
            self.launch(body, frames, launched, seq)
        except errors.RemoteError as exc:  # not sent at all: each call fails with it, raised at its read
            self._failed(launched, exc)
            return
        batch.sent(launched, self.name)

    def launch(self, body, frames: Sequence, launched: Launched, seq: int = 0) -> Launched:
        """Send a request; its reply is read later (see :meth:`wait`). (``seq``: a number kept for it.)"""
        # the header first: it takes the housekeeping queued so far. Making room reads earlier replies,
        # which may release a handle this very request names (a placeholder filled meanwhile); that
        # release must ride on the next request, not on this one. Eager calls queued before it leave
        # first, under the number before its, after its header is made (sending them reads replies too)
        first = self.coalesced is not None and not seq
        if not seq:
            self.seq += 1 + first
        launched.seq = seq or self.seq
        header = self._encode(body, launched.seq, self.acked)
        if first:
            self.flush(self.seq - 1)
        self._make_room(launched)
        alone = launched.alone = not self.inflight
        self._enter(launched, header, frames)
        if trace.ACTIVE:
            tracer = trace.current()
            if tracer is not None:
                tracer.issued(self.name, launched)
        try:
            self._post(header, launched.message[1])
        except errors.RemoteError as exc:
            if isinstance(exc, errors.TransportError) and getattr(exc, "dropped", False):
                self._recover()  # the connection dropped: a new one, and everything in flight sent again
                if alone and launched.error is not None:  # that failed too: this request says so now
                    launched.raise_error()
            elif alone:  # nothing else in flight: this request failed by itself, and says so now
                self.inflight.pop()
                self._leave(launched)
                raise
            else:  # a new connection was refused (a token no longer accepted): all is lost
                self._lose(list(self.inflight), exc)
        launched.sent_at = time.perf_counter()
        if launched.step:
            self.pipe.stepped(launched.sent_at, self._room_waited)
        if self.blocking:
            self.wait(launched, read=False)
        else:
            self.requests_queued += launched.queued
            if not alone:  # replies to earlier requests may be here (this one's cannot be yet)
                self._drain_ready()
        return launched

    def call(self, body, frames: Sequence, expect: type | None = None, what: str = "") -> tuple:
        """Send a request and read its reply now: ``(reply, frames)``, or its failure raised, named.

        With nothing else in flight, one exchange on the transport, and no
        :class:`Launched` unless it fails: the same numbering, replay and
        errors as :meth:`launch` then :meth:`wait`. (A queue, the blocking
        mode and a trace take that path.) ``what`` names it in errors (by
        default the request's type).
        """
        if self.inflight or self._exchange is None or self.blocking or trace.ACTIVE or self.coalesced is not None:
            launched = self._made(body, expect, what)  # (eager calls queued before it: they leave first)
            self.launch(body, frames, launched)
            self.wait(launched)
            launched.raise_error()
            return launched.reply, launched.frames
        self.seq = seq = self.seq + 1
        header = self._encode(body, seq, self.acked)
        sent_at = time.perf_counter()
        try:
            head, out = self._exchange(header, frames)
        except errors.RemoteError as exc:  # as launch would have: kept for a replay, then waited for
            launched = self._made(body, expect, what)
            launched.seq, launched.alone, launched.sent_at = seq, True, sent_at
            self._enter(launched, header, frames)
            if getattr(exc, "timed_out", False):  # as _settle_one: the worker did not answer in time
                self._lose(list(self.inflight), exc)
            elif isinstance(exc, errors.TransportError) and getattr(exc, "dropped", False):
                self._recover()  # as launch: a new connection, and this request sent again
            else:  # as launch: no connection could be opened, and nothing else is in flight
                self.inflight.pop()
                self._leave(launched)
                raise
            self.wait(launched)
            launched.raise_error()
            return launched.reply, launched.frames
        self.reads += 1
        self.blocking_reads += 1
        self.acked = seq
        self.pipe.answered(time.perf_counter() - sent_at)
        failed = None
        try:
            reply = self._parse(head, expect)
        except errors.RemoteError as exc:
            failed = self._made(body, expect, what)
            failed.seq, failed.done = seq, True
            self._failed(failed, exc)
        if self.unreported:  # (earlier requests' failures first: this one may depend on them)
            self.raise_effects(before=seq)
        if failed is not None:
            failed.raise_error()
        return reply, out

    @staticmethod
    def _made(body, expect: type | None, what: str) -> Launched:
        """The record of a request its caller waits for (its line is taken only for a trace)."""
        return Launched(what or type(body).__name__, expect=expect, queued=False,
                        origin=origins.here() if trace.ACTIVE else ())

    def _enter(self, launched: Launched, header: bytes, frames: Sequence) -> None:
        """In flight: kept as sent (for a replay), its bytes and steps counted against the bound."""
        launched.message = (header, list(frames))
        launched.nbytes = len(header) + sum(memoryview(f).nbytes for f in frames)
        self.inflight.append(launched)
        self._bytes += launched.nbytes
        self._steps += launched.step

    def _leave(self, launched: Launched) -> None:
        self._bytes -= launched.nbytes
        self._steps -= launched.step
        launched.message = ()

    def _make_room(self, launched: Launched) -> None:
        limits = self.limits
        while self.inflight and (len(self.inflight) >= limits.requests or self._bytes >= limits.nbytes
                                 or (launched.step and self._steps >= limits.steps  # (the link's
                                     and self._steps >= limits.steps + self.pipe.steps())):  # only then)
            if not self._drain_ready():
                self.queue_waits += 1
                started = time.perf_counter()
                self._settle_one()
                self._room_waited += time.perf_counter() - started

    # ------------------------------------------------------------------ reading
    def wait(self, launched: Launched, read: bool = True) -> None:
        """Read replies in order until ``launched``'s is read (one round trip, for a read).

        Failures of requests that make no value, sent before it, are raised
        here (a read may depend on them); ``launched``'s own error is not
        (the caller raises it where its value is used).
        """
        if self.coalesced is not None:
            self.flush()
        also = self.before_wait() if self.before_wait is not None else None
        if read and launched.on_read is not None:  # at once: nothing sent since, and soon
            on_read, launched.on_read = launched.on_read, None
            on_read(launched.seq == self.seq and time.perf_counter() - launched.sent_at < PROMPT_S)
        self.reads += read
        if not launched.done:
            if read:
                self.blocking_reads += 1
            started = time.perf_counter()
            while not launched.done:
                self._settle_one()
            tracer = trace.current()
            if tracer is not None:
                tracer.waited(self.name, started, launched, origins.here())
        while also is not None and not also.done:  # right behind it: the same round trip
            self._settle_one()
        self.raise_effects(before=launched.seq)

    def sync(self) -> None:
        """Wait for every reply; raise the first failure not raised yet (and say how many more)."""
        if self.coalesced is not None:
            self.flush()
        if self.before_wait is not None:
            self.before_wait()
        self.reads += 1
        if self.inflight:
            self.blocking_reads += 1
            started, last = time.perf_counter(), self.inflight[-1]
            while self.inflight:
                self._settle_one()
            tracer = trace.current()
            if tracer is not None:
                tracer.waited(self.name, started, last, origins.here())
        pending = [f for f in self.unreported if not root(f).reported]
        self.unreported.clear()
        if pending:
            first = pending[0]
            if len(pending) > 1:
                log.warning("%d more asynchronous failure(s) after %s: %s", len(pending) - 1, first.what,
                            "; ".join(f"{f.what}: {f.error}" for f in pending[1:4]))
            first.raise_error()

    def absorb(self) -> None:
        """Count every failure not raised yet as raised (a caller raised one error for all of them)."""
        for failed in self.unreported:
            failed.reported = True
        self.unreported.clear()

    def raise_effects(self, before: int | None = None) -> None:
        """Raise the first failure of a request that made no value (sent before seq ``before``)."""
        for failed in self.unreported:
            if failed.effect and not root(failed).reported and (before is None or failed.seq < before):
                self.unreported = [f for f in self.unreported if f is not failed]
                failed.raise_error()

    def poll(self) -> None:
        """Read the replies that are here already, without waiting."""
        self._drain_ready()

    def _drain_ready(self) -> bool:
        """Read the replies that are here already, without waiting; whether any was."""
        got = False
        while self.inflight:
            try:
                message = self._ready()
            except errors.TransportError:  # the connection dropped: send what is in flight again
                self._recover()
                return got
            if message is None:
                return got
            self._take(self.inflight.popleft(), message)
            got = True
        return got

    def _settle_one(self) -> None:
        launched = self.inflight[0]
        try:
            message = self._collect()
        except errors.TransportError as exc:
            if getattr(exc, "timed_out", False):  # the worker did not answer in time: everything in flight
                self._lose(list(self.inflight), exc)  # is lost (it may still run, but nobody will hear of it)
            else:
                self._recover()
            return
        self.inflight.popleft()
        self._take(launched, message)

    def _take(self, launched: Launched, message: tuple) -> None:
        header, frames = message
        self.acked = launched.seq
        self._leave(launched)
        if launched.alone:
            self.pipe.answered(time.perf_counter() - launched.sent_at)
        try:
            reply = self._parse(header, launched.expect)
            launched.reply, launched.frames = reply, frames
            if launched.on_reply is not None:
                launched.on_reply(reply, frames)
        except errors.RemoteError as exc:
            self._failed(launched, exc)
        finally:
            launched.done = True
            if trace.ACTIVE:
                tracer = trace.current()
                if tracer is not None:
                    tracer.answered(self.name, launched)

    def _failed(self, launched: Launched, exc: errors.RemoteError) -> None:
        if launched.subs:  # eager calls sent together: each of them failed (none ran, or none was answered)
            return fail_each(launched, exc, self._failed)
        if isinstance(exc, errors.MissingObjectsError):
            root = self._root_of(exc)
            if root is not None:
                exc.launched_root = root
        launched.error = exc
        if launched.on_error is not None:
            launched.on_error(exc)
        for key in launched.makes:
            self.failed_objects[key] = launched
        if len(self.failed_objects) > 65536:  # old failures: their objects' ids are never reused
            for key in list(self.failed_objects)[:32768]:
                del self.failed_objects[key]
        if not (launched.quiet and isinstance(exc, errors.WorkerUnavailableError)):
            self.unreported.append(launched)  # (a quiet one lost with its worker loses nothing)

    def _root_of(self, exc: errors.MissingObjectsError) -> Launched | None:
        keys = ([("h", h) for h in exc.handles] + [("t", t) for t in exc.tensors]
                + [("g", g) for g in exc.graphs] + [("b", b) for b in exc.bindings])
        for key in keys:
            root = self.failed_objects.get(key)
            if root is not None:
                return getattr(root.error, "launched_root", None) or root
        return None

    # ----------------------------------------------------------------- failures
    def _recover(self) -> None:
        """The connection dropped with requests in flight: reconnect and send them again, once.

        The worker runs only those it had not run, and answers the others from
        its memory. If the worker cannot be reached, or no longer holds the
        session, every request in flight fails, named in the error.
        """
        todo = list(self.inflight)
        try:
            resumed = self._reconnect()
            if not resumed and todo:
                raise errors.WorkerUnavailableError(
                    "the worker no longer holds this session (it restarted, or the lease ran out)")
            for launched in todo:
                launched.alone = False  # (its round trip now includes the reconnection)
                self._post(*launched.message)
            log.info("reconnected; sent %d request(s) in flight again", len(todo))
        except errors.RemoteError as exc:
            self._lose(todo, exc)

    def _lose(self, todo: list[Launched], exc: errors.RemoteError) -> None:
        """Every request in flight failed with the connection: one failure, raised once, naming them."""
        counts: dict[str, int] = {}
        for launched in todo:
            key = f"{launched.what} ({origins.first_line(launched.origin) or 'remotorch'})"
            counts[key] = counts.get(key, 0) + 1
        lost = ", ".join(f"{k} x{n}" if n > 1 else k for k, n in list(counts.items())[:8])
        more = f" and {len(counts) - 8} more" if len(counts) > 8 else ""
        error = copy.copy(exc)  # its type: unavailable, refused, ...
        error.message = f"{exc.message}; lost with it: {lost}{more}"
        error.args = (error.message,)
        error.launched_root = todo[0]  # one failure: reported once, whichever is read
        for launched in todo:
            self.inflight.remove(launched)
            self._leave(launched)
            self._failed(launched, copy.copy(error))
            launched.effect = True  # every later read must hear of it: state on the worker is gone
            launched.done = True

    # --------------------------------------------------------------- reporting
    def counters(self) -> dict:
        return dict(reads=self.reads, blocking_reads=self.blocking_reads, queue_waits=self.queue_waits,
                    requests_queued=self.requests_queued)
