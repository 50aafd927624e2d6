"""Client side of the stream transport: one authenticated connection, opened lazily.

``tcp://host:port`` and ``tls://host:port`` reach a worker over TCP;
``unix:///path/to/socket`` reaches one on the same host over a Unix socket
(same framing and handshake, without the TCP stack: about half the latency
of loopback TCP per round trip).
"""

from __future__ import annotations

import select
import socket
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from urllib.parse import urlparse

from ..errors import AuthenticationError, ProtocolError, WorkerUnavailableError
from .base import Buffer, OnConnect, Spin, Transport, poll_for, poll_until
from .framing import AuthFailed, FramedChannel, FramingError
from .handshake import client_handshake
from .tls import client_context, wrap_client

DEFAULT_MAX_FRAME = 1 << 40


def parse_url(url: str) -> tuple[str, int]:
    """``tcp://host:port`` or ``tls://host:port`` → (host, port); ``unix:///path`` → (path, -1).

    Raises ValueError for anything else.
    """
    if url.startswith("unix://"):
        path = url[len("unix://"):]
        if not path.startswith("/") or not hasattr(socket, "AF_UNIX"):
            raise ValueError(f"a Unix socket address must look like unix:///absolute/path, got {url!r}")
        return path, -1
    parsed = urlparse(url)
    if parsed.scheme not in ("tcp", "tls") or not parsed.hostname or parsed.port is None:
        raise ValueError(f"worker address must look like tcp://host:port, tls://host:port "
                         f"or unix:///path, got {url!r}")
    return parsed.hostname, parsed.port


def _readable(channel: FramedChannel) -> Callable[[], bool]:
    """Whether a reply (or part of one) is here: already read, held by TLS, or in the socket."""
    sock = channel.sock
    return lambda: channel.readable or bool(select.select([sock], [], [], 0)[0])


_MAPPED = (socket.timeout, ssl.SSLError, FramingError, OSError, ConnectionError)  # what _mapped() translates


def _mapped(exc: BaseException, url: str, timeout: float | None) -> Exception:
    """A socket, TLS or framing failure as the ``remotorch.errors`` type it means."""
    if isinstance(exc, socket.timeout):
        timed_out = WorkerUnavailableError(f"worker at {url} did not answer within {timeout}s")
        timed_out.timed_out = True  # alive, perhaps, but not answering: not a connection to open again
        return timed_out
    if isinstance(exc, ssl.SSLCertVerificationError):
        return AuthenticationError(f"{url}: the worker's TLS certificate is not trusted: {exc.verify_message}")
    if isinstance(exc, ssl.SSLError):
        return ProtocolError(f"{url}: TLS failed: {exc}")
    if isinstance(exc, AuthFailed):
        return AuthenticationError(f"{url}: {exc}")
    if isinstance(exc, FramingError):
        return ProtocolError(f"{url}: {exc}")
    return WorkerUnavailableError(f"lost the connection to {url}: {exc}")


@contextmanager
def _mapped_errors(url: str, timeout: float | None, drop: Callable[[], None] = lambda: None) -> Iterator[None]:
    """Socket, TLS and framing failures as ``remotorch.errors`` types (``drop`` runs first)."""
    try:
        yield
    except _MAPPED as exc:
        drop()
        raise _mapped(exc, url, timeout) from exc


