"""The bytes of a framed message: its format, its keys, and writing it out.

Message on the wire::

    MAGIC(4) | seq u64 | nframes u32 | len u64 × nframes     (the prefix)
    | frame 0 (the header) | frame 1 … frame n-1 (raw buffers, never copied) | mac(32)

``mac = HMAC-SHA256(k, prefix | frame 0 | D)``. When the buffer frames total
at most 16 KiB, ``D`` is their bytes (one HMAC over the message); above
that, ``D`` is the concatenation of one 16-byte AES-GMAC tag per chunk: each
buffer frame is cut into chunks of 256 KiB (its last one shorter), and chunk
``c`` of the message (counted across its frames) is tagged under this
direction's GMAC key ``g`` with the nonce ``seq u64 | c u32``, unique per key.
GMAC runs at tens of GB/s (AES-NI and carry-less multiply), several times
Poly1305's speed and far above SHA-256's. Chunks are tagged just before they
go out (up to 1 MiB ahead, written in one call) and right after each comes
in, while they are still in the cache (one pass over memory, not two). ``k`` and ``g`` are this direction's keys, derived from the
session key that a mutual challenge–response on the shared token yields when
the connection opens (:mod:`remotorch.transport.handshake`). ``seq`` must
increase by one per message and direction, so a replayed or reordered message
is refused. A receiver verifies all of it before it returns anything
(docs/protocol.md §4).

:mod:`remotorch.transport.framing` is the channel that sends and receives
these messages (and the face of this module: import from there).
"""

from __future__ import annotations

import hmac
import socket
import struct
from collections.abc import Iterator, Sequence

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

MAGIC = b"RMT2"
_FIXED = struct.Struct("<4sQI")
_NONCE = struct.Struct("<QI")  # a chunk's GMAC nonce: the message's seq, the chunk's index in it
MAC_SIZE = 32
TAG_SIZE = 16
INLINE_MAC = 16 << 10  # buffer frames up to this total go into the HMAC itself
MAX_FRAMES = 65_536
_IOV_MAX = 512
_READ_BUFFER = 1 << 18
# One read at the start of a message takes at most this much: a whole small
# message (header and frames up to INLINE_MAC), but not the bulk of a large
# frame, which goes straight into its own buffer instead of through this one.
_SMALL_READ = INLINE_MAC + (4 << 10)
# Large frames move, and are tagged, in chunks of this size: each chunk is
# tagged right after it is received (or right before it is sent), while it is
# still in the cache. Chunk boundaries are part of the MAC (protocol.md §4.2).
_CHUNK = 256 << 10
# A large message is tagged this far ahead of what is written, and written in one sendmsg per this
# much: one call for a reply of a few chunks, not one per chunk (fewer wake-ups of the reader).
_SEND_AHEAD = 1 << 20


class FramingError(Exception):
    """The peer broke the framing (bad magic, MAC, sequence or sizes)."""


class AuthFailed(FramingError):
    """The challenge–response on the token failed, or a message's MAC or tag did."""


class MessageTooLarge(Exception):
    """A whole, authentic message over the receiver's total size limit, read and discarded.

    Not a framing error: the stream is still in step, so the receiver can
    answer it and go on.
    """


def _mac(key: bytes, *parts) -> bytes:
    return hmac.digest(key, b"".join(parts), "sha256")


def direction_keys(session_key: bytes, role: str) -> tuple[bytes, bytes]:
    """(send key, receive key) of one end: each direction has its own key."""
    c2s, s2c = _mac(session_key, b"client->server"), _mac(session_key, b"server->client")
    if role == "client":
        return c2s, s2c
    if role == "server":
        return s2c, c2s
    raise ValueError(f"role must be 'client' or 'server', not {role!r}")


def frames_key(key: bytes) -> AESGCM:
    """The GMAC of one direction's large buffer frames (its key derived from that direction's ``key``)."""
    return AESGCM(_mac(key, b"frames-gmac"))


def encode_message(key: bytes, seq: int, header: bytes, frames: Sequence = ()) -> Iterator:
    """The pieces of one message in wire order (large frames are not copied).

    A small message is one buffer. In a large one the buffer frames go in
    chunks of ``_CHUNK`` bytes, each tagged as it is taken (just before it is
    written: one pass over memory), then the MAC.
    """
    return _encoded(key, frames_key(key), seq, header, frames)[0]


def _encoded(key: bytes, gmac: AESGCM, seq: int, header: bytes, frames: Sequence) -> tuple[Iterator, int]:
    views = [memoryview(f).cast("B") for f in frames]
    sizes = [v.nbytes for v in views]
    n = 1 + len(views)
    head = _FIXED.pack(MAGIC, seq, n) + struct.pack(f"<{n}Q", len(header), *sizes) + header
    total = sum(sizes)
    if total <= INLINE_MAC:
        body = b"".join([head, *views]) if views else head
        return iter((body + hmac.digest(key, body, "sha256"),)), len(head) + total + MAC_SIZE
    return _streamed(key, gmac, seq, head, views), len(head) + total + MAC_SIZE


def message_size(header: bytes, frames: Sequence) -> int:
    """Bytes one message takes on the wire."""
    return _FIXED.size + 8 * (1 + len(frames)) + len(header) + sum(memoryview(f).nbytes for f in frames) + MAC_SIZE


def send_all(sock: socket.socket, buffers: Sequence) -> int:
    """Scatter-gather send of every buffer (no joining copies); returns bytes sent."""
    views = [v for v in (memoryview(b).cast("B") for b in buffers) if v.nbytes]
    total = sum(v.nbytes for v in views)
    while views:
        _consume(views, sock.sendmsg(views[:_IOV_MAX]))
    return total


def _consume(views: list, sent: int) -> None:
    """Drop the first ``sent`` bytes from a list of memoryviews (what a partial ``sendmsg`` wrote)."""
    while sent and views:
        if sent >= views[0].nbytes:
            sent -= views[0].nbytes
            views.pop(0)
        else:
            views[0] = views[0][sent:]
            sent = 0


def _batches(pieces):
    """Pieces of a message grouped into lists of memoryviews of about ``_SEND_AHEAD`` bytes (one ``sendmsg`` each)."""
    batch, batched = [], 0
    for piece in pieces:
        view = memoryview(piece).cast("B")
        if not view.nbytes:
            continue
        batch.append(view)
        batched += view.nbytes
        if batched >= _SEND_AHEAD:
            yield batch
            batch, batched = [], 0
    if batch:
        yield batch


def _streamed(key: bytes, gmac: AESGCM, seq: int, head: bytes, views: list):
    """The pieces of a large message in wire order, tagging each chunk as it is taken."""
    tags, nonce = [], _NONCE.pack
    yield head
    for view in views:
        for at in range(0, view.nbytes, _CHUNK):
            piece = view[at:at + _CHUNK]
            tags.append(gmac.encrypt(nonce(seq, len(tags)), b"", piece))
            yield piece
    yield hmac.digest(key, b"".join([head, *tags]), "sha256")
