"""What each session's stream of requests has run, so that a request sent twice runs once.

A client sends requests without waiting for their replies, each with a
sequence number (``Envelope.seq``), and acknowledges the replies it has read
(``Envelope.ack``). When its connection drops with requests in flight, it
reconnects, attaches to the same session and sends them again. The worker
must then run only those it had not run: an optimizer step applied twice is
lost data. So for each session it remembers the last sequence number it ran
and the replies the client has not acknowledged yet, and answers a request
it already ran with the reply it gave then.

So that none of this delays a reply, :meth:`Replays.ran` only notes the
request; the bookkeeping is done by :meth:`Replays.settle`, which the serving
loop calls once the reply is written and every other method calls first.

Memory is bounded: at most :data:`MAX_REPLIES` replies and
:data:`MAX_BYTES` bytes per session (the client's queue is far smaller by
default); a request whose remembered reply had to be dropped is answered
with an error saying so (it ran; its result is lost), never run again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable

from ..errors import WorkerError

MAX_REPLIES = 4096
MAX_BYTES = 256 << 20

Reply = tuple[bytes, list]


class _Stream:
    __slots__ = ("last", "replies", "nbytes")

    def __init__(self) -> None:
        self.last = 0  # the last sequence number run
        self.replies: deque[tuple[int, Reply, int]] = deque()  # (seq, reply, bytes), oldest first
        self.nbytes = 0


class Replays:
    """Per session: the last request run, and the replies not acknowledged (see the module docstring)."""

    def __init__(self, error_reply: Callable[[Exception], bytes]) -> None:
        """``error_reply(exc)``: the header of an error reply."""
        self._streams: dict[Hashable, _Stream] = {}
        self._error_reply = error_reply
        self._unsettled: tuple | None = None  # (session, seq, reply, ack) noted by ran(), kept by settle()

    def unacknowledged(self) -> int:
        """Replies kept because their clients have not acknowledged them, all sessions together
        (as of the last :meth:`settle`: other threads read it, and only the serving loop settles)."""
        return sum(len(stream.replies) for stream in list(self._streams.values()))

    def acknowledge(self, session: Hashable, ack: int) -> None:
        """The client has read every reply up to ``ack``: forget those."""
        if self._unsettled is not None:
            self.settle()
        self._forget_read(session, ack)

    def _forget_read(self, session: Hashable, ack: int) -> None:
        stream = self._streams.get(session)
        if stream is None:
            return
        replies = stream.replies
        while replies and replies[0][0] <= ack:
            stream.nbytes -= replies.popleft()[2]

    def answered(self, session: Hashable, seq: int) -> Reply | None:
        """The reply to give for request ``seq`` if it ran already, else None (run it, then :meth:`ran`)."""
        if self._unsettled is not None:
            self.settle()
        stream = self._streams.get(session)
        if stream is None or seq > stream.last:  # new (numbers in between were refused before the
            return None  # service saw them: too large)
        for kept_seq, reply, _ in stream.replies:
            if kept_seq == seq:
                return reply
        return self._error_reply(WorkerError(
            f"request {seq} was sent again after a dropped connection: it ran already, and its reply "
            "could not be kept for so long (the client read no reply for too long)")), []

    def ran(self, session: Hashable, seq: int, reply: Reply, ack: int = 0) -> None:
        """Request ``seq`` ran and was answered ``reply``: keep it until the client acknowledges it;
        ``ack``: what the request acknowledged (see :meth:`acknowledge`). Noted now, done by :meth:`settle`."""
        if self._unsettled is not None:
            self.settle()
        self._unsettled = (session, seq, reply, ack)

    def settle(self) -> None:
        """Keep the reply :meth:`ran` noted (the serving loop calls this once the reply is written)."""
        unsettled, self._unsettled = self._unsettled, None
        if unsettled is None:
            return
        session, seq, reply, ack = unsettled
        if ack:
            self._forget_read(session, ack)
        stream = self._streams.get(session)
        if stream is None:
            stream = self._streams[session] = _Stream()
        stream.last = seq
        header, frames = reply
        nbytes = len(header) + (sum(memoryview(f).nbytes for f in frames) if frames else 0)
        replies = stream.replies
        replies.append((seq, reply, nbytes))
        stream.nbytes += nbytes
        while len(replies) > MAX_REPLIES or stream.nbytes > MAX_BYTES:
            stream.nbytes -= replies.popleft()[2]

    def forget(self, session: Hashable) -> None:
        """The session ended: its stream with it."""
        unsettled = self._unsettled
        if unsettled is not None and unsettled[0] == session:
            self._unsettled = None
        self._streams.pop(session, None)

    def held_bytes(self) -> int:
        """Bytes of replies kept for all sessions."""
        return sum(s.nbytes for s in self._streams.values())
