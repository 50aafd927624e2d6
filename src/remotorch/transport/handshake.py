"""Opening a connection: a mutual challenge–response on the token, yielding the session key.

Both ends send a hello (magic, protocol version, 32 random bytes); each proves
it knows the secret by a MAC over both nonces, the worker first, so a client
never talks to a worker that does not share its token, and the token itself
never crosses the wire. The session key then keys every message's MAC
(:mod:`remotorch.transport.framing`).

A client's hello (``RMTK``) is followed by the 16-byte key id of its token
(:func:`key_id`): the worker, which may serve several tenants and stores only
their tokens' SHA-256, picks the tenant by it, and the proofs are made with
that hash. A hello of another worker presenting a one-time ticket (``RMTT``)
is followed by the ticket's id, its secret proved instead. The plain hello
(``RMTH``) proves the raw token, for a worker with one ``--token``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
from collections.abc import Callable

import numpy as np

from .framing import MAC_SIZE, AuthFailed, FramingError, _mac

HELLO = b"RMTH"
KEYED_HELLO = b"RMTK"  # a client naming its token by key id; proofs made with the token's SHA-256
TICKET_HELLO = b"RMTT"  # a worker presenting another worker's one-time ticket instead of the token
_HELLO = struct.Struct("<4sI32s")
TICKET_ID_SIZE = 16
KEY_ID_SIZE = 16


def token_hash(token: str | bytes) -> bytes:
    """The SHA-256 of a token: what a worker stores, and the secret a keyed hello proves."""
    return hashlib.sha256(token if isinstance(token, bytes) else token.encode()).digest()


def key_id(secret: bytes) -> bytes:
    """The key id a keyed hello names a token by (from its hash; reveals neither)."""
    return hashlib.sha256(b"remotorch key id\x00" + secret).digest()[:KEY_ID_SIZE]


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


def _derive(token: bytes, cn: bytes, sn: bytes) -> tuple[bytes, bytes, bytes]:
    return (_mac(token, b"server", cn, sn), _mac(token, b"client", cn, sn), _mac(token, b"session", cn, sn))


def client_handshake(sock: socket.socket, token: bytes, version: int, ticket_id: bytes | None = None) -> bytes:
    """Prove the token to the server and make it prove it back; returns the session key.

    With ``ticket_id``, ``token`` is that ticket's secret: the hello names the
    ticket (its id is not secret), and the proofs are made with the secret.
    """
    cn = os.urandom(32)
    if ticket_id is None:
        token = token_hash(token)  # what the proofs are made with: the worker stores only the hash
        sock.sendall(_HELLO.pack(KEYED_HELLO, version, cn) + key_id(token))
    else:
        if len(ticket_id) != TICKET_ID_SIZE:
            raise ValueError("a ticket id is 16 bytes")
        sock.sendall(_HELLO.pack(TICKET_HELLO, version, cn) + ticket_id)
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
    """Server side of :func:`client_handshake` for one token; raises AuthFailed on a bad proof."""
    return accept_handshake(sock, token, version)[0]


def accept_handshake(sock: socket.socket, token: bytes | None, version: int,
                     tickets: Callable[[bytes], bytes | None] | None = None,
                     keys: Callable[[bytes], bytes | None] | None = None) -> tuple[bytes, bytes | None, bytes | None]:
    """Server side of :func:`client_handshake`: (session key, the ticket id the peer presented or None,
    the key id a keyed hello named or None).

    ``token``: the raw token a plain hello proves (None: plain hellos fail).
    ``keys(key_id)`` gives the token hash a keyed hello's key id names (None:
    no such tenant); without it, the only key is ``token``'s. ``tickets(ticket_id)``
    gives an outstanding ticket's secret (None: no such ticket). A peer naming
    an unknown ticket or key is answered as one with a wrong token (a proof
    made with a random secret), so the answer tells nothing.
    """
    magic, cversion, cn = _HELLO.unpack(recv_exact(sock, _HELLO.size).tobytes())
    ticket_id = kid = None
    if magic == KEYED_HELLO:
        kid = recv_exact(sock, KEY_ID_SIZE).tobytes()
        if keys is None:
            mine = token_hash(token) if token is not None else None
            keys = lambda k: mine if mine is not None and hmac.compare_digest(k, key_id(mine)) else None  # noqa: E731
        token = keys(kid) or os.urandom(32)
    elif magic == TICKET_HELLO and tickets is not None:
        ticket_id = recv_exact(sock, TICKET_ID_SIZE).tobytes()
        token = tickets(ticket_id) or os.urandom(32)
    elif magic != HELLO:
        raise FramingError("peer did not open with a remotorch hello")
    elif token is None:
        token = os.urandom(32)  # no plain token here (tenants only): answered as a wrong one
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
    return key, ticket_id, kid
