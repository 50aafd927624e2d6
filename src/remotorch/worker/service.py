"""The worker's service: one request message in, one reply message out. No sockets.

:class:`Service` decodes a request (frame 0 and its buffer frames), checks it, calls the
:class:`~remotorch.worker.worker.Worker` and encodes the reply. Every failure becomes an
``ErrorReply`` naming a ``remotorch.errors`` kind and the service keeps serving. It also keeps the
lease table: which worker-side session each connection serves (``Attach``), and which sessions'
leases ran out (:meth:`Service.reap`). The socket loop (:mod:`remotorch.worker.server`) calls it
for each message; tests may call it in-process.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import time
import traceback
from collections.abc import Callable

import msgspec
import torch

from ..codec import messages as m
from ..codec.frames import FrameWriter
from ..errors import (AuthenticationError, InvalidRequestError, LimitExceededError, ProtocolError, RemoteError,
                      RemoteOutOfMemoryError, WorkerError)
from ..transport import framing
from .attention import answer as _attention_choice
from .leases import SESSION_ID, LeaseTable
from .runs import error_of, run_reply, serve_runs
from .activity import Activity
from .replay import Replays
from .tenancy import Tenancy
from .tenants import Tenants
from .peers import PeerLinks, Tickets, deliver_proof
from .worker import Worker
from .replies import OK as _OK, Reply, ok as _ok
from . import service_training, service_weights

log = logging.getLogger(__name__)

_LIVENESS = (m.Attach, m.Heartbeat, m.Detach)  # never refused for a tenant's request rate


def error_reply(exc: RemoteError) -> bytes:
    """A typed failure as the reply header (missing objects listed, for the client to re-upload)."""
    return m.encode(error_of(exc))


class Service:
    """Message dispatch for one worker, with the lease table of its sessions.

    ``close_connection(cid)`` is how the service asks the transport to drop a
    connection (one displaced by a reconnect, or one whose session expired).
    """

    def __init__(self, worker: Worker, *, lease_s: float = 30.0, max_message_bytes: int | None = None,
                 close_connection: Callable[[int], None] = lambda cid: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.worker = worker
        self.max_message_bytes = max_message_bytes
        self.leases = LeaseTable(lease_s, clock)
        self.close_connection = close_connection
        self._connections: set[int] = set()
        self.tickets = Tickets(clock=clock)
        self.peers = PeerLinks()  # one idle connection per peer worker, for deliveries
        self.peer_timeout_s = 60.0  # a send to another worker: connect and delivery
        self.peer_tls_ca: str | None = None  # CA to check tls:// workers this one sends to
        self._nonce_key = secrets.token_bytes(32)  # each session's possession nonce derives from it (§20)
        self.replays = Replays(error_reply)  # what each session's stream ran, to run nothing twice
        self.tenancy: Tenancy | None = None  # named tenants (``use_tenants``); None: one, unnamed
        self.last_body = self.last_run = None  # the last request's message, and (engine, ms) of a graph it ran
        self.activity = Activity()  # counters and recent errors for the operator's view (Stats)
        self.reload_pending = False  # SIGHUP asked to read the tokens file again (done between requests)

    def use_tenants(self, tenants: Tenants) -> Tenancy:
        """Serve these tenants: each connection is one, and the worker asks its quotas and allowlists."""
        self.tenancy = self.worker.tenancy = Tenancy(tenants, self.leases)
        self.worker.handles.track()  # (a tenant's quota asks what its sessions hold before every output kept)
        return self.tenancy

    def request_reload(self) -> None:
        """Ask for the tokens file to be read again before the next request (safe in a signal handler)."""
        self.reload_pending = True

    def reload_tokens(self) -> list[str]:
        """Read the tokens file again now (on the serving thread, between requests): the revoked
        tenants' sessions end; the names revoked. A file that cannot be read changes nothing."""
        self.reload_pending = False
        return self.tenancy.reload(self._end_session) if self.tenancy is not None else []

    def _end_session(self, key: object) -> None:
        self.worker.close_session(key)
        self.replays.forget(key)

    # ------------------------------------------------------------------ sessions
    def disconnected(self, cid: int) -> None:
        """A connection closed: what it held as itself is freed; an attached session waits for its lease."""
        self._connections.discard(cid)
        if self.tenancy is not None:
            self.tenancy.disconnected(cid)
        self._end_session(cid)
        self.leases.disconnect(cid)

    def reap(self) -> None:
        """Free sessions whose lease ran out and close their connections (called periodically)."""
        gone, close = self.leases.expired()
        for cid in close:
            self.close_connection(cid)
        for lease in gone:
            log.info("session %r: lease expired, freeing what it held", lease)
            self._end_session(lease)

    def sessions(self) -> int:
        """Worker-side sessions now: attached sessions, and connections that serve as their own."""
        attached = sum(1 for cid in self._connections if self.leases.key(cid) != cid)
        return len(self.leases) + len(self._connections) - attached

    # ------------------------------------------------------------------ dispatch
    def handle(self, cid: int, header: bytes, frames: list) -> Reply:
        """Decode one request, run it, encode the reply (errors included)."""
        self._connections.add(cid)
        self.last_body = self.last_run = None  # (what the metrics read after each request)
        self.last_quiet = False  # its reply only acknowledges it: the transport may hold it (see listener)
        try:
            try:
                env = m.decode_envelope(header)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise ProtocolError(f"malformed request header: {exc}") from None
            self._check_size(header, frames)
        except RemoteError as exc:
            return error_reply(exc), []
        self.last_body = env.body
        if env.seq < 0 or env.ack < 0:
            return error_reply(ProtocolError("sequence numbers are never negative")), []
        if self.reload_pending:
            self.reload_tokens()
        if self.tenancy is not None:
            try:
                self.tenancy.admit(cid, env.seq > 0, isinstance(env.body, _LIVENESS))
            except RemoteError as exc:
                return error_reply(exc), []
        if not env.seq:  # outside the session's stream: attach, heartbeat, detach
            if env.ack:
                self.replays.acknowledge(self.leases.key(cid), env.ack)
            return self._serve(cid, env, frames)
        session, replays = self.leases.key(cid), self.replays
        reply = replays.answered(session, env.seq)  # sent again after a reconnect: it ran already
        if reply is None:
            reply = self._serve(cid, env, frames)
            replays.ran(session, env.seq, reply, env.ack)  # (the acknowledged replies forgotten after)
        else:
            replays.acknowledge(session, env.ack)
        self.last_quiet = self.last_quiet or reply[0] is _OK
        return reply

    def _serve(self, cid: int, env: m.Envelope, frames: list) -> Reply:
        """Run one decoded request; its reply (a typed error when it failed)."""
        try:
            started = time.monotonic()
            self.leases.begin(cid)
            try:
                return self._dispatch(cid, env.body, env.pending, frames)
            finally:
                self.leases.end(cid, started)
        except RemoteError as exc:
            return error_reply(exc), []
        except MemoryError as exc:
            return error_reply(RemoteOutOfMemoryError(f"worker out of host memory: {exc}")), []
        except Exception as exc:  # a bug of ours must still be an answer, not a dead worker
            log.exception("unexpected error while serving a request")
            return error_reply(WorkerError(f"{type(exc).__name__}: {exc}",
                                           remote_traceback=traceback.format_exc())), []

    def _check_size(self, header: bytes, frames: list) -> None:
        limit = self.max_message_bytes
        if limit is not None and (size := len(header) + sum(f.nbytes for f in frames)) > limit:
            raise LimitExceededError(f"message of {size} bytes is over the worker's limit of {limit}")

    def _dispatch(self, cid: int, req, pending: m.Pending | None, frames: list) -> Reply:
        if isinstance(req, m.Attach):
            return self._attach(cid, req)
        if isinstance(req, m.Heartbeat):
            return _ok()
        if isinstance(req, m.Detach):
            lease = self.leases.release(cid)
            if lease is not None:
                self.worker.close_session(lease)
                self.replays.forget(lease)
            return _ok()
        session = self.leases.key(cid)
        if pending is not None:
            self.worker.apply_pending(session, pending)
        handler = _HANDLERS.get(type(req))
        if handler is None:
            raise ProtocolError(f"{type(req).__name__} is not a request")
        return handler(self, session, req, frames)

    def _attach(self, cid: int, req: m.Attach) -> Reply:
        if not SESSION_ID.fullmatch(req.session_id):
            raise InvalidRequestError("session id must be 16 to 128 characters of [0-9A-Za-z_-]")
        if self.tenancy is not None:
            self.tenancy.attach(cid, req.session_id)
        try:
            resumed, displaced = self.leases.attach(cid, req.session_id)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        if self.tenancy is not None:
            self.tenancy.attached(cid, req.session_id)
        for other in displaced:
            self.close_connection(other)
        return m.encode(m.AttachReply(resumed, self.leases.lease_s)), []

    # --------------------------------------------------------------- core messages
    def _health(self, session, req: m.Health, frames) -> Reply:
        return m.encode(m.HealthReply(protocol=m.PROTOCOL_VERSION, sessions=self.sessions(),
                                      connections=len(self._connections),
                                      framing="python" if framing._C is None else "compiled",
                                      **self.worker.info())), []

    def _stats(self, session, req: m.Stats, frames) -> Reply:
        if self.tenancy is not None and not self.tenancy.operator(session):
            raise AuthenticationError("only an operator's token may ask for the worker's activity")
        return m.encode(self.activity.reply(self)), []

    def _echo(self, session, req: m.Echo, frames) -> Reply:
        return m.encode(m.EchoReply()), frames

    def _put_graph(self, session, req: m.PutGraph, frames) -> Reply:
        self.worker.put_graph(session, req.graph_id, req.doc, req.consts, frames)
        return _ok()

    def _put_tensors(self, session, req: m.PutTensors, frames) -> Reply:
        self.worker.put_tensors(session, req.ids, req.metas, frames)
        return _ok()

    def _profile(self, session, req: m.ProfileGraph, frames) -> Reply:
        start = time.perf_counter()
        outs, runs, compiled, compile_ms, cuda_graph = self.worker.profile(session, req.graph_id, req.engine, req.args,
            frames, warmups=req.warmups, repeats=req.repeats, cuda_graphs=req.cuda_graphs)
        w = FrameWriter()
        out_args = w.values(outs)
        worker_ms = (time.perf_counter() - start) * 1e3
        return m.encode(m.ProfileReply(out_args, runs.times_ms, runs.clock, compiled, compile_ms, worker_ms,
                                       cuda_graph)), w.frames

    # --------------------------------------------------------------------- runs
    def _run(self, session, req: m.Run, frames) -> Reply:
        """Run a graph; the worker disposes of each output as the request's plan says."""
        ran = self.worker.run(session, req, frames, self._send)
        self.last_run = (req.engine, ran.ms)
        w = FrameWriter()
        reply = run_reply(ran, req.brief, w)
        # a brief reply with no value (nothing after this can fail: not an error's) only acknowledges
        self.last_quiet = req.brief and not reply.outputs and not reply.rng
        return m.encode(reply), w.frames

    def _runs(self, session, req: m.Runs, frames) -> Reply:
        """Eager calls queued together (§18.4): each run in order, one reply for all."""
        reply, out = serve_runs(self.worker, session, req, frames, self._send)
        self.last_run = ("eager", sum(reply.run_ms))
        self.last_quiet = not reply.said
        return m.encode(reply), out

    def _send(self, url: str, ticket_id: bytes, secret: bytes, tensors: list) -> None:
        self.peers.send(url, ticket_id, secret, tensors, timeout=self.peer_timeout_s, tls_ca=self.peer_tls_ca)

    # ------------------------------------------------ values that stay on the worker
    def _arg_tensor(self, session, a) -> torch.Tensor:
        if isinstance(a, m.ViewArg):
            return self.worker.handles.view(session, a.id, a.shape, a.strides, a.offset)
        return self.worker.handles.get(session, a.id)

    def _fetch(self, session, req: m.Fetch, frames) -> Reply:
        w = FrameWriter()
        metas = [w.meta(self._arg_tensor(session, a)) for a in req.args]
        return m.encode(m.FetchReply(metas)), w.frames

    def _expect_handles(self, session, req: m.ExpectHandles, frames) -> Reply:
        if len(req.handles) != len(req.metas) or len(set(req.handles)) != len(req.handles):
            raise InvalidRequestError("one layout per expected handle, and distinct handles")
        ticket = self.tickets.issue(session, req.handles, req.metas, req.ttl_s, req.ticket_id, req.secret)
        # a run that names one of them before it arrives waits for it (the sender runs in parallel)
        self.worker.handles.expect(session, req.handles, time.monotonic() + (ticket.expires - self.tickets.now()))
        return m.encode(m.TicketReply(ticket.ticket_id, ticket.secret,
                                      ticket.expires - self.tickets.now())), []

    def _send_handles(self, session, req: m.SendHandles, frames) -> Reply:
        """Open a connection to the receiving worker with its ticket and deliver the tensors (this loop waits)."""
        tensors = [self._arg_tensor(session, a) for a in req.args]
        self._send(req.url, req.ticket_id, req.secret, tensors)
        return _ok()

    def deliver(self, ticket_id: bytes | None, binding: bytes, header: bytes, frames: list) -> Reply:
        """A message of a connection opened with a ticket (runs on that connection's thread).

        ``ticket_id``: the ticket the connection's hello presented, for its
        first message; None for a later one, which names its own ticket and
        proves its secret for this connection (``binding``).
        """
        try:
            try:
                req = m.decode(header)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise ProtocolError(f"malformed message: {exc}") from None
            if not isinstance(req, m.Deliver):
                raise ProtocolError("a ticket connection carries only Deliver")
            if ticket_id is None:  # a later delivery on the connection: its own ticket, proven
                secret = self.tickets.secret(req.ticket)
                if secret is None or not hmac.compare_digest(req.proof, deliver_proof(secret, binding, req.ticket)):
                    raise InvalidRequestError("the ticket was used already or expired, or its proof is wrong")
                ticket_id = req.ticket
            elif req.ticket and req.ticket != ticket_id:
                raise ProtocolError("the first Deliver of a ticket connection is under the hello's ticket")
            ticket = self.tickets.take(ticket_id)
            if ticket is None:
                raise InvalidRequestError("the ticket was used already or expired")
            if not self.leases.alive(ticket.session, self._connections):
                raise InvalidRequestError("the session that issued the ticket has ended")
            if len(req.metas) != len(ticket.metas) or any(
                    (a.dtype, a.shape, a.strides) != (b.dtype, b.shape, b.strides)
                    for a, b in zip(req.metas, ticket.metas)):
                raise InvalidRequestError("delivered tensors do not match the ticket's layouts")
            reader = self.worker.reader(frames)
            tensors = [reader.tensor(meta).to(self.worker.device) for meta in req.metas]
            self.worker.handles.put(ticket.session, ticket.handles, tensors)
            return _ok()
        except RemoteError as exc:
            return error_reply(exc), []

    def _flush(self, session, req: m.Flush, frames) -> Reply:
        return _ok()  # the envelope's housekeeping was applied in _dispatch

    # --------------------------------------------------------------- disk cache (§20)
    def _nonce(self, session) -> bytes:
        """This session's nonce for possession proofs: fixed for the session, unknown to others."""
        return hmac.new(self._nonce_key, repr(session).encode(), hashlib.sha256).digest()[:16]

    def _challenge(self, session, req: m.Challenge, frames) -> Reply:
        return m.encode(m.ChallengeReply(self._nonce(session) if self.worker.disk is not None else b"")), []

    def _have(self, session, req: m.Have, frames) -> Reply:
        if len(req.graphs) + len(req.tensors) > 1 << 16:
            raise LimitExceededError("a Have names at most 65536 objects")
        graphs, tensors = self.worker.have(session, self._nonce(session), req.graphs, req.tensors)
        return m.encode(m.HaveReply(graphs, tensors)), []

    # ------------------------------------------------------------ process groups (§19)
    def _open_store(self, session, req: m.OpenStore, frames) -> Reply:
        return m.encode(m.StoreReply(self.worker.groups.open_store(session, req.timeout_s))), []

    def _join_group(self, session, req: m.JoinGroup, frames) -> Reply:
        self.worker.groups.join(session, req.group, req.store, req.prefix, req.rank, req.world, req.timeout_s)
        return _ok()

    def _leave_group(self, session, req: m.LeaveGroup, frames) -> Reply:
        self.worker.groups.leave(session, req.group)
        return _ok()

    def _broadcast_slots(self, session, req: m.BroadcastSlots, frames) -> Reply:
        self.worker.groups.broadcast_slots(session, req.group, req.slots, req.shapes, req.dtypes, req.root)
        return _ok()

    def _reduce_grads(self, session, req: m.ReduceGrads, frames) -> Reply:
        self.worker.groups.reduce_grads(session, req.group, req.slots, req.weight, req.bucket_bytes, req.wait)
        return _ok()


_HANDLERS: dict[type, Callable[[Service, object, object, list], Reply]] = {
    m.Health: Service._health, m.Stats: Service._stats, m.Echo: Service._echo, m.PutGraph: Service._put_graph,
    m.PutTensors: Service._put_tensors, m.Run: Service._run, m.Runs: Service._runs,
    m.ProfileGraph: Service._profile,
    m.Flush: Service._flush, m.Fetch: Service._fetch,
    m.ExpectHandles: Service._expect_handles, m.SendHandles: Service._send_handles,
    m.OpenStore: Service._open_store, m.JoinGroup: Service._join_group, m.LeaveGroup: Service._leave_group,
    m.BroadcastSlots: Service._broadcast_slots, m.ReduceGrads: Service._reduce_grads,
    m.Challenge: Service._challenge, m.Have: Service._have, m.AttentionChoice: _attention_choice,
    **service_training.HANDLERS,  # training state (§17)
    **service_weights.HANDLERS,  # weights read and written by the worker (§22)
}
