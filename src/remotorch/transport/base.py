"""The one seam between a client connection and the bytes on the wire."""

from __future__ import annotations

import abc
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

    def post(self, header: bytes, frames: Sequence[Buffer] = ()) -> None:
        """Send one message without waiting; its reply is :meth:`collect`'s, in the order posted.

        Optional: a transport that cannot pipeline raises ``NotImplementedError``
        (the caller then waits for each reply). While replies are outstanding,
        :meth:`request` is refused.
        """
        raise NotImplementedError

    def collect(self) -> tuple[bytes, list]:
        """The reply to the oldest posted message not collected yet (blocks until it arrives)."""
        raise NotImplementedError

    def set_timeout(self, seconds: float | None) -> None:
        """Change how long a reply may take (None: forever)."""

    def close(self) -> None:
        """Release the connection; a later request may open a new one."""
