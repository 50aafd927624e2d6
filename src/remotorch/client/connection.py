"""One worker as the client sees it: the ONE copy of the client's call policy.

A :class:`Connection` owns, for one worker:

* the transport and the worker-side session it attaches to on every new
  connection (uploads survive a dropped connection for the worker's lease;
  a background thread sends heartbeats while the connection is idle);
* what the worker holds for it: graphs and resident tensors by content id;
* the policy, each piece in its own method, layered as httpx's client is:
  :meth:`call` (retry once after the worker forgot objects) →
  :meth:`ensure_graph` / :meth:`pack_args` / :meth:`refs` (upload what is
  missing) → :meth:`request` (a short back-off after a worker failed to
  answer; the only method that touches the transport);
* counters (:attr:`stats`).

Sessions, training, profiling and the pipeline all run their requests
through this public API; none keeps a copy of it.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from collections import deque
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import msgspec
import torch

from .. import errors
from ..codec import messages as m
from ..codec.frames import SCALARS, FrameReader, FrameWriter
from ..transport import TcpTransport, Transport
from ..transport.tls import client_context
from .handles import HandleTable
from .remote import RemoteTensor, arg_of, keep_values, placeholder, plain, remote_ref
from .ids import ContentIds
from .reuse import InputReuse

if TYPE_CHECKING:
    from ..codec.graph import GraphPayload

log = logging.getLogger(__name__)

# MissingObjectsError ids with these prefixes name worker-side state the client
# cannot upload again (saved activations, parameter slots, optimizers).
UNRECOVERABLE = ("handle:", "slot:", "optim:")

# (url, token) of the worker, resolved when the first request needs it
Locate = Callable[[], tuple[str, "str | None"]]


class Graph(Protocol):
    """What the client needs of a captured graph (``remotorch.capture.graph.RemoteGraph`` is one)."""

    graph_id: str
    engine: str
    payload: GraphPayload
    resident: list[int]  # argument indices of weights and buffers: sent by content id
    resident_set: frozenset[int]
    output_devices: list  # the device of each output (None: not a tensor)
    kind: str  # "inference", "forward" (of a training pair) or "backward"
    saved_from: int | None  # forward: outputs from here on are saved for backward
    worker: int | str | None  # which worker of the session runs it (None: the first)
    read_outputs: set[int]  # outputs Python read (learned): not kept on the worker
    layouts: dict  # output layouts by input signature, from calls that kept every output (learned)
    reused_inputs: set[int]  # inputs a later graph of the same call took too (learned): kept there


@dataclass(eq=False)
class Launched:
    """A request sent without waiting for its reply (an asynchronous call); settled in order later."""

    what: str  # names it in errors: "graph 3f2a9c01d2e4"
    on_reply: Callable[[object, list], None]
    done: bool = False
    error: errors.RemoteError | None = None

    def raise_error(self) -> None:
        """Raise what the call failed with, naming the call."""
        if self.error is not None:
            exc = self.error
            raise type(exc)(f"{self.what} (launched earlier) failed: {exc.message}",
                            remote_traceback=exc.remote_traceback) from exc


class Connection:
    """One worker: transport, worker-side session, upload cache, request policy and counters.

    ``locate`` gives the worker's URL and token when the first request needs
    them (the embedded worker starts then); ``transport`` replaces the socket
    transport (e.g. an in-memory one in unit tests).
    """

    def __init__(self, locate: Locate, *, ids: ContentIds | None = None, connect_timeout: float = 5.0,
                 timeout: float | None = 300.0, tls_ca: str | None = None, spin_s: float | None = 0.0,
                 retry_after: float = 1.0, transport: Transport | None = None) -> None:
        self._locate = locate
        self.ids = ids if ids is not None else ContentIds()
        self._connect_timeout = connect_timeout
        self._timeout = timeout
        self._tls_ca = tls_ca
        self._spin_s = spin_s
        self._retry_after = retry_after
        self._transport = transport
        if transport is not None:
            transport.on_connect = self._attach
        self.url: str | None = None
        self.session_id = secrets.token_urlsafe(24)  # 192 random bits; a capability on the worker
        self.lock = threading.RLock()  # one request (or one sequence that must stay together) at a time
        self.graphs: set[str] = set()  # graph ids the worker holds for this session
        self.tensors: set[str] = set()  # content ids the worker holds for this session
        self.stats = dict(remote_calls=0, graphs_uploaded=0, tensors_uploaded=0, remote_ms=0.0,
                          values_fetched=0, values_moved=0)
        self.lease_s: float | None = None
        self.name = ""  # the worker's name (from its health reply; made unique within a session)
        self._info: dict | None = None
        self._down_until = 0.0
        self._last_request = time.monotonic()
        self._heartbeat_stop = threading.Event()
        self._closed = False
        self.on_reset: list[Callable[[], None]] = []  # called when the worker lost this session
        # called before the session ends with fetch (training brings parameters and optimizer state here)
        self.before_close: list[Callable[[], None]] = []
        self._closed_why = "session is closed"
        self.handles = HandleTable()  # values the worker keeps for this session, by id
        # contributors of deferred housekeeping (training: slots, optimizers…): each returns
        # a dict of Pending fields to add, or None
        self.pending_hooks: list[Callable[[], dict | None]] = []
        self.reuse = InputReuse(self.handles)  # large inputs sent once per call; outputs sent back
        # hook around large uploads: upload_progress(description, nbytes) -> context giving advance(n)
        self.upload_progress: Callable[[str, int], AbstractContextManager] | None = None
        self._inflight: deque[Launched] = deque()  # launched calls whose replies are not read yet
        self.max_inflight = 32
        # graph id -> [(argument index, weak reference, version, RefArg)] of its last call's resident
        # arguments (weak: a model that goes away takes its weights with it)
        self._last_resident: dict[str, list] = {}

    # ------------------------------------------------------------------ lifetime
    @property
    def transport(self) -> Transport:
        """The transport, created (not connected) on first use."""
        if self._closed:
            raise errors.WorkerUnavailableError(self._closed_why)
        if self._transport is None:
            url, token = self._locate()
            self.url = url
            self._transport = TcpTransport(url, token, protocol=m.PROTOCOL_VERSION,
                                           connect_timeout=self._connect_timeout, timeout=self._timeout,
                                           tls=client_context(self._tls_ca) if self._tls_ca else None,
                                           on_connect=self._attach, spin_s=self._spin_s)
        return self._transport

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def connected(self) -> bool:
        """True while a connection to the worker is open (no I/O)."""
        return self._transport is not None and self._transport.connected

    def close(self, detach: bool = True, fetch: bool = False) -> None:
        """End the worker-side session (``detach``: free what it holds now, not after the lease) and close.

        ``fetch``: first bring here every value the worker keeps for a
        placeholder Python still holds, and whatever ``before_close`` hooks
        keep (trained parameters, optimizer state), so nothing Python holds
        becomes unreadable. Without it, such values are dropped with the session.
        """
        with self.lock:
            if fetch and not self._closed and self.connected:
                self._keep_before_close()
            self._heartbeat_stop.set()
            if detach and not self._closed and self.connected:
                try:
                    self._transport.set_timeout(min(2.0, self._timeout or 2.0))  # never hang in close()
                    self._transport.request(m.encode(m.Detach()))
                except errors.RemoteError:
                    pass
            if not fetch and not self._closed:
                self._closed_why = ("session is closed and its values were dropped "
                                    "(it was closed with fetch=False)")
            self._closed = True
            if self._transport is not None:
                self._transport.close()

    def _keep_before_close(self) -> None:
        for hook in self.before_close:
            try:
                hook()
            except errors.RemoteError as exc:
                log.warning("%r: could not keep worker state before the session ended: %s", self, exc)
        try:
            keep_values(self)
        except errors.RemoteError as exc:
            log.warning("%r: values could not be fetched before the session ended: %s", self, exc)

    def drop(self) -> None:
        """Close the socket only; the next request reconnects and re-attaches (the lease keeps the session)."""
        if self._transport is not None:
            self._transport.close()

    def stop_heartbeats(self) -> None:
        """Stop sending heartbeats (the worker then sees an idle client; tests of lease expiry use it)."""
        self._heartbeat_stop.set()

    def _attach(self, ask: Callable[[bytes], bytes]) -> None:
        """On each new connection: name this session, learn whether the worker still holds it."""
        try:
            reply = m.decode(ask(m.encode(m.Attach(self.session_id))))
        except (ValueError, TypeError) as exc:
            raise errors.ProtocolError(f"unreadable reply from the worker: {exc}") from None
        if isinstance(reply, m.ErrorReply):
            raise errors.from_reply(reply.kind, reply.message, reply.traceback)
        if not isinstance(reply, m.AttachReply):
            raise errors.ProtocolError(f"worker answered Attach with {type(reply).__name__}")
        if not reply.resumed:  # a new session (worker restarted, or the lease ran out): upload again
            self.graphs.clear()
            self.tensors.clear()
            for hook in self.on_reset:
                hook()
        first, self.lease_s = self.lease_s is None, reply.lease_s
        if first:
            threading.Thread(target=_heartbeats, args=(weakref.ref(self), self._heartbeat_stop),
                             name="remotorch-heartbeat", daemon=True).start()

    def heartbeat(self) -> None:
        """Keep the lease alive if idle; never opens a connection or waits on a call."""
        if not self.lock.acquire(blocking=False):
            return  # a call is running: that keeps the lease alive
        try:
            if self._closed or not self.connected or self._inflight:
                return
            self._last_request = time.monotonic()
            self._transport.request(m.encode(m.Heartbeat()))
        except errors.RemoteError as exc:
            log.debug("heartbeat failed: %s", exc)
        finally:
            self.lock.release()

    # ------------------------------------------------------------------- queries
    def info(self, refresh: bool = False) -> dict:
        """The worker's health reply (asked once and remembered, unless ``refresh``)."""
        if self._info is None or refresh:
            reply, _ = self.request(m.Health())
            self._info = {f: getattr(reply, f) for f in reply.__struct_fields__}
            self.name = self.name or self._info["name"]
        return self._info

    @property
    def bytes_sent(self) -> int:
        return self._transport.bytes_sent if self._transport is not None else 0

    @property
    def bytes_received(self) -> int:
        return self._transport.bytes_received if self._transport is not None else 0

    # ------------------------------------------------------------------- policy
    def call(self, build: Callable[[], tuple[object, list]], graph: Graph | None = None):
        """Send the request ``build()`` makes (after uploading ``graph`` if the worker lacks it).

        When the worker answers that it forgot graphs or tensors (it restarted,
        or the lease ran out), they are uploaded again by calling ``build``
        once more; state that cannot be uploaded again is raised. Returns
        ``(reply, frames)``.
        """
        with self.lock:
            for attempt in range(2):
                try:
                    if graph is not None:
                        self.ensure_graph(graph)
                    body, frames = build()
                    return self.request(body, frames)
                except errors.MissingObjectsError as exc:
                    if attempt or not self.forget(exc):
                        raise
        raise AssertionError("unreachable")

    def forget(self, exc: errors.MissingObjectsError) -> bool:
        """Take the worker's word that it lacks these objects; False when one cannot be re-uploaded."""
        if any(str(i).startswith(UNRECOVERABLE) for i in exc.tensors):
            return False
        self.graphs.difference_update(exc.graphs)
        self.tensors.difference_update(exc.tensors)
        return True

    def run(self, graph: Graph, args: Sequence, request: Callable = m.RunGraph, *, engine: str | None = None,
            **fields):
        """Run a graph (plain arguments, resident ones by content id); returns ``(reply, frames)``.

        ``engine`` overrides the graph's; ``request`` and ``fields`` make
        other run messages of the same shape (``ProfileGraph`` with
        ``warmups`` and ``repeats``).
        """
        engine = engine or graph.engine
        self.import_values(args)
        reuse = request is m.RunGraph and self.reuse.begin(args, graph.resident_set)

        def build():
            run_args, frames = self.pack_args(graph, args, reuse)
            keep_inputs = self.reuse.keep_inputs
            extra = dict(fields, keep_inputs=keep_inputs) if keep_inputs else fields
            return request(graph.graph_id, engine, run_args, **extra), frames

        try:
            reply, frames = self.call(build, graph)
        except BaseException:
            self.reuse.failed()
            raise
        self.reuse.committed()
        self.stats["remote_calls"] += 1
        self.stats["remote_ms"] += getattr(reply, "run_ms", 0.0)
        return reply, frames

    def ensure_graph(self, graph: Graph) -> None:
        """Upload the graph unless the worker holds it for this session."""
        if graph.graph_id in self.graphs:
            return
        p = graph.payload
        with self._uploading("a graph", p.const_frames) as advance:
            self.request(m.PutGraph(p.graph_id, p.doc, p.consts), p.const_frames, progress=advance)
        self.graphs.add(graph.graph_id)
        self.stats["graphs_uploaded"] += 1

    def pack_args(self, graph: Graph, args: Sequence, reuse: bool = False) -> tuple[list, list]:
        """Wire arguments: resident tensors by content id (uploading what the worker lacks), values
        kept on a worker by handle, others inline.

        With ``reuse``, a large input already sent during the same call of the
        compiled function is referenced where the worker kept it
        (:mod:`remotorch.client.reuse`).
        """
        w, uploads = FrameWriter(), {}
        self.reuse.start_request()
        run_args = self._resident_args(graph, args)
        if run_args is None:  # not as last time: hash what changed, upload what the worker lacks
            run_args, resident = [None] * len(args), graph.resident_set
            for i in resident:
                a = args[i]
                if type(a) is not RemoteTensor and isinstance(a, torch.Tensor):
                    tid = self.ids.get(a)[0]
                    if tid not in self.tensors:
                        uploads[tid] = a
                    run_args[i] = m.RefArg(tid)
            self._remember_resident(graph, args, run_args)
        for i, a in enumerate(args):
            if run_args[i] is not None:
                continue
            if type(a) is RemoteTensor:
                run_args[i] = self.value_arg(a, w)
            else:
                hid = self.reuse.arg(graph, i, a, reuse) if isinstance(a, torch.Tensor) else None
                run_args[i] = m.HandleArg(hid) if hid is not None else w.value(a)
        if uploads:
            self.upload(uploads)
        return run_args, w.frames

    def _resident_args(self, graph: Graph, args: Sequence) -> list | None:
        """The resident arguments of the last call of this graph, when they are the same tensors
        at the same versions and the worker still holds them (a warm call hashes nothing); else None."""
        last = self._last_resident.get(graph.graph_id)
        if last is None:
            return None
        run_args, held = [None] * len(args), self.tensors
        for i, ref, version, arg in last:
            a = args[i]
            if ref() is not a or a._version != version or arg.id not in held:
                return None
            run_args[i] = arg
        return run_args

    def _remember_resident(self, graph: Graph, args: Sequence, run_args: list) -> None:
        self._last_resident[graph.graph_id] = [(i, weakref.ref(args[i]), args[i]._version, run_args[i])
                                               for i in graph.resident if run_args[i] is not None]

    # ------------------------------------------------- values that stay on workers
    def value_arg(self, t: RemoteTensor, w: FrameWriter):
        """A placeholder as an argument here: its handle (or view), a copy moved here, or its data."""
        ref = remote_ref(t)
        if ref is None:
            return w.value(plain(t))  # fetched already: an ordinary tensor
        if ref.launched is not None and (ref.launched.done or ref.conn is not self):
            ref.check()  # the call that makes it failed: say so, not "missing handle"
        if ref.conn is self:
            return arg_of(t)
        copy = ref.copies.get((id(self), _view_key(t)))
        if copy is None:
            raise errors.ProtocolError("a value of another worker was not moved here first")
        return m.HandleArg(copy[1])

    def import_values(self, args: Sequence) -> None:
        """Move values that other workers keep, among ``args``, to this worker (worker to worker).

        Call before the request that uses them, without holding this
        connection's lock: each transfer takes the two connections' locks one
        after the other, never together.
        """
        for t in args:
            if type(t) is not RemoteTensor:
                continue
            ref = remote_ref(t)
            if ref is None or ref.conn is self or (id(self), _view_key(t)) in ref.copies:
                continue
            if self.transport is not None and not self.url:
                raise errors.WorkerUnavailableError("this worker has no address another worker can reach")
            arg = arg_of(t)
            hid = self.handles.reserve(1)
            ticket, _ = self.request(m.ExpectHandles([hid], [m.TensorMeta(_dtype(t), list(t.shape),
                                                                              list(t.stride()), 0)]))
            self.handles.seen(hid)  # from now on the worker may hold it: released with the placeholder
            ref.copies[(id(self), _view_key(t))] = (self, hid)
            ref.conn.request(m.SendHandles([arg], self.url or "", ticket.ticket_id, ticket.secret))
            self.stats["values_moved"] += 1

    def fetch(self, arg: m.HandleArg | m.ViewArg) -> torch.Tensor:
        """The tensor of a handle (or a view of one) this worker keeps; it stays there."""
        return self.fetch_many([arg])[0]

    def fetch_many(self, args: Sequence[m.HandleArg | m.ViewArg]) -> list[torch.Tensor]:
        """The tensors of several handles (or views), in one request; they stay on the worker."""
        with self.lock:
            reply, frames = self.request(m.Fetch(list(args)))
            if not isinstance(reply, m.FetchReply) or len(reply.values) != len(args):
                raise errors.ProtocolError("worker answered a fetch with the wrong reply")
            self.stats["values_fetched"] += len(args)
        reader = FrameReader(frames)
        return [reader.tensor(meta) for meta in reply.values]

    def unpack(self, graph: Graph, outputs: list, frames: list) -> list:
        """A reply's outputs: tensors sent back, on the devices the graph's outputs live on; kept
        ones as placeholders (``RemoteTensor``) standing for their handles here."""
        if len(outputs) != len(graph.output_devices):
            raise errors.ProtocolError("worker returned the wrong number of outputs")
        reader, out = FrameReader(frames), []
        for i, (arg, device) in enumerate(zip(outputs, graph.output_devices)):
            if isinstance(arg, m.KeptArg):
                self.handles.seen(arg.id)
                out.append(placeholder(self, arg, device, graph, i))
                continue
            value = reader.value(arg, device)
            self.reuse.returned(graph, i, value)
            out.append(value)
        return out

    def refs(self, tensors: Sequence[torch.Tensor]) -> list[str]:
        """Content ids of resident tensors, uploading those the worker lacks."""
        ids, uploads = [], {}
        for t in tensors:
            tid = self.ids.get(t)[0]
            if tid not in self.tensors:
                uploads[tid] = t
            ids.append(tid)
        if uploads:
            self.upload(uploads)
        return ids

    def held(self, t: torch.Tensor) -> str | None:
        """The content id the worker already holds for this exact local value, if any (no hashing)."""
        tid = self.ids.current(t)
        return tid if tid is not None and tid in self.tensors else None

    def upload(self, tensors: dict[str, torch.Tensor]) -> None:
        """Store tensors on the worker under their content ids (one ``PutTensors``)."""
        w = FrameWriter()
        metas = [w.meta(t) for t in tensors.values()]
        with self._uploading(f"{len(tensors)} weight tensor(s)", w.frames) as advance:
            self.request(m.PutTensors(list(tensors), metas), w.frames, progress=advance)
        self.tensors.update(tensors)
        self.stats["tensors_uploaded"] += len(tensors)

    def _uploading(self, what: str, frames: Sequence) -> AbstractContextManager:
        """The ``upload_progress`` hook around an upload of ``frames`` (nothing without a hook)."""
        if self.upload_progress is None or not frames:
            return nullcontext()
        nbytes = sum(memoryview(f).nbytes for f in frames)
        return self.upload_progress(f"uploading {what} to {self.name or self.url or 'the worker'}", nbytes)

    # ------------------------------------------------------------ housekeeping
    def take_pending(self) -> m.Pending | None:
        """Deferred housekeeping (released handles, and what the hooks add), None when there is none."""
        handles = self.handles.take_released()
        extra = [hook() for hook in self.pending_hooks] if self.pending_hooks else ()
        if not handles and not any(extra):
            return None
        fields: dict[str, list] = {"handles": handles}
        for more in extra:
            for key, values in (more or {}).items():
                fields.setdefault(key, []).extend(values)
        return m.Pending(**fields)

    def flush(self) -> None:
        """Send deferred housekeeping now (normally it rides on the next request that can carry it)."""
        with self.lock:
            pending = self.take_pending()
            if pending is not None:
                self.request(pending)

    def request(self, body, frames: Sequence = (), progress: Callable[[int], None] | None = None):
        """Send one request; the decoded reply and its frames, or its error raised as a ``RemoteError``.

        A request that can carry deferred housekeeping (a ``pending`` field)
        carries it. Replies of launched calls are read first (they come in order).
        ``progress(n)`` hears of the bytes sent (see :meth:`Transport.request`).
        """
        with self.lock:
            if self._inflight:
                self.settle()
            body, transport = self._prepare(body)
            try:
                if progress is None:
                    header, out = transport.request(m.encode(body), frames)
                else:
                    header, out = transport.request(m.encode(body), frames, progress=progress)
            except errors.WorkerUnavailableError:
                self._down_until = time.monotonic() + self._retry_after
                raise
            return parse_reply(header, self.url), out

    def _prepare(self, body):
        if "pending" in body.__struct_fields__ and body.pending is None:
            pending = self.take_pending()
            if pending is not None:
                body = msgspec.structs.replace(body, pending=pending)
        if time.monotonic() < self._down_until:
            raise errors.WorkerUnavailableError(f"worker {self.url or 'local'} failed moments ago; "
                                                f"not retrying for {self._retry_after}s")
        transport = self.transport
        self._last_request = time.monotonic()
        return body, transport

    # ------------------------------------------------------------ asynchronous calls
    def launch(self, body, frames: Sequence, launched: Launched) -> Launched:
        """Send a request without waiting for its reply; ``launched.on_reply(reply, frames)`` runs
        when it is read.

        Replies are read in order, by the next request on this connection, by
        :meth:`settle`, or when more than ``max_inflight`` calls are
        outstanding. A failure is kept on ``launched`` and raised where its
        results are used.
        """
        with self.lock:
            body, transport = self._prepare(body)
            try:
                transport.post(m.encode(body), frames)
            except errors.WorkerUnavailableError:
                self._down_until = time.monotonic() + self._retry_after
                raise
            self._inflight.append(launched)
            while len(self._inflight) > self.max_inflight:
                self._settle_one()
            return launched

    @property
    def can_launch(self) -> bool:
        """Whether this connection's transport can send without waiting for replies."""
        return type(self.transport).post is not Transport.post

    def settle(self, until: Launched | None = None) -> None:
        """Read the replies of launched calls, oldest first (all of them, or up to ``until``)."""
        with self.lock:
            while self._inflight and (until is None or not until.done):
                self._settle_one()

    def _settle_one(self) -> None:
        launched = self._inflight.popleft()
        try:
            header, out = self._transport.collect()
            launched.on_reply(parse_reply(header, self.url), out)
        except errors.RemoteError as exc:
            launched.error = exc
            if isinstance(exc, errors.TransportError):  # the connection is gone: so are the other replies
                while self._inflight:
                    other = self._inflight.popleft()
                    other.error, other.done = exc, True
        finally:
            launched.done = True

    def __repr__(self) -> str:
        return f"Connection({self.name or self.url or 'embedded'})"


