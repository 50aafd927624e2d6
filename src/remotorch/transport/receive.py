"""Receiving framed messages on the Python path: reading, assembling and verifying them.

A small message is read whole through one reusable read buffer (about one
syscall a message); a large one is assembled across calls, each buffer frame
straight into its own memory and each chunk tagged right after it came in
(:mod:`remotorch.transport.wire` gives the format). Nothing is returned
before the MAC and the sequence number are verified.
"""

from __future__ import annotations

import hmac
import struct
from dataclasses import dataclass

import numpy as np

from .wire import (_CHUNK, _FIXED, _NONCE, _SMALL_READ, INLINE_MAC, MAC_SIZE, MAGIC, MAX_FRAMES, AuthFailed,
                   FramingError, MessageTooLarge)


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


class Receiving:
    """The receiving half of :class:`~remotorch.transport.framing.FramedChannel` (its Python path).

    The channel holds the state: ``sock``, the read buffer (``_buf``,
    ``_view``, ``_start``, ``_end``), the message being assembled
    (``_partial``), this direction's keys (``_recv_key``, ``_recv_gmac``),
    the next sequence number (``_recv_seq``) and the size limits.
    """

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

    def _advance(self) -> tuple[bytes, list, int]:
        """Go on assembling the current message; every read may raise ``BlockingIOError``.

        All progress is kept in the read buffer or in ``_partial``, so after
        an interruption the next call carries on where this one stopped.
        """
        part = self._partial
        if part is None:
            whole = self._begin()
            if whole is not None:
                return whole
            part = self._partial
        while part.index < len(part.lengths):
            if part.scratch is not None:
                self._discard_frame(part)
            else:
                self._receive_frame(part)
            part.index += 1
            part.got = part.tagged = 0
        return self._finish(part)

    def _begin(self) -> tuple[bytes, list, int] | None:
        """Read a message's prefix and header: a small message whole (returned), else its ``_partial``."""
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
        return None

    def _discard_frame(self, part: _Partial) -> None:
        """Over the limit: each chunk through the scratch buffer, tagged, dropped."""
        tags, tag, nonce, seq = part.tags, self._recv_gmac.encrypt, _NONCE.pack, part.seq
        n = part.lengths[part.index]
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

    def _receive_frame(self, part: _Partial) -> None:
        """Each frame into its own buffer, each chunk tagged once it is complete."""
        tags, tag, nonce, seq = part.tags, self._recv_gmac.encrypt, _NONCE.pack, part.seq
        n = part.lengths[part.index]
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

    def _finish(self, part: _Partial) -> tuple[bytes, list, int]:
        """The MAC after the last frame: verified, then the whole message."""
        self._fill(MAC_SIZE)
        mac = bytes(self._view[self._start:self._start + MAC_SIZE])
        self._start += MAC_SIZE
        self._partial = None
        self._verify(mac, b"".join([part.signed, *part.tags]), part.seq)
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
