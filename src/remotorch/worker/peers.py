"""Worker to worker: one-time tickets for receiving tensors, and sending them to another worker.

A client that holds a value on worker A and needs it on worker B (a pipeline
stage's activations, a handle passed to another worker's graph) never moves
the bytes itself. It asks B for a ticket (``ExpectHandles``: these handle ids
of my session, these layouts), then asks A to send (``SendHandles`` with B's
URL and the ticket). A opens a connection to B presenting the ticket in place
of a token (the same challenge–response, with the ticket's secret; see
:mod:`remotorch.transport.handshake`), sends a ``Deliver``, and B stores
exactly the expected tensors in the issuing session. A ticket is used once,
expires after ``ttl_s``, and gives its bearer nothing else: no request of the
worker protocol is served on a ticket connection.

A keeps that connection (:class:`PeerLinks`, one idle connection per peer)
and sends its next deliveries to B on it, each naming its own ticket with a
proof of that ticket's secret bound to the connection
(:func:`deliver_proof`): a pipeline's steady stream of activations pays one
handshake per peer, not one per transfer, and still every delivery is
authorised by a ticket of its own.
"""

from __future__ import annotations

import hmac
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..codec import messages as m
from ..codec.frames import FrameWriter
from ..errors import InvalidRequestError, LimitExceededError, ProtocolError, WorkerUnavailableError, from_reply
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
        # tickets used up, until they would have expired (oldest first, at most ``limit``): a second
        # use is refused at once, not waited for as a ticket that may still be on its way
        self._used: dict[bytes, float] = {}
        self._lock = threading.Lock()
        self._issued = threading.Condition(self._lock)

    max_ttl_s = 3600.0  # the longest a client may ask a ticket to wait (a long pipeline step)
    # how long a delivery under a ticket not issued yet waits for it: a client that chose the ticket
    # sends it to this worker and the run that delivers to the sending one at once, and the
    # delivery may come first (it waits on its own connection's thread, never the serving loop)
    arrival_s = 10.0

    def issue(self, session: object, handles: list[int], metas: list[m.TensorMeta], ttl_s: float = 0.0,
              ticket_id: bytes = b"", secret: bytes = b"") -> Ticket:
        """A ticket for these handles; ``ttl_s`` > 0 asks for another lifetime (capped at ``max_ttl_s``).

        ``ticket_id`` and ``secret``: the ticket the client chose (so that it
        need not wait for this answer before it hands the ticket to the
        sending worker): 16 and 32 bytes, and an id no ticket has now.
        """
        ttl = min(float(ttl_s), self.max_ttl_s) if ttl_s and ttl_s > 0 else self.ttl_s
        if (ticket_id or secret) and (len(ticket_id) != TICKET_ID_SIZE or len(secret) != 32):
            raise InvalidRequestError(f"a ticket the client chooses is {TICKET_ID_SIZE} bytes, its secret 32")
        with self._lock:
            now = self._clock()
            for tid in [t for t, k in self._by_id.items() if k.expires <= now]:
                del self._by_id[tid]
            if len(self._by_id) >= self._limit:
                raise LimitExceededError(f"over {self._limit} transfer tickets are outstanding")
            if ticket_id and ticket_id in self._by_id:
                raise InvalidRequestError("a ticket with this id is outstanding")
            if ticket_id and self._used.get(ticket_id, now) > now:
                raise InvalidRequestError("a ticket with this id was used already")
            ticket = Ticket(ticket_id or os.urandom(TICKET_ID_SIZE), secret or os.urandom(32), session,
                            list(handles), list(metas), now + ttl)
            self._by_id[ticket.ticket_id] = ticket
            self._issued.notify_all()
            return ticket

    def secret(self, ticket_id: bytes) -> bytes | None:
        """The secret of an outstanding, unexpired ticket (for the handshake), else None; a ticket
        not issued yet is waited for up to :attr:`arrival_s` (one used already, not at all)."""
        deadline = time.monotonic() + self.arrival_s
        with self._lock:
            if self._used.get(ticket_id, 0.0) > self._clock():  # used up: it will not come again
                return None
            while ticket_id not in self._by_id and time.monotonic() < deadline:
                self._issued.wait(max(0.0, deadline - time.monotonic()))
            ticket = self._by_id.get(ticket_id)
            return ticket.secret if ticket is not None and ticket.expires > self._clock() else None

    def take(self, ticket_id: bytes) -> Ticket | None:
        """Use a ticket up (None: unknown, used or expired)."""
        with self._lock:
            ticket = self._by_id.pop(ticket_id, None)
            now = self._clock()
            if ticket is None or ticket.expires <= now:
                return None
            used = self._used  # (the oldest first: those that expired, and beyond the limit, go)
            while used and (len(used) >= self._limit or next(iter(used.values())) <= now):
                del used[next(iter(used))]
            self._used[ticket_id] = ticket.expires
            return ticket

    def now(self) -> float:
        return self._clock()

    def __len__(self) -> int:
        return len(self._by_id)