class TcpTransport(Transport):
    """Length-prefixed frames over one TCP connection (thread-safe, one request at a time).

    The connection opens on the first request, not in the constructor, so
    creating a session for a worker that is down does not fail by itself.
    A ``tls://`` address (or a ``tls`` context) wraps the socket in TLS,
    verifying the worker's certificate, before the token handshake.
    ``on_connect`` runs on each new connection before the first request
    (a connection uses it to re-attach to its session on the worker).
    With ``ticket_id`` the connection is opened with another worker's
    one-time ticket instead of a token (``token`` is the ticket's secret).
    """

    def __init__(self, url: str, token: str | bytes | None = None, *, protocol: int,
                 connect_timeout: float = 5.0, timeout: float | None = 300.0,
                 tls: ssl.SSLContext | None = None, on_connect: OnConnect | None = None,
                 spin_s: float | None = 0.0, ticket_id: bytes | None = None) -> None:
        self.url = url
        self._ticket_id = ticket_id  # present this one-time ticket (``token`` is its secret)
        self.spin = Spin(spin_s)  # busy-poll for a reply before sleeping (None: auto)
        self.host, self.port = parse_url(url)  # (path, -1) for unix://
        if tls is None and url.startswith("tls://"):
            tls = client_context()
        self._tls = tls
        self.on_connect = on_connect
        self._token = token if isinstance(token, bytes) else (token or "").encode()
        self._protocol = protocol
        self.connect_timeout = connect_timeout
        self.timeout = timeout
        self._channel: FramedChannel | None = None
        self._lock = threading.Lock()
        self.outstanding = 0  # posted messages whose replies are not collected yet
        self._early: deque = deque()  # replies read while a message was being sent
        self.bytes_sent = 0
        self.messages_sent = 0
        self.bytes_received = 0

    def _connect(self) -> FramedChannel:
        try:
            sock = self._open()
        except OSError as exc:
            raise WorkerUnavailableError(f"no worker at {self.url}: {exc}") from exc
        with _mapped_errors(f"worker at {self.url} (handshake)", self.connect_timeout, sock.close):
            if self._tls is not None:
                sock = wrap_client(self._tls, sock, self.host)
            key = client_handshake(sock, self._token, self._protocol, self._ticket_id)
        sock.settimeout(self.timeout)
        channel = FramedChannel(sock, key, role="client", max_frame=DEFAULT_MAX_FRAME, max_header=DEFAULT_MAX_FRAME)
        if self.on_connect is not None:
            try:
                with _mapped_errors(self.url, self.timeout):
                    self.on_connect(lambda header: self._exchange(channel, header)[0])
            except BaseException:
                sock.close()
                raise
        return channel

    def _open(self) -> socket.socket:
        if self.port == -1:  # unix:///path
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(self.connect_timeout)
                sock.connect(self.host)
            except OSError:
                sock.close()
                raise
            return sock
        sock = socket.create_connection((self.host, self.port), timeout=self.connect_timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _exchange(self, channel: FramedChannel, header: bytes, frames: Sequence[Buffer] = (),
                  progress: Callable[[int], None] | None = None) -> tuple:
        """One message and its reply on ``channel``; socket errors are the caller's to map."""
        self.bytes_sent += channel.send(header, frames, progress)
        self.messages_sent += 1
        return self._receive(channel)

    def _receive(self, channel: FramedChannel) -> tuple:
        """The next reply on ``channel``, busy-polled for first while the spin policy says so."""
        spin = self.spin
        started = time.perf_counter()
        window = spin.budget()
        got = None
        if window and channel.compiled:  # poll for the reply itself: one call per turn, none after
            got = poll_for(channel.poll, window)
        elif window:
            poll_until(_readable(channel), window)
        reply, out, nbytes = got if got is not None else channel.recv()
        spin.waited(time.perf_counter() - started)
        self.bytes_received += nbytes
        return reply, out

    def set_timeout(self, seconds: float | None) -> None:
        """Change the reply timeout, for the open connection too."""
        with self._lock:
            self.timeout = seconds
            if self._channel is not None:
                self._channel.sock.settimeout(seconds)

    @property
    def connected(self) -> bool:
        """True while a connection is open (no I/O)."""
        return self._channel is not None

    @property
    def binding(self) -> bytes | None:
        """The open connection's binding (:attr:`FramedChannel.binding`), or None when none is open."""
        channel = self._channel
        return None if channel is None else channel.binding

    def request(self, header: bytes, frames: Sequence[Buffer] = (), *,
                progress: Callable[[int], None] | None = None) -> tuple[bytes, list]:
        with self._lock:
            if self.outstanding:
                raise ProtocolError("replies to posted messages must be collected first")
            if self._channel is None:
                self._channel = self._connect()
            try:  # the hot path: a plain try costs nothing when nothing fails
                return self._exchange(self._channel, header, frames, progress)
            except _MAPPED as exc:
                raise self._lost(exc) from exc

    def connect(self) -> None:
        with self._lock:
            if self._channel is None:
                self._channel = self._connect()

    def post(self, header: bytes, frames: Sequence[Buffer] = (), *,
             progress: Callable[[int], None] | None = None) -> None:
        with self._lock:
            if self._channel is None:
                self._channel = self._connect()
            try:  # (a plain try: a context manager costs microseconds on the hot path)
                if self.outstanding and progress is None and type(self._channel.sock) is socket.socket:
                    self.bytes_sent += self._send_reading(self._channel, header, frames)
                else:
                    self.bytes_sent += self._channel.send(header, frames, progress)
            except _MAPPED as exc:
                raise self._lost(exc) from exc
            self.messages_sent += 1
            self.outstanding += 1
        # (no sched_yield here: on a loaded machine it hands the CPU to another process for a time
        # slice, 2 us at the median but over 100 us for one post in ten, measured in benchmarks/peers.py)

    def _send_reading(self, channel: FramedChannel, header: bytes, frames: Sequence[Buffer]) -> int:
        """Send a message while replies to earlier ones are due, reading those that come meanwhile.

        The worker stops reading a connection while a reply of its waits to be
        written; were this side to write without reading, each would wait on
        the other. Replies read here are handed out by :meth:`collect` first.
        (A TLS socket sends blocking, as before: its non-blocking writes are
        another protocol of their own.)
        """
        size = channel.queue(header, frames)
        sock = channel.sock
        sock.setblocking(False)
        try:
            deadline = None if self.timeout is None else time.monotonic() + self.timeout
            while not channel.flush():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise socket.timeout("the worker took neither the request nor its replies")
                readable, _, _ = select.select([sock], [sock], [], left)
                if readable:
                    while (got := channel.poll()) is not None:
                        self._early.append(got)
        finally:
            sock.settimeout(self.timeout)
        return size

    def collect(self) -> tuple[bytes, list]:
        with self._lock:
            if not self.outstanding or self._channel is None:
                raise WorkerUnavailableError(f"lost the connection to {self.url} with replies outstanding")
            if self._early:
                reply, out, nbytes = self._early.popleft()
                self.bytes_received += nbytes
            else:
                try:
                    reply, out = self._receive(self._channel)
                except _MAPPED as exc:
                    raise self._lost(exc) from exc
            self.outstanding -= 1
            return reply, out

    def ready(self) -> tuple[bytes, list] | None:
        with self._lock:
            if not self.outstanding or self._channel is None:
                return None
            if self._early:
                got = self._early.popleft()
            else:
                with _mapped_errors(self.url, self.timeout, self._drop):
                    got = self._channel.poll()
                if got is None:
                    return None
            reply, out, nbytes = got
            self.outstanding -= 1
            self.bytes_received += nbytes
            return reply, out

    def _drop(self) -> None:
        self.outstanding = 0  # their replies went with the connection
        self._early.clear()
        if self._channel is not None:
            try:
                self._channel.sock.close()
            except OSError:
                pass
            self._channel = None

    def _lost(self, exc: BaseException) -> Exception:
        """A socket, TLS or framing failure on the hot path: the connection dropped, the error typed
        (as :func:`_mapped_errors` does, without a context manager's cost per message)."""
        self._drop()
        return _mapped(exc, self.url, self.timeout)

    def close(self) -> None:
        with self._lock:
            self._drop()
