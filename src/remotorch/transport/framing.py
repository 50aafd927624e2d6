"""Length-prefixed, authenticated frames over a stream socket.

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

``_cframing.c`` does the same in C, byte for byte; a :class:`FramedChannel` on
a plain socket uses it where it is built (``REMOTORCH_FRAMING=python`` turns it
off), and this module is then only its set-up and the fallback.
"""

from __future__ import annotations

import hmac
import importlib
import os
import select
import socket
import ssl
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
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


def _compiled():
    """The compiled hot path (``_cframing``), or None: not built, or ``REMOTORCH_FRAMING=python``.

    It speaks the same bytes as this module (tests/unit/test_framing.py runs
    both against each other); its constants must agree with these.
    """
    if os.environ.get("REMOTORCH_FRAMING", "").lower() == "python":
        return None
    try:
        _cframing = importlib.import_module(f"{__package__}._cframing")
    except ImportError:
        return None
    if (_cframing.MAGIC.encode(), _cframing.INLINE_MAC, _cframing.CHUNK, _cframing.MAC_SIZE, _cframing.MAX_FRAMES,
            _cframing.SMALL_READ, _cframing.SEND_AHEAD) != (MAGIC, INLINE_MAC, _CHUNK, MAC_SIZE, MAX_FRAMES,
                                                            _SMALL_READ, _SEND_AHEAD):
        return None  # built from another version of the format: never mix the two
    # large frames go into numpy's memory, as here: it asks for huge pages (a 256 MB frame faults in
    # 128 pages, not 65,536)
    _cframing.configure(FramingError, AuthFailed, MessageTooLarge, lambda n: np.empty(n, dtype=np.uint8))
    return _cframing


_C = _compiled()


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


@dataclass
class _Partial:
    """A large message being received: its prefix and header, and how far its frames got."""

    seq: int
    head: int  # bytes of prefix before the header in ``signed``
    signed: bytes  # prefix and header, as received
    lengths: tuple  # the buffer frames' lengths
    frames: list  # one uninitialized buffer per buffer frame (none for a message being discarded)
    tags: list  # the chunk tags so far, one per chunk as it completes
    index: int = 0  # frame being filled
    got: int = 0  # bytes of it received
    tagged: int = 0  # bytes of it tagged (a multiple of _CHUNK until the frame is complete)
    scratch: bytearray | None = None  # an over-limit message: each chunk gathered here, tagged, dropped


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


