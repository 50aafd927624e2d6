"""One worker as the client sees it, and the one path every run takes to it.

A :class:`Connection` puts together, for one worker:

* :class:`~remotorch.client.link.Link`: the transport, the worker-side
  session, heartbeats; the only I/O;
* :class:`~remotorch.client.uploads.Uploads`: what the worker holds by
  content id, and uploads of what it lacks;
* the values it keeps for this client (:class:`~remotorch.client.handles.HandleTable`,
  :mod:`remotorch.client.values`);
* :class:`~remotorch.client.stats.Counters`.

The call path is layered as httpx's client is: :meth:`Connection.run` (pack
the arguments with :meth:`pack_args`; send now, or launch without waiting) →
:meth:`call` (upload the graph if missing, build the request, check the
reply's type, count it, and build it once more after the worker forgot
objects) → :meth:`Link.request`. Captured graphs, asynchronous launches,
training, pipeline stages and profiling all run through it; none builds its
own copy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

import torch

from .. import errors
from ..codec import messages as m
from ..codec.frames import FrameWriter
from ..transport import Transport
from . import values
from .attention import AttentionKernels
from .graph import Graph
from .handles import HandleTable, spans_of
from .ids import ContentIds
from .launched import Launched
from .link import Link, Locate, parse_reply
from .stream import QueueLimits
from .policy import Policies
from .remote import REMOTE
from .rng import GENERATORS
from .reuse import InputReuse
from .stats import Counters
from .uploads import Resident, Uploads

log = logging.getLogger(__name__)

# pack_args' hook: (graph, args) -> a wire argument for each argument the caller places itself
# (training: parameter slots, saved activations, tracked buffers), None for the others
Placed = Callable[[Graph, Sequence], list]


class Connection:
    """One worker: its link, what it holds for us, the values it keeps, and the call path to it.

    ``locate`` gives the worker's URL and token when the first request needs
    them (the embedded worker starts then); ``transport`` replaces the socket
    transport (e.g. an in-memory one in unit tests).
    """

    def __init__(self, locate: Locate, *, ids: ContentIds | None = None, connect_timeout: float = 5.0,
                 timeout: float | None = 300.0, tls_ca: str | None = None, spin_s: float | None = 0.0,
                 retry_after: float = 1.0, transport: Transport | None = None, limits: QueueLimits | None = None,
                 blocking: bool = False) -> None:
        self.link = Link(locate, connect_timeout=connect_timeout, timeout=timeout, tls_ca=tls_ca,
                         spin_s=spin_s, retry_after=retry_after, transport=transport, limits=limits,
                         blocking=blocking)
        self.lock = self.link.lock  # one request (or one sequence that must stay together) at a time
        self.stats = Counters()
        self.uploads = Uploads(self.link, self.stats, ids)
        self.uploads.worker_name = lambda: self.name or self.link.url or "the worker"
        self.link.on_reset.append(self.uploads.reset)
        self.link.take_pending = self.take_pending
        self.name = ""  # the worker's name (from its health reply; made unique within a session)
        self._info: dict | None = None
        # called before the session ends with fetch (training brings parameters and optimizer state here)
        self.before_close: list[Callable[[], None]] = []
        self.handles = HandleTable()  # values the worker keeps for this session, by id
        # contributors of deferred housekeeping (training: slots, optimizers…): each returns
        # a dict of Pending fields to add, or None
        self.pending_hooks: list[Callable[[], dict | None]] = []
        self.policies = Policies()  # what the client learned of each graph (client.policy)
        self.reuse = InputReuse(self.handles, self.policies)  # large inputs sent once per call
        self.attention = AttentionKernels(self.request, self.link.on_reset)  # its kernels, per call (capture)

    # ------------------------------------------------------------------ the link
    @property
    def url(self) -> str | None:
        return self.link.url

    @property
    def session_id(self) -> str:
        return self.link.session_id

    @property
    def lease_s(self) -> float | None:
        return self.link.lease_s

    @property
    def on_reset(self) -> list[Callable[[], None]]:
        return self.link.on_reset

    @property
    def transport(self) -> Transport:
        return self.link.transport

    @property
    def closed(self) -> bool:
        return self.link.closed

    @property
    def connected(self) -> bool:
        return self.link.connected

    @property
    def bytes_sent(self) -> int:
        return self.link.bytes_sent

    @property
    def messages_sent(self) -> int:
        return self.link.messages_sent

    @property
    def bytes_received(self) -> int:
        return self.link.bytes_received

    @property
    def can_launch(self) -> bool:
        return self.link.can_launch

    def drop(self) -> None:
        self.link.drop()

    def stop_heartbeats(self) -> None:
        self.link.stop_heartbeats()

    def heartbeat(self) -> None:
        self.link.heartbeat()

    def settle(self, until: Launched | None = None) -> None:
        self.link.settle(until)

    def request(self, body, frames: Sequence = (), progress: Callable[[int], None] | None = None,
                expect: type | None = None, pending: m.Pending | None = None):
        """Send one request (deferred housekeeping rides on it); ``(reply, frames)``."""
        return self.link.request(body, frames, progress, expect, pending)

    def close(self, detach: bool = True, fetch: bool = False) -> None:
        """End the worker-side session (``detach``: free what it holds now, not after the lease) and close.

        ``fetch``: first bring here every value the worker keeps for a
        placeholder Python still holds, and whatever ``before_close`` hooks
        keep (trained parameters, optimizer state), so nothing Python holds
        becomes unreadable. Without it, such values are dropped with the session.
        A failure of a request whose result nobody read is raised once closed.
        """
        with self.lock:
            failure = None
            if not self.closed and self.connected:
                try:  # first every reply, and the failures nobody read (raised once closed)
                    self.link.sync()
                except errors.RemoteError as exc:
                    failure = exc
            if fetch and not self.closed and self.connected:
                self._pull_before_close()
            if not fetch and not self.closed:
                self.link.closed_why = ("session is closed and its values were dropped "
                                        "(it was closed with fetch=False)")
            try:
                self.link.close(detach)
            except errors.RemoteError as exc:
                failure = failure or exc
            if failure is not None:
                raise failure

    def _pull_before_close(self) -> None:
        for hook in self.before_close:
            try:
                hook()
            except errors.RemoteError as exc:
                log.warning("%r: could not keep worker state before the session ended: %s", self, exc)
        try:
            values.fetch_held(self)
        except errors.RemoteError as exc:
            log.warning("%r: values could not be fetched before the session ended: %s", self, exc)

    def info(self, refresh: bool = False) -> dict:
        """The worker's health reply (asked once and remembered, unless ``refresh``)."""
        if self._info is None or refresh:
            reply, _ = self.request(m.Health(), expect=m.HealthReply)
            self._info = {f: getattr(reply, f) for f in reply.__struct_fields__}
            self.name = self.name or self._info["name"]
        return self._info

    # ------------------------------------------------------------ what it holds
    @property
    def ids(self) -> ContentIds:
        return self.uploads.ids

    @property
    def graphs(self) -> set[str]:
        return self.uploads.graphs

    @property
    def tensors(self) -> set[str]:
        return self.uploads.tensors

    @property
    def upload_progress(self) -> Callable[[str, int], AbstractContextManager] | None:
        return self.uploads.progress

    @upload_progress.setter
    def upload_progress(self, hook) -> None:
        self.uploads.progress = hook

    def refs(self, tensors: Sequence[torch.Tensor]) -> list[str]:
        return self.uploads.refs(tensors)

    def held(self, t: torch.Tensor) -> str | None:
        return self.uploads.held(t)

    def release(self, tid: str) -> None:
        """Stop holding an upload (dropped by the worker with the next request)."""
        self.uploads.release(tid)

    def keeps_disk_cache(self) -> bool:
        """Whether the worker keeps uploads on disk (protocol.md §20): then values worth keeping
        across its restarts go up by content id."""
        return self.uploads.disk_cache()

    def fetch(self, arg: m.HandleArg | m.ViewArg) -> torch.Tensor:
        """The tensor of a handle (or a view of one) this worker keeps; it stays there."""
        return values.fetch_many(self, [arg])[0]

    def fetch_many(self, args: Sequence[m.HandleArg | m.ViewArg]) -> list[torch.Tensor]:
        return values.fetch_many(self, args)

    def unpack(self, graph: Graph, outputs: list, frames: list) -> list:
        return values.unpack(self, graph, outputs, frames)

    def import_values(self, args: Sequence) -> None:
        values.import_values(self, args)

    # ------------------------------------------------------------- housekeeping
    def take_pending(self) -> m.Pending | None:
        """Deferred housekeeping (released handles, and what the hooks add), None when there is none."""
        handles = self.handles.take_released()
        extra = [hook() for hook in self.pending_hooks] if self.pending_hooks else ()
        tensors = self.uploads.released
        if not handles and not tensors and not any(extra):
            return None
        handles, spans = spans_of(handles)
        fields: dict[str, list] = {"handles": handles}
        if spans:
            fields["spans"] = spans
        if tensors:
            fields["tensors"], self.uploads.released = tensors, []
        for more in extra:
            for key, value in (more or {}).items():
                fields.setdefault(key, []).extend(value)
        return m.Pending(**fields)

    def flush(self, wait: bool = True) -> None:
        """Send deferred housekeeping now (normally it rides on the next request); ``wait=False``: do
        not wait for the worker's answer (a failure is raised at the next read)."""
        with self.lock:
            pending = self.take_pending()
            if pending is None:
                return
            if wait:
                self.request(m.Flush(), pending=pending, expect=m.Ok)
            else:
                self.link.launch(m.Flush(), (), Launched("releases", expect=m.Ok, effect=True, quiet=True), pending=pending)

    # ------------------------------------------------------------------ the path
    def call(self, build: Callable[[], tuple[object, list]], graph: Graph | None = None,
             expect: type | None = None):
        """Send the request ``build()`` makes (after uploading ``graph`` if the worker lacks it).

        The reply must be of type ``expect``; a run (``RunReply``, ``ProfileReply``) is counted. When
        the worker answers that it forgot graphs or tensors (it restarted, or
        the lease ran out), they are uploaded again by calling ``build`` once
        more; state that cannot be uploaded again is raised. An argument
        binding it forgot costs one more build, which sends the arguments
        themselves (and may then learn of forgotten tensors). Returns
        ``(reply, frames)``.
        """
        with self.lock:
            again = 0  # builds after the worker forgot graphs or tensors
            for _ in range(3):
                try:
                    if graph is not None:
                        self.uploads.ensure_graph(graph)
                    body, frames = build()
                    reply, out = self.link.request(body, frames, expect=expect)
                    if expect is m.RunReply or expect is m.ProfileReply:
                        self.stats.ran(reply, body)
                    return reply, out
                except errors.MissingObjectsError as exc:
                    if again or not self.uploads.forget(exc):
                        raise
                    again += bool(exc.graphs or exc.tensors or not exc.bindings)
            raise AssertionError("unreachable")

    def run(self, graph: Graph, args: Sequence, *, request: type = m.Run, expect: type = m.RunReply,
            engine: str | None = None, placed: Placed | None = None,
            fields: Callable[[], dict] | dict | None = None, launched: Launched | None = None):
        """Run a graph; ``(reply, frames)``, or with ``launched``, send it without waiting.

        The arguments are packed by :meth:`pack_args` (``placed``: the
        caller's hook for those it places itself); ``fields`` (or a function
        giving them, called for each build) are the rest of the request.
        ``engine`` overrides the graph's; ``request`` and ``expect`` make
        other run messages of the same shape (``ProfileGraph``). With
        ``launched``, its ``on_reply`` gets the reply when it is read (see
        :meth:`Link.launch`); a launched run cannot be built again if the
        worker forgot objects: it fails, the uploads are forgotten, and the
        next call uploads them.
        """
        engine = engine or graph.engine
        self.import_values(args)
        plain = request is m.Run and placed is None
        reuse = plain and self.reuse.begin(args, graph.resident_set)
        binds: list = [None]  # the binding this request makes, if it makes one
        random = request is m.Run and getattr(graph, "random", False)  # draws from this process's generator
        rng: list = []  # the state it carries (None: its session's), taken when first built

        def build():
            run_args, frames, resident = self.pack_args(graph, args, reuse, placed)
            extra = fields() if callable(fields) else dict(fields or ())
            if random:  # last, just before it goes: requests sent while building it are not random
                if not rng:
                    state = GENERATORS.state_for(self.link)
                    rng.extend((state, GENERATORS.sent(self.link, state)))
                if rng[0] is not None:
                    extra["rng"] = rng[0]
            if self.reuse.keep_inputs:
                extra["keep_inputs"] = self.reuse.keep_inputs
            if getattr(graph, "cuda_graphs", False):
                extra["cuda_graphs"] = True
            binds[0] = None
            if plain and resident.id:  # resident arguments by binding (plain: placed is None)
                if resident.held:
                    run_args = [run_args[i] for i in resident.free]
                    extra["bound"] = resident.id
                else:
                    extra["bind"], binds[0] = resident.id, resident
            gid = graph.graph_id
            if request is m.Run:
                run_args = m.compact(run_args)  # runs of handles and slots in two numbers each
                if launched is not None:  # a warm call: the graph ran here, its short id names it
                    gid = gid[:m.SHORT_GRAPH_ID]
            return request(gid, engine, run_args, **extra), frames

        if launched is not None:
            if random:
                on_reply = launched.on_reply

                def generator_back(reply, out) -> None:
                    GENERATORS.answered(self.link, rng[1], reply.rng)
                    on_reply(reply, out)
                launched.on_reply = generator_back
                self._launch(graph, build, launched, binds)
                GENERATORS.launched(self.link, launched)
                return launched
            return self._launch(graph, build, launched, binds)
        try:
            reply, frames = self.call(build, graph, expect)
        except BaseException:
            self.reuse.failed()
            raise
        if random and rng:
            GENERATORS.answered(self.link, rng[1], reply.rng)
        if binds[0] is not None:
            binds[0].held = True
        self.reuse.committed()
        return reply, frames

    def _launch(self, graph: Graph, build, launched: Launched, binds: list) -> Launched:
        """Send a run without waiting. What it asks the worker to keep (an argument binding, inputs
        kept for the call) counts as held at once: the worker runs requests in order, so the next
        request finds it, unless this one fails (then it counts as not held again)."""
        on_reply = launched.on_reply
        with self.lock:
            self.link.connect()  # a new connection attaches first: a worker that lost us is known before the build
            self.uploads.ensure_graph(graph)
            body, frames = build()
            resident = binds[0]

            def counted(reply, out) -> None:
                self.stats.ran(reply, body)
                try:
                    on_reply(reply, out)
                except errors.RemoteError:
                    if resident is not None:
                        resident.held = False
                    raise

            def failed(exc: errors.RemoteError) -> None:
                if resident is not None:
                    resident.held = False
                if isinstance(exc, errors.MissingObjectsError):
                    self.uploads.forget(exc)  # the next call uploads them again, waiting for its
                    self.policies.of(graph).ran = False  # reply (so it can repair more than one layer)

            launched.on_reply, launched.expect, launched.on_error = counted, m.RunReply, failed
            self.link.launch(body, frames, launched)
            if resident is not None:
                resident.held = True
            self.reuse.committed()
        return launched

    def pack_args(self, graph: Graph, args: Sequence, reuse: bool = False,
                  placed: Placed | None = None) -> tuple[list, list, Resident | None]:
        """Wire arguments: resident tensors by content id (uploading what the worker lacks), values
        kept on a worker by handle, others inline; the frames; the resident arguments' record
        (:class:`~remotorch.client.uploads.Resident`, None with ``placed``).

        ``placed(graph, args)`` gives the arguments the caller places itself
        (instead of the resident ones by content id). With ``reuse``, a large
        input already sent during the same call of the compiled function is
        referenced where the worker kept it (:mod:`remotorch.client.reuse`).
        """
        w = FrameWriter()
        self.reuse.start_request()
        if placed is None:
            run_args, resident = self.uploads.resident_args(graph, args)
            rest = resident.free
        else:
            run_args, resident = placed(graph, args), None
            rest = range(len(args))
        for i in rest:
            a = args[i]
            if run_args[i] is not None:
                continue
            if type(a) in REMOTE:
                run_args[i] = values.value_arg(self, a, w)
            else:
                hid = self.reuse.arg(graph, i, a, reuse) if placed is None and isinstance(a, torch.Tensor) else None
                run_args[i] = m.HandleArg(hid) if hid is not None else w.value(a)
        return run_args, w.frames, resident

    def __repr__(self) -> str:
        return f"Connection({self.name or self.url or 'embedded'})"


__all__ = ["Connection", "ContentIds", "Graph", "Launched", "parse_reply"]
