"""The one seam between the session and the bytes on the wire."""

from __future__ import annotations

import abc
from collections.abc import Sequence

Buffer = bytes | bytearray | memoryview


class Transport(abc.ABC):
    """Carries one request (header + raw frames) and returns the reply.

    Implementations raise only ``remotorch.errors`` types:
    ``WorkerUnavailableError`` when no worker answers, ``AuthenticationError``
    when the token is refused, ``TransportError``/``ProtocolError`` otherwise.
    Received frames are writable uint8 numpy arrays (the receiver may view them
    as tensors without copying).
    """

    bytes_sent: int = 0
    bytes_received: int = 0

    @abc.abstractmethod
    def request(self, header: bytes, frames: Sequence[Buffer] = ()) -> tuple[bytes, list]:
        """Send one message and block until its reply arrives."""

    def close(self) -> None:
        """Release the connection; a later request may open a new one."""