def parse_reply(header: bytes, url: str | None) -> object:
    """Decode a reply's frame 0; an ``ErrorReply`` is raised as its ``RemoteError``."""
    try:
        reply = m.decode(header)
    except Exception as exc:
        raise errors.ProtocolError(f"unreadable reply from worker {url or 'local'}: {exc}") from None
    if isinstance(reply, m.ErrorReply):
        raise errors.from_reply(reply.kind, reply.message, reply.traceback, reply.graphs, reply.tensors)
    return reply


def unpack_outputs(graph: Graph, outputs: list, frames: list) -> list:
    """A reply's outputs as values on the devices the graph's outputs live on."""
    if len(outputs) != len(graph.output_devices):
        raise errors.ProtocolError("worker returned the wrong number of outputs")
    reader = FrameReader(frames)
    return [reader.value(arg, device) for arg, device in zip(outputs, graph.output_devices)]


def _view_key(t: RemoteTensor):
    view = t.__dict__.get("_rt_view")
    return None if view is None else (tuple(view[0]), tuple(view[1]), view[2])


def _dtype(t: torch.Tensor) -> str:
    from ..codec.tensors import dtype_name
    return dtype_name(t.dtype)


def _heartbeats(ref: weakref.ref, stop: threading.Event) -> None:
    """Background thread: a heartbeat whenever the connection was idle a third of its lease."""
    while True:
        conn = ref()
        if conn is None or stop.is_set():
            return
        interval = max((conn.lease_s or 30.0) / 3, 0.05)
        wait = conn._last_request + interval - time.monotonic()
        if wait <= 0:
            conn.heartbeat()
            wait = interval
        del conn
        if stop.wait(wait):
            return


__all__ = ["Connection", "ContentIds", "SCALARS", "parse_reply", "unpack_outputs"]
