"""Per-worker connection state for sessions that use several workers at once.

A :class:`~remotorch.session.Session` runs ordinary calls on its first
worker. Profiling runs the same graphs on every worker of the session, each
through a :class:`WorkerLink`: its own connection (so one worker's slow reply
never holds up another's), its own record of what that worker holds, and the
worker's name and price from its health reply. Links are created by
:meth:`Session.worker_links` and closed with the session.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .. import errors
from ..codec import messages as m
from ..codec.tensors import content_id, tensor_to_wire
from ..codec.values import arg_to_value
from ..transport import TcpTransport

if TYPE_CHECKING:
    from ..capture.graph import RemoteGraph


@dataclass(frozen=True)
class ProfileResult:
    """What one timed request to one worker engine gave back."""

    outputs: list
    times_ms: list[float]  # one per timed run, measured by the worker
    clock: str  # "monotonic" or "cuda_events"
    compiled: bool  # the request compiled the graph for the engine (first use)
    compile_ms: float
    worker_ms: float  # the worker's time for the whole request
    round_trip_ms: float  # the client's time for the whole request

    @property
    def network_ms(self) -> float:
        """Round-trip time not spent in the worker: transport, serialization, queueing."""
        return max(0.0, self.round_trip_ms - self.worker_ms)


class WorkerLink:
    """One connection to one worker, with the graphs and tensors uploaded over it."""

    def __init__(self, url: str, token: str | None, *, connect_timeout: float = 5.0,
                 timeout: float | None = 300.0, tls=None) -> None:
        self.url = url
        self._transport = TcpTransport(url, token, protocol=m.PROTOCOL_VERSION,
                                       connect_timeout=connect_timeout, timeout=timeout, tls=tls)
        self._lock = threading.Lock()
        self._graphs: set[str] = set()
        self._tensors: set[str] = set()
        self._ids: dict[int, tuple] = {}
        self._info: dict | None = None
        self.name: str = ""  # set from the health reply (made unique within a session)
        self.graphs_uploaded = 0
        self.tensors_uploaded = 0

    def close(self) -> None:
        self._transport.close()

    def info(self, refresh: bool = False) -> dict:
        """The worker's health reply (asked once and remembered, unless ``refresh``)."""
        if self._info is None or refresh:
            reply, _ = self._request(m.Health())
            self._info = {f: getattr(reply, f) for f in reply.__struct_fields__}
            self.name = self.name or self._info["name"]
        return self._info

    def profile(self, graph: RemoteGraph, args: Sequence, engine: str, *, warmups: int,
                repeats: int) -> ProfileResult:
        """Run a captured graph on one engine of this worker with timed repeats."""
        with self._lock:
            for attempt in range(2):
                try:
                    self._ensure_graph(graph)
                    run_args, frames = self._pack(graph, args)
                    start = time.perf_counter()
                    reply, out = self._request(m.ProfileGraph(graph.graph_id, engine, run_args,
                                                              warmups, repeats), frames)
                    round_trip = (time.perf_counter() - start) * 1e3
                    break
                except errors.MissingObjectsError as exc:  # the worker forgot: upload again, once
                    if attempt:
                        raise
                    self._graphs.difference_update(exc.graphs)
                    self._tensors.difference_update(exc.tensors)
        return ProfileResult(unpack_outputs(graph, reply.outputs, out), list(reply.times_ms), reply.clock,
                             reply.compiled, reply.compile_ms, reply.worker_ms, round_trip)

    def _ensure_graph(self, graph: RemoteGraph) -> None:
        if graph.graph_id not in self._graphs:
            p = graph.payload
            self._request(m.PutGraph(p.graph_id, p.doc, p.consts), p.const_frames)
            self._graphs.add(graph.graph_id)
            self.graphs_uploaded += 1

    def _pack(self, graph: RemoteGraph, args: Sequence) -> tuple[list, list]:
        resident = set(graph.resident)
        uploads: dict[str, torch.Tensor] = {}
        run_args, frames = [], []
        for i, a in enumerate(args):
            if i in resident and isinstance(a, torch.Tensor):
                tid = self._content_id(a)
                if tid not in self._tensors:
                    uploads[tid] = a
                run_args.append(m.RefArg(tid))
            elif isinstance(a, torch.Tensor):
                meta, buf = tensor_to_wire(a, len(frames))
                run_args.append(m.TensorArg(meta))
                frames.append(buf)
            elif a is None or isinstance(a, (bool, int, float)):
                run_args.append(m.ScalarArg(a))
            else:
                raise errors.UnsupportedGraphError(f"argument of type {type(a).__name__} cannot travel")
        if uploads:
            self._upload(uploads)
        return run_args, frames

    def _content_id(self, t: torch.Tensor) -> str:
        entry = self._ids.get(id(t))
        if entry is not None and entry[0]() is t and entry[1] == t._version:
            return entry[2]
        meta, buf = tensor_to_wire(t, 0)
        tid = content_id(meta, buf)
        key = id(t)

        def forget(ref, key=key, cache=self._ids):
            if cache.get(key, (None,))[0] is ref:  # a newer tensor may have taken the same id()
                del cache[key]

        self._ids[key] = (weakref.ref(t, forget), t._version, tid)
        return tid

    def _upload(self, uploads: dict[str, torch.Tensor]) -> None:
        metas, frames = [], []
        for t in uploads.values():
            meta, buf = tensor_to_wire(t, len(frames))
            metas.append(meta)
            frames.append(buf)
        self._request(m.PutTensors(list(uploads), metas), frames)
        self._tensors.update(uploads)
        self.tensors_uploaded += len(uploads)

    def _request(self, body, frames: Sequence = ()):
        header, out = self._transport.request(m.encode(body), frames)
        return parse_reply(header, self.url), out


def parse_reply(header: bytes, url: str | None) -> object:
    """Decode a reply's frame 0; an ``ErrorReply`` is raised as its ``RemoteError``."""
    try:
        reply = m.decode(header)
    except Exception as exc:
        raise errors.ProtocolError(f"unreadable reply from worker {url or 'local'}: {exc}") from None
    if isinstance(reply, m.ErrorReply):
        raise errors.from_reply(reply.kind, reply.message, reply.traceback, reply.graphs, reply.tensors)
    return reply


def unpack_outputs(graph: RemoteGraph, outputs: list, frames: list) -> list:
    """A reply's outputs as values on the devices the graph's outputs live on."""
    if len(outputs) != len(graph.output_devices):
        raise errors.ProtocolError("worker returned the wrong number of outputs")
    return [arg_to_value(arg, frames, device) for arg, device in zip(outputs, graph.output_devices)]


def split_urls(url: str | Sequence[str] | None) -> tuple[str | None, list[str]]:
    """A session's ``url`` argument as (first worker, further workers)."""
    if url is None or isinstance(url, str):
        return url, []
    urls = list(url)
    if not urls or not all(isinstance(u, str) and u for u in urls):
        raise ValueError("Session needs a worker URL, a list of worker URLs, or None")
    if len(set(urls)) != len(urls):
        raise ValueError("the same worker URL is listed twice")
    return urls[0], urls[1:]


def name_links(links: list[WorkerLink]) -> None:
    """Give each link its worker's name, adding ``-2``, ``-3``… where names repeat."""
    seen: dict[str, int] = {}
    for link in links:
        base = link.info()["name"]
        seen[base] = seen.get(base, 0) + 1
        link.name = base if seen[base] == 1 else f"{base}-{seen[base]}"
