"""The worker server: transport + codec + worker, and nothing else.

Each connection is one session. Every request gets exactly one reply; every
failure becomes an ``ErrorReply`` naming a ``remotorch.errors`` kind, and the
server keeps serving.
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
import traceback

import msgspec

from ..codec import messages as m
from ..codec.values import values_to_args
from ..errors import (InvalidRequestError, LimitExceededError, ProtocolError, RemoteError,
                     RemoteOutOfMemoryError)
from .leases import SESSION_ID, LeaseTable
from .service_training import serve_training
from ..transport.listener import TcpServer
from .worker import Worker

log = logging.getLogger(__name__)


class WorkerServer:
    """Serves one :class:`~remotorch.worker.Worker` over TCP (or TLS, or a Unix socket)."""

    def __init__(self, worker: Worker, host: str = "127.0.0.1", port: int = 7878,
                 token: str | None = None, *, max_frame_bytes: int = 1 << 38,
                 max_message_bytes: int | None = None, lease_s: float = 30.0,
                 tls: ssl.SSLContext | None = None, message_timeout: float = 60.0,
                 unix_path: str | None = None, spin_s: float = 0.0) -> None:
        self.worker = worker
        self.max_message_bytes = max_message_bytes
        if max_message_bytes is not None:  # no single frame may exceed the whole message either
            max_frame_bytes = min(max_frame_bytes, max_message_bytes)
        self._leases = LeaseTable(lease_s)
        self._tcp = TcpServer(self.handle, host, port, token, protocol=m.PROTOCOL_VERSION,
                              max_frame=max_frame_bytes, on_disconnect=self._disconnected,
                              max_header=min(64 << 20, max_message_bytes or 64 << 20),
                              protocol_error=lambda msg: m.encode(m.ErrorReply(ProtocolError.kind, msg)),
                              tls=tls, message_timeout=message_timeout, unix_path=unix_path,
                              spin_s=spin_s, max_message=max_message_bytes,
                              limit_error=lambda msg: m.encode(m.ErrorReply(LimitExceededError.kind, msg)))
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

    def shutdown(self) -> None:
        """Stop serving (the request in progress finishes first). Safe from any thread."""
        self._reaper_stop.set()
        self._tcp.shutdown()

    # ------------------------------------------------------------------ sessions
    def _disconnected(self, cid: int) -> None:
        self.worker.close_session(cid)  # what the connection held as itself
        self._leases.disconnect(cid)  # an attached session waits for its lease

    def _reap(self) -> None:
        """Free sessions whose lease ran out; close connections that went silent."""
        interval = min(1.0, self._leases.lease_s / 4)
        while not self._reaper_stop.wait(interval):
            gone, close = self._leases.expired()
            for cid in close:
                self._tcp.close_connection(cid)
            for lease in gone:
                log.info("session %r: lease expired, freeing what it held", lease)
                self.worker.close_session(lease)

    def _attach(self, cid: int, req: m.Attach) -> tuple[bytes, list]:
        if not SESSION_ID.fullmatch(req.session_id):
            raise InvalidRequestError("session id must be 16 to 128 characters of [0-9A-Za-z_-]")
        try:
            resumed, displaced = self._leases.attach(cid, req.session_id)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        for other in displaced:
            self._tcp.close_connection(other)
        return m.encode(m.AttachReply(resumed, self._leases.lease_s)), []

    # ------------------------------------------------------------------ dispatch
    def handle(self, session: int, header: bytes, frames: list) -> tuple[bytes, list]:
        """Decode one request, run it, encode the reply (errors included)."""
        try:
            try:
                request = m.decode(header)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise ProtocolError(f"malformed request header: {exc}") from None
            self._check_size(header, frames)
            started = time.monotonic()
            self._leases.begin(session)
            try:
                return self._dispatch(session, request, frames)
            finally:
                self._leases.end(session, started)
        except RemoteError as exc:
            return self._error(exc), []
        except MemoryError as exc:
            return m.encode(m.ErrorReply(RemoteOutOfMemoryError.kind, f"worker out of host memory: {exc}")), []
        except Exception as exc:  # a bug of ours must still be an answer, not a dead worker
            log.exception("unexpected error while serving a request")
            return m.encode(m.ErrorReply("worker", f"{type(exc).__name__}: {exc}",
                                         traceback.format_exc())), []

    def _check_size(self, header: bytes, frames: list) -> None:
        if self.max_message_bytes is not None:
            size = len(header) + sum(f.nbytes for f in frames)
            if size > self.max_message_bytes:
                raise LimitExceededError(f"message of {size} bytes is over the worker's limit of "
                                         f"{self.max_message_bytes}")

    def _dispatch(self, session: int, req, frames: list) -> tuple[bytes, list]:
        if isinstance(req, m.Attach):
            return self._attach(session, req)
        if isinstance(req, m.Heartbeat):
            return m.encode(m.Ok()), []
        if isinstance(req, m.Detach):
            lease = self._leases.release(session)
            if lease is not None:
                self.worker.close_session(lease)
            return m.encode(m.Ok()), []
        session = self._leases.key(session)
        if isinstance(req, m.RunGraph):
            return self._run(session, req, frames)
        if isinstance(req, m.PutTensors):
            self.worker.put_tensors(session, req.ids, req.metas, frames)
            return m.encode(m.Ok()), []
        if isinstance(req, m.PutGraph):
            self.worker.put_graph(session, req.graph_id, req.doc, req.consts, frames)
            return m.encode(m.Ok()), []
        if isinstance(req, m.Health):
            return m.encode(m.HealthReply(protocol=m.PROTOCOL_VERSION, sessions=self._tcp.connections, **self.worker.info())), []
        if isinstance(req, m.Echo):
            return m.encode(m.EchoReply()), frames
        if isinstance(req, m.ProfileGraph):
            return self._profile(session, req, frames)
        if isinstance(req, m.TRAINING_REQUESTS):
            return serve_training(self.worker, session, req, frames)
        raise ProtocolError(f"{type(req).__name__} is not a request")

    def _run(self, session: int, req: m.RunGraph, frames: list) -> tuple[bytes, list]:
        args = []
        for a in req.args:
            if isinstance(a, m.RefArg):
                args.append(("ref", a.id))
            elif isinstance(a, m.ScalarArg):
                args.append(a.value)
            else:
                args.append(self.worker.wire_tensor(a.meta, frames))
        outs, ms, compiled = self.worker.run(session, req.graph_id, req.engine, args, frames)
        out_args, out_frames = values_to_args(outs)
        return m.encode(m.RunReply(out_args, ms, compiled)), out_frames

    def _profile(self, session: int, req: m.ProfileGraph, frames: list) -> tuple[bytes, list]:
        start = time.perf_counter()
        args = [("ref", a.id) if isinstance(a, m.RefArg) else a.value if isinstance(a, m.ScalarArg)
                else self.worker.wire_tensor(a.meta, frames) for a in req.args]
        outs, runs, compiled, compile_ms = self.worker.profile(
            session, req.graph_id, req.engine, args, frames, warmups=req.warmups, repeats=req.repeats)
        out_args, out_frames = values_to_args(outs)
        worker_ms = (time.perf_counter() - start) * 1e3
        return m.encode(m.ProfileReply(out_args, runs.times_ms, runs.clock, compiled, compile_ms,
                                       worker_ms)), out_frames

    @staticmethod
    def _error(exc: RemoteError) -> bytes:
        graphs = getattr(exc, "graphs", [])
        tensors = getattr(exc, "tensors", [])
        return m.encode(m.ErrorReply(exc.kind, exc.message, exc.remote_traceback, graphs, tensors))
