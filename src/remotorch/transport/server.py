"""Server side of the TCP transport: accept, authenticate, hand messages to a handler.

Handshakes run in short-lived threads (so a peer that stalls before proving
the token cannot hold anything up). Authenticated connections are then served
by one selector loop on the thread that calls :meth:`TcpServer.serve_forever`
(the worker's main thread): each request is read, handled and answered there,
with no hand-off between threads on the hot path. PyTorch's CPU kernels also
run markedly slower from secondary threads, so the graphs run where they are
fastest, one at a time.
"""

from __future__ import annotations

import logging
import queue
import selectors
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
                 max_frame: int, max_header: int = 64 << 20, message_timeout: float = 60.0,
                 on_disconnect: Callable[[int], None] | None = None,
                 protocol_error: Callable[[str], bytes] | None = None) -> None:
        self._handler = handler
        self._token = (token or "").encode()
        self._protocol = protocol
        self._max_frame = max_frame
        self._max_header = max_header
        self._message_timeout = message_timeout
        self._on_disconnect = on_disconnect
        self._protocol_error = protocol_error
        self._sock = socket.create_server((host, port), backlog=128)
        self.address = self._sock.getsockname()[:2]
        self._closing = threading.Event()
        self._next_id = 0
        self._ready: queue.SimpleQueue = queue.SimpleQueue()  # authenticated (cid, channel)
        self._wake_r, self._wake_w = socket.socketpair()
        self._channels: dict[int, FramedChannel] = {}

    @property
    def connections(self) -> int:
        """Authenticated connections open now (each is one session)."""
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
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(30.0)
            key = server_handshake(conn, self._token, self._protocol)
        except AuthFailed as exc:
            log.warning("connection %d from %s refused: %s", cid, peer, exc)
            conn.close()
            return
        except (FramingError, OSError) as exc:
            log.debug("handshake with %s failed: %s", peer, exc)
            conn.close()
            return
        conn.settimeout(self._message_timeout)
        self._ready.put((cid, FramedChannel(conn, key, role="server", max_frame=self._max_frame,
                                                   max_header=self._max_header)))
        try:
            self._wake_w.send(b"\x00")
        except OSError:
            conn.close()

    # ------------------------------------------------------------------- serving
    def serve_forever(self) -> None:
        """Serve until shutdown(); requests are handled on the calling thread."""
        threading.Thread(target=self._accept_loop, name="remotorch-accept", daemon=True).start()
        sel = selectors.DefaultSelector()
        sel.register(self._wake_r, selectors.EVENT_READ, None)
        try:
            while not self._closing.is_set():
                for key, _ in sel.select():
                    if key.data is None:
                        self._wake_r.recv(4096)
                        self._adopt(sel)
                    else:
                        self._serve_one(sel, key.data)
        finally:
            for cid in list(self._channels):
                self._drop(sel, cid)
            sel.close()

    def _adopt(self, sel: selectors.BaseSelector) -> None:
        while True:
            try:
                cid, channel = self._ready.get_nowait()
            except queue.Empty:
                return
            self._channels[cid] = channel
            sel.register(channel.sock, selectors.EVENT_READ, cid)

    def _serve_one(self, sel: selectors.BaseSelector, cid: int) -> None:
        channel = self._channels[cid]
        try:
            while True:  # also drain messages already sitting in the channel's buffer
                try:
                    header, frames, _ = channel.recv()
                except FramingError as exc:
                    if self._protocol_error and not isinstance(exc, AuthFailed):
                        channel.send(self._protocol_error(str(exc)))
                    raise
                reply, reply_frames = self._handler(cid, header, frames)
                del header, frames
                channel.send(reply, reply_frames)
                if not channel.buffered:
                    return
        except AuthFailed as exc:
            log.warning("connection %d dropped: %s", cid, exc)
        except (FramingError, ConnectionError, OSError) as exc:
            log.debug("connection %d closed: %s", cid, exc)
        self._drop(sel, cid)

    def _drop(self, sel: selectors.BaseSelector, cid: int) -> None:
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

    def shutdown(self) -> None:
        """Stop accepting and serving; safe from any thread or a signal handler."""
        self._closing.set()
        for action in (lambda: self._sock.shutdown(socket.SHUT_RDWR), self._sock.close,
                       lambda: self._wake_w.send(b"\x00")):
            try:
                action()
            except OSError:
                pass
