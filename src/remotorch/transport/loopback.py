"""An in-memory transport: requests go to a handler in this process, no sockets.

For fast unit tests of client policy (upload-if-missing, retry after the
worker forgot, fallback, statistics) against the worker's real service,
``remotorch.worker.service.Service``::

    service = Service(Worker("cpu"))
    session = Session(transport=LoopbackTransport(service.handle, on_disconnect=service.disconnected))

Frames are copied in both directions, as the wire would, so neither side
ever aliases the other's memory. Integration tests use the real server.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np

from ..errors import ProtocolError, WorkerUnavailableError
from .base import Buffer, OnConnect, Transport
from .framing import message_size

Handler = Callable[[int, bytes, list], tuple[bytes, Sequence]]
_connection_ids = itertools.count(1)  # unique in this process, as a server's would be


def _copied(frames: Sequence[Buffer]) -> list:
    return [np.frombuffer(memoryview(f).cast("B"), dtype=np.uint8).copy() for f in frames]


class LoopbackTransport(Transport):
    """Hands each message to ``handler(connection_id, header, frames)`` on the calling thread.

    ``down = True`` makes every request fail as if no worker answered (a
    worker that went away); each new connection gets a new id
    (:attr:`connection_id`), and ``on_disconnect(id)`` hears when one closes.
    """

    def __init__(self, handler: Handler, *, on_connect: OnConnect | None = None,
                 on_disconnect: Callable[[int], None] | None = None) -> None:
        self._handler = handler
        self.on_connect = on_connect
        self._on_disconnect = on_disconnect
        self.connection_id = 0
        self._open = False
        self.down = False
        self.requests = 0  # messages handed to the handler (attach included)
        self._posted: deque = deque()  # replies of posted messages, oldest first
        self.bytes_sent = 0
        self.messages_sent = 0
        self.bytes_received = 0

    @property
    def connected(self) -> bool:
        return self._open

    def _exchange(self, header: bytes, frames: Sequence[Buffer] = ()) -> tuple[bytes, list]:
        if self.down:
            self.close()
            raise WorkerUnavailableError("loopback worker is down")
        self.requests += 1
        self.bytes_sent += message_size(header, frames)
        self.messages_sent += 1
        reply, out = self._handler(self.connection_id, bytes(header), _copied(frames))
        self.bytes_received += message_size(reply, out)
        return bytes(reply), _copied(out)

    def connect(self) -> None:
        if not self._open:
            if self.down:
                raise WorkerUnavailableError("loopback worker is down")
            self.connection_id = next(_connection_ids)
            self._open = True
            if self.on_connect is not None:
                self.on_connect(lambda h: self._exchange(h)[0])

    def request(self, header: bytes, frames: Sequence[Buffer] = (), *, progress=None) -> tuple[bytes, list]:
        if self._posted:
            raise ProtocolError("replies to posted messages must be collected first")
        self.connect()
        return self._exchange(header, frames)

    def post(self, header: bytes, frames: Sequence[Buffer] = (), *, progress=None) -> None:
        self.connect()
        self._posted.append(self._exchange(header, frames))  # handled at once; the reply waits here
        self.outstanding += 1

    def collect(self) -> tuple[bytes, list]:
        if not self._posted:
            raise ProtocolError("no reply is outstanding on this connection")
        self.outstanding -= 1
        return self._posted.popleft()

    def ready(self) -> tuple[bytes, list] | None:
        return self.collect() if self._posted else None

    def close(self) -> None:
        self._posted.clear()
        self.outstanding = 0
        if self._open:
            self._open = False
            if self._on_disconnect is not None:
                self._on_disconnect(self.connection_id)
