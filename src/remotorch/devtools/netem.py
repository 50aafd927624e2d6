"""A network in user space: a TCP relay that delays each direction, caps bandwidth, logs, and cuts.

``DelayProxy(worker_url, delay_ms=10)`` listens on a loopback port and relays
each connection to the worker, holding every chunk ``delay_ms`` before
passing it on, in each direction: a round trip through it costs ``2 *
delay_ms`` more than the direct one. ``bandwidth`` (bytes per second) paces
each direction as a link of that rate would. It keeps a log of the
*exchanges* it saw (bytes sent one way until the other way answered), and
:meth:`DelayProxy.cut` drops every connection at once, with whatever it was
still holding in either direction: a link that fails mid-queue.

So that the relay adds little time and takes little CPU of its own, one thread
per proxy does it all: an event loop over ``select.select`` (whose timeout is
in microseconds; ``poll`` and ``epoll`` round up to whole milliseconds) that
accepts, connects, reads and writes without blocking. Each direction of a
connection is a queue of ``(due, bytes)``, due ``delay_ms`` after the kernel
received the bytes (their receive timestamp, on Linux), however late the loop
came to read them. The loop sleeps until a socket is ready or the next chunk is
due, with 1 ns of timer slack instead of Linux's 50 µs; as an idle CPU is slow
to wake up (hundreds of µs in a VM after tens of ms), it learns how late its
timer wakes it and wakes that much early (at most ``_SPIN_MAX_S``), then waits
awake. What a full socket does not take stays at the head of its queue until
it can take more. Other threads hand :meth:`~DelayProxy.cut` and
:meth:`~DelayProxy.close` to the loop and wake it through a socket pair.

Made for remotorch's own benchmarks and tests of what a real network costs
(``benchmarks/wan.py``), where the kernel's ``netem`` is not at hand; it is a
debug aid, like the fault-injecting engines.
"""

from __future__ import annotations

import errno
import select
import socket
import struct
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

_CHUNK = 1 << 16
_SPIN_MAX_S = 500e-6  # the most the loop waits awake for a chunk to be due
_LINUX = sys.platform.startswith("linux")
_SO_TIMESTAMPNS = 35  # Linux: each read says when the kernel received its last bytes


def _tight_timers() -> None:
    """Ask Linux for 1 ns of timer slack on this thread (not 50 µs), so that its sleeps end on time."""
    if _LINUX:
        try:
            import ctypes
            one, zero = ctypes.c_ulong(1), ctypes.c_ulong(0)
            ctypes.CDLL(None).prctl(29, one, zero, zero, zero)  # PR_SET_TIMERSLACK
        except Exception:  # a nicety: the relay works without it
            pass


def _wait(readers: list, writers: list, timeout: float | None) -> tuple[list, list]:
    """The sockets ready to read and those ready to write, after at most ``timeout`` seconds."""
    try:
        return select.select(readers, writers, [], timeout)[:2]
    except ValueError:  # a descriptor past FD_SETSIZE: poll, to the millisecond (spurious readiness is harmless)
        poller = select.poll()
        for s in {*readers, *writers}:
            poller.register(s, (select.POLLIN if s in readers else 0) | (select.POLLOUT if s in writers else 0))
        ready = {fd for fd, _ in poller.poll(None if timeout is None else timeout * 1e3)}
        return [s for s in readers if s.fileno() in ready], [s for s in writers if s.fileno() in ready]


@dataclass
class Exchange:
    """What crossed one connection in one burst each way: ``up`` (client → worker) then ``down``.

    ``reads_up`` and ``reads_down``: in how many reads the relay took them (each one what had arrived
    when it came to read: a write of the sender's, or more than one if they came close together).
    """

    up: int = 0
    down: int = 0
    reads_up: int = field(default=0, compare=False)
    reads_down: int = field(default=0, compare=False)


@dataclass(eq=False)
class _Flow:
    """One direction of a link: chunks read from ``src``, held until due, then written to ``dst``."""

    src: socket.socket
    dst: socket.socket
    up: bool  # client → worker
    held: deque = field(default_factory=deque)  # (due, bytes), oldest first; b"": the end of the stream
    head_due: float | None = None  # when the head chunk leaves, paced (None: not reckoned yet)
    free_at: float = 0.0  # when the paced link is free again
    ended: bool = False  # src is at its end: nothing more to read
    blocked: bool = False  # dst took less than it was given: wait until it can take more
    done: bool = False  # dst is shut down for writing: all was passed on


