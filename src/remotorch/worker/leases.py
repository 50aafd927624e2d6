"""Sessions that outlive a connection, for a lease time, kept alive by heartbeats.

A client names its session with a random id (``Attach``) on every new
connection, so what it uploaded survives a dropped connection: reconnecting
within the lease finds its graphs and tensors still there. A session with no
connection is freed when its lease runs out; so is a connected session that
sends nothing (no request, no ``Heartbeat``) for a whole lease, which is what a
killed or frozen client, or a vanished network, looks like from the worker.

A connection that never attaches is its own session, freed when it closes.

The session id is a capability: whoever presents it gets the session, so
clients draw it from 192 random bits and send it only inside an authenticated
connection. Each lease gets a fresh store key (the :class:`Lease` object), so
freeing an expired session can never touch a later session with the same id.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

SESSION_ID = re.compile(r"[0-9A-Za-z_-]{16,128}")


@dataclass(eq=False)
class Lease:
    """One attached session: its id, its live connections and when it was last heard from."""

    session_id: str
    connections: set = field(default_factory=set)
    last_seen: float = 0.0
    detached_at: float | None = None
    kid: bytes | None = None  # the key id of the tenant whose connection made it

    def __repr__(self) -> str:  # never print the capability itself
        return f"Lease({self.session_id[:6]}…, connections={len(self.connections)})"


class LeaseTable:
    """Which session each connection serves, and which sessions' leases ran out.

    Thread-safe: the serving loop attaches, touches and disconnects; a reaper
    thread asks :meth:`expired`. ``clock`` is injectable for tests.
    """

    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.lease_s = lease_s
        self._clock = clock
        self._by_id: dict[str, Lease] = {}
        self._by_conn: dict[int, Lease] = {}
        self._lock = threading.Lock()
        self._busy: int | None = None  # connection whose request is running now
        self._stall_end = 0.0  # end of the last request long enough to delay others' heartbeats

    def key(self, cid: int) -> object:
        """The store key of the session a connection serves (the connection itself if unattached)."""
        return self._by_conn.get(cid, cid)

    def attach(self, cid: int, session_id: str) -> tuple[bool, list[int]]:
        """Bind a connection to a session id; returns (resumed, connections it displaced).

        A session has one live connection: a client that reconnects before the
        worker noticed its old connection drop takes the session over, and the
        old connection is to be closed.
        """
        with self._lock:
            now = self._clock()
            old = self._by_conn.get(cid)
            if old is not None and old.session_id != session_id:
                raise ValueError("this connection is already attached to another session")
            lease = self._by_id.get(session_id)
            resumed = lease is not None
            if lease is None:
                lease = self._by_id[session_id] = Lease(session_id)
            displaced = [c for c in lease.connections if c != cid]
            for c in displaced:
                self._by_conn.pop(c, None)
            lease.connections = {cid}
            lease.last_seen, lease.detached_at = now, None
            self._by_conn[cid] = lease
            return resumed, displaced

    def lookup(self, session_id: str) -> Lease | None:
        """The lease of a session id, if one is in the table."""
        with self._lock:
            return self._by_id.get(session_id)

    def leases(self) -> list[Lease]:
        """Every lease in the table now (a copy)."""
        with self._lock:
            return list(self._by_id.values())

    def drop(self, lease: Lease) -> list[int]:
        """End a lease now, whoever serves it; its connections (no longer attached)."""
        with self._lock:
            if self._by_id.get(lease.session_id) is lease:
                del self._by_id[lease.session_id]
            for c in lease.connections:
                self._by_conn.pop(c, None)
            return list(lease.connections)

    def begin(self, cid: int) -> None:
        """A request of this connection starts running."""
        with self._lock:
            self._busy = cid
            lease = self._by_conn.get(cid)
            if lease is not None:
                lease.last_seen = self._clock()

    def end(self, cid: int, started: float) -> None:
        """The request that :meth:`begin` announced is answered."""
        with self._lock:
            now = self._clock()
            self._busy = None
            lease = self._by_conn.get(cid)
            if lease is not None:
                lease.last_seen = now
            if now - started > self.lease_s / 4:
                self._stall_end = now  # others' heartbeats waited behind this request

    def disconnect(self, cid: int) -> None:
        """A connection closed: its session's lease starts running out (if it has no other)."""
        with self._lock:
            lease = self._by_conn.pop(cid, None)
            if lease is None:
                return
            lease.connections.discard(cid)
            if not lease.connections:
                lease.detached_at = self._clock()

    def release(self, cid: int) -> Lease | None:
        """End the session a connection serves, now; returns its lease (to free), or None."""
        with self._lock:
            lease = self._by_conn.pop(cid, None)
            if lease is None:
                return None
            self._by_id.pop(lease.session_id, None)
            for c in lease.connections:
                self._by_conn.pop(c, None)
            return lease

    def expired(self) -> tuple[list[Lease], list[int]]:
        """Sessions whose lease ran out (to free), and their connections (to close).

        Removed from the table as they are returned, so a client attaching with
        the same id afterwards starts a new, empty session.
        """
        with self._lock:
            now = self._clock()
            if self._busy is not None:
                return [], []  # a long request may be holding up everyone's heartbeats
            gone, close = [], []
            for sid, lease in list(self._by_id.items()):
                if lease.detached_at is not None:
                    over = now - lease.detached_at > self.lease_s
                else:
                    over = now - max(lease.last_seen, self._stall_end) > self.lease_s
                if over:
                    del self._by_id[sid]
                    for c in lease.connections:
                        self._by_conn.pop(c, None)
                    close.extend(lease.connections)
                    gone.append(lease)
            return gone, close

    def alive(self, key: object, connections) -> bool:
        """True while the session with this store key lives: a lease still in the table, or an open
        connection serving as its own session (``connections``: the open connection ids)."""
        if isinstance(key, Lease):
            with self._lock:
                return self._by_id.get(key.session_id) is key
        return key in connections

    def __len__(self) -> int:
        return len(self._by_id)
