"""The user-facing session: one worker, its upload cache, and the call policy.

Policy lives here, each piece in its own method: upload-if-missing
(:meth:`Session._ensure_graph`, :meth:`Session._pack_args`), re-upload
after the worker forgot (:meth:`Session.run_graph`), a short back-off after a
worker failed to answer (:meth:`Session._request`). Only :meth:`_request`
touches the transport.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from .. import errors
from ..codec import messages as m
from ..codec.tensors import content_id, tensor_to_wire
from ..config import from_env
from ..transport import TcpTransport, Transport
from ..transport.tls import client_context
from .pool import WorkerLink, name_links, parse_reply, split_urls, unpack_outputs

if TYPE_CHECKING:
    from ..capture.graph import RemoteGraph

log = logging.getLogger(__name__)


class Session:
    """A connection to one worker (or several), with what has been uploaded to it.

    ``url`` is ``tcp://host:port`` (or ``tls://host:port``, checking the
    worker's certificate against the system CAs or ``tls_ca``); without it
    ``REMOTORCH_URL`` is used, and without that an embedded worker process is
    started on this machine (on a private Unix socket) the first time the
    session needs a worker. ``unix:///path`` reaches a worker on this host
    started with ``remotorch serve --unix /path``. Creating a
    session never contacts the worker, so a session for a worker that is down
    fails only when a call needs it (and then falls back or raises, as the
    call's policy says).

    On the worker the session is named by a random ``session_id``, sent on
    every new connection: what it uploaded survives a dropped connection for
    the worker's lease time, and a background thread sends heartbeats while
    the session is idle so the lease does not run out under it.

    ``url`` may also be a list of URLs: ordinary calls run on the first
    worker, and profiling (:func:`remotorch.remote_profile`) uses all of
    them. ``tokens`` maps URLs to tokens where they differ from ``token``;
    ``prices`` maps worker names to $ per hour, overriding what workers report.

    ``spin_us`` (default ``REMOTORCH_SPIN_US``, else 0) makes each call
    busy-poll that many microseconds for its reply before it sleeps: lower
    latency for calls that answer within the window, at the cost of a busy
    core meanwhile (pair it with ``remotorch serve --spin-us``).
    """

    def __init__(self, url: str | Sequence[str] | None = None, *, token: str | None = None, device: str = "auto",
                 timeout: float | None = 300.0, connect_timeout: float = 5.0,
                 transport: Transport | None = None, retry_after: float = 1.0,
                 tokens: Mapping[str, str] | None = None, prices: Mapping[str, float] | None = None,
                 tls_ca: str | None = None, spin_us: float | None = None) -> None:
        env = from_env()
        url, self._more_urls = split_urls(url)  # several workers: ordinary calls use the first
        self._tokens = dict(tokens or {})  # per-URL tokens, where workers differ
        self.prices = dict(prices or {})  # $ per hour by worker name, overriding what workers report
        self._links: list[WorkerLink] | None = None
        self.url = url or env.url
        self.session_id = secrets.token_urlsafe(24)  # 192 random bits; a capability on the worker
        self._tls_ca = tls_ca
        if spin_us is not None and not spin_us >= 0:
            raise ValueError(f"spin_us must be >= 0, got {spin_us!r}")
        self._spin_s = (spin_us if spin_us is not None else env.spin_us) / 1e6
        self._lease_s: float | None = None
        self._last_request = time.monotonic()
        self._heartbeat_stop = threading.Event()
        self.device = device
        self._token = token if token is not None else env.token
        self._timeout = timeout
        self._connect_timeout = connect_timeout
        self._transport = transport
        self._embedded = None
        self._lock = threading.RLock()
        self._graphs_on_worker: set[str] = set()
        self._tensors_on_worker: set[str] = set()
        self._resident: dict[int, tuple] = {}
        self._retry_after = retry_after
        self._down_until = 0.0
        self._closed = False
        self._stats = dict(remote_calls=0, fallbacks=0, graphs_uploaded=0, tensors_uploaded=0,
                           remote_ms=0.0)

    # ------------------------------------------------------------------ lifetime
    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection and stop the embedded worker if this session started one."""
        with self._lock:
            self._heartbeat_stop.set()
            if not self._closed and getattr(self._transport, "connected", False):
                try:  # free what this session holds now, instead of after the lease
                    self._transport.set_timeout(min(2.0, self._timeout or 2.0))  # never hang in close()
                    self._transport.request(m.encode(m.Detach()))
                except errors.RemoteError:
                    pass
            self._closed = True
            for link in self._links or []:
                link.close()
            if self._transport is not None:
                self._transport.close()
            if self._embedded is not None:
                self._embedded.stop()
                self._embedded = None

    @property
    def embedded(self) -> bool:
        """True when this session uses (or will start) its own embedded worker process."""
        return self.url is None

    def _get_transport(self) -> Transport:
        if self._closed:
            raise errors.WorkerUnavailableError("session is closed")
        if self._transport is None:
            url, token = self.url, self._token
            if url is None:
                from .embedded import EmbeddedWorker
                self._embedded = EmbeddedWorker(self.device, spin_us=self._spin_s * 1e6)
                url, token = self._embedded.url, self._embedded.token
            self._transport = TcpTransport(url, token, protocol=m.PROTOCOL_VERSION,
                                           connect_timeout=self._connect_timeout, timeout=self._timeout,
                                           tls=client_context(self._tls_ca) if self._tls_ca else None,
                                           on_connect=self._attach, spin_s=self._spin_s)
        return self._transport

    # ------------------------------------------------------------------ the worker-side session
    def _attach(self, ask) -> None:
        """On each new connection: name this session, learn whether the worker still holds it."""
        try:
            reply = m.decode(ask(m.encode(m.Attach(self.session_id))))
        except (ValueError, TypeError) as exc:
            raise errors.ProtocolError(f"unreadable reply from the worker: {exc}") from None
        if isinstance(reply, m.ErrorReply):
            if reply.kind == errors.ProtocolError.kind:
                return  # a worker without sessions beyond a connection: plain behaviour
            raise errors.from_reply(reply.kind, reply.message, reply.traceback)
        if not isinstance(reply, m.AttachReply):
            raise errors.ProtocolError(f"worker answered Attach with {type(reply).__name__}")
        if not reply.resumed:  # a new session (worker restarted, or the lease ran out): upload again
            self._graphs_on_worker.clear()
            self._tensors_on_worker.clear()
        first, self._lease_s = self._lease_s is None, reply.lease_s
        if first:
            threading.Thread(target=_heartbeats, args=(weakref.ref(self), self._heartbeat_stop),
                             name="remotorch-heartbeat", daemon=True).start()

    def _heartbeat(self) -> None:
        """Keep the lease alive if the session is idle; never opens a connection or waits on a call."""
        if not self._lock.acquire(blocking=False):
            return  # a call is running: that keeps the lease alive
        try:
            transport = self._transport
            if self._closed or transport is None or not getattr(transport, "connected", False):
                return
            self._last_request = time.monotonic()
            transport.request(m.encode(m.Heartbeat()))
        except errors.RemoteError as exc:
            log.debug("heartbeat failed: %s", exc)
        finally:
            self._lock.release()

    # ------------------------------------------------------------------ queries
    def stats(self) -> dict:
        """Counters since the session started (calls, fallbacks, uploads, bytes)."""
        t = self._transport
        return dict(self._stats, bytes_sent=t.bytes_sent if t else 0,
                    bytes_received=t.bytes_received if t else 0)

    def health(self) -> dict:
        """Ask the worker who it is: name, device, torch version, engines."""
        reply, _ = self._request(m.Health())
        return {f: getattr(reply, f) for f in reply.__struct_fields__}

    def echo(self, frames: Sequence) -> list:
        """Send buffers to the worker and back (measures the transport alone)."""
        _, out = self._request(m.Echo(), frames)
        return out

    # ------------------------------------------------------------------ training
    def pull(self, module: torch.nn.Module, grads: bool = False) -> int:
        """Copy the worker's current parameters (and, asked, gradients) into ``module``.

        After training with a :class:`~remotorch.optim.RemoteOptimizer` the
        worker holds the parameters of record; this brings them back, e.g.
        before ``module.state_dict()``. Tensors the worker does not train
        (buffers, frozen parameters) are the local ones already and stay as
        they are, and so do the gradients of parameters no worker-side
        optimizer manages (they are in ``p.grad``). Returns how many tensors
        were copied.
        """
        from ..training.client import training_client
        return training_client(self).pull(module, grads)

    def flush_releases(self) -> None:
        """Tell the worker now about freed activations, parameters and optimizers.

        Normally that news rides on the next training request, at no cost of
        its own; call this before measuring the worker's memory.
        """
        from ..training.client import training_client
        training_client(self).flush()

    # ------------------------------------------------------------ several workers
    @property
    def urls(self) -> list[str | None]:
        """Every worker of the session, first one first (None: the embedded worker)."""
        return [self.url, *self._more_urls]

    def worker_links(self) -> list[WorkerLink]:
        """One connection per worker, named after the workers (used by profiling).

        Created on first use; asks each worker's health, so every worker must
        answer. The first link goes to the same worker as ordinary calls (the
        embedded one, started now, when the session has no URL).
        """
        with self._lock:
            if self._links is None:
                links = []
                for url in self.urls:
                    token = self._tokens.get(url, self._token) if url else None
                    if url is None:
                        self._get_transport()
                        if self._embedded is None:
                            raise errors.WorkerUnavailableError("this session has no worker address")
                        url, token = self._embedded.url, self._embedded.token
                    links.append(WorkerLink(url, token, connect_timeout=self._connect_timeout,
                                            timeout=self._timeout,
                                            tls=client_context(self._tls_ca) if self._tls_ca else None))
                try:
                    name_links(links)
                except BaseException:
                    for link in links:
                        link.close()
                    raise
                self._links = links
            return list(self._links)

    def workers(self) -> list[dict]:
        """Each worker's health reply (asked now) plus ``url`` and ``price_per_hour`` after overrides."""
        return [dict(link.info(refresh=True), name=link.name, url=link.url,
                     price_per_hour=self.price_per_hour(link.name)) for link in self.worker_links()]

    def backends(self) -> list[str]:
        """Every ``WORKER/ENGINE`` pair the session's workers offer, in worker order."""
        return [f"{link.name}/{engine}" for link in self.worker_links() for engine in link.info()["engines"]]

    def price_per_hour(self, worker: str) -> float:
        """$ per hour of a worker: the session's ``prices`` entry, else what the worker reports."""
        if worker in self.prices:
            return float(self.prices[worker])
        for link in self.worker_links():
            if link.name == worker:
                return float(link.info().get("price_per_hour", 0.0))
        raise KeyError(f"no worker named {worker!r} in this session")

    def note_fallback(self) -> None:
        with self._lock:
            self._stats["fallbacks"] += 1

    # ------------------------------------------------------------------ running
    def run_graph(self, graph: RemoteGraph, args: Sequence) -> list:
        """Run a captured graph on the worker; uploads what the worker lacks first."""
        with self._lock:
            for attempt in range(2):
                try:
                    self._ensure_graph(graph)
                    run_args, frames = self._pack_args(graph, args)
                    reply, out_frames = self._request(m.RunGraph(graph.graph_id, graph.engine, run_args), frames)
                    break
                except errors.MissingObjectsError as exc:  # worker restarted or forgot: upload again
                    if attempt:
                        raise
                    self._graphs_on_worker.difference_update(exc.graphs)
                    self._tensors_on_worker.difference_update(exc.tensors)
            self._stats["remote_calls"] += 1
            self._stats["remote_ms"] += reply.run_ms
        return self._unpack(graph, reply, out_frames)

    def _ensure_graph(self, graph: RemoteGraph) -> None:
        if graph.graph_id in self._graphs_on_worker:
            return
        p = graph.payload
        self._request(m.PutGraph(p.graph_id, p.doc, p.consts), p.const_frames)
        self._graphs_on_worker.add(graph.graph_id)
        self._stats["graphs_uploaded"] += 1

    def _pack_args(self, graph: RemoteGraph, args: Sequence) -> tuple[list, list]:
        """Wire arguments: resident tensors by content id (uploading what the worker lacks), others inline."""
        run_args, frames, uploads = [], [], []
        resident = graph.resident_set
        on_worker = self._tensors_on_worker
        for i, a in enumerate(args):
            if i in resident:
                entry = self._resident.get(id(a))
                if entry is None or entry[0]() is not a or entry[1] != a._version:
                    entry = self._remember(a)
                if entry[2] not in on_worker and all(entry[2] != u[0] for u in uploads):
                    uploads.append((entry[2], a))
                run_args.append(entry[3])
            elif isinstance(a, torch.Tensor):
                meta, buf = tensor_to_wire(a, len(frames))
                run_args.append(m.TensorArg(meta))
                frames.append(buf)
            else:
                run_args.append(m.ScalarArg(_scalar(a)))
        if uploads:
            self._upload_tensors(uploads)
        return run_args, frames

    def _remember(self, t: torch.Tensor) -> tuple:
        """Hash a resident tensor and remember its id until its version counter moves.

        Warm calls then cost one dict lookup per weight; an in-place change
        (which bumps ``_version``) makes the next call hash and upload again.
        """
        meta, buf = tensor_to_wire(t, 0)
        tid = content_id(meta, buf)
        key = id(t)

        def forget(ref, key=key, cache=self._resident):
            if cache.get(key, (None,))[0] is ref:
                del cache[key]

        entry = (weakref.ref(t, forget), t._version, tid, m.RefArg(tid))
        self._resident[key] = entry
        return entry

    def _upload_tensors(self, uploads: list) -> None:
        metas, frames = [], []
        for _, t in uploads:
            meta, buf = tensor_to_wire(t, len(frames))
            metas.append(meta)
            frames.append(buf)
        self._request(m.PutTensors([u[0] for u in uploads], metas), frames)
        self._tensors_on_worker.update(u[0] for u in uploads)
        self._stats["tensors_uploaded"] += len(uploads)

    @staticmethod
    def _unpack(graph: RemoteGraph, reply: m.RunReply, frames: list) -> list:
        return unpack_outputs(graph, reply.outputs, frames)

    def _request(self, body, frames: Sequence = ()):
        """Send one request; the reply, or its error raised as a ``RemoteError``."""
        if time.monotonic() < self._down_until:
            raise errors.WorkerUnavailableError(f"worker {self.url or 'local'} failed moments ago; "
                                                f"not retrying for {self._retry_after}s")
        transport = self._get_transport()
        self._last_request = time.monotonic()
        try:
            header, out = transport.request(m.encode(body), frames)
        except errors.WorkerUnavailableError:
            self._down_until = time.monotonic() + self._retry_after
            raise
        return parse_reply(header, self.url), out


def _heartbeats(ref: weakref.ref, stop: threading.Event) -> None:
    """Background thread: a heartbeat whenever the session was idle a third of its lease."""
    while True:
        session = ref()
        if session is None or stop.is_set():
            return
        interval = max((session._lease_s or 30.0) / 3, 0.05)
        wait = session._last_request + interval - time.monotonic()
        if wait <= 0:
            session._heartbeat()
            wait = interval
        del session
        if stop.wait(wait):
            return


def _scalar(a):
    if a is None or isinstance(a, (bool, int, float)):
        return a
    raise errors.UnsupportedGraphError(f"argument of type {type(a).__name__} cannot travel")


_default: Session | None = None
_default_lock = threading.Lock()


def default_session() -> Session:
    """The process-wide session used when none is given (created on first use)."""
    global _default
    with _default_lock:
        if _default is None or _default._closed:
            _default = Session()
        return _default
