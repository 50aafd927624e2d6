"""The user-facing session: which workers, their connections, and how a captured graph runs.

A :class:`Session` is a façade. Each worker is one
:class:`~remotorch.client.connection.Connection` (the one copy of request,
upload-if-missing and retry policy), held in a
:class:`~remotorch.client.pool.Pool`; ordinary calls go to the first
worker. A session is the runner that captured graphs call
(``remotorch.capture.graph.GraphRunner``): plain graphs run through the
connection, graphs that keep state on the worker (a training forward and its
backward, and every graph once parameters live in worker slots) through the
session's training client, which :mod:`remotorch.training` provides.
"""

from __future__ import annotations

import threading
import weakref
from functools import partial
from collections.abc import Callable, Mapping, Sequence
from typing import ClassVar, overload

import torch

from .. import errors
from ..codec import messages as m
from ..config import from_env, parse_spin_us
from ..transport import Transport
from . import values
from .connection import Connection, ContentIds, Graph
from .stream import QueueLimits
from .eager import install as install_eager
from .embedded import EmbeddedWorker
from .progress import upload_bar
from .runner import GraphRunner, Trainer
from .pool import Pool, split_urls
from .wiring import ensure as _join_parts


class Session(GraphRunner):
    """A connection to one worker (or several), with what has been uploaded to each.

    ``url`` is ``tcp://host:port`` (or ``tls://host:port``, checking the
    worker's certificate against the system CAs or ``tls_ca``, default
    ``REMOTORCH_TLS_CA``); without it
    ``REMOTORCH_URL`` is used, and without that an embedded worker process is
    started on this machine (on a private Unix socket) the first time the
    session needs a worker. ``unix:///path`` reaches a worker on this host
    started with ``remotorch serve --unix /path``. Creating a
    session never contacts the worker, so a session for a worker that is down
    fails only when a call needs it (and then falls back or raises, as the
    call's policy says).

    On each worker the session is named by a random id, sent on every new
    connection: what it uploaded survives a dropped connection for the
    worker's lease time, and a background thread sends heartbeats while the
    session is idle so the lease does not run out under it.

    ``url`` may also be a list of URLs: ordinary calls run on the first
    worker; profiling (:func:`remotorch.remote_profile`) uses all of them.
    ``tokens`` maps URLs to tokens where they differ from ``token``;
    ``prices`` maps worker names to $ per hour, overriding what workers report.

    ``spin_us`` (default ``REMOTORCH_SPIN_US``, else ``"auto"``) makes each
    call busy-poll that many microseconds for its reply before it sleeps:
    lower latency for calls that answer within the window, at the cost of a
    busy core meanwhile (``remotorch serve --spin-us`` is the worker's side).
    ``"auto"`` polls up to 1000 µs, only while replies come within that
    window and only on a machine with more than one CPU; 0 never polls.

    ``keep_outputs`` (default on): a graph output that Python has not read
    stays on the worker, standing here as a ``RemoteTensor``
    (:mod:`remotorch.client.remote`): passed to the next graph it travels
    as a reference (worker to worker when that graph runs elsewhere), read
    by anything else it is fetched once. An output Python read once comes
    back directly from then on; outputs under ``keep_min_bytes`` always do.

    Requests are not waited for unless Python needs their answer: a graph
    call whose outputs Python does not read, a backward, an optimizer step,
    an upload are sent and the program goes on, as a CUDA kernel launch does;
    a read of a value waits for it (one round trip), and a failure is raised
    there, naming what failed and the line that issued it
    (:mod:`remotorch.client.stream`). ``queue`` (a
    :class:`~remotorch.client.stream.QueueLimits`) bounds how far the program
    runs ahead; :meth:`synchronize` waits for everything sent.
    ``blocking`` (default ``REMOTORCH_LAUNCH_BLOCKING``) makes every request
    wait for its reply, for debugging.

    ``weights`` and ``checkpoints`` (default ``REMOTORCH_WEIGHTS``,
    ``REMOTORCH_CHECKPOINTS``: ``NAME=DIR,NAME=DIR``) name the folders the
    *embedded* worker may read weights from and write checkpoints into
    (``{"models": "/data/models"}``: see :func:`remotorch.from_pretrained`); a
    worker elsewhere reads what its ``remotorch serve --weights`` says.

    ``allow_ops`` (default ``REMOTORCH_ALLOW_OPS``) lists namespaces of
    library custom operators the *embedded* worker may run
    (``["transformers"]``), with ``worker_imports`` (default
    ``REMOTORCH_WORKER_IMPORTS``) naming modules it imports to register
    namespaces remotorch does not know; a worker elsewhere allows what its
    ``remotorch serve --allow-ops`` says. A graph calling an operator its
    worker does not allow is never uploaded: it runs locally or raises.

    ``fetch_on_close`` (default on): closing the session (or leaving its
    ``with`` block) first brings here, in one batched request per worker,
    every value still on a worker that Python holds, the parameters a
    worker-side optimizer trained and that optimizer's state, so results
    stay readable after the block that made them, as in plain PyTorch.
    ``close(fetch=False)``, or ``fetch_on_close=False``, drops them instead:
    reading one then raises ``WorkerUnavailableError``. Values whose worker
    died raise their typed error either way.

    ``progress``: uploads of 64 MiB or more show a progress bar on stderr
    when it is a terminal (None, the default; ``REMOTORCH_PROGRESS=0`` or a
    ``remotorch`` logger set above ``WARNING`` turns that off), always
    (True) or never (False).

    ``eager_remote`` (default on): an eager torch call outside a compiled
    region whose arguments include a value kept on a worker runs on that
    worker, queued without waiting, its result a placeholder at once
    (:mod:`remotorch.client.eager`); only a read waits. Off, such a call reads
    its arguments and runs here (for debugging).

    ``transport`` replaces the first worker's socket transport (an in-memory
    one in unit tests).
    """

    #: Makes the training client of a connection (``TrainingClient``); set by the package root,
    #: since training builds on this module and not the reverse.
    make_trainer: ClassVar[Callable[[Connection], Trainer] | None] = None

    def __init__(self, url: str | Sequence[str] | None = None, *, token: str | None = None, device: str = "auto",
                 timeout: float | None = 300.0, connect_timeout: float = 5.0,
                 transport: Transport | None = None, retry_after: float = 1.0,
                 tokens: Mapping[str, str] | None = None, prices: Mapping[str, float] | None = None,
                 tls_ca: str | None = None, spin_us: float | str | None = None, keep_outputs: bool = True,
                 keep_min_bytes: int = 1024, blocking: bool | None = None, queue: QueueLimits | None = None,
                 allow_ops: str | Sequence[str] | None = None,
                 worker_imports: str | Sequence[str] | None = None, progress: bool | None = None,
                 fetch_on_close: bool = True, eager_remote: bool = True,
                 weights: str | Mapping[str, str] | None = None,
                 checkpoints: str | Mapping[str, str] | None = None) -> None:
        _join_parts()  # the root's wiring (remotorch.client.wiring): a session may be the first part used
        env = from_env()
        urls = split_urls(url)
        if urls == [None]:
            urls = [env.url]
        spin_us = parse_spin_us(spin_us, "spin_us") if spin_us is not None else env.spin_us
        self.device = device
        self.keep_outputs = keep_outputs
        self.keep_min_bytes = keep_min_bytes
        self.fetch_on_close = fetch_on_close
        self.eager_remote = eager_remote
        if eager_remote:
            install_eager()
        self.blocking = env.launch_blocking if blocking is None else blocking
        self._token = token if token is not None else env.token
        self._tokens = dict(tokens or {})
        self._spin_s = None if spin_us is None else spin_us / 1e6  # None: auto
        self._embedded: EmbeddedWorker | None = None
        self._embedded_transport = env.embedded_transport
        if (allow_ops or worker_imports or weights or checkpoints) and None not in urls:
            raise ValueError("allow_ops, worker_imports, weights and checkpoints configure the embedded worker; a "
                             "worker at a URL allows and reads what its `remotorch serve` flags say")
        self._embedded_ops = (_names(allow_ops if allow_ops is not None else env.allow_ops),
                              _names(worker_imports if worker_imports is not None else env.worker_imports),
                              _roots("--weights", weights if weights is not None else env.weights) +
                              _roots("--checkpoints", checkpoints if checkpoints is not None else env.checkpoints))
        self._lock = threading.Lock()
        self._closed = False
        self._fallbacks = 0
        self.ids = ContentIds()  # content ids of resident tensors, shared by all workers
        self._trainers: dict[int, Trainer] = {}  # by id(connection), made when first needed
        options = dict(connect_timeout=connect_timeout, timeout=timeout, tls_ca=tls_ca or env.tls_ca,
                       spin_s=self._spin_s, retry_after=retry_after, limits=queue, blocking=self.blocking)
        first = [transport]

        def make(u: str | None) -> Connection:
            given = first.pop() if first else None
            conn = Connection(lambda: self._locate(u), ids=self.ids, transport=given, **options)
            conn.eager_remote, conn.runner = self.eager_remote, weakref.ref(self)  # (client.eager)
            if progress is not False:
                conn.upload_progress = partial(upload_bar, enabled=True) if progress else upload_bar
            return conn

        self.pool = Pool(urls, make, prices)

    # ------------------------------------------------------------------ lifetime
    def __copy__(self) -> Session:
        return self  # a session is a connection, not a value: a copied model or trainer shares it

    def __deepcopy__(self, memo) -> Session:
        return self

    def __reduce__(self):
        raise TypeError("a remotorch Session is a connection and cannot be pickled; "
                        "make a new one where it is needed")

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self, fetch: bool | None = None) -> None:
        """End the session on every worker and stop the embedded worker if this session started one.

        ``fetch`` (default: the session's ``fetch_on_close``) first brings
        here what Python still holds of the workers' values (see the class
        docstring); closing twice does nothing. A failure of a request whose
        result nobody read is raised after everything is closed.
        """
        fetch = self.fetch_on_close if fetch is None else fetch
        with self._lock:
            if self._closed:
                return
        failure = None
        for conn in self.pool.opened:
            try:
                conn.close(fetch=fetch)
            except errors.RemoteError as exc:  # a failure nobody read: raised once all is closed
                failure = failure or exc
        with self._lock:
            self._closed = True
            self.pool.close()
            if self._embedded is not None:
                self._embedded.stop()
                self._embedded = None
        if failure is not None:
            raise failure

    @property
    def closed(self) -> bool:
        return self._closed

    def _locate(self, url: str | None) -> tuple[str, str | None]:
        """A worker's URL and token; for no URL, the embedded worker (started now)."""
        if url is not None:
            return url, self._tokens.get(url, self._token)
        with self._lock:
            if self._closed:
                raise errors.WorkerUnavailableError("session is closed")
            if self._embedded is None:
                spin_us = None if self._spin_s is None else self._spin_s * 1e6
                self._embedded = EmbeddedWorker(self.device, spin_us=spin_us,
                                                transport=self._embedded_transport,
                                                allow_ops=self._embedded_ops[0], imports=self._embedded_ops[1],
                                                roots=self._embedded_ops[2])
            return self._embedded.url, self._embedded.token

    @property
    def url(self) -> str | None:
        """The first worker's URL (None: the embedded worker)."""
        return self.pool.urls[0]

    @property
    def urls(self) -> list[str | None]:
        """Every worker of the session, first one first (None: the embedded worker)."""
        return list(self.pool.urls)

    @property
    def embedded(self) -> bool:
        """True when this session uses (or will start) its own embedded worker process."""
        return self.url is None

    @property
    def embedded_worker(self) -> EmbeddedWorker | None:
        """The embedded worker process this session started (None before it needs one, or with a URL)."""
        return self._embedded

    @property
    def connection(self) -> Connection:
        """The first worker's connection: ordinary calls go there."""
        return self.pool.get(0)

    @property
    def prices(self) -> dict[str, float]:
        return self.pool.prices

    # ------------------------------------------------------------------ queries
    def stats(self) -> dict:
        """Counters since the session started, over every worker: calls, fallbacks, uploads (and
        objects taken from a worker's disk cache instead, ``*_recalled``), bytes,
        values fetched from workers when Python read them, values moved worker to worker, and the
        request messages sent (``messages_sent``: heartbeats and housekeeping included)."""
        out = dict(remote_calls=0, fallbacks=self._fallbacks, graphs_uploaded=0, tensors_uploaded=0,
                   graphs_recalled=0, tensors_recalled=0, remote_ms=0.0, values_fetched=0, values_moved=0,
                   bytes_sent=0, bytes_received=0, messages_sent=0, reads=0, blocking_reads=0, queue_waits=0,
                   requests_queued=0, eager_ops=0)
        for conn in self.pool.opened:
            if not conn.closed:
                conn.link.poll()  # replies already here count (a launched call is counted when answered)
            for key, value in (*conn.stats.as_dict().items(), *conn.link.stream.counters().items()):
                out[key] += value
            out["bytes_sent"] += conn.bytes_sent
            out["bytes_received"] += conn.bytes_received
            out["messages_sent"] += conn.messages_sent
        return out

    def synchronize(self) -> None:
        """Wait until every worker answered everything sent to it; raise a failure nobody read yet.

        Like ``torch.cuda.synchronize()``: for timing, and to hear of
        failures of requests whose results were never read (they are raised
        here, or at :meth:`close`, never dropped). The session goes on working
        after the error is raised.
        """
        for conn in self.pool.opened:
            if not conn.closed:
                conn.link.sync()

    def health(self) -> dict:
        """Ask the first worker who it is: name, device, torch version, engines."""
        return dict(self.connection.info(refresh=True))

    def echo(self, frames: Sequence) -> list:
        """Send buffers to the worker and back (measures the transport alone)."""
        return self.connection.request(m.Echo(), frames)[1]

    def connections(self) -> list[Connection]:
        """One connection per worker, named after the workers (every worker must answer)."""
        return self.pool.all()

    def workers(self) -> list[dict]:
        """Each worker's health reply (asked now) plus ``url`` and ``price_per_hour`` after overrides."""
        return [dict(c.info(refresh=True), name=c.name, url=c.url, price_per_hour=self.price_per_hour(c.name))
                for c in self.connections()]

    def backends(self) -> list[str]:
        """Every ``WORKER/ENGINE`` pair the session's workers offer, in worker order."""
        return [f"{c.name}/{engine}" for c in self.connections() for engine in c.info()["engines"]]

    def price_per_hour(self, worker: str) -> float:
        """$ per hour of a worker: the session's ``prices`` entry, else what the worker reports."""
        return self.pool.price_per_hour(worker)

    # ------------------------------------------------------------------ training
    @property
    def training(self) -> Trainer | None:
        """The first worker's training client, if a graph or an optimizer needed one."""
        return self._trainers.get(id(self.connection)) if self.pool.opened else None

    def trainer(self, conn: Connection | None = None) -> Trainer:
        """The training client of a worker (default the first): activation handles, parameter
        slots, optimizers there; made on first use."""
        conn = conn if conn is not None else self.connection
        trainer = self._trainers.get(id(conn))
        if trainer is None:
            with self._lock:
                trainer = self._trainers.get(id(conn))
                if trainer is None:
                    if Session.make_trainer is None:
                        raise RuntimeError("no training client: import remotorch (its root sets one)")
                    trainer = self._trainers[id(conn)] = Session.make_trainer(conn)
                    trainer.keep_outputs, trainer.keep_min_bytes = self.keep_outputs, self.keep_min_bytes
        return trainer

    def connection_for(self, worker: int | str | None) -> Connection:
        """The connection of a worker given by index or name (None: the first), or the connection given."""
        if isinstance(worker, Connection):  # (an eager call's graph runs where its values are: client.eager)
            return worker
        if worker is None or worker == 0:
            return self.connection
        if isinstance(worker, int):
            if not 0 <= worker < len(self.pool.urls):
                raise IndexError(f"this session has {len(self.pool.urls)} worker(s), not a worker {worker}")
            return self.pool.get(worker)
        return self.pool.by_name(worker)

    def pull(self, module: torch.nn.Module, grads: bool = False) -> int:
        """Copy the worker's current parameters (and, asked, gradients) into ``module``.

        After training with a :class:`~remotorch.optim.RemoteOptimizer` the
        worker holds the parameters of record; this brings them back, e.g.
        before ``module.state_dict()``. Weights a worker loaded itself
        (:func:`remotorch.from_pretrained`) come here too, as ordinary tensors. Tensors the worker does not train
        (buffers, frozen parameters) are the local ones already and stay as
        they are, and so do the gradients of parameters no worker-side
        optimizer manages (they are in ``p.grad``). Returns how many tensors
        were copied.
        """
        pulled = sum(t.pull(module, grads) for t in list(self._trainers.values()))
        # values the workers keep for it (weights they loaded): brought here, in one request per worker
        return pulled + values.fetch_placeholders([*module.parameters(), *module.buffers()])

    def refresh(self, module: torch.nn.Module) -> int:
        """Bring back into ``module`` the parameters an optimizer stepped on a worker (only those).

        A read: it waits for the steps sent before it. ``state_dict()`` of a
        module compiled with :func:`remotorch.compile` calls it first. Returns
        how many tensors were copied.
        """
        tensors = [*module.parameters(), *module.buffers()]
        return sum(t.refresh_local(tensors) for t in list(self._trainers.values()) if not t.closed)

    def flush_releases(self) -> None:
        """Tell the workers now about freed values, activations, parameters and optimizers.

        Normally that news rides on the next request, at no cost of its own;
        call this before measuring a worker's memory.
        """
        for conn in self.pool.opened:
            conn.flush()

def _names(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """``"a,b"`` or ``["a", "b"]`` as a tuple of names."""
    parts = value.split(",") if isinstance(value, str) else list(value or ())
    return tuple(p.strip() for p in parts if p.strip())


def _roots(flag: str, value: str | Mapping[str, str] | None) -> list[tuple[str, str]]:
    """``{"models": "/data"}`` or ``"models=/data,hub=/cache"`` as ``[(flag, "NAME=DIR")]``."""
    pairs = value.items() if isinstance(value, Mapping) else (p.split("=", 1) for p in _names(value) if "=" in p)
    return [(flag, f"{name}={folder}") for name, folder in pairs]


_default: Session | None = None
_default_lock = threading.Lock()


@overload
def default_session() -> Session: ...
@overload
def default_session(create: bool) -> Session | None: ...
def default_session(create: bool = True) -> Session | None:
    """The process-wide session used when none is given (created on first use; with
    ``create=False``, None while there is none open)."""
    global _default
    with _default_lock:
        if (_default is None or _default.closed) and create:
            _default = Session()
        return _default if _default is not None and not _default.closed else None
