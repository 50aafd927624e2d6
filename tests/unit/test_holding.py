"""The worker's holding of acknowledgements (transport/holding.py), on a real loopback TCP connection.

The serving loop's end to end behaviour is in integration/test_held_replies.py;
here each rule on its own: held only while more of the peer's bytes are here,
and only when quiet, never past ``HOLD_MAX_S``, and let out by the next reply
not held.
"""

from __future__ import annotations

import socket
import time
from types import SimpleNamespace

import pytest

from remotorch.transport import holding
from remotorch.transport.holding import Holding

from helpers import Clock

pytestmark = pytest.mark.skipif(getattr(socket, "TCP_CORK", None) is None, reason="needs TCP_CORK (Linux)")


@pytest.fixture
def pair():
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    conn, _ = server.accept()
    conn.setblocking(False)
    yield SimpleNamespace(sock=conn, readable=False), client
    for s in (client, conn, server):
        s.close()


def corked(channel) -> bool:
    return bool(channel.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CORK))


def _wait_for_bytes(channel) -> None:
    deadline = time.monotonic() + 5
    while not holding.more_here(channel) and time.monotonic() < deadline:
        time.sleep(0.001)


def test_a_quiet_reply_is_held_only_while_more_bytes_are_here(pair):
    channel, client = pair
    h = Holding()
    assert not h.before(channel, 1, quiet=True) and not corked(channel)  # nothing more here: it goes now
    client.sendall(b"next request")
    _wait_for_bytes(channel)
    assert not h.before(channel, 1, quiet=False) and not corked(channel)  # not quiet: never held
    assert h.before(channel, 1, quiet=True) and corked(channel)
    h.after(channel, 1, hold=True, written=True)
    assert corked(channel)  # still held
    assert not h.before(channel, 1, quiet=False)
    h.after(channel, 1, hold=False, written=True)
    assert not corked(channel)  # the next reply not held takes them out


def test_no_reply_is_held_past_the_longest_hold(pair, monkeypatch):
    channel, client = pair
    monkeypatch.setattr(holding, "HOLD_MAX_S", 0.25)  # (sums exact in binary: the bound is judged exactly)
    clock = Clock(64.0)
    h = Holding(clock)
    client.sendall(b"more")
    _wait_for_bytes(channel)
    assert h.before(channel, 1, quiet=True)
    h.after(channel, 1, hold=True, written=True)
    clock.now = 64.125
    assert h.before(channel, 1, quiet=True)  # within the hold
    h.after(channel, 1, hold=True, written=True)
    clock.now = 64.25
    assert not h.before(channel, 1, quiet=True)  # held for HOLD_MAX_S: this one takes them out
    h.after(channel, 1, hold=False, written=True)
    assert not corked(channel) and h.corked == {}
    assert h.before(channel, 1, quiet=True) and h.corked == {1: 64.25}  # a new hold starts now


def test_bytes_here_are_peeked_at_never_taken(pair):
    channel, client = pair
    assert not holding.more_here(channel)  # nothing there: no wait either
    client.sendall(b"x")
    _wait_for_bytes(channel)
    assert holding.more_here(channel) and holding.more_here(channel)
    assert channel.sock.recv(16) == b"x"  # still there for the reader
    channel.readable = True  # read already, into the channel's buffer
    assert holding.more_here(channel)


def test_nothing_is_held_on_a_unix_socket():
    a, b = socket.socketpair(socket.AF_UNIX)
    try:
        b.sendall(b"more")
        channel = SimpleNamespace(sock=a, readable=True)
        assert not holding.more_here(channel)
        assert not Holding().before(channel, 1, quiet=True)
    finally:
        a.close()
        b.close()


def test_a_connection_forgotten_is_no_longer_held(pair):
    channel, client = pair
    h = Holding()
    client.sendall(b"more")
    _wait_for_bytes(channel)
    assert h.before(channel, 3, quiet=True) and 3 in h.corked
    h.forget(3)
    assert h.corked == {}


def test_a_reply_the_peer_is_slow_to_take_lets_out_what_was_held(pair):
    channel, client = pair
    h = Holding()
    client.sendall(b"more")
    _wait_for_bytes(channel)
    assert h.before(channel, 7, quiet=True)
    h.after(channel, 7, hold=True, written=False)  # the socket was full: nothing stays corked behind it
    assert not corked(channel)
    h.forget(7)
