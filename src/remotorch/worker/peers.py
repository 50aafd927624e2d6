"""Worker to worker: one-time tickets for receiving tensors, and sending them to another worker.

A client that holds a value on worker A and needs it on worker B (a pipeline
stage's activations, a handle passed to another worker's graph) never moves
the bytes itself. It asks B for a ticket (``ExpectHandles``: these handle ids
of my session, these layouts), then asks A to send (``SendHandles`` with B's
URL and the ticket). A opens a connection to B presenting the ticket in place
of a token (the same challenge–response, with the ticket's secret; see
:mod:`remotorch.transport.handshake`), sends one ``Deliver``, and B stores
exactly the expected tensors in the issuing session. A ticket is used once,
expires after ``ttl_s``, and gives its bearer nothing else: no request of the
worker protocol is served on a ticket connection.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..codec import messages as m
from ..codec.frames import FrameWriter
from ..errors import InvalidRequestError, LimitExceededError, ProtocolError, from_reply
from ..transport.client import TcpTransport
from ..transport.handshake import TICKET_ID_SIZE
from ..transport.tls import client_context


@dataclass(frozen=True)
class Ticket:
    ticket_id: bytes
    secret: bytes
    session: object  # the store key of the session that asked for it
    handles: list[int]
    metas: list[m.TensorMeta]
    expires: float


class Tickets:
    """Outstanding tickets, by id (thread-safe: issued on the serving loop, taken on ticket connections)."""

    def __init__(self, ttl_s: float = 60.0, clock: Callable[[], float] = time.monotonic, limit: int = 4096) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._limit = limit
        self._by_id: dict[bytes, Ticket] = {}
        self._lock = threading.Lock()

    max_ttl_s = 3600.0  # the longest a client may ask a ticket to wait (a long pipeline step)

    def issue(self, session: object, handles: list[int], metas: list[m.TensorMeta], ttl_s: float = 0.0) -> Ticket:
        """A ticket for these handles; ``ttl_s`` > 0 asks for another lifetime (capped at ``max_ttl_s``)."""
        ttl = min(float(ttl_s), self.max_ttl_s) if ttl_s and ttl_s > 0 else self.ttl_s
        with self._lock:
            now = self._clock()
            for tid in [t for t, k in self._by_id.items() if k.expires <= now]:
                del self._by_id[tid]
            if len(self._by_id) >= self._limit:
                raise LimitExceededError(f"over {self._limit} transfer tickets are outstanding")
            ticket = Ticket(os.urandom(TICKET_ID_SIZE), os.urandom(32), session, list(handles), list(metas),
                            now + ttl)
            self._by_id[ticket.ticket_id] = ticket
            return ticket

    def secret(self, ticket_id: bytes) -> bytes | None:
        """The secret of an outstanding, unexpired ticket (for the handshake), else None."""
        with self._lock:
            ticket = self._by_id.get(ticket_id)
            return ticket.secret if ticket is not None and ticket.expires > self._clock() else None

    def take(self, ticket_id: bytes) -> Ticket | None:
        """Use a ticket up (None: unknown, used or expired)."""
        with self._lock:
            ticket = self._by_id.pop(ticket_id, None)
            return ticket if ticket is not None and ticket.expires > self._clock() else None

    def now(self) -> float:
        return self._clock()

    def __len__(self) -> int:
        return len(self._by_id)


def send_to_peer(url: str, ticket_id: bytes, secret: bytes, tensors: list[torch.Tensor], *,
                 timeout: float, tls_ca: str | None = None) -> None:
    """Deliver tensors to the worker at ``url`` under its ticket; raises the typed error it answers."""
    if len(ticket_id) != TICKET_ID_SIZE or len(secret) != 32:
        raise InvalidRequestError("a ticket is a 16-byte id and a 32-byte secret")
    tls = client_context(tls_ca) if url.startswith("tls://") else None
    try:
        transport = TcpTransport(url, secret, protocol=m.PROTOCOL_VERSION, connect_timeout=min(timeout, 10.0),
                                 timeout=timeout, tls=tls, ticket_id=ticket_id)
    except ValueError as exc:
        raise InvalidRequestError(str(exc)) from None
    try:
        w = FrameWriter()
        metas = [w.meta(t) for t in tensors]
        header, _ = transport.request(m.encode(m.Deliver(metas)), w.frames)
    finally:
        transport.close()
    try:
        reply = m.decode(header)
    except Exception as exc:
        raise ProtocolError(f"unreadable answer from worker {url}: {exc}") from None
    if isinstance(reply, m.ErrorReply):
        raise from_reply(reply.kind, f"worker {url}: {reply.message}", reply.traceback)
