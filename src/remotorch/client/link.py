"""The link to one worker: the only place on the client that does I/O.

A :class:`Link` owns the transport and the worker-side session it attaches
to on every new connection (uploads survive a dropped connection for the
worker's lease; a background thread sends heartbeats while the link is
idle), and the ordered stream of requests on it
(:class:`~remotorch.client.stream.Stream`): :meth:`Link.launch` sends a
request without waiting (its reply is read in order later),
:meth:`Link.request` sends one and waits for its reply, :meth:`Link.sync`
waits for all. Every request carries the deferred housekeeping
``take_pending()`` gives, on its envelope, with its sequence number. Replies
that are errors are raised as their ``RemoteError``; a reply of the wrong
type is a ``ProtocolError``.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Sequence

from .. import errors
from ..codec import messages as m
from ..transport import TcpTransport, Transport
from ..transport.tls import client_context
from .rng import GENERATORS
from .launched import Launched
from .probe import parse_reply
from .stream import QueueLimits, Stream

log = logging.getLogger(__name__)

# (url, token) of the worker, resolved when the first request needs it
Locate = Callable[[], tuple[str, "str | None"]]


class Link:
    """Transport, worker-side session, heartbeats, and the ordered stream of requests on them.

    ``limits`` bound how far the client runs ahead of the worker;
    ``blocking`` waits for every reply at once (see :mod:`remotorch.client.stream`).
    """

    def __init__(self, locate: Locate, *, connect_timeout: float = 5.0, timeout: float | None = 300.0,
                 tls_ca: str | None = None, spin_s: float | None = 0.0, retry_after: float = 1.0,
                 transport: Transport | None = None, limits: QueueLimits | None = None,
                 blocking: bool = False) -> None:
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
        self._resumed = True  # the last attach found the session on the worker
        self._progress = self._pending = None  # of the request being sent (see launch)
        self.stream = Stream(post=self._post, collect=lambda: self.transport.collect(),
                             ready=lambda: self.transport.ready(), reconnect=self._reconnect,
                             encode=self._encode, parse=lambda header, expect: parse_reply(header, self.url, expect),
                             exchange=self._exchange, limits=limits, blocking=blocking)
        self.stream.before_wait = lambda: GENERATORS.awaited(self)  # a read brings the generator back too

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
            self.stream.name = url
        return self._transport

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def connected(self) -> bool:
        """True while a connection to the worker is open (no I/O)."""
        return self._transport is not None and self._transport.connected

    def close(self, detach: bool = True) -> None:
        """End the worker-side session (``detach``: free what it holds now, not after the lease) and close.

        Replies still in flight are read first; a failure among them that
        nobody read is raised after the link closed.
        """
        with self.lock:
            failure = None
            if not self._closed and self._transport is not None:
                try:
                    self.stream.sync()
                except errors.RemoteError as exc:
                    failure = exc
            self._heartbeat_stop.set()
            if detach and not self._closed and self.connected and not self.stream.inflight:
                try:
                    self._transport.set_timeout(min(2.0, self._timeout or 2.0))  # never hang in close()
                    self._transport.request(m.encode(m.Detach()))
                except errors.RemoteError:
                    pass
            self._closed = True
            GENERATORS.forget(self)
            if self._transport is not None:
                self._transport.close()
            if failure is not None:
                raise failure

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
        self._resumed = reply.resumed
        first = self.lease_s is None
        if not reply.resumed:  # a new session (worker restarted, or the lease ran out): upload again
            if not first:
                GENERATORS.forget(self)  # and it holds no random generator state
            for hook in self.on_reset:
                hook()
        self.lease_s = reply.lease_s
        if first:
            threading.Thread(target=_heartbeats, args=(weakref.ref(self), self._heartbeat_stop),
                             name="remotorch-heartbeat", daemon=True).start()

    def _reconnect(self) -> bool:
        """Open a new connection now (after one dropped); whether the worker still held the session."""
        if self._closed:
            raise errors.WorkerUnavailableError(self.closed_why)
        self._resumed = True
        try:
            self.transport.connect()
        except errors.WorkerUnavailableError:
            self._down_until = time.monotonic() + self._retry_after
            raise
        return self._resumed

    def bring_back_generator(self) -> None:
        """Wait for the random generator's state, if it lives on this worker (a read)."""
        with self.lock:
            last = GENERATORS.awaited(self)
            if last is not None:
                self.stream.wait(last)

    def connect(self) -> None:
        """Open the connection now if none is open (attaching to the session: see :meth:`_attach`)."""
        if not self.connected:
            if time.monotonic() < self._down_until:
                raise errors.WorkerUnavailableError(f"worker {self.url or 'local'} failed moments ago; "
                                                    f"not retrying for {self._retry_after}s")
            try:
                self.transport.connect()
            except errors.WorkerUnavailableError:
                self._down_until = time.monotonic() + self._retry_after
                raise

    def heartbeat(self) -> None:
        """Keep the lease alive if idle; never opens a connection or waits on a call."""
        if not self.lock.acquire(blocking=False):
            return  # a call is running: that keeps the lease alive
        try:
            if self._closed or not self.connected or self.stream.inflight:
                return
            # (eager calls kept to leave together stay until the next request or read: sent from this
            # thread, their replies' callbacks would run here, beside the program's own thread)
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
    def messages_sent(self) -> int:
        return self._transport.messages_sent if self._transport is not None else 0

    @property
    def bytes_received(self) -> int:
        return self._transport.bytes_received if self._transport is not None else 0

    # ------------------------------------------------------------------ requests
    def request(self, body, frames: Sequence = (), progress: Callable[[int], None] | None = None,
                expect: type | None = None, pending: m.Pending | None = None, what: str = ""):
        """Send one request and wait for its reply: ``(reply, frames)``, or its error raised.

        ``expect``: the reply type it must be (else ``ProtocolError``).
        Requests sent before it are answered first (in order). ``progress(n)``
        hears of the bytes sent (see :meth:`Transport.post`). ``what`` names
        it in errors (by default the request's type).
        """
        with self.lock:
            self._ready_to_send()
            if progress is None and pending is None:
                got = self.stream.call(body, frames, expect, what)
            else:
                self._progress, self._pending = progress, pending
                try:
                    got = self.stream.call(body, frames, expect, what)
                finally:
                    self._progress = self._pending = None
            self.last_request = time.monotonic()
            return got

    def launch(self, body, frames: Sequence, launched: Launched, *,
               pending: m.Pending | None = None) -> Launched:
        """Send a request without waiting for its reply; ``launched.on_reply(reply, frames)`` runs
        when it is read (in order: by a later wait, or as replies arrive). A failure is kept on
        ``launched`` and raised where its results are used (see :mod:`remotorch.client.stream`)."""
        with self.lock:
            self._ready_to_send()
            if launched.coalesce and pending is None and not self.stream.blocking:  # (client.coalesce)
                self.stream.queue(body, frames, launched, self.take_pending())
            elif pending is None:
                self.stream.launch(body, frames, launched)
            else:
                self._pending = pending  # (taken by this request's header: see _encode)
                try:
                    self.stream.launch(body, frames, launched)
                finally:
                    self._pending = None
            self.last_request = time.monotonic()
            return launched

    def _ready_to_send(self) -> None:
        """Refuse while a failed worker is not retried; make the transport on first use (naming the
        stream), or refuse once closed."""
        if time.monotonic() < self._down_until:
            raise errors.WorkerUnavailableError(f"worker {self.url or 'local'} failed moments ago; "
                                                f"not retrying for {self._retry_after}s")
        if self._transport is None or self._closed:
            self.transport  # noqa: B018

    def _encode(self, body, seq: int, ack: int) -> bytes:
        pending, self._pending = self._pending, None  # (the request's own, once: not a later one's)
        if type(body) is m.Runs:  # each call carries its own; what was released since rides on the next
            return m.encode(body, None, seq=seq, ack=ack)
        if pending is None:
            pending = self.take_pending()
        return m.encode(body, pending, seq=seq, ack=ack)

    def _post(self, header: bytes, frames: Sequence) -> None:
        progress, self._progress = self._progress, None
        was_connected = self.transport.connected
        try:
            self.transport.post(header, frames, progress=progress)
        except errors.RemoteError as exc:
            if was_connected:  # the connection dropped: the stream opens a new one and sends again
                exc.dropped = True
            elif isinstance(exc, errors.WorkerUnavailableError):  # no worker answered: not again at once
                self._down_until = time.monotonic() + self._retry_after
            raise

    def _exchange(self, header: bytes, frames: Sequence) -> tuple:
        """Post one message and read its reply, nothing else being in flight (``Stream.call``).
        An error that closed the open connection says ``dropped``, as :meth:`_post`'s does."""
        transport = self._transport  # (made by _ready_to_send)
        if not transport.connected:  # (a failure to connect is not a dropped connection)
            try:
                transport.connect()
            except errors.WorkerUnavailableError:
                self._down_until = time.monotonic() + self._retry_after
                raise
        progress, self._progress = self._progress, None
        try:
            return transport.request(header, frames, progress=progress)
        except errors.RemoteError as exc:
            if not transport.connected:  # (the transport closes a connection it lost)
                exc.dropped = True
            raise

    def settle(self, until: Launched | None = None) -> None:
        """Read the replies of launched calls, oldest first (all of them, or up to ``until``)."""
        with self.lock:
            self.stream.flush()
            if until is None:
                while self.stream.inflight:
                    self.stream.wait(self.stream.inflight[-1], read=False)
            else:
                self.stream.wait(until)

    def poll(self) -> None:
        """Read the replies that are here already, without waiting (a failure stays for its read)."""
        if self.stream.inflight and not self._closed:
            with self.lock:
                self.stream.poll()

    def sync(self) -> None:
        """Wait until the worker answered everything sent; raise a failure nobody read yet."""
        with self.lock:
            self.stream.sync()

    @property
    def idle(self) -> bool:
        """No launched call waits for its reply."""
        return not self.stream.inflight and self.stream.coalesced is None


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
