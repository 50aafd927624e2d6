"""Length-prefixed, authenticated frames over a stream socket.

Message on the wire::

    prefix  = MAGIC(4) | seq u64 | nframes u32 | len u64 × nframes | mac(32)
    payload = frame 0 (header) | frame 1 … (raw buffers, never copied)

``mac = HMAC-SHA256(session_key, prefix-without-mac | frame 0)`` and ``seq``
must increase by one per message and direction, so a replayed or reordered
message is refused before anything is decoded. The session key comes from a
mutual challenge–response on the shared token when the connection opens
(see :func:`client_handshake`). Buffer frames are covered by their lengths
in the MAC; see docs/protocol.md for what that does and does not protect.
"""

from __future__ import annotations

import hmac
import os
import socket
import struct
from collections.abc import Sequence

import numpy as np

MAGIC = b"RMT1"
HELLO = b"RMTH"
_FIXED = struct.Struct("<4sQI")
_HELLO = struct.Struct("<4sI32s")
MAC_SIZE = 32
MAX_FRAMES = 65_536
_IOV_MAX = 512
_READ_BUFFER = 1 << 18
_COALESCE = 1 << 16  # below this, one joined send beats scatter-gather


class FramingError(Exception):
    """The peer broke the framing (bad magic, MAC, sequence or sizes)."""


class AuthFailed(FramingError):
    """The challenge–response on the token failed."""


def _mac(key: bytes, *parts) -> bytes:
    return hmac.digest(key, b"".join(parts), "sha256")


def recv_exact(sock: socket.socket, n: int) -> np.ndarray:
    """Receive exactly n bytes into a fresh writable buffer (no zero-fill, no copy)."""
    buf = np.empty(n, dtype=np.uint8)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("connection closed by peer")
        got += k
    return buf


def send_all(sock: socket.socket, buffers: Sequence) -> int:
    """Scatter-gather send of every buffer (no joining copies); returns bytes sent."""
    views = [v for v in (memoryview(b).cast("B") for b in buffers) if v.nbytes]
    total = sum(v.nbytes for v in views)
    while views:
        sent = sock.sendmsg(views[:_IOV_MAX])
        while sent and views:
            if sent >= views[0].nbytes:
                sent -= views[0].nbytes
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0
    return total