def deliver_proof(secret: bytes, binding: bytes, ticket_id: bytes) -> bytes:
    """The proof that a later ``Deliver`` on a connection holds ``ticket_id``'s secret (worthless elsewhere)."""
    return hmac.digest(secret, b"remotorch deliver\x00" + binding + ticket_id, "sha256")


class PeerLinks:
    """One idle ticket connection per peer URL, reused for the next delivery to that peer.

    A link is taken out of the pool while it carries a delivery, so two
    deliveries to one peer at once use two connections. A link idle longer
    than ``idle_s`` is closed rather than reused (the peer closes a silent
    ticket connection after its message timeout); a reused link that turns
    out closed is replaced by a fresh connection under the same ticket, once.
    """

    def __init__(self, idle_s: float = 20.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.idle_s = idle_s
        self._clock = clock
        self._idle: dict[str, list[tuple[float, TcpTransport]]] = {}
        self._lock = threading.Lock()
        self.opened = 0  # connections made (handshakes), for tests and benchmarks

    def send(self, url: str, ticket_id: bytes, secret: bytes, tensors: list[torch.Tensor], *,
             timeout: float, tls_ca: str | None = None) -> None:
        """Deliver ``tensors`` to the worker at ``url`` under its ticket; raises the typed error it answers."""
        if len(ticket_id) != TICKET_ID_SIZE or len(secret) != 32:
            raise InvalidRequestError("a ticket is a 16-byte id and a 32-byte secret")
        w = FrameWriter()
        metas = [w.meta(t) for t in tensors]
        link = self._take(url)
        if link is not None:
            proof = deliver_proof(secret, link.binding or b"", ticket_id)
            try:
                header = link.request(m.encode(m.Deliver(metas, ticket_id, proof)), w.frames)[0]
            except WorkerUnavailableError:  # the peer closed it meanwhile: a fresh one, under the same ticket
                link.close()
                link = None
        if link is None:
            link = self._open(url, ticket_id, secret, timeout, tls_ca)
            try:
                header = link.request(m.encode(m.Deliver(metas)), w.frames)[0]
            except BaseException:
                link.close()
                raise
        self._give_back(url, link)
        try:
            reply = m.decode(header)
        except Exception as exc:
            raise ProtocolError(f"unreadable answer from worker {url}: {exc}") from None
        if isinstance(reply, m.ErrorReply):
            raise from_reply(reply.kind, f"worker {url}: {reply.message}", reply.traceback)

    def close(self) -> None:
        """Close every idle link."""
        with self._lock:
            links, self._idle = [t for ts in self._idle.values() for _, t in ts], {}
        for link in links:
            link.close()

    def __len__(self) -> int:
        return sum(len(ts) for ts in self._idle.values())

    def _open(self, url: str, ticket_id: bytes, secret: bytes, timeout: float, tls_ca: str | None) -> TcpTransport:
        tls = client_context(tls_ca) if url.startswith("tls://") else None
        try:
            # the handshake outwaits the receiver's wait for a ticket not issued yet (Tickets.arrival_s):
            # a ticket it never issues is then answered as a wrong one, not taken for a silent worker
            link = TcpTransport(url, secret, protocol=m.PROTOCOL_VERSION,
                                connect_timeout=min(timeout, Tickets.arrival_s + 10.0),
                                timeout=timeout, tls=tls, ticket_id=ticket_id)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        self.opened += 1
        return link

    def _take(self, url: str) -> TcpTransport | None:
        now = self._clock()
        stale = []
        with self._lock:
            links = self._idle.get(url, [])
            while links:
                since, link = links.pop()
                if now - since <= self.idle_s and link.connected:
                    break
                stale.append(link)
            else:
                link = None
        for old in stale:
            old.close()
        return link

    def _give_back(self, url: str, link: TcpTransport) -> None:
        if not link.connected:
            return
        with self._lock:
            self._idle.setdefault(url, []).append((self._clock(), link))
