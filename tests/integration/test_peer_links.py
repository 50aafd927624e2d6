"""Worker to worker deliveries reuse one authenticated connection per peer, each under a ticket of its own.

The receiver is a real ``remotorch serve`` on loopback; this process plays
the sending worker with the worker's own :class:`~remotorch.worker.peers.PeerLinks`,
and a client session asks the receiver for tickets and fetches what arrived.
"""

from __future__ import annotations

import select
import socket

import pytest
import torch

import remotorch
from remotorch import errors
from remotorch.codec import messages as m
from remotorch.worker.peers import PeerLinks, deliver_proof

from conftest import TOKEN, wait_until


def meta(t: torch.Tensor) -> m.TensorMeta:
    return m.TensorMeta("float32", list(t.shape), list(t.stride()), 0)


def ticket_for(conn, handle: int, t: torch.Tensor) -> m.TicketReply:
    return conn.request(m.ExpectHandles([handle], [meta(t)]))[0]


def closed_by_peer(link) -> bool:
    """Whether the other end closed ``link``'s connection (its end of the stream is here), without reading."""
    sock = link._channel.sock
    if not select.select([sock], [], [], 0)[0]:
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except ConnectionResetError:
        return True


def fetched(conn, handle: int) -> torch.Tensor:
    reply, frames = conn.request(m.Fetch([m.HandleArg(handle)]))
    value = reply.values[0]
    return torch.frombuffer(bytearray(frames[value.frame]), dtype=torch.float32).reshape(value.shape)


@pytest.fixture
def receiver(start_server):
    srv = start_server(name="receiver", extra_args=("--message-timeout", "3"))
    with remotorch.Session(srv.url, token=TOKEN) as s:
        yield srv, s.connections()[0]


def test_three_deliveries_to_one_peer_open_one_connection_and_each_lands(receiver):
    srv, conn = receiver
    links = PeerLinks()
    values = [torch.randn(32, 32) + i for i in range(3)]
    try:
        for i, v in enumerate(values):
            t = ticket_for(conn, 700 + i, v)
            links.send(srv.url, t.ticket_id, t.secret, [v], timeout=10.0)
        assert links.opened == 1 and len(links) == 1  # one handshake, kept for the next
        for i, v in enumerate(values):
            torch.testing.assert_close(fetched(conn, 700 + i), v)
    finally:
        links.close()


def test_a_later_delivery_needs_its_own_ticket_and_a_proof_for_this_connection(receiver):
    srv, conn = receiver
    links = PeerLinks()
    v = torch.randn(8, 8)
    try:
        first = ticket_for(conn, 800, v)
        links.send(srv.url, first.ticket_id, first.secret, [v], timeout=30.0)  # (room for a loaded machine)
        link = links._take(srv.url)
        second = ticket_for(conn, 801, v)
        w_meta = [meta(v)]
        frames = [v.numpy().tobytes()]
        for ticket, proof, why in (
                (first.ticket_id, deliver_proof(first.secret, link.binding, first.ticket_id), "used"),  # used up
                (second.ticket_id, deliver_proof(second.secret, b"another connection", second.ticket_id), "proof"),
                (second.ticket_id, deliver_proof(first.secret, link.binding, second.ticket_id), "proof"),
                (second.ticket_id, b"", "proof")):
            reply = m.decode(link.request(m.encode(m.Deliver(w_meta, ticket, proof)), frames)[0])
            assert isinstance(reply, m.ErrorReply) and reply.kind == errors.InvalidRequestError.kind, (why, reply)
        assert link.connected  # a refused delivery leaves the connection (and the worker) serving
        # none of those spent the second ticket: with its real proof, it still delivers, on the same connection
        good = deliver_proof(second.secret, link.binding, second.ticket_id)
        reply = m.decode(link.request(m.encode(m.Deliver(w_meta, second.ticket_id, good)), frames)[0])
        assert isinstance(reply, m.Ok), reply
        torch.testing.assert_close(fetched(conn, 801), v)
        link.close()
        assert conn.request(m.Health())[0].name == "receiver"
    finally:
        links.close()


def test_a_link_the_peer_closed_while_idle_is_replaced_under_the_same_ticket(receiver):
    """The receiver closes a ticket connection silent for its message timeout (3 s here)."""
    srv, conn = receiver
    links = PeerLinks()
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    try:
        t = ticket_for(conn, 900, a)
        links.send(srv.url, t.ticket_id, t.secret, [a], timeout=10.0)
        (_, idle), = links._idle[srv.url]
        assert not closed_by_peer(idle)
        assert wait_until(lambda: closed_by_peer(idle), timeout=60)  # past its message timeout
        t = ticket_for(conn, 901, b)
        links.send(srv.url, t.ticket_id, t.secret, [b], timeout=10.0)
        assert links.opened == 2
        torch.testing.assert_close(fetched(conn, 900), a)
        torch.testing.assert_close(fetched(conn, 901), b)
    finally:
        links.close()


def test_an_idle_link_past_its_age_is_not_reused(receiver):
    srv, conn = receiver
    now = [0.0]
    links = PeerLinks(idle_s=5.0, clock=lambda: now[0])
    v = torch.randn(2, 2)
    try:
        for i in range(2):
            t = ticket_for(conn, 950 + i, v)
            links.send(srv.url, t.ticket_id, t.secret, [v], timeout=10.0)
            now[0] += 6.0
        assert links.opened == 2 and len(links) == 1  # the old one closed, not reused
    finally:
        links.close()