class FramedChannel:
    """One authenticated message stream over a connected socket.

    Small messages are read through one reusable buffer (about one syscall a
    message); large frames are received straight into their own buffers.
    """

    def __init__(self, sock: socket.socket, key: bytes, *, max_frame: int, max_header: int) -> None:
        self.sock = sock
        self._key = key
        self._send_seq = 0
        self._recv_seq = 0
        self.max_frame = max_frame
        self.max_header = max_header
        self._buf = bytearray(_READ_BUFFER)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0

    def send(self, header: bytes, frames: Sequence = ()) -> int:
        """Send header + frames as one message; returns bytes written."""
        n = 1 + len(frames)
        lengths = [len(header)] + [memoryview(f).nbytes for f in frames]
        prefix = _FIXED.pack(MAGIC, self._send_seq, n) + struct.pack(f"<{n}Q", *lengths)
        self._send_seq += 1
        mac = _mac(self._key, prefix, header)
        if n == 1 or sum(lengths) < _COALESCE:
            data = b"".join([prefix, mac, header, *frames])
            self.sock.sendall(data)
            return len(data)
        return send_all(self.sock, [prefix + mac, header, *frames])

    @property
    def buffered(self) -> bool:
        """True when bytes of a further message are already read."""
        return self._end > self._start

    def _fill(self, need: int) -> None:
        """Make at least ``need`` bytes available in the read buffer."""
        if self._end - self._start >= need:
            return
        if need > len(self._buf) - self._start:
            rest = self._end - self._start
            if need > len(self._buf):
                grown = bytearray(need)
                grown[:rest] = self._view[self._start:self._end]
                self._buf, self._view = grown, memoryview(grown)
            else:
                self._view[:rest] = self._view[self._start:self._end]
            self._start, self._end = 0, rest
        while self._end - self._start < need:
            k = self.sock.recv_into(self._view[self._end:])
            if k == 0:
                raise ConnectionError("connection closed by peer")
            self._end += k

    def _take(self, n: int) -> bytes:
        self._fill(n)
        out = bytes(self._view[self._start:self._start + n])
        self._start += n
        return out

    def _take_frame(self, n: int) -> np.ndarray:
        buf = np.empty(n, dtype=np.uint8)
        have = min(n, self._end - self._start)
        if have:
            buf[:have] = np.frombuffer(self._view[self._start:self._start + have], dtype=np.uint8)
            self._start += have
        if have < n:
            if n - have < _READ_BUFFER // 2:
                self._fill(n - have)
                buf[have:] = np.frombuffer(self._view[self._start:self._start + n - have], dtype=np.uint8)
                self._start += n - have
            else:
                view, got = memoryview(buf), have
                while got < n:
                    k = self.sock.recv_into(view[got:], n - got)
                    if k == 0:
                        raise ConnectionError("connection closed by peer")
                    got += k
        return buf

    def recv(self) -> tuple[bytes, list[np.ndarray], int]:
        """Receive one message; verifies MAC and sequence before returning anything."""
        fixed = self._take(_FIXED.size)
        magic, seq, n = _FIXED.unpack(fixed)
        if magic != MAGIC or not 1 <= n <= MAX_FRAMES:
            raise FramingError("bad message prefix")
        lens_raw = self._take(8 * n)
        lengths = struct.unpack(f"<{n}Q", lens_raw)
        if lengths[0] > self.max_header or any(x > self.max_frame for x in lengths[1:]):
            raise FramingError(f"message frame over the size limit ({max(lengths)} bytes)")
        mac = self._take(MAC_SIZE)
        header = self._take(lengths[0])
        if not hmac.compare_digest(mac, _mac(self._key, fixed, lens_raw, header)):
            raise AuthFailed("message authentication failed")
        if seq != self._recv_seq:
            raise AuthFailed(f"message out of sequence (got {seq}, expected {self._recv_seq})")
        self._recv_seq += 1
        frames = [self._take_frame(k) for k in lengths[1:]]
        return header, frames, _FIXED.size + len(lens_raw) + MAC_SIZE + sum(lengths)


def _derive(token: bytes, cn: bytes, sn: bytes) -> tuple[bytes, bytes, bytes]:
    return (_mac(token, b"server", cn, sn), _mac(token, b"client", cn, sn), _mac(token, b"session", cn, sn))


def client_handshake(sock: socket.socket, token: bytes, version: int) -> bytes:
    """Prove the token to the server and make it prove it back; returns the session key."""
    cn = os.urandom(32)
    sock.sendall(_HELLO.pack(HELLO, version, cn))
    magic, sversion, sn = _HELLO.unpack(recv_exact(sock, _HELLO.size).tobytes())
    if magic != HELLO:
        raise FramingError("peer is not a remotorch worker")
    if sversion != version:
        raise FramingError(f"worker speaks protocol {sversion}, this client {version}")
    server_proof = recv_exact(sock, MAC_SIZE).tobytes()
    expect_server, client_proof, key = _derive(token, cn, sn)
    if not hmac.compare_digest(server_proof, expect_server):
        sock.sendall(b"\x00" * MAC_SIZE)
        raise AuthFailed("the worker does not share this token")
    sock.sendall(client_proof)
    if recv_exact(sock, 1).tobytes() != b"\x01":
        raise AuthFailed("the worker refused this token")
    return key


def server_handshake(sock: socket.socket, token: bytes, version: int) -> bytes:
    """Server side of :func:`client_handshake`; raises AuthFailed on a bad proof."""
    magic, cversion, cn = _HELLO.unpack(recv_exact(sock, _HELLO.size).tobytes())
    if magic != HELLO:
        raise FramingError("peer did not open with a remotorch hello")
    sn = os.urandom(32)
    server_proof, expect_client, key = _derive(token, cn, sn)
    sock.sendall(_HELLO.pack(HELLO, version, sn) + server_proof)
    if cversion != version:
        raise FramingError(f"client speaks protocol {cversion}, this worker {version}")
    client_proof = recv_exact(sock, MAC_SIZE).tobytes()
    if not hmac.compare_digest(client_proof, expect_client):
        sock.sendall(b"\x00")
        raise AuthFailed("client failed the token challenge")
    sock.sendall(b"\x01")
    return key
