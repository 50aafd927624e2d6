"""The link to one worker: the only place on the client that does I/O.

A :class:`Link` owns the transport and the worker-side session it attaches
to on every new connection (uploads survive a dropped connection for the
worker's lease; a background thread sends heartbeats while the link is
idle). :meth:`Link.request` sends one request and reads its reply;
:meth:`Link.launch` sends one without waiting, its reply read in order
later (:meth:`Link.settle`). Every request carries the deferred housekeeping
``take_pending()`` gives, on its envelope. Replies that are errors are
raised as their ``RemoteError``; a reply of the wrong type is a ``ProtocolError``.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .. import errors
from ..codec import messages as m
from ..transport import TcpTransport, Transport
from ..transport.tls import client_context

log = logging.getLogger(__name__)

# (url, token) of the worker, resolved when the first request needs it
Locate = Callable[[], tuple[str, "str | None"]]


@dataclass(eq=False)
class Launched:
    """A request sent without waiting for its reply (an asynchronous call); settled in order later."""

    what: str  # names it in errors: "graph 3f2a9c01d2e4"
    on_reply: Callable[[object, list], None]
    expect: type | None = None
    done: bool = False
    error: errors.RemoteError | None = None

    def raise_error(self) -> None:
        """Raise what the call failed with, naming the call."""
        if self.error is not None:
            exc = self.error
            raise type(exc)(f"{self.what} (launched earlier) failed: {exc.message}",
                            remote_traceback=exc.remote_traceback) from exc


class Link:
    """Transport, worker-side session, heartbeats, and the request/launch/settle primitives."""

    def __init__(self, locate: Locate, *, connect_timeout: float = 5.0, timeout: float | None = 300.0,
                 tls_ca: str | None = None, spin_s: float | None = 0.0, retry_after: float = 1.0,
                 transport: Transport | None = None) -> None:
        self._locate = locate
        self._connect_timeout = connect_timeout
        self._timeout = timeout
        self._tls_ca = tls_ca
        self._spin_s = spin_s
        self._retry_after = retry_after
        self._transport = transport
        if transport is not None:
            transport.on_connect = self._attach
        self.url: str | None = None
        self.session_id = secrets.token_urlsafe(24)  # 192 random bits; a capability on the worker
        self.lock = threading.RLock()  # one request (or one sequence that must stay together) at a time
        self.lease_s: float | None = None
        self.on_reset: list[Callable[[], None]] = []  # called when the worker lost this session
        self.take_pending: Callable[[], m.Pending | None] = lambda: None  # housekeeping for the envelope
        self._down_until = 0.0
        self.last_request = time.monotonic()
        self._heartbeat_stop = threading.Event()
        self._closed = False
        self.closed_why = "session is closed"
        self._inflight: deque[Launched] = deque()  # launched calls whose replies are not read yet
        self.max_inflight = 32

    # ------------------------------------------------------------------ lifetime
    @property
    def transport(self) -> Transport:
        """The transport, created (not connected) on first use."""
        if self._closed:
            raise errors.WorkerUnavailableError(self.closed_why)
        if self._transport is None:
            url, token = self._locate()
            self.url = url
            self._transport = TcpTransport(url, token, protocol=m.PROTOCOL_VERSION,
                                           connect_timeout=self._connect_timeout, timeout=self._timeout,
                                           tls=client_context(self._tls_ca) if self._tls_ca else None,
                                           on_connect=self._attach, spin_s=self._spin_s)
        return self._transport

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def connected(self) -> bool:
        """True while a connection to the worker is open (no I/O)."""
        return self._transport is not None and self._transport.connected

    def close(self, detach: bool = True) -> None:
        """End the worker-side session (``detach``: free what it holds now, not after the lease) and close."""
        with self.lock:
            self._heartbeat_stop.set()
            if detach and not self._closed and self.connected:
                try:
                    self._transport.set_timeout(min(2.0, self._timeout or 2.0))  # never hang in close()
                    self._transport.request(m.encode(m.Detach()))
                except errors.RemoteError:
                    pass
            self._closed = True
            if self._transport is not None:
                self._transport.close()

    def drop(self) -> None:
        """Close the socket only; the next request reconnects and re-attaches (the lease keeps the session)."""
        if self._transport is not None:
            self._transport.close()

    def stop_heartbeats(self) -> None:
        """Stop sending heartbeats (the worker then sees an idle client; tests of lease expiry use it)."""
        self._heartbeat_stop.set()

    def _attach(self, ask: Callable[[bytes], bytes]) -> None:
        """On each new connection: name this session, learn whether the worker still holds it."""
        reply = parse_reply(ask(m.encode(m.Attach(self.session_id))), self.url, m.AttachReply)
        if not reply.resumed:  # a new session (worker restarted, or the lease ran out): upload again
            for hook in self.on_reset:
                hook()
        first, self.lease_s = self.lease_s is None, reply.lease_s
        if first:
            threading.Thread(target=_heartbeats, args=(weakref.ref(self), self._heartbeat_stop),
                             name="remotorch-heartbeat", daemon=True).start()

    def heartbeat(self) -> None:
        """Keep the lease alive if idle; never opens a connection or waits on a call."""
        if not self.lock.acquire(blocking=False):
            return  # a call is running: that keeps the lease alive
        try:
            if self._closed or not self.connected or self._inflight:
                return
            self.last_request = time.monotonic()
            self._transport.request(m.encode(m.Heartbeat()))
        except errors.RemoteError as exc:
            log.debug("heartbeat failed: %s", exc)
        finally:
            self.lock.release()

    @property
    def bytes_sent(self) -> int:
        return self._transport.bytes_sent if self._transport is not None else 0

    @property
    def bytes_received(self) -> int:
        return self._transport.bytes_received if self._transport is not None else 0

    # ------------------------------------------------------------------ requests
    def request(self, body, frames: Sequence = (), progress: Callable[[int], None] | None = None,
                expect: type | None = None, pending: m.Pending | None = None):
        """Send one request; the decoded reply and its frames, or its error raised as a ``RemoteError``.

        ``expect``: the reply type it must be (else ``ProtocolError``).
        Replies of launched calls are read first (they come in order).
        ``progress(n)`` hears of the bytes sent (see :meth:`Transport.request`).
        """
        with self.lock:
            if self._inflight:
                self.settle()
            transport, header = self._prepare(body, pending)
            try:
                if progress is None:
                    reply, out = transport.request(header, frames)
                else:
                    reply, out = transport.request(header, frames, progress=progress)
            except errors.WorkerUnavailableError:
                self._down_until = time.monotonic() + self._retry_after
                raise
            return parse_reply(reply, self.url, expect), out

    def _prepare(self, body, pending: m.Pending | None = None) -> tuple[Transport, bytes]:
        if time.monotonic() < self._down_until:
            raise errors.WorkerUnavailableError(f"worker {self.url or 'local'} failed moments ago; "
                                                f"not retrying for {self._retry_after}s")
        transport = self.transport
        self.last_request = time.monotonic()
        return transport, m.encode(body, pending or self.take_pending())

    def launch(self, body, frames: Sequence, launched: Launched) -> Launched:
        """Send a request without waiting for its reply; ``launched.on_reply(reply, frames)`` runs
        when it is read.

        Replies are read in order, by the next request on this link, by
        :meth:`settle`, or when more than ``max_inflight`` calls are
        outstanding. A failure is kept on ``launched`` and raised where its
        results are used.
        """
        with self.lock:
            transport, header = self._prepare(body)
            try:
                transport.post(header, frames)
            except errors.WorkerUnavailableError:
                self._down_until = time.monotonic() + self._retry_after
                raise
            self._inflight.append(launched)
            while len(self._inflight) > self.max_inflight:
                self._settle_one()
            return launched

    @property
    def can_launch(self) -> bool:
        """Whether this link's transport can send without waiting for replies."""
        return type(self.transport).post is not Transport.post

    def settle(self, until: Launched | None = None) -> None:
        """Read the replies of launched calls, oldest first (all of them, or up to ``until``)."""
        with self.lock:
            while self._inflight and (until is None or not until.done):
                self._settle_one()

    @property
    def idle(self) -> bool:
        """No launched call waits for its reply."""
        return not self._inflight

    def _settle_one(self) -> None:
        launched = self._inflight.popleft()
        try:
            header, out = self._transport.collect()
            launched.on_reply(parse_reply(header, self.url, launched.expect), out)
        except errors.RemoteError as exc:
            launched.error = exc
            if isinstance(exc, errors.TransportError):  # the connection is gone: so are the other replies
                while self._inflight:
                    other = self._inflight.popleft()
                    other.error, other.done = exc, True
        finally:
            launched.done = True


