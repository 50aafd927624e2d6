"""The user-space network relay (``remotorch.devtools.netem.DelayProxy``) on real loopback sockets.

Each test runs a small server in a thread, relays a connection to it, and
checks what crosses: that a round trip costs at least the delay (a lower
bound only: the machine may be slow, never fast), that bytes arrive intact
and in order when the relay has to write a little at a time, that a
half-close crosses, that a cut resets both ends and the relay goes on, and
what the exchange log counts.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from remotorch.devtools.netem import DelayProxy, Exchange

PATTERN = bytes(range(251)) * 21_000  # about 5 MB, no period of a power of two


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(min(n - len(out), 1 << 20))
        assert chunk, f"stream ended after {len(out)} of {n} bytes"
        out += chunk
    return bytes(out)


def recv_all(sock: socket.socket) -> bytes:
    out = bytearray()
    while chunk := sock.recv(1 << 20):
        out += chunk
    return bytes(out)


class Server:
    """A loopback server: each connection is handed to ``handler`` in a thread of its own."""

    def __init__(self, handler) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.handler, self.errors, self.threads = handler, [], []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            t = threading.Thread(target=self._run, args=(conn,), daemon=True)
            t.start()
            self.threads.append(t)

    def _run(self, conn: socket.socket) -> None:
        try:
            with conn:
                self.handler(conn)
        except Exception as exc:  # reported by the test that reads self.errors
            self.errors.append(exc)

    def join(self) -> None:
        for t in self.threads:
            t.join(timeout=30)
        assert not any(t.is_alive() for t in self.threads)

    def close(self) -> None:
        self.sock.close()


def echo(conn: socket.socket) -> None:
    while data := conn.recv(1 << 16):
        conn.sendall(data)


@pytest.fixture
def serve():
    servers = []

    def start(handler=echo) -> Server:
        servers.append(Server(handler))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def connect(proxy: DelayProxy) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def test_a_round_trip_costs_at_least_twice_the_delay(serve):
    server = serve()
    with DelayProxy(f"tcp://127.0.0.1:{server.port}", delay_ms=15) as proxy, connect(proxy) as c:
        assert proxy.url == f"tcp://127.0.0.1:{proxy.port}" and proxy.delay_s == pytest.approx(0.015)
        for i in range(3):
            start = time.perf_counter()
            c.sendall(b"ping %d" % i)
            assert recv_exactly(c, 6) == b"ping %d" % i
            assert time.perf_counter() - start >= 0.030 - 1e-3  # a millisecond for converting clocks
        proxy.set_delay(40)
        start = time.perf_counter()
        c.sendall(b"x")
        assert recv_exactly(c, 1) == b"x"
        assert time.perf_counter() - start >= 0.080 - 1e-3


def test_five_megabytes_cross_intact_and_in_order_to_a_slow_reader(serve):
    """The server reads only after a pause: the relay's sends to it fill its buffers and go out in parts."""
    got = {}

    def slow_sink(conn):
        time.sleep(0.3)
        got["up"] = recv_all(conn)  # ends with the client's half-close, crossed
        conn.sendall(got["up"][::-1])

    server = serve(slow_sink)
    with DelayProxy(("127.0.0.1", server.port), delay_ms=2) as proxy, connect(proxy) as c:
        sender = threading.Thread(target=lambda: (c.sendall(PATTERN), c.shutdown(socket.SHUT_WR)))
        sender.start()
        down = recv_all(c)
        sender.join()
        server.join()
    assert not server.errors
    assert got["up"] == PATTERN
    assert down == PATTERN[::-1]
    assert proxy.exchanges() == [Exchange(up=len(PATTERN), down=len(PATTERN))]


def test_bandwidth_paces_each_direction(serve):
    server = serve(lambda conn: recv_all(conn))
    with DelayProxy(("127.0.0.1", server.port), bandwidth=10e6) as proxy, connect(proxy) as c:
        start = time.perf_counter()
        c.sendall(b"b" * 1_000_000)
        c.shutdown(socket.SHUT_WR)
        assert recv_all(c) == b""  # the server closes once it has it all
        assert time.perf_counter() - start >= 0.1 - 1e-3
        server.join()


