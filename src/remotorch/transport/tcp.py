"""Client side of the TCP transport: one authenticated connection, opened lazily."""

from __future__ import annotations

import socket
import threading
from collections.abc import Sequence
from urllib.parse import urlparse

from ..errors import AuthenticationError, ProtocolError, WorkerUnavailableError
from .base import Buffer, Transport
from .framing import AuthFailed, FramedChannel, FramingError, client_handshake

DEFAULT_MAX_FRAME = 1 << 40


def parse_url(url: str) -> tuple[str, int]:
    """``tcp://host:port`` → (host, port); raises ValueError for anything else."""
    parsed = urlparse(url)
    if parsed.scheme != "tcp" or not parsed.hostname or parsed.port is None:
        raise ValueError(f"worker address must look like tcp://host:port, got {url!r}")
    return parsed.hostname, parsed.port


class TcpTransport(Transport):
    """Length-prefixed frames over one TCP connection (thread-safe, one request at a time).

    The connection opens on the first request, not in the constructor, so
    creating a session for a worker that is down does not fail by itself.
    """

    def __init__(self, url: str, token: str | None = None, *, protocol: int,
                 connect_timeout: float = 5.0, timeout: float | None = 300.0) -> None:
        self.url = url
        self.host, self.port = parse_url(url)
        self._token = (token or "").encode()
        self._protocol = protocol
        self.connect_timeout = connect_timeout
        self.timeout = timeout
        self._channel: FramedChannel | None = None
        self._lock = threading.Lock()
        self.bytes_sent = 0
        self.bytes_received = 0

    def _connect(self) -> FramedChannel:
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self.connect_timeout)
        except OSError as exc:
            raise WorkerUnavailableError(f"no worker at {self.url}: {exc}") from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            key = client_handshake(sock, self._token, self._protocol)
        except AuthFailed as exc:
            sock.close()
            raise AuthenticationError(f"{self.url}: {exc}") from exc
        except FramingError as exc:
            sock.close()
            raise ProtocolError(f"{self.url}: {exc}") from exc
        except OSError as exc:
            sock.close()
            raise WorkerUnavailableError(f"worker at {self.url} dropped the handshake: {exc}") from exc
        sock.settimeout(self.timeout)
        return FramedChannel(sock, key, role="client", max_frame=DEFAULT_MAX_FRAME, max_header=DEFAULT_MAX_FRAME)

    def request(self, header: bytes, frames: Sequence[Buffer] = ()) -> tuple[bytes, list]:
        with self._lock:
            if self._channel is None:
                self._channel = self._connect()
            channel = self._channel
            try:
                self.bytes_sent += channel.send(header, frames)
                reply, out, nbytes = channel.recv()
            except socket.timeout as exc:
                self._drop()
                raise WorkerUnavailableError(f"worker at {self.url} did not answer within {self.timeout}s") from exc
            except AuthFailed as exc:
                self._drop()
                raise AuthenticationError(f"{self.url}: {exc}") from exc
            except FramingError as exc:
                self._drop()
                raise ProtocolError(f"{self.url}: {exc}") from exc
            except (OSError, ConnectionError) as exc:
                self._drop()
                raise WorkerUnavailableError(f"lost the connection to {self.url}: {exc}") from exc
            self.bytes_received += nbytes
            return reply, out

    def _drop(self) -> None:
        if self._channel is not None:
            try:
                self._channel.sock.close()
            except OSError:
                pass
            self._channel = None

    def close(self) -> None:
        with self._lock:
            self._drop()