def parse_reply(header: bytes, url: str | None, expect: type | None = None) -> object:
    """Decode a reply's frame 0; an ``ErrorReply`` is raised as its ``RemoteError``; a reply that
    is not of type ``expect`` is a ``ProtocolError``."""
    try:
        reply = m.decode(header)
    except Exception as exc:
        raise errors.ProtocolError(f"unreadable reply from worker {url or 'local'}: {exc}") from None
    if type(reply) is m.ErrorReply:
        raise errors.from_reply(reply.kind, reply.message, reply.traceback, graphs=reply.graphs,
                                tensors=reply.tensors, handles=reply.handles, slots=reply.slots,
                                optims=reply.optims, bindings=reply.bindings)
    if expect is not None and type(reply) is not expect:
        raise errors.ProtocolError(f"worker {url or 'local'} answered with {type(reply).__name__}, "
                                   f"not {expect.__name__}")
    return reply


def _heartbeats(ref: weakref.ref, stop: threading.Event) -> None:
    """Background thread: a heartbeat whenever the link was idle a third of its lease."""
    while True:
        link = ref()
        if link is None or stop.is_set():
            return
        interval = max((link.lease_s or 30.0) / 3, 0.05)
        wait = link.last_request + interval - time.monotonic()
        if wait <= 0:
            link.heartbeat()
            wait = interval
        del link
        if stop.wait(wait):
            return
