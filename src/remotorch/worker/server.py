"""``remotorch serve``'s server: the socket loop around the worker's service, and the lease reaper.

Socket I/O lives in :mod:`remotorch.transport.listener`; message dispatch in
:mod:`remotorch.worker.service`. This module only wires the two together.
"""

from __future__ import annotations

import logging
import ssl
import threading
import time

from ..codec import messages as m
from ..errors import LimitExceededError, ProtocolError
from ..transport.listener import TcpServer
from .service import Service
from .logs import REQUESTS, log_request
from .activity import error_of
from .metrics import Metrics, request_type
from .tenants import Tenants
from .hostmem import HostMemory
from .worker import Worker


class WorkerServer:
    """Serves one :class:`~remotorch.worker.Worker` over TCP (or TLS, or a Unix socket)."""

    def __init__(self, worker: Worker, host: str = "127.0.0.1", port: int = 7878,
                 token: str | None = None, *, max_frame_bytes: int = 1 << 38,
                 max_message_bytes: int | None = None, lease_s: float = 30.0,
                 tls: ssl.SSLContext | None = None, message_timeout: float = 60.0,
                 unix_path: str | None = None, spin_s: float | None = 0.0, peer_tls_ca: str | None = None,
                 tenants: Tenants | None = None, metrics: tuple[str, int] | None = None,
                 host_memory: HostMemory | None = None) -> None:
        self.worker = worker
        self.host_memory = host_memory  # (trimmed by the housekeeping thread when idle)
        self._last_request = time.monotonic()
        if max_message_bytes is not None:  # no single frame may exceed the whole message either
            max_frame_bytes = min(max_frame_bytes, max_message_bytes)
        self.service = Service(worker, lease_s=lease_s, max_message_bytes=max_message_bytes)
        self.service.peer_tls_ca = peer_tls_ca
        self.service.peer_timeout_s = message_timeout
        tenancy = self.service.use_tenants(tenants) if tenants is not None else None
        self.metrics = Metrics(self.service) if metrics is not None else None
        self._log_requests = REQUESTS.isEnabledFor(logging.INFO)  # (--log-format json)
        handler = self._observed
        self._unsettled: tuple | None = None  # the request just served, until _settle
        self._tcp = TcpServer(handler, host, port, token, protocol=m.PROTOCOL_VERSION,
                              max_frame=max_frame_bytes, on_disconnect=self.service.disconnected,
                              max_header=min(64 << 20, max_message_bytes or 64 << 20),
                              protocol_error=lambda msg: m.encode(m.ErrorReply(ProtocolError.kind, msg)),
                              tls=tls, message_timeout=message_timeout, unix_path=unix_path,
                              spin_s=spin_s, max_message=max_message_bytes,
                              limit_error=lambda msg: m.encode(m.ErrorReply(LimitExceededError.kind, msg)),
                              tickets=self.service.tickets.secret, ticket_handler=self.service.deliver,
                              tenants=tenants, on_connect=None if tenancy is None else tenancy.connected,
                              between=self._between, quiet=lambda: self.service.last_quiet,
                              after=self._settle)
        self.service.close_connection = self._tcp.close_connection
        self.metrics_address = self.metrics.serve(*metrics) if self.metrics is not None else None
        self.address = self._tcp.address
        self.scheme = "unix" if unix_path is not None else "tls" if tls is not None else "tcp"
        self._reaper_stop = threading.Event()

    @property
    def url(self) -> str:
        if self.scheme == "unix":
            return f"unix://{self.address[0]}"
        return f"{self.scheme}://{self.address[0]}:{self.address[1]}"

    def serve_forever(self) -> None:
        """Serve until :meth:`shutdown`; requests run on the calling thread, one at a time."""
        reaper = threading.Thread(target=self._reap, name="remotorch-leases", daemon=True)
        reaper.start()
        try:
            self._tcp.serve_forever()
        finally:
            self._reaper_stop.set()
            self.service.peers.close()
            if self.metrics is not None:
                self.metrics.close()

    def _observed(self, cid: int, header: bytes, frames: list):
        """The service's handler; the request is counted for the operator (Stats), in the metrics
        and logged (``--log-format json``) by :meth:`_settle`, once its reply is written."""
        if self._unsettled is not None:
            self._settle()
        started = time.perf_counter()
        if self.host_memory is not None:
            self.host_memory.served()
        reply = self.service.handle(cid, header, frames)
        self._last_request = time.monotonic()
        service = self.service
        if self.metrics is None and not self._log_requests:
            self._unsettled = (cid, service.last_body, service.last_run, reply, 0, 0.0)
        else:
            self._unsettled = (cid, service.last_body, service.last_run, reply,
                               len(header) + sum(memoryview(f).nbytes for f in frames),
                               (time.perf_counter() - started) * 1e3)
        return reply

    def _settle(self) -> None:
        """What follows a request, off its round trip: the serving loop calls this once the reply is
        written (or its connection dropped), and the next request first."""
        service = self.service
        service.replays.settle()
        unsettled, self._unsettled = self._unsettled, None
        if unsettled is None:
            return
        cid, body, run, reply, nbytes_in, ms = unsettled
        error = error_of(reply[0])
        tenancy = service.tenancy
        tenant = tenancy.name(cid) if tenancy is not None else ""
        service.activity.record(tenant, body, error, run)
        if self.metrics is None and not self._log_requests:
            return
        kind = error.kind if error is not None else None
        nbytes_out = len(reply[0]) + sum(memoryview(f).nbytes for f in reply[1])
        if self.metrics is not None:
            self.metrics.observe(cid, body, kind, nbytes_in, nbytes_out, run)
        if self._log_requests:
            log_request(tenant, service.leases.key(cid), request_type(body) if body is not None else "malformed",
                        ms, kind or "ok", nbytes_in, nbytes_out, run)

    def reload_tokens(self) -> None:
        """Read the tokens file again, between requests (safe in a signal handler: SIGHUP)."""
        self.service.request_reload()
        self._tcp.wake()

    def _between(self) -> None:
        if self.service.reload_pending:
            self.service.reload_tokens()

    def shutdown(self) -> None:
        """Stop serving (the request in progress finishes first). Safe from any thread."""
        self._reaper_stop.set()
        self._tcp.shutdown()

    def _reap(self) -> None:
        """Free sessions whose lease ran out; close connections that went silent."""
        interval = min(1.0, self.service.leases.lease_s / 4)
        while not self._reaper_stop.wait(interval):
            self.service.reap()
            if self.host_memory is not None:
                self.host_memory.idle(time.monotonic() - self._last_request)
