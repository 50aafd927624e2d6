"""A worker's tenants at work: which tenant each connection and session is, and what it may do.

:class:`Tenancy` sits between the service and the worker:

* the listener tells it the key id each connection's hello named
  (:meth:`connected`); every request then passes :meth:`admit` (a revoked
  tenant is refused with ``AuthenticationError``, one over its request rate
  with ``QuotaExceededError``);
* a session is a lease (``Attach``) or a connection serving as its own; it
  belongs to the tenant that made it, and another tenant cannot attach to it
  (:meth:`attach`), or make more sessions than its ``max_sessions``;
* the worker asks it for a session's tenant-wide memory quota and its
  custom-operator namespaces (:meth:`reserve`, :meth:`allowed_ops`).

Values, graphs and cache entries stay per session as they always were (a
session sees only what it uploaded or made): sessions of two tenants share
nothing a session of either could name.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch

from ..codec.ops import CORE_NAMESPACES, TORCH_NAMESPACES, not_allowed
from ..errors import AuthenticationError, InvalidRequestError, QuotaExceededError
from .leases import Lease, LeaseTable
from .tenants import Tenant, Tenants

log = logging.getLogger(__name__)
_UNKNOWN = object()


class Tenancy:
    """Connections and sessions by tenant, for one worker's service."""

    def __init__(self, tenants: Tenants, leases: LeaseTable) -> None:
        self.tenants = tenants
        self.leases = leases
        self._lock = threading.Lock()
        self._kid: dict[int, bytes | None] = {}  # connection -> the key id of its hello (None: plain)
        self._revoked: set[int] = set()  # connections whose tenant was revoked
        self._own: set[int] = set()  # unattached connections that serve as their own session

    # ----------------------------------------------------------- connections
    def connected(self, cid: int, kid: bytes | None) -> None:
        with self._lock:
            self._kid[cid] = kid

    def disconnected(self, cid: int) -> None:
        with self._lock:
            self._kid.pop(cid, None)
            self._revoked.discard(cid)
            self._own.discard(cid)

    def tenant(self, cid: int) -> Tenant | None:
        """The tenant a connection authenticated as (None: revoked). A connection the listener never
        announced (an in-process service) is the unnamed tenant."""
        kid = self._kid.get(cid, _UNKNOWN)
        if kid is _UNKNOWN:
            return self.tenants.get(None)
        return None if cid in self._revoked else self.tenants.get(kid)

    def name(self, cid: int) -> str:
        tenant = self.tenant(cid)
        return "?" if tenant is None else tenant.name

    def admit(self, cid: int, stream: bool, liveness: bool = False) -> None:
        """Raise for a request this connection may not make now (``stream``: it runs in a session;
        ``liveness``: attach, heartbeat or detach, which no request rate refuses)."""
        tenant = self.tenant(cid)
        if tenant is None:
            raise AuthenticationError("this connection's token was revoked: its sessions ended")
        if not liveness and not tenant.admit():
            raise QuotaExceededError(f"tenant {tenant.name or '(unnamed)'} is over its rate of "
                                     f"{tenant.requests_per_second:g} requests per second")
        if stream and cid not in self._own and not isinstance(self.leases.key(cid), Lease):
            self._count(tenant, cid)  # its first request: the connection becomes a session
            with self._lock:
                self._own.add(cid)

    def attach(self, cid: int, session_id: str) -> None:
        """Check an ``Attach`` before the lease table takes it: a session belongs to its tenant."""
        tenant = self.tenant(cid)
        if tenant is None:
            raise AuthenticationError("this connection's token was revoked: its sessions ended")
        lease = self.leases.lookup(session_id)
        if lease is not None:
            if lease.kid != tenant.key_id:
                raise InvalidRequestError("no such session for this token")
            return
        self._count(tenant, cid)

    def attached(self, cid: int, session_id: str) -> None:
        lease = self.leases.lookup(session_id)
        tenant = self.tenant(cid)
        if lease is not None and tenant is not None and lease.kid is None:
            lease.kid = tenant.key_id
        with self._lock:
            self._own.discard(cid)

    def _count(self, tenant: Tenant, cid: int) -> None:
        if tenant.max_sessions is not None and len(self.sessions(tenant.key_id, but=cid)) >= tenant.max_sessions:
            raise QuotaExceededError(f"tenant {tenant.name or '(unnamed)'} has {tenant.max_sessions} sessions "
                                     "on this worker, its limit (close one, or let its lease run out)")

    def sessions(self, kid: bytes, but: int | None = None) -> list:
        """The store keys of a tenant's live sessions (leases, and connections serving as their own)."""
        keys: list = [lease for lease in self.leases.leases() if lease.kid == kid]
        with self._lock:
            keys += [c for c in self._own if c != but and self._kid.get(c) == kid
                     and not isinstance(self.leases.key(c), Lease)]
        return keys

    def session_counts(self) -> dict[str, int]:
        """Live sessions by tenant name."""
        out: dict[str, int] = {}
        for kid in {lease.kid for lease in self.leases.leases()} | set(self._kid.values()):
            tenant = self.tenants.get(kid) if kid is not None else self.tenants.get(None)
            if tenant is not None:
                out[tenant.name] = len(self.sessions(tenant.key_id))
        return out

    def _kid_of(self, session: object) -> bytes | None:
        if isinstance(session, Lease):
            return session.kid
        kid = self._kid.get(session, _UNKNOWN)
        if kid is _UNKNOWN or kid is None:
            tenant = self.tenants.get(None)
            return None if tenant is None else tenant.key_id
        return kid

    # ---------------------------------------------------------------- reload
    def reload(self, end_session: Callable[[object], None]) -> list[str]:
        """Read the tokens file again; the revoked tenants' sessions end (``end_session(key)``) and their
        connections' next request is refused. Returns the names of the tenants revoked."""
        before = {t.key_id: t.name for t in self.tenants.all()}  # (a revoked tenant is named, connected or not)
        try:
            gone = set(self.tenants.reload())
        except ValueError as exc:
            log.error("tokens file not reloaded (everything stays as it was): %s", exc)
            return []
        if not gone:
            return []
        for lease in self.leases.leases():
            if lease.kid in gone:
                for cid in self.leases.drop(lease):
                    with self._lock:
                        self._revoked.add(cid)
                end_session(lease)
        with self._lock:
            doomed = [c for c, k in self._kid.items() if k in gone or (k is None and self.tenants.get(None) is None)]
            self._revoked.update(doomed)
            own = [c for c in doomed if c in self._own]
            self._own.difference_update(doomed)
        for cid in own:
            end_session(cid)
        names = sorted(before[k] for k in gone)
        log.warning("tokens reloaded: revoked %s; %d connection(s) refused from now on", names, len(doomed))
        return names

    # ------------------------------------------------------------ the worker's
    def over_quota(self, session: object, nbytes: int, bytes_of: Callable[[object], int]) -> str:
        """Why ``nbytes`` more held by ``session`` would exceed its tenant's memory quota ("" if not):
        ``bytes_of(key)`` is what one session holds; the quota counts all the tenant's together."""
        kid = self._kid_of(session)
        tenant = self.tenants.get(kid) if kid is not None else None
        if tenant is None or tenant.memory_quota is None:
            return ""
        sessions = self.sessions(kid)
        if session not in sessions:
            sessions.append(session)
        held = sum(map(bytes_of, sessions))
        if held + nbytes <= tenant.memory_quota:
            return ""
        return (f"tenant {tenant.name or '(unnamed)'} would hold {held + nbytes} bytes on the worker, over its "
                f"memory quota of {tenant.memory_quota} (its {len(sessions)} session(s) hold {held} now)")

    def operator(self, session: object) -> bool:
        """Whether a session's tenant may see the worker's activity (``operator = true``; ``--token``'s)."""
        kid = self._kid_of(session)
        tenant = self.tenants.get(kid) if kid is not None else None
        return tenant is not None and tenant.operator

    def allowed_ops(self, session: object, worker_ops: frozenset[str]) -> frozenset[str]:
        """The custom-operator namespaces a session's graphs may call: the worker's, narrowed by its tenant's."""
        kid = self._kid_of(session)
        tenant = self.tenants.get(kid) if kid is not None else None
        if tenant is None or tenant.allow_ops is None:
            return worker_ops
        return worker_ops & tenant.allow_ops


def check_namespaces(module: torch.fx.GraphModule, allowed: frozenset[str]) -> None:
    """Raise the typed refusal for a decoded graph (subgraphs included) that calls a custom operator
    outside ``allowed`` (a graph another session decoded under a wider allowlist)."""
    for sub in module.modules():
        graph = getattr(sub, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        for node in graph.nodes:
            ns = getattr(node.target, "namespace", None) if node.op == "call_function" else None
            if ns is not None and ns not in CORE_NAMESPACES and ns not in TORCH_NAMESPACES and ns not in allowed:
                raise not_allowed(f"{ns}::{getattr(node.target, '_opname', node.target)}", ns)
