"""What one worker holds for this client, by content id, and how it gets there.

:class:`Uploads` knows which graphs and resident tensors (weights, buffers)
the worker holds for the session, names tensors by content id
(:class:`~remotorch.client.ids.ContentIds`), uploads what is missing
(``PutGraph``, ``PutTensors``) and takes the worker's word when it forgot
some (:meth:`Uploads.forget`, after which the caller builds its request again).
A warm call hashes nothing: the resident arguments of a graph's last call are
reused while they are the same tensors at the same versions.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch

from .. import errors
from ..codec import messages as m
from ..codec.frames import FrameWriter
from .graph import Graph
from .ids import ContentIds
from .link import Link
from .remote import RemoteTensor
from .stats import Counters


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
        # graph id -> [(argument index, weak reference, version, RefArg)] of its last call's resident
        # arguments (weak: a model that goes away takes its weights with it)
        self._last: dict[str, list] = {}
        self.released: list[str] = []  # content ids no longer referenced, for the next Pending

    def release(self, tid: str) -> None:
        """The client no longer references this upload (e.g. a buffer's superseded value): the
        worker drops it with the next request."""
        if tid in self.tensors:
            self.tensors.discard(tid)
            self.released.append(tid)

    def reset(self) -> None:
        """The worker lost the session: it holds nothing of ours."""
        self.graphs.clear()
        self.tensors.clear()

    def forget(self, exc: errors.MissingObjectsError) -> bool:
        """Take the worker's word that it lacks these objects; False when one cannot be uploaded again."""
        if not exc.recoverable:
            return False
        self.graphs.difference_update(exc.graphs)
        self.tensors.difference_update(exc.tensors)
        return True

    def ensure_graph(self, graph: Graph) -> None:
        """Upload the graph unless the worker holds it for this session."""
        if graph.graph_id in self.graphs:
            return
        p = graph.payload
        with self._uploading("a graph", p.const_frames) as advance:
            self.link.request(m.PutGraph(p.graph_id, p.doc, p.consts), p.const_frames, progress=advance,
                              expect=m.Ok)
        self.graphs.add(graph.graph_id)
        self.stats.graphs_uploaded += 1

    def resident_args(self, graph: Graph, args: Sequence) -> list:
        """Wire arguments with the graph's resident tensors as ``RefArg`` (the rest None), uploading
        what the worker lacks. The same tensors at the same versions as last time: nothing is hashed."""
        last = self._last.get(graph.graph_id)
        if last is not None:
            run_args, held = [None] * len(args), self.tensors
            for i, ref, version, arg in last:
                a = args[i]
                if ref() is not a or a._version != version or arg.id not in held:
                    break
                run_args[i] = arg
            else:
                return run_args
        run_args, uploads = [None] * len(args), {}
        for i in graph.resident:
            a = args[i]
            if type(a) is not RemoteTensor and isinstance(a, torch.Tensor):
                tid = self.ids.get(a)[0]
                if tid not in self.tensors:
                    uploads[tid] = a
                run_args[i] = m.RefArg(tid)
        self._last[graph.graph_id] = [(i, weakref.ref(args[i]), args[i]._version, run_args[i])
                                      for i in graph.resident if run_args[i] is not None]
        if uploads:
            self.upload(uploads)
        return run_args

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
            self.link.request(m.PutTensors(list(tensors), metas), w.frames, progress=advance, expect=m.Ok)
        self.tensors.update(tensors)
        self.stats.tensors_uploaded += len(tensors)

    def _uploading(self, what: str, frames: Sequence) -> AbstractContextManager:
        """The ``progress`` hook around an upload of ``frames`` (nothing without a hook)."""
        if self.progress is None or not frames:
            return nullcontext()
        nbytes = sum(memoryview(f).nbytes for f in frames)
        return self.progress(f"uploading {what} to {self.worker_name()}", nbytes)
