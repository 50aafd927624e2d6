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
for is never held (Linux also sends corked bytes after 200 ms at most).
Elsewhere (a Unix socket, a system without ``TCP_CORK``) nothing is held.
"""

from __future__ import annotations

import socket

from .framing import FramedChannel

_CORK = getattr(socket, "TCP_CORK", None)


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
    """The connections whose replies are held in the kernel now (see the module docstring)."""

    def __init__(self) -> None:
        self._corked: set[int] = set()

    def before(self, channel: FramedChannel, cid: int, quiet: bool) -> bool:
        """Before a reply is written: whether to hold it (and the socket is corked if so)."""
        hold = quiet and more_here(channel)
        if hold and cid not in self._corked:
            channel.sock.setsockopt(socket.IPPROTO_TCP, _CORK, 1)
            self._corked.add(cid)
        return hold

    def after(self, channel: FramedChannel, cid: int, hold: bool, written: bool) -> None:
        """After it was written (all of it, or not: the peer is slow to read): out with what was held."""
        if cid in self._corked and not (hold and written):
            self._corked.discard(cid)
            channel.sock.setsockopt(socket.IPPROTO_TCP, _CORK, 0)

    def forget(self, cid: int) -> None:
        self._corked.discard(cid)
