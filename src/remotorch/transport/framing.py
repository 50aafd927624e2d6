"""Length-prefixed, authenticated frames over a stream socket: the channel that sends and receives them.

The format (the prefix, frame 0, raw buffer frames, the MAC over them and the
GMAC tags of large frames) and writing a message out are in
:mod:`remotorch.transport.wire`; receiving one (assembling and verifying it)
is in :mod:`remotorch.transport.receive`. This module is the face of both:
import the format's names from here (docs/protocol.md §4).

``_cframing.c`` does the same in C, byte for byte; a :class:`FramedChannel` on
a plain socket uses it where it is built (``REMOTORCH_FRAMING=python`` turns it
off), and this module is then only its set-up and the fallback.
"""

from __future__ import annotations

import importlib
import os
import select
import socket
import ssl
import time
from collections.abc import Callable, Sequence

import numpy as np

from .receive import Receiving, _Partial
from .wire import (_CHUNK, _FIXED, _IOV_MAX, _NONCE, _READ_BUFFER, _SEND_AHEAD, _SMALL_READ, INLINE_MAC,
                   MAC_SIZE, MAGIC, MAX_FRAMES, TAG_SIZE, AuthFailed, FramingError, MessageTooLarge, _batches,
                   _consume, _encoded, _mac, direction_keys, encode_message, frames_key,
                   message_size, send_all)

__all__ = ["INLINE_MAC", "MAC_SIZE", "MAGIC", "MAX_FRAMES", "TAG_SIZE", "AuthFailed", "FramedChannel",
           "FramingError", "MessageTooLarge", "direction_keys", "encode_message", "frames_key", "message_size",
           "send_all"]


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


class FramedChannel(Receiving):
    """One authenticated message stream over a connected socket.

    ``role`` is ``"client"`` or ``"server"``: it picks this end's send and
    receive keys. Small messages are read through one reusable buffer (about
    one syscall a message); large frames are received straight into their
    own buffers (:class:`~remotorch.transport.receive.Receiving`).
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

