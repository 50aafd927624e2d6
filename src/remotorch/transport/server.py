"""Server side of the TCP transport: accept, authenticate, hand messages to a handler.

One thread per connection; the handler does the work. A connection that
breaks the framing or fails authentication is closed; the server goes on.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Sequence

from .framing import AuthFailed, FramedChannel, FramingError, server_handshake

log = logging.getLogger(__name__)

# handler(connection_id, header, frames) -> (reply_header, reply_frames)
Handler = Callable[[int, bytes, list], tuple[bytes, Sequence]]


class TcpServer:
    """Serves a :data:`Handler` on host:port until :meth:`shutdown`."""

    def __init__(self, handler: Handler, host: str, port: int, token: str | None, *, protocol: int,
                 max_frame: int, max_header: int = 64 << 20,
                 on_disconnect: Callable[[int], None] | None = None,
                 protocol_error: Callable[[str], bytes] | None = None) -> None:
        self._handler = handler
        self._token = (token or "").encode()
        self._protocol = protocol
        self._max_frame = max_frame
        self._max_header = max_header
        self._on_disconnect = on_disconnect
        self._protocol_error = protocol_error
        self._sock = socket.create_server((host, port), reuse_port=False, backlog=128)
        self.address = self._sock.getsockname()[:2]
        self._closing = threading.Event()
        self._next_id = 0
        self._conns: dict[int, socket.socket] = {}
        self._lock = threading.Lock()

    def serve_forever(self) -> None:
        """Accept connections until shutdown() is called."""
        while not self._closing.is_set():
            try:
                conn, peer = self._sock.accept()
            except OSError:
                if self._closing.is_set():
                    break
                continue
            with self._lock:
                self._next_id += 1
                cid = self._next_id
                self._conns[cid] = conn
            threading.Thread(target=self._serve_connection, args=(cid, conn, peer),
                             name=f"remotorch-conn-{cid}", daemon=True).start()

    def _serve_connection(self, cid: int, conn: socket.socket, peer) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            conn.settimeout(30.0)
            key = server_handshake(conn, self._token, self._protocol)
            conn.settimeout(None)
            channel = FramedChannel(conn, key, max_frame=self._max_frame, max_header=self._max_header)
            log.debug("connection %d from %s authenticated", cid, peer)
            while not self._closing.is_set():
                try:
                    header, frames, _ = channel.recv()
                except FramingError as exc:
                    if self._protocol_error and not isinstance(exc, AuthFailed):
                        channel.send(self._protocol_error(str(exc)))
                    raise
                reply, reply_frames = self._handler(cid, header, frames)
                del header, frames
                channel.send(reply, reply_frames)
        except AuthFailed as exc:
            log.warning("connection %d from %s refused: %s", cid, peer, exc)
        except (FramingError, ConnectionError, OSError) as exc:
            log.debug("connection %d from %s closed: %s", cid, peer, exc)
        finally:
            with self._lock:
                self._conns.pop(cid, None)
            try:
                conn.close()
            except OSError:
                pass
            if self._on_disconnect:
                self._on_disconnect(cid)

    @property
    def connections(self) -> int:
        """Connections open now (each is one session)."""
        return len(self._conns)

    def shutdown(self) -> None:
        """Stop accepting and close every connection."""
        self._closing.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in accept()
        except OSError:
            pass
        try:
            self._sock.close()
        except OSError:
            pass
        with self._lock:
            conns = list(self._conns.values())
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
