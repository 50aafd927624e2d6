"""What one worker holds for this client, by content id, and how it gets there.

:class:`Uploads` knows which graphs and resident tensors (weights, buffers)
the worker holds for the session, names tensors by content id
(:class:`~remotorch.client.ids.ContentIds`), uploads what is missing
(``PutGraph``, ``PutTensors``) and takes the worker's word when it forgot
some (:meth:`Uploads.forget`, after which the caller builds its request again).
A warm call hashes nothing: the resident arguments of a graph's last call are
reused while they are the same tensors at the same versions. Nor does it send
them: the first run names them as an argument binding of the session
(``Run.bind``, protocol.md §8.1) and the next ones send only the other
arguments (``Run.bound``), while the binding holds.

Before uploading, it asks a worker that keeps a disk cache which of those objects
it still has (``Have``, protocol.md §20), proving for each that it holds the bytes
(:mod:`remotorch.codec.possession`): a restarted worker then takes a known model
from its disk instead of the wire.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch

from .. import errors
from ..codec import messages as m, possession
from ..codec.frames import FrameWriter
from ..codec.tensors import tensor_to_wire
from .graph import Graph
from .ids import ContentIds, stamp
from .launched import Launched
from .link import Link
from .remote import RemoteTensor
from .stats import Counters


_deref = weakref.ref.__call__


class Resident:
    """A graph's resident arguments at its last call, and the argument binding the worker keeps of them."""

    __slots__ = ("positions", "refs", "stamps", "run_args", "free", "generation", "id", "held")

    def __init__(self, positions: tuple[int, ...], args: Sequence, run_args: list, generation: int,
                 binding_id: int) -> None:
        self.positions = positions  # argument indices sent as RefArg
        self.refs = tuple(weakref.ref(args[i]) for i in positions)  # weak: a model that goes away takes them
        self.stamps = tuple(stamp(args[i]) for i in positions)
        self.run_args = run_args  # the RefArg at each of those positions, None elsewhere
        self.free = tuple(i for i in range(len(args)) if run_args[i] is None)  # the others
        self.generation = generation  # Uploads.generation when made
        self.id = binding_id if positions else 0  # its binding id (0: none)
        self.held = False  # the worker holds the binding (a run that made it was answered)

    def same(self, args: Sequence) -> bool:
        """The same tensors with the same local values (:func:`~remotorch.client.ids.stamp`) as when it was made."""
        live = list(map(_deref, self.refs))  # (maps: no Python loop per weight, and a model has many)
        return all(map(operator.is_, live, map(args.__getitem__, self.positions))) and \
            tuple(map(stamp, live)) == self.stamps