class FramedChannel:
    """One authenticated message stream over a connected socket.

    ``role`` is ``"client"`` or ``"server"``: it picks this end's send and
    receive keys. Small messages are read through one reusable buffer (about
    one syscall a message); large frames are received straight into their
    own buffers.
    """

    def __init__(self, sock: socket.socket, key: bytes, *, role: str, max_frame: int, max_header: int,
                 send_timeout: float | None = None, max_message: int | None = None, recv_seq: int = 0,
                 compiled: bool | None = None) -> None:
        """``recv_seq``: the sequence number the first message received must carry (0 on a new connection).

        ``compiled``: use the compiled hot path (True: it must be there;
        None: where it is built and the socket is a plain one, not TLS).
        """
        self.sock = sock
        self.send_timeout = send_timeout  # for a non-blocking socket: how long a send may wait
        self._send_key, self._recv_key = direction_keys(key, role)
        # names this connection to both ends (a proof made for it is worthless on any other); not a key
        self.binding = _mac(key, b"binding")
        self._send_seq = 0
        self._recv_seq = recv_seq
        self._core = None
        if compiled is None:
            compiled = _C is not None and type(sock) is socket.socket
        elif compiled and (_C is None or type(sock) is not socket.socket):
            raise RuntimeError("the compiled framing needs the built extension and a plain socket")
        if compiled:
            # the same methods, in C (the instance's own attributes: no Python frame per call)
            self._core = core = _C.Core(sock, self._send_key, self._recv_key, _mac(self._send_key, b"frames-gmac"),
                                        _mac(self._recv_key, b"frames-gmac"), max_frame, max_header, max_message,
                                        send_timeout, recv_seq)
            self.send, self.queue, self.flush, self.recv, self.poll = \
                core.send, core.queue, core.flush, core.recv, core.poll
        self.max_frame = max_frame
        self.max_header = max_header
        # A message whose prefix announces more than this in all is read into the
        # read buffer and dropped (nothing allocated for it), then refused.
        self.max_message = max_message
        # the Python path's read buffer and GMAC keys (the compiled one keeps its own)
        self._buf = bytearray(0 if compiled else _READ_BUFFER)
        self._view = memoryview(self._buf)
        self._send_gmac = self._recv_gmac = None
        if not compiled:
            self._send_gmac, self._recv_gmac = frames_key(self._send_key), frames_key(self._recv_key)
        self._start = 0
        self._end = 0
        self._partial: _Partial | None = None
        self._out = None  # batches of the message being sent (an iterator), or None
        self._out_buf: list | None = None  # pieces taken from it and not yet written

    def send(self, header: bytes, frames: Sequence = (), progress: Callable[[int], None] | None = None) -> int:
        """Send header + frames as one message, waiting until it is written; returns its size.

        ``progress(n)`` is called after each piece with the bytes it took (a
        blocking socket; a non-blocking one calls it once, at the end).
        On a non-blocking socket it waits for room up to ``send_timeout``.
        A serving loop that must not wait uses :meth:`queue` and
        :meth:`flush` instead.
        """
        size = self.queue(header, frames)
        if self.sock.gettimeout() != 0.0:
            batches, self._out = self._out, None
            for batch in batches:
                sent = send_all(self.sock, batch)
                if progress is not None:
                    progress(sent)
            return size
        deadline = None if self.send_timeout is None else time.monotonic() + self.send_timeout
        while not self.flush():
            left = None if deadline is None else deadline - time.monotonic()
            if (left is not None and left <= 0) or not select.select([], [self.sock], [], left)[1]:
                self._out = self._out_buf = None
                raise socket.timeout("the peer did not take the message in time")
        if progress is not None:
            progress(size)
        return size

    def queue(self, header: bytes, frames: Sequence = ()) -> int:
        """Make header + frames the message to send next; returns its size on the wire.

        Nothing is written yet: :meth:`flush` (or :meth:`send`) writes it.
        A small message is one buffer. A large one streams: the buffer frames
        go in chunks of ``_CHUNK`` bytes, each tagged just before it is
        written (one pass over memory), and the MAC follows.
        """
        if self._out is not None:
            raise RuntimeError("the previous message is not sent yet")
        seq = self._send_seq
        self._send_seq += 1
        pieces, size = _encoded(self._send_key, self._send_gmac, seq, header, frames)
        self._out = _batches(pieces)
        return size

    @property
    def compiled(self) -> bool:
        """True when this channel runs on the compiled hot path."""
        return self._core is not None

    @property
    def sending(self) -> bool:
        """True while a queued message is not all written."""
        return self._out is not None if self._core is None else self._core.sending

    def flush(self) -> bool:
        """Write what the socket takes now of the queued message (non-blocking socket).

        True when the whole message is written (or none was queued); False
        when the socket is full and the rest waits for the next call.
        """
        while self._out is not None:
            if not self._out_buf:
                self._out_buf = next(self._out, None)
                if self._out_buf is None:
                    self._out = None
                    return True
            try:
                sent = self.sock.sendmsg(self._out_buf[:_IOV_MAX])
            except (BlockingIOError, InterruptedError):
                return False
            _consume(self._out_buf, sent)
        return True

    @property
    def buffered(self) -> bool:
        """True when bytes of a further message are already read."""
        return self._end > self._start if self._core is None else self._core.buffered

    def _fill(self, need: int) -> None:
        """Make at least ``need`` bytes available in the read buffer (from ``_start``)."""
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
            want = max(need - (self._end - self._start), _SMALL_READ)
            k = self.sock.recv_into(self._view[self._end:], min(want, len(self._buf) - self._end))
            if k == 0:
                raise ConnectionError("connection closed by peer")
            self._end += k

    def recv(self) -> tuple[bytes, list, int]:
        """Receive one message, blocking (up to the socket's timeout): (header, buffer frames, bytes read).

        Verifies the MAC and the sequence number before returning anything.
        Each buffer frame is a writable byte buffer of its own (a memoryview
        or a uint8 ndarray), safe to keep and to view as a tensor.
        """
        return self._advance()

    def poll(self) -> tuple[bytes, list, int] | None:
        """Receive without blocking: take what the socket holds now; a whole message or None.

        A message that arrives in pieces is assembled across calls (large
        frames straight into their own buffers), so a peer that stops in the
        middle of a message holds up nobody; :attr:`pending` tells that a
        message has started.
        """
        timeout = self.sock.gettimeout()
        if timeout == 0.0:  # a non-blocking socket already
            try:
                return self._advance()
            except (BlockingIOError, ssl.SSLWantReadError):
                return None
        self.sock.setblocking(False)
        try:
            return self._advance()
        except (BlockingIOError, ssl.SSLWantReadError):
            return None
        finally:
            self.sock.settimeout(timeout)

    @property
    def readable(self) -> bool:
        """True when bytes of a further message may be here already (read, or held by TLS)."""
        if self._core is not None:
            return self._core.buffered
        if self._end > self._start:
            return True
        pending = getattr(self.sock, "pending", None)
        return bool(pending and pending())

    @property
    def pending(self) -> bool:
        """True when part of a message has arrived and the rest has not."""
        if self._core is not None:
            return self._core.pending
        return self._partial is not None or self._end > self._start

    def _advance(self) -> tuple[bytes, list, int]:
        """Go on assembling the current message; every read may raise ``BlockingIOError``.

        All progress is kept in the read buffer or in ``_partial``, so after
        an interruption the next call carries on where this one stopped.
        """
        part = self._partial
        if part is None:
            self._fill(_FIXED.size)
            magic, seq, n = _FIXED.unpack_from(self._buf, self._start)
            if magic != MAGIC or not 1 <= n <= MAX_FRAMES:
                raise FramingError("bad message prefix")
            head = _FIXED.size + 8 * n
            self._fill(head)
            lengths = struct.unpack_from(f"<{n}Q", self._buf, self._start + _FIXED.size)
            if lengths[0] > self.max_header or any(x > self.max_frame for x in lengths[1:]):
                raise FramingError(f"message frame over the size limit ({max(lengths)} bytes)")
            signed = head + lengths[0]
            body = sum(lengths[1:])
            over = self.max_message is not None and lengths[0] + body > self.max_message
            if body <= INLINE_MAC and not over:  # the whole message sits in the read buffer
                total = signed + sum(lengths[1:])
                self._fill(total + MAC_SIZE)
                s, view = self._start, self._view
                self._verify(view[s + total:s + total + MAC_SIZE], view[s:s + total], seq)
                header = bytes(view[s + head:s + signed])
                frames, at = [], s + signed
                for k in lengths[1:]:  # small: copied out of the read buffer into their own memory
                    frames.append(memoryview(bytearray(view[at:at + k])))
                    at += k
                self._start = s + total + MAC_SIZE
                return header, frames, total + MAC_SIZE
            self._fill(signed)
            part = _Partial(seq, head, bytes(self._view[self._start:self._start + signed]), lengths[1:],
                            [] if over else [np.empty(k, dtype=np.uint8) for k in lengths[1:]], [],
                            scratch=bytearray(min(_CHUNK, max(lengths[1:], default=0))) if over else None)
            self._start += signed
            self._partial = part
        tags, tag, nonce, seq = part.tags, self._recv_gmac.encrypt, _NONCE.pack, part.seq
        while part.index < len(part.lengths):
            n = part.lengths[part.index]
            if part.scratch is not None:  # over the limit: each chunk through the scratch buffer, tagged, dropped
                scratch = memoryview(part.scratch)
                while part.got < n:
                    got, done = part.got, part.tagged
                    have = min(n - got, self._end - self._start, done + _CHUNK - got)
                    if not have:
                        self._fill(min(n - got, _CHUNK))
                        continue
                    scratch[got - done:got - done + have] = self._view[self._start:self._start + have]
                    self._start += have
                    part.got = got = got + have
                    if got - done == _CHUNK or got == n:
                        tags.append(tag(nonce(seq, len(tags)), b"", scratch[:got - done]))
                        part.tagged = got
            else:  # each frame into its own buffer, each chunk tagged once it is complete
                view = memoryview(part.frames[part.index])
                while part.got < n:
                    got = part.got
                    have = min(n - got, self._end - self._start)
                    if have:  # what the read buffer already holds
                        view[got:got + have] = self._view[self._start:self._start + have]
                        self._start += have
                    elif n - got < _SMALL_READ:  # a short rest: through the read buffer, with the MAC
                        self._fill(n - got)
                        continue
                    else:  # the bulk: straight into the frame's own buffer, up to the chunk's end
                        have = self.sock.recv_into(view[got:], min(n, part.tagged + _CHUNK) - got)
                        if have == 0:
                            raise ConnectionError("connection closed by peer")
                    part.got = got = got + have
                    while got - part.tagged >= _CHUNK or (got == n and part.tagged < n):
                        stop = min(part.tagged + _CHUNK, n)
                        tags.append(tag(nonce(seq, len(tags)), b"", view[part.tagged:stop]))
                        part.tagged = stop
            part.index += 1
            part.got = part.tagged = 0
        self._fill(MAC_SIZE)
        mac = bytes(self._view[self._start:self._start + MAC_SIZE])
        self._start += MAC_SIZE
        self._partial = None
        self._verify(mac, b"".join([part.signed, *tags]), part.seq)
        lengths = struct.unpack_from(f"<{_FIXED.unpack_from(part.signed)[2]}Q", part.signed, _FIXED.size)
        size = len(part.signed) + sum(lengths[1:]) + MAC_SIZE
        if self.max_message is not None and sum(lengths) > self.max_message:
            raise MessageTooLarge(f"message of {sum(lengths)} bytes is over the limit of {self.max_message}")
        return part.signed[part.head:], part.frames, size

    def _verify(self, mac, signed, seq: int) -> None:
        if not hmac.compare_digest(mac, hmac.digest(self._recv_key, signed, "sha256")):
            raise AuthFailed("message authentication failed")
        if seq != self._recv_seq:
            raise AuthFailed(f"message out of sequence (got {seq}, expected {self._recv_seq})")
        self._recv_seq += 1
