"""Server side of the stream transport: accept, authenticate, hand messages to a handler.

It listens on TCP (``host:port``) or on a Unix socket (``unix_path``, for
clients on the same host; the socket file is private to the user).

Handshakes run in short-lived threads (so a peer that stalls before proving
the token cannot hold anything up). Authenticated connections are then served
by one selector loop on the thread that calls :meth:`TcpServer.serve_forever`
(the worker's main thread): each request is read, handled and answered there,
with no hand-off between threads on the hot path. Reads never block the loop
(a message arriving in pieces is assembled across wake-ups), so a peer that
stops in the middle of a message holds up nobody until it is dropped. Nor do
writes: a reply the peer does not take is left queued on its connection
(the loop serves others and writes more when the socket has room), and a
peer that takes nothing for ``message_timeout`` is dropped. PyTorch's CPU kernels also
run markedly slower from secondary threads, so the graphs run where they are
fastest, one at a time. A reply that only acknowledges its request (``quiet()``) waits for
the next while more of the peer's requests are here (:mod:`~remotorch.transport.holding`).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import queue
import select
import selectors
import socket
import ssl
import stat
import threading
import time
from collections.abc import Callable, Sequence

from .framing import AuthFailed, FramedChannel, FramingError, MessageTooLarge
from .base import Spin, poll_until
from .handshake import accept_handshake
from .holding import Holding
from .tls import wrap_server

log = logging.getLogger(__name__)

# handler(connection_id, header, frames) -> (reply_header, reply_frames)
Handler = Callable[[int, bytes, list], tuple[bytes, Sequence]]
# ticket_handler(ticket_id, binding, header, frames) -> (reply_header, reply_frames): a message of
# a connection opened with a one-time ticket instead of the token (worker to worker); ticket_id is
# the hello's ticket for the connection's first message, None for the later ones (each names its own)
TicketHandler = Callable[[bytes | None, bytes, bytes, list], tuple[bytes, Sequence]]


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class TcpServer:
    """Serves a :data:`Handler` on host:port (or a Unix socket) until :meth:`shutdown`."""

    def __init__(self, handler: Handler, host: str, port: int, token: str | None, *, protocol: int,
                 max_frame: int, max_header: int = 64 << 20, message_timeout: float = 60.0,
                 on_disconnect: Callable[[int], None] | None = None,
                 protocol_error: Callable[[str], bytes] | None = None,
                 tls: ssl.SSLContext | None = None, unix_path: str | None = None,
                 spin_s: float | None = 0.0, max_message: int | None = None,
                 limit_error: Callable[[str], bytes] | None = None,
                 tickets: Callable[[bytes], bytes | None] | None = None,
                 ticket_handler: TicketHandler | None = None, tenants=None,
                 on_connect: Callable[[int, bytes | None], None] | None = None,
                 between: Callable[[], None] | None = None,
                 quiet: Callable[[], bool] | None = None, after: Callable[[], None] | None = None) -> None:
        self._handler = handler
        self._after = after  # run once each reply is written (or its connection dropped): off the round trip
        self._quiet = quiet  # the reply just made only acknowledges its request (it may be held)
        self._tenants = tenants  # token hashes by key id, and the plain token (worker.tenants.Tenants)
        self._on_connect = on_connect  # (connection id, the key id its hello named) once authenticated
        self._between = between  # run on the serving thread after each wake-up (see wake())
        self._tickets = tickets if ticket_handler is not None else None
        self._ticket_handler = ticket_handler
        self._spin = Spin(spin_s)  # busy-poll for the next message before sleeping (None: auto)
        self._token = (token or "").encode()
        self._protocol = protocol
        self._max_frame = max_frame
        self._max_header = max_header
        self._max_message = max_message  # announced totals above it are read, dropped and refused
        self._limit_error = limit_error or protocol_error
        self._message_timeout = message_timeout
        self._on_disconnect = on_disconnect
        self._protocol_error = protocol_error
        self._tls = tls
        self.unix_path = unix_path
        if unix_path is not None:
            if tls is not None:
                raise ValueError("TLS is for TCP; a Unix socket is reachable only on this host")
            self._sock = _unix_listener(unix_path)
            self.address = (unix_path, -1)
        else:
            self._sock = socket.create_server((host, port), backlog=128)
            self.address = self._sock.getsockname()[:2]
        self._closing = threading.Event()
        self._next_id = 0
        self._ready: queue.SimpleQueue = queue.SimpleQueue()  # authenticated (cid, channel)
        self._wake_r, self._wake_w = socket.socketpair()
        self._channels: dict[int, FramedChannel] = {}
        self._stalled: dict[int, float] = {}  # connection -> when its unfinished message times out
        self._holding = Holding()

    @property
    def connections(self) -> int:
        """Authenticated connections open now."""
        return len(self._channels)

    # ------------------------------------------------------------------ accepting
    def _accept_loop(self) -> None:
        while not self._closing.is_set():
            try:
                conn, peer = self._sock.accept()
            except OSError:
                if self._closing.is_set():
                    break
                continue
            self._next_id += 1
            threading.Thread(target=self._authenticate, args=(self._next_id, conn, peer),
                             name=f"remotorch-hello-{self._next_id}", daemon=True).start()

    def _authenticate(self, cid: int, conn: socket.socket, peer) -> None:
        try:
            if conn.family != getattr(socket, "AF_UNIX", None):
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(30.0)
            if self._tls is not None:
                conn = wrap_server(self._tls, conn)
            if self._tenants is None:
                key, ticket, kid = accept_handshake(conn, self._token, self._protocol, self._tickets)
            else:
                key, ticket, kid = accept_handshake(conn, self._tenants.legacy_token, self._protocol,
                                                    self._tickets, self._tenants.secret)
        except AuthFailed as exc:
            log.warning("connection %d from %s refused: %s", cid, peer, exc)
            conn.close()
            return
        except (FramingError, OSError) as exc:
            log.debug("handshake with %s failed: %s", peer, exc)
            conn.close()
            return
        if ticket is not None:
            self._serve_ticket(cid, conn, key, ticket)
            return
        if self._on_connect is not None:
            self._on_connect(cid, kid)
        if self._tls is None:
            conn.setblocking(False)  # reads are polled; sends wait up to send_timeout themselves
        else:
            conn.settimeout(self._message_timeout)  # TLS: the channel switches to non-blocking per read
        self._ready.put((cid, FramedChannel(conn, key, role="server", max_frame=self._max_frame,
                                            max_header=self._max_header, max_message=self._max_message,
                                            send_timeout=self._message_timeout)))
        try:
            self._wake_w.send(b"\x00")
        except OSError:
            conn.close()

    def _serve_ticket(self, cid: int, conn: socket.socket, key: bytes, ticket: bytes) -> None:
        """A connection opened with a ticket carries ``Deliver`` messages, served on this thread.

        The first is under the ticket the hello presented; the handler checks
        the ticket each later one names (``ticket`` is None then). The
        connection closes when the peer closes it or stays silent longer
        than the message timeout. Off the serving loop on purpose: two
        workers sending to each other at the same time must not wait on
        each other's loops.
        """
        try:
            conn.settimeout(self._message_timeout)
            channel = FramedChannel(conn, key, role="server", max_frame=self._max_frame,
                                    max_header=self._max_header, max_message=self._max_message)
            first: bytes | None = ticket
            while not self._closing.is_set():
                header, frames, _ = channel.recv()
                reply, reply_frames = self._ticket_handler(first, channel.binding, header, frames)
                del frames
                channel.send(reply, reply_frames)
                first = None
        except (FramingError, MessageTooLarge, OSError) as exc:
            log.debug("ticket connection %d closed: %s", cid, exc)
        finally:
            conn.close()

    # ------------------------------------------------------------------- serving
    def serve_forever(self) -> None:
        """Serve until shutdown(); requests are handled on the calling thread."""
        threading.Thread(target=self._accept_loop, name="remotorch-accept", daemon=True).start()
        sel = selectors.DefaultSelector()
        sel.register(self._wake_r, selectors.EVENT_READ, None)
        try:
            while not self._closing.is_set():
                timeout = None
                if self._stalled:
                    timeout = max(0.0, min(self._stalled.values()) - time.monotonic())
                for key, mask in self._wait(sel, timeout):
                    if key.data is None:
                        self._wake_r.recv(4096)
                        self._adopt(sel)
                    elif key.data in self._channels:
                        if self._channels[key.data].sending:
                            self._write_more(sel, key.data)
                        else:
                            self._serve_one(sel, key.data)
                self._drop_stalled(sel)
                if self._between is not None:
                    self._between()
        finally:
            self._finish_writes()
            for cid in list(self._channels):
                self._drop(sel, cid)
            sel.close()

    def _finish_writes(self) -> None:
        """On shutdown: write out the replies still queued (each peer gets ``message_timeout``)."""
        for cid, channel in list(self._channels.items()):
            deadline = time.monotonic() + self._message_timeout
            try:
                while not channel.flush():
                    left = deadline - time.monotonic()
                    if left <= 0 or not select.select([], [channel.sock], [], left)[1]:
                        log.warning("connection %d: reply not taken before shutdown", cid)
                        break
            except OSError as exc:
                log.debug("connection %d closed while its reply was sent: %s", cid, exc)

    def _wait(self, sel: selectors.BaseSelector, timeout: float | None) -> list:
        """The selector's events, polled without sleeping first while the spin policy says so.

        Waking a sleeping process costs tens of microseconds (much more on a
        virtual machine, where an idle vCPU is halted); a client that sends
        its next request within the spin window finds the loop awake.
        """
        spin = self._spin
        if not spin.window:
            return sel.select(timeout)
        start = time.perf_counter()
        window = spin.budget()
        if window and (timeout is None or timeout > 0):
            found: list = []
            if poll_until(lambda: found.extend(sel.select(0)) or found, window):
                spin.waited(time.perf_counter() - start)
                return found
        events = sel.select(timeout)
        if events:
            spin.waited(time.perf_counter() - start)
        return events

    def _drop_stalled(self, sel: selectors.BaseSelector) -> None:
        """Close connections stalled over ``message_timeout``: mid-message, or not taking a reply."""
        now = time.monotonic()
        for cid, deadline in list(self._stalled.items()):
            if deadline <= now and cid in self._channels:
                what = "a reply waited to be read" if self._channels[cid].sending else "a message stalled"
                log.warning("connection %d dropped: %s for over %.0f s", cid, what, self._message_timeout)
                self._drop(sel, cid)

    def _write_more(self, sel: selectors.BaseSelector, cid: int) -> None:
        """Go on writing a reply the peer was slow to take; then serve what it sent meanwhile."""
        channel = self._channels[cid]
        try:
            if not channel.flush():
                # progress: the peer reads, if slowly; it gets message_timeout per stall, not per reply
                self._stalled[cid] = time.monotonic() + self._message_timeout
                return
        except OSError as exc:
            log.debug("connection %d closed while sending: %s", cid, exc)
            self._drop(sel, cid)
            return
        self._stalled.pop(cid, None)
        sel.modify(channel.sock, selectors.EVENT_READ, cid)
        if channel.readable:
            self._serve_one(sel, cid)

    def _adopt(self, sel: selectors.BaseSelector) -> None:
        while True:
            try:
                cid, channel = self._ready.get_nowait()
            except queue.Empty:
                return
            self._channels[cid] = channel
            sel.register(channel.sock, selectors.EVENT_READ, cid)

    def _serve_one(self, sel: selectors.BaseSelector, cid: int) -> None:
        """Take what a readable connection sent; answer each whole message in it.

        Reads never block: a message that arrives in pieces is assembled
        across wake-ups, so one slow or stalled peer delays nobody else. It
        only gets ``message_timeout`` to finish a message it has started.
        """
        channel = self._channels[cid]
        try:
            while True:
                try:
                    message = channel.poll()
                except FramingError as exc:
                    if self._protocol_error and not isinstance(exc, AuthFailed):
                        channel.send(self._protocol_error(str(exc)))
                    raise
                except MessageTooLarge as exc:  # read and dropped whole: answer it, keep serving
                    if self._limit_error is None:
                        raise
                    message = (None, None, 0)
                    reply, reply_frames = self._limit_error(str(exc)), []
                if message is None:
                    if channel.pending:
                        self._stalled.setdefault(cid, time.monotonic() + self._message_timeout)
                    else:
                        self._stalled.pop(cid, None)
                    return
                self._stalled.pop(cid, None)
                header, frames, _ = message
                del message
                if header is not None:
                    reply, reply_frames = self._handler(cid, header, frames)
                quiet = header is not None and self._quiet is not None and self._quiet()  # (a refusal: never)
                del header, frames
                after = self._after
                if channel.sock.gettimeout() != 0.0:  # TLS: written with the socket's timeout
                    channel.send(reply, reply_frames)
                    if after is not None:
                        after()
                else:
                    holding = self._holding
                    hold = quiet and holding.before(channel, cid, quiet)
                    channel.queue(reply, reply_frames)
                    del reply_frames
                    done = channel.flush()
                    if holding.corked:  # (none held: nothing to let out)
                        holding.after(channel, cid, hold, done)
                    if after is not None:
                        after()
                    if not done:  # the peer is not reading: serve others meanwhile
                        self._stalled[cid] = time.monotonic() + self._message_timeout
                        sel.modify(channel.sock, selectors.EVENT_WRITE, cid)
                        return
                if not channel.readable:  # nothing more already here: back to the selector
                    return
        except AuthFailed as exc:
            log.warning("connection %d dropped: %s", cid, exc)
        except (FramingError, MessageTooLarge, ConnectionError, OSError) as exc:
            log.debug("connection %d closed: %s", cid, exc)
        except MemoryError:  # a message too large to hold: drop its connection, keep serving
            log.warning("connection %d dropped: no memory to receive its message", cid)
        self._drop(sel, cid)

    def _drop(self, sel: selectors.BaseSelector, cid: int) -> None:
        if self._after is not None:  # (a reply not written: what follows its request still does)
            self._after()
        self._stalled.pop(cid, None)
        self._holding.forget(cid)
        channel = self._channels.pop(cid)
        try:
            sel.unregister(channel.sock)
        except (KeyError, ValueError):
            pass
        try:
            channel.sock.close()
        except OSError:
            pass
        if self._on_disconnect:
            self._on_disconnect(cid)

    def close_connection(self, cid: int) -> None:
        """Close one connection from any thread; the loop then drops it (and calls on_disconnect)."""
        channel = self._channels.get(cid)
        if channel is not None:
            try:
                channel.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def wake(self) -> None:
        """Wake the serving loop (it runs ``between`` then); safe from any thread or a signal handler."""
        try:
            self._wake_w.send(b"\x00")
        except OSError:
            pass

    def shutdown(self) -> None:
        """Stop accepting and serving; safe from any thread or a signal handler."""
        self._closing.set()
        for action in (lambda: self._sock.shutdown(socket.SHUT_RDWR), self._sock.close,
                       lambda: self._wake_w.send(b"\x00")):
            try:
                action()
            except OSError:
                pass
        if self.unix_path is not None:
            try:
                os.unlink(self.unix_path)
            except OSError:
                pass


def _unix_listener(path: str) -> socket.socket:
    """A listening Unix socket at ``path``, readable and writable by this user only.

    A socket file left by a worker that died is replaced; one that a live
    worker still answers on is not (``OSError``).
    """
    if os.path.exists(path):
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            raise OSError(f"{path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.settimeout(1.0)
            probe.connect(path)
        except OSError:
            os.unlink(path)  # nobody listens: a stale socket file
        else:
            raise OSError(f"a worker is already listening on {path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_mask = os.umask(0o177)  # the file is created by bind: owner read/write only
    try:
        sock.bind(path)
    except OSError:
        sock.close()
        raise
    finally:
        os.umask(old_mask)
    sock.listen(128)
    return sock
