"""The client's side of failures: peers that are not remotorch workers, or that stop answering.

These peers are deliberately broken, so they are small sockets in a thread
(a real worker never behaves like this); the client under test is the real
Session and TcpTransport.
"""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest
import torch

import remotorch
from remotorch.codec import messages as m
from remotorch.errors import (AuthenticationError, ProtocolError, RemoteFallbackWarning,
                              WorkerUnavailableError)
from remotorch.transport import framing, handshake

from conftest import TOKEN


class Peer:
    """A one-purpose TCP listener on loopback; ``behave(conn)`` runs for each connection."""

    def __init__(self, behave) -> None:
        self._behave = behave
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"tcp://127.0.0.1:{self._sock.getsockname()[1]}"
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self._conns.append(conn)
            threading.Thread(target=self._run, args=(conn,), daemon=True).start()

    def _run(self, conn: socket.socket) -> None:
        try:
            self._behave(conn)
        except OSError:
            pass

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        for c in self._conns:
            try:
                c.close()
            except OSError:
                pass


@pytest.fixture
def peer():
    made: list[Peer] = []

    def make(behave) -> Peer:
        p = Peer(behave)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def http_server(conn: socket.socket) -> None:
    conn.recv(1024)
    conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n" + b"\x00" * 100)
    time.sleep(0.5)
    conn.close()


def hang_up(conn: socket.socket) -> None:
    conn.close()


def silent(conn: socket.socket) -> None:
    time.sleep(5)


def other_version(conn: socket.socket) -> None:
    handshake.recv_exact(conn, 40)
    conn.sendall(struct.pack("<4sI32s", handshake.HELLO, m.PROTOCOL_VERSION + 1, b"\x00" * 32) + b"\x00" * 32)
    time.sleep(0.5)


def handshake_then_silence(conn: socket.socket) -> None:
    handshake.server_handshake(conn, TOKEN.encode(), m.PROTOCOL_VERSION)
    time.sleep(5)


def handshake_then_bad_mac(conn: socket.socket) -> None:
    key = handshake.server_handshake(conn, TOKEN.encode(), m.PROTOCOL_VERSION)
    channel = framing.FramedChannel(conn, key, role="server", max_frame=1 << 20, max_header=1 << 20)
    channel.recv()
    framing.FramedChannel(conn, b"k" * 32, role="server", max_frame=1, max_header=1).send(m.encode(m.Ok()))
    time.sleep(0.5)


def handshake_then_garbage_reply(conn: socket.socket) -> None:
    key = handshake.server_handshake(conn, TOKEN.encode(), m.PROTOCOL_VERSION)
    channel = framing.FramedChannel(conn, key, role="server", max_frame=1 << 20, max_header=1 << 20)
    channel.recv()
    channel.send(b"\xc1 not msgpack")
    time.sleep(0.5)


def handshake_then_tampered_frames(conn: socket.socket) -> None:
    """A reply whose header MAC is right but whose buffer frame was altered in flight."""
    key = handshake.server_handshake(conn, TOKEN.encode(), m.PROTOCOL_VERSION)
    channel = framing.FramedChannel(conn, key, role="server", max_frame=1 << 20, max_header=1 << 20)
    channel.recv()
    send_key, _ = framing.direction_keys(key, "server")
    parts = framing.encode_message(send_key, 0, m.encode(m.EchoReply()), [b"\x00" * (framing.INLINE_MAC + 1)])
    message = bytearray(b"".join(bytes(p) for p in parts))
    message[-framing.MAC_SIZE - 1] ^= 0x01  # last byte of the frame
    conn.sendall(bytes(message))
    time.sleep(0.5)


CASES = [
    (http_server, ProtocolError),
    (hang_up, WorkerUnavailableError),
    (silent, WorkerUnavailableError),
    (other_version, ProtocolError),
    (handshake_then_silence, WorkerUnavailableError),
    (handshake_then_bad_mac, AuthenticationError),
    (handshake_then_tampered_frames, AuthenticationError),
    (handshake_then_garbage_reply, ProtocolError),
]


@pytest.mark.parametrize("behave, error", CASES, ids=[c[0].__name__ for c in CASES])
def test_broken_peer_gives_a_typed_error(peer, behave, error):
    p = peer(behave)
    session = remotorch.Session(p.url, token=TOKEN, connect_timeout=1.0, timeout=1.0, retry_after=0.0)
    try:
        start = time.monotonic()
        with pytest.raises(error):
            session.health()
        assert time.monotonic() - start < 10
    finally:
        session.close()


@pytest.mark.parametrize("behave", [http_server, handshake_then_silence], ids=["http", "silent"])
def test_broken_peer_with_local_fallback(peer, behave):
    p = peer(behave)
    session = remotorch.Session(p.url, token=TOKEN, connect_timeout=1.0, timeout=1.0)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).eval()
        compiled = remotorch.compile(model, session=session, fallback="local")
        x = torch.randn(2, 4)
        with pytest.warns(RemoteFallbackWarning), torch.no_grad():
            assert torch.equal(compiled(x), model(x))
        assert session.stats()["fallbacks"] == 1
    finally:
        session.close()


def test_back_off_after_a_failure_then_retry(peer):
    """After a failure the session does not hammer the address; after the back-off it tries again."""
    p = peer(hang_up)
    session = remotorch.Session(p.url, token=TOKEN, connect_timeout=1.0, retry_after=0.5)
    try:
        with pytest.raises(WorkerUnavailableError):
            session.health()
        with pytest.raises(WorkerUnavailableError, match="not retrying"):
            session.health()
        time.sleep(0.6)
        with pytest.raises(WorkerUnavailableError) as info:
            session.health()
        assert "not retrying" not in str(info.value)
    finally:
        session.close()


def test_bad_url_is_refused():
    with pytest.raises(ValueError):
        remotorch.transport.TcpTransport("http://127.0.0.1:1", TOKEN, protocol=m.PROTOCOL_VERSION)
    with pytest.raises(ValueError):
        remotorch.transport.TcpTransport("tcp://127.0.0.1", TOKEN, protocol=m.PROTOCOL_VERSION)