@dataclass(eq=False)
class _Link:
    """One relayed connection: the client, the worker (once connected), a flow each way."""

    client: socket.socket
    addrs: list = field(default_factory=list)  # the target's addresses still to try
    upstream: socket.socket | None = None
    flows: tuple[_Flow, ...] = ()  # none while connecting
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
        self.delay_s = self.down_s = delay_ms / 1e3
        self.bandwidth = bandwidth
        self.cuts = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._wake_r, self._wake_w = socket.socketpair()
        for s in (self._listener, self._wake_r, self._wake_w):
            s.setblocking(False)
        self._links: list[_Link] = []  # every connection relayed, for the log
        self._open: list[_Link] = []  # those not closed yet (the loop's own)
        self._lock = threading.Lock()  # for the log, and for the three below
        self._cut_requests: list[Future] = []
        self._closing = self._stopped = False
        self._thread = threading.Thread(target=self._run, name="netem", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        """Where clients connect instead of the worker."""
        return f"tcp://127.0.0.1:{self.port}"

    def set_delay(self, delay_ms: float, down_ms: float | None = None) -> None:
        """Change the one-way delay (for chunks that arrive from now on); ``down_ms``: toward the client,
        where it differs (a large one holds the worker's replies in the relay until a :meth:`cut`)."""
        with self._lock:  # (a chunk logged after this returns was held with these delays)
            self.delay_s = delay_ms / 1e3
            self.down_s = self.delay_s if down_ms is None else down_ms / 1e3

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
        done: Future[int] = Future()
        with self._lock:
            self.cuts += 1
            if self._stopped:
                return 0
            self._cut_requests.append(done)
        self._wake()
        return done.result()

    def close(self) -> None:
        """Cut every connection and stop relaying (the port closes)."""
        self.cut()
        with self._lock:
            self._closing = True
        self._wake()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def __enter__(self) -> DelayProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ the loop
    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:  # its buffer is full (the loop wakes anyway), or the loop is gone
            pass

    def _run(self) -> None:
        _tight_timers()
        timeout: float | None = None  # until the next chunk is due
        late = 0.0  # how late the timer has been waking the loop (a moving average)
        try:
            while True:
                readers: dict = {self._wake_r: None, self._listener: None}
                writers: dict = {}
                for link in self._open:
                    if not link.flows:  # connecting: writable once done
                        writers[link.upstream] = link
                    for flow in link.flows:
                        if not flow.ended:
                            readers[flow.src] = (link, flow)
                        if flow.blocked:
                            writers[flow.dst] = flow
                # sleep until ``late`` before the chunk is due, then wait awake (timeout 0)
                nap = None if timeout is None else max(0.0, timeout - late)
                slept = time.perf_counter()
                readable, writable = _wait(list(readers), list(writers), nap)
                if nap and not readable and not writable:
                    late += 0.1 * (min(max(time.perf_counter() - slept - nap, 0.0), _SPIN_MAX_S) - late)
                if self._wake_r in readable and self._serve_requests():
                    return
                for s in writable:
                    if isinstance(it := writers[s], _Link):
                        self._connected(it)
                    else:
                        it.blocked = False
                for s in readable:
                    if s is self._listener:
                        self._accept()
                    elif readers[s] and not readers[s][0].closed:
                        self._read(*readers[s])
                timeout = self._flush()
        finally:
            with self._lock:
                self._stopped = True
                requests, self._cut_requests = self._cut_requests, []
            lost = self._drop_all()
            for done in requests:
                done.set_result(lost)
                lost = 0
            for s in (self._listener, self._wake_r, self._wake_w):
                s.close()

    def _serve_requests(self) -> bool:
        """Make the cuts asked for; True when the proxy is closing."""
        try:
            self._wake_r.recv(4096)
        except BlockingIOError:
            pass
        with self._lock:
            requests, self._cut_requests = self._cut_requests, []
            closing = self._closing
        for done in requests:
            done.set_result(self._drop_all())
        return closing

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except OSError:  # the client left already
            return
        link = _Link(client)
        self._open.append(link)
        try:
            client.setblocking(False)
            link.addrs = [(f, t, p, a) for f, t, p, _, a in socket.getaddrinfo(*self.target, type=socket.SOCK_STREAM)]
        except OSError:  # no address: no connection
            pass
        self._dial(link)

    def _dial(self, link: _Link) -> None:
        """Start connecting to the target's next address; with none left, close the client."""
        while link.addrs:
            family, kind, proto, addr = link.addrs.pop(0)
            link.upstream = socket.socket(family, kind, proto)
            link.upstream.setblocking(False)
            if link.upstream.connect_ex(addr) in (0, errno.EINPROGRESS):
                return
            link.upstream.close()
        self._drop(link, reset=False)

    def _connected(self, link: _Link) -> None:
        """``link.upstream`` is done connecting: relay, or try the next address."""
        if link.closed:
            return
        try:
            if link.upstream.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                link.upstream.close()
                return self._dial(link)
            for s in (link.client, link.upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if _LINUX:
                    s.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
        except OSError:
            return self._drop(link, reset=True)
        link.flows = (_Flow(link.client, link.upstream, up=True), _Flow(link.upstream, link.client, up=False))
        with self._lock:
            self._links.append(link)

    def _read(self, link: _Link, flow: _Flow) -> None:
        try:
            data, notes, _, _ = flow.src.recvmsg(_CHUNK, 64) if _LINUX else (flow.src.recv(_CHUNK), (), 0, 0)
        except BlockingIOError:
            return
        except OSError:  # a reset: the end of this direction's stream, as a close would be
            data, notes = b"", ()
        arrived = time.perf_counter()
        for level, kind, note in notes:  # back to when the kernel got it, before the loop came
            if (level, kind) == (socket.SOL_SOCKET, _SO_TIMESTAMPNS):
                sec, nsec = struct.unpack("ll", note[:struct.calcsize("ll")])
                arrived -= max(0.0, time.time() - sec - nsec * 1e-9)
        with self._lock:
            flow.held.append((arrived + (self.delay_s if flow.up else self.down_s), data))
            if not data:
                flow.ended = True
                return
            if not link.exchanges or (flow.up and link.exchanges[-1].down):
                link.exchanges.append(Exchange())
            if flow.up:
                link.exchanges[-1].up += len(data)
                link.exchanges[-1].reads_up += 1
            else:
                link.exchanges[-1].down += len(data)
                link.exchanges[-1].reads_down += 1

    def _flush(self) -> float | None:
        """Pass on every chunk that is due; the seconds until the next one is (None: nothing to wait for)."""
        nearest = None
        now = time.perf_counter()
        for link in list(self._open):
            for flow in link.flows:
                if flow.blocked or not flow.held:
                    continue
                try:
                    due = self._send(flow, now)
                except OSError:  # the other end is gone: so is the link, both ways
                    self._drop(link, reset=True)
                    break
                if due is not None and (nearest is None or due < nearest):
                    nearest = due
            if link.flows and not link.closed and all(flow.done for flow in link.flows):
                self._drop(link, reset=False)  # both ends closed their side: a clean end
        return None if nearest is None else max(0.0, nearest - time.perf_counter())

    def _send(self, flow: _Flow, now: float) -> float | None:
        """Write ``flow``'s chunks due by ``now``; when the next is due (None: none held, or ``dst`` is full)."""
        while flow.held:
            due, data = flow.held[0]
            if flow.head_due is None:  # paced as the link it emulates: it leaves once it is through
                if self.bandwidth and data:
                    flow.free_at = due = max(due, flow.free_at) + len(data) / self.bandwidth
                flow.head_due = due
            if flow.head_due > now:
                return flow.head_due
            if not data:
                flow.held.popleft()
                flow.dst.shutdown(socket.SHUT_WR)
                flow.done = True
                return None
            try:
                sent = flow.dst.send(data)
            except BlockingIOError:
                sent = 0
            if sent < len(data):
                flow.held[0] = (due, memoryview(data)[sent:])
                flow.blocked = True
                return None
            flow.held.popleft()
            flow.head_due = None
        return None

    def _drop_all(self) -> int:
        """Reset every open connection; the bytes they held."""
        lost = sum(len(data) for link in self._open for flow in link.flows for _, data in flow.held)
        for link in list(self._open):
            self._drop(link, reset=True)
        return lost

    def _drop(self, link: _Link, reset: bool) -> None:
        link.closed = True
        self._open.remove(link)
        for flow in link.flows:
            flow.held.clear()
        for s in filter(None, (link.client, link.upstream)):
            try:  # a reset, not a clean close: what a failed link looks like to both ends
                if reset:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.close()
            except OSError:
                pass


__all__ = ["DelayProxy", "Exchange"]
