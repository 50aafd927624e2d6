"""Replies that only acknowledge their request wait for the next reply while more requests are here.

A client that queues requests without waiting for them (remotorch's stream)
would otherwise get one write, one packet and one wake-up per reply. The
serving loop says, for each reply it is about to write, whether it is
*quiet*: nothing in it that the peer may be waiting to read (no value, no
error). A quiet reply is held while more of the same peer's bytes are already
here (read, or in the socket), and leaves with the next reply that is not
held: on TCP the socket is corked (``TCP_CORK``), so the kernel sends them
as one segment. The last request of a burst finds nothing more here, so its
reply, and every one held before it, leaves at once; a reply the peer waits
for is never held. A client whose queue is full waits for its oldest reply,
though, and a worker that always has more to do would never let it go: so
no reply is held more than :data:`HOLD_MAX_S` (the worker's answer to an
optimizer step, which a training loop's queue bound waits for, is not held
at all: ``quiet`` says so). Elsewhere (a Unix socket, a system without
``TCP_CORK``) nothing is held.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

from .framing import FramedChannel

_CORK = getattr(socket, "TCP_CORK", None)
HOLD_MAX_S = 0.05  # the longest a reply waits for the next (Linux's own ceiling for a cork is 200 ms)


def more_here(channel: FramedChannel) -> bool:
    """Whether bytes of a further message from this TCP peer are here already (read, or in the socket)."""
    if _CORK is None or channel.sock.family == socket.AF_UNIX:
        return False  # (nothing to hold replies with)
    if channel.readable:
        return True
    try:
        return bool(channel.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except OSError:  # nothing yet (or the connection broke: the next read says so)
        return False


class Holding:
    """The connections whose replies are held in the kernel now (see the module docstring).

    ``clock`` is injectable for tests.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.corked: dict[int, float] = {}  # connection -> since when its replies are held (the listener reads it)
        self._clock = clock

    def before(self, channel: FramedChannel, cid: int, quiet: bool) -> bool:
        """Before a reply is written: whether to hold it (and the socket is corked if so)."""
        if not (quiet and more_here(channel)):
            return False
        since = self.corked.get(cid)
        if since is None:
            channel.sock.setsockopt(socket.IPPROTO_TCP, _CORK, 1)
            self.corked[cid] = self._clock()
            return True
        return self._clock() - since < HOLD_MAX_S  # (held long enough: this one takes them out)

    def after(self, channel: FramedChannel, cid: int, hold: bool, written: bool) -> None:
        """After it was written (all of it, or not: the peer is slow to read): out with what was held."""
        if cid in self.corked and not (hold and written):
            del self.corked[cid]
            channel.sock.setsockopt(socket.IPPROTO_TCP, _CORK, 0)

    def forget(self, cid: int) -> None:
        self.corked.pop(cid, None)
