"""The receiving worker's transfer tickets: one use each, a second use refused at once."""

from __future__ import annotations

import threading
import time

import pytest

from remotorch.codec import messages as m
from remotorch.errors import InvalidRequestError
from remotorch.worker.peers import Tickets

META = [m.TensorMeta("float32", [2], [1], 0)]


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_used_ticket_is_refused_at_once_not_waited_for():
    tickets = Tickets(ttl_s=60.0)
    ticket = tickets.issue("s", [1], META)
    assert tickets.secret(ticket.ticket_id) == ticket.secret
    assert tickets.take(ticket.ticket_id) == ticket
    started = time.monotonic()
    assert tickets.secret(ticket.ticket_id) is None
    assert tickets.take(ticket.ticket_id) is None
    assert time.monotonic() - started < Tickets.arrival_s / 10  # not the wait for a ticket on its way


def test_a_ticket_not_issued_yet_is_waited_for_until_it_comes():
    tickets = Tickets()
    tid, secret = b"\1" * 16, b"\2" * 32
    threading.Timer(0.05, lambda: tickets.issue("s", [1], META, ticket_id=tid, secret=secret)).start()
    assert tickets.secret(tid) == secret


def test_a_client_cannot_choose_the_id_of_a_used_ticket_until_it_would_have_expired():
    clock = Clock()
    tickets = Tickets(ttl_s=10.0, clock=clock)
    tid, secret = b"\3" * 16, b"\4" * 32
    tickets.issue("s", [1], META, ticket_id=tid, secret=secret)
    assert tickets.take(tid) is not None
    with pytest.raises(InvalidRequestError, match="used already"):
        tickets.issue("s", [2], META, ticket_id=tid, secret=secret)
    clock.t += 11.0
    assert tickets.issue("s", [2], META, ticket_id=tid, secret=secret).handles == [2]


def test_the_used_tickets_kept_are_bounded_and_expire():
    clock = Clock()
    tickets = Tickets(ttl_s=10.0, clock=clock, limit=4)
    ids = []
    for _ in range(6):
        ids.append(tickets.issue("s", [1], META).ticket_id)
        assert tickets.take(ids[-1]) is not None
    assert list(tickets._used) == ids[-4:]  # the oldest went
    clock.t += 11.0
    fresh = tickets.issue("s", [1], META).ticket_id
    assert tickets.take(fresh) is not None
    assert list(tickets._used) == [fresh]  # the expired went with the next use
