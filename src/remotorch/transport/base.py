"""The one seam between a client connection and the bytes on the wire."""

from __future__ import annotations

import abc
import os
import time
from collections.abc import Callable, Sequence

Buffer = bytes | bytearray | memoryview

# on_connect(ask): called on every new connection before the first request;
# ask(header) sends one message on it and returns the reply's header.
OnConnect = Callable[[Callable[[bytes], bytes]], None]


class Transport(abc.ABC):
    """Carries one request (header + raw frames) and returns the reply.

    Implementations raise only ``remotorch.errors`` types:
    ``WorkerUnavailableError`` when no worker answers, ``AuthenticationError``
    when the token is refused, ``TransportError``/``ProtocolError`` otherwise.
    Received frames are writable byte buffers (the receiver may view them as
    tensors without copying). A transport connects on its first request and
    after :meth:`close`; ``on_connect`` runs on each new connection first.
    """

    bytes_sent: int = 0
    messages_sent: int = 0  # request messages (heartbeats and housekeeping included)
    bytes_received: int = 0
    on_connect: OnConnect | None = None
    outstanding: int = 0  # posted messages whose replies are not collected yet

    @abc.abstractmethod
    def request(self, header: bytes, frames: Sequence[Buffer] = (), *,
                progress: Callable[[int], None] | None = None) -> tuple[bytes, list]:
        """Send one message and block until its reply arrives.

        ``progress(n)``, when given, is called as ``n`` more bytes of the
        message are written (a transport that cannot tell may call it once).
        """

    @property
    @abc.abstractmethod
    def connected(self) -> bool:
        """True while a connection is open (no I/O)."""

    @abc.abstractmethod
    def post(self, header: bytes, frames: Sequence[Buffer] = (), *,
             progress: Callable[[int], None] | None = None) -> None:
        """Send one message without waiting; its reply is :meth:`collect`'s, in the order posted.

        While replies are outstanding, :meth:`request` is refused. ``progress``
        as for :meth:`request`.
        """

    @abc.abstractmethod
    def collect(self) -> tuple[bytes, list]:
        """The reply to the oldest posted message not collected yet (blocks until it arrives)."""

    def ready(self) -> tuple[bytes, list] | None:
        """The reply to the oldest posted message if it is here whole already, else None (never waits)."""
        return None

    def connect(self) -> None:
        """Open a connection now if none is open (``on_connect`` runs on it)."""

    def set_timeout(self, seconds: float | None) -> None:
        """Change how long a reply may take (None: forever)."""

    def close(self) -> None:
        """Release the connection; a later request may open a new one."""


AUTO_SPIN_S = 1e-3  # the window of "auto" busy-polling: calls that come back within it find the other end awake


class Spin:
    """When one end busy-polls for the next message instead of sleeping, and for how long.

    Waking a sleeping process costs tens of microseconds per message, far
    more on a virtual machine whose idle vCPU is halted (and what it ran
    comes back to cold caches). ``Spin(seconds)`` polls up to that long
    after every message (0: never). ``Spin(None)`` is ``auto``: it polls up
    to :data:`AUTO_SPIN_S`, only when this process may run on more than one
    CPU, and only while one of the last two waits ended within that window.
    Calls that come back to back keep it polling; the first call of a burst
    after a pause still finds the other end polling for the second (one long
    wait alone does not stop it); a slower caller or an idle peer costs at
    most two windows, after which the end sleeps until messages come quickly
    again. The poll loop yields the CPU between polls, so a process that
    needs the core gets it.
    """

    __slots__ = ("window", "adaptive", "hot", "_long")

    def __init__(self, seconds: float | None) -> None:
        self.adaptive = seconds is None
        if self.adaptive:
            self.window = AUTO_SPIN_S if _cpus() > 1 else 0.0
        else:
            self.window = max(0.0, seconds)
        self.hot = True
        self._long = 0  # waits in a row that took longer than the window

    def budget(self) -> float:
        """Seconds to poll before the next wait sleeps."""
        return self.window if self.hot else 0.0

    def waited(self, seconds: float) -> None:
        """The last wait took this long: ``auto`` stops polling after two in a row over the window."""
        if self.adaptive:
            self._long = 0 if seconds <= self.window else self._long + 1
            self.hot = self._long < 2

    def __repr__(self) -> str:
        return "Spin(auto)" if self.adaptive else f"Spin({self.window * 1e6:g} us)"


def poll_until(ready, seconds: float) -> bool:
    """Call ``ready()`` without sleeping (yielding the CPU in between) until it is true or
    ``seconds`` passed; whether it became true."""
    until = time.perf_counter() + seconds
    while True:
        if ready():
            return True
        if time.perf_counter() >= until:
            return False
        os.sched_yield()


def poll_for(take, seconds: float):
    """Call ``take()`` without sleeping (yielding the CPU in between) until it returns something
    other than None or ``seconds`` passed; what it returned, or None."""
    until = time.perf_counter() + seconds
    while True:
        got = take()
        if got is not None:
            return got
        if time.perf_counter() >= until:
            return None
        os.sched_yield()


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
