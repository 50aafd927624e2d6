"""A network in user space: a TCP relay that delays each direction, caps bandwidth, logs, and cuts.

``DelayProxy(worker_url, delay_ms=10)`` listens on a loopback port and relays
each connection to the worker, holding every chunk ``delay_ms`` before
passing it on, in each direction: a round trip through it costs ``2 *
delay_ms`` more than the direct one. ``bandwidth`` (bytes per second) paces
each direction as a link of that rate would. It keeps a log of the
*exchanges* it saw (bytes sent one way until the other way answered), and
:meth:`DelayProxy.cut` drops every connection at once, with whatever it was
still holding in either direction: a link that fails mid-queue.

Made for remotorch's own benchmarks and tests of what a real network costs
(``benchmarks/wan.py``), where the kernel's ``netem`` is not at hand; it is a
debug aid, like the fault-injecting engines.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass, field

_CHUNK = 1 << 16


@dataclass
class Exchange:
    """What crossed one connection in one burst each way: ``up`` (client → worker) then ``down``."""

    up: int = 0
    down: int = 0


@dataclass
class _Link:
    """One relayed connection: two sockets and a queue per direction."""

    client: socket.socket
    upstream: socket.socket
    queues: tuple = field(default_factory=lambda: (deque(), deque()))
    ready: threading.Condition = field(default_factory=threading.Condition)
    closed: bool = False
    exchanges: list[Exchange] = field(default_factory=list)


class DelayProxy:
    """Relay from a loopback port to ``target`` (a ``tcp://host:port`` URL or ``(host, port)``).

    ``delay_ms``: one-way delay added in each direction (changeable with
    :meth:`set_delay`). ``bandwidth``: bytes per second each way (None:
    unlimited). Use as a context manager or :meth:`close` it.
    """

    def __init__(self, target: str | tuple[str, int], delay_ms: float = 0.0, bandwidth: float | None = None) -> None:
        if isinstance(target, str):
            host, port = target.split("://", 1)[1].rsplit(":", 1)
            target = (host, int(port))
        self.target = target
        self.delay_s = delay_ms / 1e3
        self.bandwidth = bandwidth
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._links: list[_Link] = []
        self._lock = threading.Lock()
        self._closed = False
        self.cuts = 0
        threading.Thread(target=self._accept, name="netem-accept", daemon=True).start()

    @property
    def url(self) -> str:
        """Where clients connect instead of the worker."""
        return f"tcp://127.0.0.1:{self.port}"

    def set_delay(self, delay_ms: float) -> None:
        """Change the one-way delay (for chunks that arrive from now on)."""
        self.delay_s = delay_ms / 1e3

    def exchanges(self) -> list[Exchange]:
        """Every burst pair seen so far, over all connections, in order of connection."""
        with self._lock:
            return [e for link in self._links for e in link.exchanges]

    def reset_log(self) -> None:
        """Forget the exchanges seen so far."""
        with self._lock:
            for link in self._links:
                link.exchanges.clear()

    def cut(self) -> int:
        """Drop every open connection now (a reset), with the bytes held in either direction.

        Returns how many bytes were lost in flight. New connections are
        relayed as before (the link comes back).
        """
        with self._lock:
            links = [link for link in self._links if not link.closed]
            self.cuts += 1
        lost = 0
        for link in links:
            with link.ready:
                lost += sum(len(d) for q in link.queues for _, d in q)
            self._close(link)
        return lost

    def close(self) -> None:
        self._closed = True
        try:
            self._listener.close()
        except OSError:
            pass
        self.cut()

    def __enter__(self) -> DelayProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ relaying
    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            link = _Link(client, upstream)
            with self._lock:
                self._links.append(link)
            for direction, (src, dst) in enumerate(((client, upstream), (upstream, client))):
                threading.Thread(target=self._read, args=(link, direction, src), daemon=True,
                                 name=f"netem-read-{direction}").start()
                threading.Thread(target=self._write, args=(link, direction, dst), daemon=True,
                                 name=f"netem-write-{direction}").start()

    def _read(self, link: _Link, direction: int, src: socket.socket) -> None:
        try:
            while not link.closed:
                data = src.recv(_CHUNK)
                if not data:
                    break
                now = time.perf_counter()
                with link.ready:
                    self._log(link, direction, len(data))
                    link.queues[direction].append((now + self.delay_s, data))
                    link.ready.notify_all()
        except OSError:
            pass
        with link.ready:  # end of stream: the writer shuts its side down once the queue is empty
            link.queues[direction].append((time.perf_counter() + self.delay_s, b""))
            link.ready.notify_all()

    def _log(self, link: _Link, direction: int, n: int) -> None:
        if direction == 0:
            if not link.exchanges or link.exchanges[-1].down:
                link.exchanges.append(Exchange())
            link.exchanges[-1].up += n
        else:
            if not link.exchanges:
                link.exchanges.append(Exchange())
            link.exchanges[-1].down += n

    def _write(self, link: _Link, direction: int, dst: socket.socket) -> None:
        free_at = 0.0  # when the paced link is free again
        q = link.queues[direction]
        try:
            while True:
                with link.ready:
                    while not q and not link.closed:
                        link.ready.wait()
                    if link.closed:
                        return
                    due, data = q.popleft()
                if self.bandwidth and data:
                    due = max(due, free_at)
                    free_at = due + len(data) / self.bandwidth
                    due = free_at
                wait = due - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                if link.closed:
                    return
                if not data:
                    dst.shutdown(socket.SHUT_WR)
                    return
                dst.sendall(data)
        except OSError:
            self._close(link)

    def _close(self, link: _Link) -> None:
        with link.ready:
            if link.closed:
                return
            link.closed = True
            for q in link.queues:
                q.clear()
            link.ready.notify_all()
        for s in (link.client, link.upstream):
            try:  # a reset, not a clean close: what a failed link looks like to both ends
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.close()
            except OSError:
                pass


__all__ = ["DelayProxy", "Exchange"]