class Uploads:
    """Graph ids and content ids one worker holds for the session; uploads what it lacks."""

    def __init__(self, link: Link, stats: Counters, ids: ContentIds | None = None) -> None:
        self.link = link
        self.stats = stats
        self.ids = ids if ids is not None else ContentIds()
        self.graphs: set[str] = set()  # graph ids the worker holds for this session
        self.tensors: set[str] = set()  # content ids the worker holds for this session
        # hook around large uploads: progress(description, nbytes) -> context giving advance(n)
        self.progress: Callable[[str, int], AbstractContextManager] | None = None
        self.worker_name: Callable[[], str] = lambda: link.url or "the worker"
        self._last: dict[str, Resident] = {}  # graph id -> its last call's resident arguments
        self.generation = 0  # counts the times content ids left ``tensors`` (each invalidates _last)
        self._binding_ids = 0  # binding ids given out (at most MAX_BINDINGS; after that, none)
        self.released: list[str] = []  # content ids no longer referenced, for the next Pending
        self._nonce: bytes | None = None  # the session's possession nonce (b"": the worker keeps no disk cache)

    def release(self, tid: str) -> None:
        """The client no longer references this upload (e.g. a buffer's superseded value): the
        worker drops it with the next request."""
        if tid in self.tensors:
            self.tensors.discard(tid)
            self.released.append(tid)
            self.generation += 1

    def reset(self) -> None:
        """The worker lost the session: it holds nothing of ours."""
        self.graphs.clear()
        self.tensors.clear()
        self._nonce = None
        self.generation += 1
        for last in self._last.values():
            last.held = False

    def forget(self, exc: errors.MissingObjectsError) -> bool:
        """Take the worker's word that it lacks these objects; False when one cannot be uploaded again."""
        if not exc.recoverable:
            return False
        self.graphs.difference_update([g for g in self.graphs if any(g.startswith(p) for p in exc.graphs)])
        if exc.tensors:
            self.tensors.difference_update(exc.tensors)
            self.generation += 1
        if exc.bindings:
            gone = set(exc.bindings)
            for last in self._last.values():
                if last.id in gone:
                    last.held = False
        return True

    def ensure_graph(self, graph: Graph) -> None:
        """Upload the graph unless the worker holds it for this session."""
        if graph.graph_id in self.graphs:
            return
        p = graph.payload
        if getattr(graph, "eager_op", False):  # an eager call's small graph: sent without waiting
            self.link.launch(m.PutGraph(p.graph_id, p.doc, p.consts), p.const_frames,
                             Launched("uploading a graph", expect=m.Ok, effect=True, makes=(("g", p.graph_id),)))
            self.graphs.add(graph.graph_id)
            self.stats.graphs_uploaded += 1
            return
        if self.disk_cache() and self._recall(graphs={p.graph_id: possession.Bytes([p.doc, *p.const_frames])}):
            self.graphs.add(graph.graph_id)
            self.stats.graphs_recalled += 1
            return
        with self._uploading("a graph", p.const_frames) as advance:
            self.link.request(m.PutGraph(p.graph_id, p.doc, p.consts), p.const_frames, progress=advance,
                              expect=m.Ok)
        self.graphs.add(graph.graph_id)
        self.stats.graphs_uploaded += 1

    def resident_args(self, graph: Graph, args: Sequence) -> tuple[list, Resident]:
        """Wire arguments with the graph's resident tensors as ``RefArg`` (the rest None), uploading
        what the worker lacks, and their :class:`Resident` record (its binding). The same tensors at
        the same versions as last time, with nothing released since: nothing is hashed."""
        last = self._last.get(graph.graph_id)
        if last is not None and last.generation == self.generation and (not graph.resident or last.same(args)):
            return last.run_args.copy(), last
        run_args, uploads = [None] * len(args), {}
        for i in graph.resident:
            a = args[i]
            if type(a) is not RemoteTensor and isinstance(a, torch.Tensor):
                tid = self.ids.get(a)[0]
                if tid not in self.tensors:
                    uploads[tid] = a
                run_args[i] = m.RefArg(tid)
        if uploads:
            self.upload(uploads)
        positions = tuple(i for i in graph.resident if run_args[i] is not None)
        if last is None and positions and self._binding_ids < m.MAX_BINDINGS:
            self._binding_ids += 1
            binding_id = self._binding_ids
        else:
            binding_id = last.id if last is not None else 0
        made = Resident(positions, args, run_args.copy(), self.generation, binding_id)
        # the worker still holds the binding when it binds the same ids and none had to go up again
        made.held = bool(last is not None and last.held and not uploads and last.positions == positions
                         and all(last.run_args[i] == run_args[i] for i in positions))
        self._last[graph.graph_id] = made
        return run_args, made

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
        """Store tensors on the worker under their content ids (one ``PutTensors``), except those
        its disk cache still has."""
        kept = self._recall(tensors={tid: tensor_to_wire(t, 0)[1] for tid, t in tensors.items()}) \
            if self.disk_cache() else set()
        if kept:
            self.tensors.update(kept)
            self.stats.tensors_recalled += len(kept)
            tensors = {tid: t for tid, t in tensors.items() if tid not in kept}
            if not tensors:
                return
        w = FrameWriter()
        metas = [w.meta(t) for t in tensors.values()]
        with self._uploading(f"{len(tensors)} weight tensor(s)", w.frames) as advance:
            self.link.request(m.PutTensors(list(tensors), metas), w.frames, progress=advance, expect=m.Ok)
        self.tensors.update(tensors)
        self.stats.tensors_uploaded += len(tensors)

    def disk_cache(self) -> bool:
        """Whether the worker keeps a disk cache (asked once per session and worker start)."""
        if self._nonce is None:
            try:
                self._nonce = self.link.request(m.Challenge(), expect=m.ChallengeReply)[0].nonce
            except errors.ProtocolError:  # a worker without §20
                self._nonce = b""
        return bool(self._nonce)

    def _recall(self, graphs: dict | None = None, tensors: dict | None = None) -> set[str]:
        """The ids of these objects the worker now holds for the session from its disk cache, each
        proven held here (``graphs``: id -> :class:`~remotorch.codec.possession.Bytes`; ``tensors``:
        id -> raw bytes); empty when the worker keeps no cache."""
        if not self.disk_cache():
            return set()
        nonce = self._nonce

        def claim(key: str, total: int, read) -> tuple[str, int, bytes]:
            return key, total, possession.proof(nonce, key, total, read)
        graph_claims = [claim(k, b.total, b.read) for k, b in (graphs or {}).items()]
        tensor_claims = [claim(k, buf.nbytes, lambda o, n, buf=buf: bytes(buf[o:o + n]))
                         for k, buf in (tensors or {}).items()]
        reply = self.link.request(m.Have(graph_claims, tensor_claims), expect=m.HaveReply)[0]
        return set(reply.graphs) | set(reply.tensors)

    def _uploading(self, what: str, frames: Sequence) -> AbstractContextManager:
        """The ``progress`` hook around an upload of ``frames`` (nothing without a hook)."""
        if self.progress is None or not frames:
            return nullcontext()
        nbytes = sum(memoryview(f).nbytes for f in frames)
        return self.progress(f"uploading {what} to {self.worker_name()}", nbytes)