def test_a_half_close_crosses_each_way_and_the_other_way_stays_open(serve):
    seen = []

    def late_answer(conn):
        seen.append(recv_all(conn))  # returns at the client's half-close
        conn.sendall(b"after your end")
        conn.shutdown(socket.SHUT_WR)
        seen.append(conn.recv(10))  # the relay has nothing more for us: b""

    server = serve(late_answer)
    with DelayProxy(("127.0.0.1", server.port), delay_ms=5) as proxy, connect(proxy) as c:
        c.sendall(b"question")
        c.shutdown(socket.SHUT_WR)
        assert recv_all(c) == b"after your end"
        server.join()
        assert seen == [b"question", b""] and not server.errors
        assert proxy.cut() == 0  # both sides ended cleanly: nothing left to cut


def test_a_cut_resets_both_ends_loses_what_was_held_and_the_relay_goes_on(serve):
    ends = []

    def hold(conn):
        try:
            ends.append(conn.recv(100))
        except ConnectionResetError:
            ends.append("reset")

    server = serve(hold)
    with DelayProxy(("127.0.0.1", server.port), delay_ms=10_000) as proxy:
        c = connect(proxy)
        c.sendall(b"h" * 1000)
        deadline = time.monotonic() + 10
        while proxy.exchanges() != [Exchange(up=1000)] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proxy.exchanges() == [Exchange(up=1000)]
        assert proxy.cut() == 1000 and proxy.cuts == 1
        with pytest.raises(ConnectionResetError):
            c.recv(100)
        c.close()
        server.join()
        assert ends == ["reset"]

        proxy.set_delay(1)
        server.handler = echo
        with connect(proxy) as again:
            again.sendall(b"back")
            assert recv_exactly(again, 4) == b"back"


def test_the_log_counts_each_exchange_and_forgets_on_reset(serve):
    def answer_half(conn):
        while data := conn.recv(1 << 16):
            conn.sendall(data[: len(data) // 2])

    server = serve(answer_half)
    with DelayProxy(("127.0.0.1", server.port), delay_ms=1) as proxy, connect(proxy) as c:
        for _ in range(2):
            c.sendall(b"u" * 100)
            assert recv_exactly(c, 50) == b"u" * 50
        assert proxy.exchanges() == [Exchange(up=100, down=50), Exchange(up=100, down=50)]
        proxy.reset_log()
        assert proxy.exchanges() == []
        c.sendall(b"u" * 10)
        recv_exactly(c, 5)
        assert proxy.exchanges() == [Exchange(up=10, down=5)]


def test_a_failed_upstream_closes_the_client_and_a_new_target_is_relayed(serve):
    dead = socket.create_server(("127.0.0.1", 0))
    dead_port = dead.getsockname()[1]
    dead.close()  # nothing listens there now
    with DelayProxy(("127.0.0.1", dead_port)) as proxy:
        with connect(proxy) as c:
            try:
                assert c.recv(10) == b""
            except ConnectionResetError:
                pass
        server = serve()
        proxy.target = ("127.0.0.1", server.port)
        with connect(proxy) as c:
            c.sendall(b"alive")
            assert recv_exactly(c, 5) == b"alive"


def test_close_stops_the_relay_and_frees_its_port(serve):
    server = serve()
    proxy = DelayProxy(("127.0.0.1", server.port), delay_ms=1000)
    c = connect(proxy)
    c.sendall(b"in flight")
    time.sleep(0.05)
    proxy.close()
    with pytest.raises(ConnectionResetError):
        c.recv(10)
    c.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", proxy.port), timeout=5).close()
    assert proxy.cut() == 0  # a closed relay has nothing to cut


def test_a_delay_toward_the_client_alone_holds_replies_until_a_cut(serve):
    server = serve(echo)
    with DelayProxy(("127.0.0.1", server.port), delay_ms=1) as proxy, connect(proxy) as c:
        proxy.set_delay(1, down_ms=3600e3)
        c.sendall(b"q" * 300)  # reaches the server at once; its answer stays in the relay
        deadline = time.monotonic() + 30
        while proxy.exchanges() != [Exchange(up=300, down=300)] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proxy.exchanges() == [Exchange(up=300, down=300)]
        assert proxy.cut() == 300  # what it held: the answer
        with pytest.raises(ConnectionResetError):
            c.recv(100)
        proxy.set_delay(1)  # both ways alike again
        with connect(proxy) as again:
            again.sendall(b"back")
            assert recv_exactly(again, 4) == b"back"
