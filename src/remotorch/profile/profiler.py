"""The profiler behind ``with remotorch.remote_profile(...)``: runs every graph on every backend.

While the block runs, each graph an ``@accelerate`` function reaches is sent
to every chosen backend (``WORKER/ENGINE``) with timed repeats measured by
the worker. Workers run at the same time, one thread each; the engines of one
worker run one after another, so they do not disturb each other's timings.
The user's program gets the outputs of one backend (``output_backend``,
default the first). The client times the Python between graphs itself, with
all remote work (and the local eager reference used for differences)
excluded. :meth:`Profiler.report` turns the records into statistics.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import msgspec
import torch

from .. import errors
from ..client.session import default_session
from ..client.values import unpack_outputs
from ..client.progress import bar
from ..codec import messages as m
from ..codec.graph import decode_graph
from ..codec.ops import namespace
from ..codec.tensors import tensor_from_wire
from .context import activate_profiler, deactivate_profiler
from .records import BackendRun, CallRecord, GraphCall, ProfileSettings
from .report import Report, build_report

if TYPE_CHECKING:
    from ..capture.graph import RemoteGraph
    from ..client.session import Session
    from ..client.connection import Connection

log = logging.getLogger(__name__)


def remote_profile(session: Session | None = None, *, backends: list[str] | None = None,
                   num_repeats: int = 10, num_warmups: int = 1,
                   output_backend: str | None = None) -> Profiler:
    """Profile ``@accelerate`` functions on several workers and engines.

    Use as ``with remotorch.remote_profile() as prof: ...`` then
    ``prof.report()``. ``session`` defaults to the process-wide session;
    ``backends`` (``"WORKER/ENGINE"`` strings) default to every engine of
    every worker of the session. Each graph runs ``num_warmups`` times
    untimed, then ``num_repeats`` times timed, on each backend, per call.
    """
    return Profiler(session, backends=backends, num_repeats=num_repeats, num_warmups=num_warmups,
                    output_backend=output_backend)


class Profiler:
    """Records calls of accelerated functions and the graphs they ran on each backend."""

    def __init__(self, session: Session | None = None, *, backends: list[str] | None = None,
                 num_repeats: int = 10, num_warmups: int = 1, output_backend: str | None = None) -> None:
        if num_repeats < 1 or num_warmups < 0:
            raise ValueError("num_repeats must be at least 1 and num_warmups at least 0")
        self.num_repeats = num_repeats
        self.num_warmups = num_warmups
        self._session = session
        self._wanted = list(backends) if backends is not None else None
        self._wanted_output = output_backend
        self.backends: list[str] = []
        self.output_backend = ""
        self.workers: dict[str, dict] = {}
        self.records: list[CallRecord] = []
        self._engines_of: list[tuple[Connection, list[str]]] = []
        self._call: CallRecord | None = None
        self._refused: dict[tuple[str, str], str] = {}  # (graph, backend) -> compile failure
        self._references: dict[str, object] = {}
        self._ops: dict[str, int] = {}
        self._names: dict[int, str] = {}
        self._keep: list = []
        self._pool: ThreadPoolExecutor | None = None
        self._token = None
        self._bar = None  # a progress bar of calls, on a terminal
        self._advance = None
        self._entered = False
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ lifetime
    def __enter__(self) -> Profiler:
        if self._entered:
            raise RuntimeError("a profiler is used for one with-block; call remote_profile() again")
        self._entered = True
        session = self._session if self._session is not None else default_session()
        self._session = session
        offered = session.backends()
        self.backends = list(self._wanted) if self._wanted is not None else offered
        unknown = [b for b in self.backends if b not in offered]
        if unknown or not self.backends:
            raise errors.UnknownBackendError(
                f"no such backend: {', '.join(unknown) or '(none given)'}; the session's workers "
                f"offer {', '.join(offered)}")
        self.output_backend = self._wanted_output or self.backends[0]
        if self.output_backend not in self.backends:
            raise errors.UnknownBackendError(f"output backend {self.output_backend} is not profiled")
        for conn in session.connections():
            engines = [b.split("/", 1)[1] for b in self.backends if b.split("/", 1)[0] == conn.name]
            if engines:
                self._engines_of.append((conn, engines))
                self.workers[conn.name] = dict(url=conn.url, device=conn.info()["device"],
                                               price_per_hour=session.price_per_hour(conn.name))
        self._pool = ThreadPoolExecutor(max_workers=len(self._engines_of), thread_name_prefix="remotorch-profile")
        self._bar = bar(f"profiling on {len(self.backends)} backend(s): calls", None, unit="items")
        self._advance = self._bar.__enter__()
        self._token = activate_profiler(self)
        return self

    def __exit__(self, *exc) -> None:
        deactivate_profiler(self._token)
        if self._bar is not None:
            self._bar.__exit__(None, None, None)
            self._bar = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def report(self) -> Report:
        """Statistics of everything recorded so far (see :class:`~remotorch.profile.report.Report`)."""
        plan = ProfileSettings(list(self.backends), self.output_backend, self.num_repeats, self.num_warmups,
                           dict(self.workers))
        with self._lock:
            records = list(self.records)
        return build_report(records, plan)

    # ------------------------------------------------------- hooks from accelerate
    def run_call(self, accelerated, fn, args: tuple, kwargs: dict):
        """Run one call of an accelerated function, recording its segments."""
        if self._call is not None:  # a nested accelerated call belongs to the outer one
            return fn(*args, **kwargs)
        record = CallRecord(self._function_name(accelerated), _now())
        self._call = record
        try:
            return fn(*args, **kwargs)
        except BaseException:
            record.failed = True
            raise
        finally:
            record.end = _now()
            self._call = None
            with self._lock:
                self.records.append(record)
            self._advance(1)

    def note_compile(self) -> None:
        """Dynamo compiled something: the current call's times are not representative."""
        if self._call is not None:
            self._call.compiled = True

    def note_fallback(self) -> None:
        """A graph ran locally instead of on the output backend (see ``RemoteGraph``)."""
        if self._call is not None:
            self._call.fell_back = True

    def run_graph(self, graph: RemoteGraph, args: list) -> list:
        """Run one graph on every backend; return the output backend's outputs."""
        start = _now()
        futures = [self._pool.submit(self._run_on_worker, conn, engines, graph, args)
                   for conn, engines in self._engines_of]
        results: dict[str, tuple[BackendRun, list | None, BaseException | None]] = {}
        for future in futures:
            results.update(future.result())
        reference = self._reference(graph, args)
        for run, outputs, _ in results.values():
            if outputs is not None and reference is not None:
                run.max_abs_diff = _max_abs_diff(outputs, reference)
        end = _now()
        if self._call is not None:
            runs = {b: results[b][0] for b in self.backends}
            self._call.graphs.append(GraphCall(graph.graph_id, self._count_ops(graph), start, end, runs))
            if any(r.compiled for r in runs.values()):
                self._call.compiled = True
        _, outputs, exc = results[self.output_backend]
        if exc is not None:
            raise exc
        return outputs

    # ------------------------------------------------------------------- helpers
    def _function_name(self, accelerated) -> str:
        """The accelerated object's name, with ``#2``, ``#3``… for different objects of one name."""
        name = self._names.get(id(accelerated))
        if name is None:
            taken = set(self._names.values())
            name, n = accelerated.name, 1
            while name in taken:
                n += 1
                name = f"{accelerated.name}#{n}"
            self._names[id(accelerated)] = name
            self._keep.append(accelerated)  # ids stay unique while the profiler lives
        return name

    def _run_on_worker(self, conn: Connection, engines: list[str], graph: RemoteGraph, args: list) -> dict:
        out = {}
        for engine in engines:  # one after another: engines of one worker never overlap
            backend = f"{conn.name}/{engine}"
            refused = self._refused.get((graph.graph_id, backend))
            if refused is not None:
                out[backend] = (BackendRun(error=refused), None, errors.UnsupportedGraphError(refused))
                continue
            started = time.perf_counter()
            try:
                res = profile_graph(conn, graph, args, engine, warmups=self.num_warmups,
                                    repeats=self.num_repeats)
            except errors.RemoteError as exc:
                message = f"{type(exc).__name__}: {(exc.message or str(exc)).splitlines()[0][:300]}"
                if isinstance(exc, errors.UnsupportedGraphError):  # compile failure: do not retry
                    self._refused[(graph.graph_id, backend)] = message
                log.debug("%s failed on graph %s: %s", backend, graph.graph_id[:12], message)
                out[backend] = (BackendRun(error=message, started=started, finished=time.perf_counter()), None, exc)
                continue
            run = BackendRun(res.times_ms, None, res.compiled, res.compile_ms, res.network_ms,
                             started=started, finished=time.perf_counter(), clock=res.clock, cuda_graph=res.cuda_graph)
            out[backend] = (run, res.outputs, None)
        return out

    def _reference(self, graph: RemoteGraph, args: list):
        """The graph's outputs from plain local eager PyTorch, for differences."""
        try:
            module = self._references.get(graph.graph_id)
            if module is None:
                p = graph.payload
                consts = [tensor_from_wire(meta, frame).clone() for meta, frame in zip(p.consts, p.const_frames)]
                device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
                own_ops = frozenset(namespace(name) for name in p.custom_ops)  # registered here: we traced them
                module = decode_graph(p.doc, consts, device, own_ops).module
                self._references[graph.graph_id] = module
            with torch.no_grad():
                out = module(*args)
            return list(out) if isinstance(out, (list, tuple)) else [out]
        except Exception:  # a missing reference only leaves the difference column empty
            log.debug("no local reference for graph %s", graph.graph_id[:12], exc_info=True)
            return None

    def _count_ops(self, graph: RemoteGraph) -> int:
        n = self._ops.get(graph.graph_id)
        if n is None:
            nodes = msgspec.msgpack.decode(graph.payload.doc).get("nodes", [])
            n = self._ops[graph.graph_id] = sum(1 for node in nodes if node.get("op") == "call")
        return n


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
    cuda_graph: str = ""  # a worker recording CUDA graphs: "replayed", or why the graph ran uncaptured

    @property
    def network_ms(self) -> float:
        """Round-trip time not spent in the worker: transport, serialization, queueing."""
        return max(0.0, self.round_trip_ms - self.worker_ms)


def profile_graph(conn: Connection, graph: RemoteGraph, args: list, engine: str, *, warmups: int,
                  repeats: int) -> ProfileResult:
    """Run a captured graph on one engine of a worker with timed repeats (one ``ProfileGraph``)."""
    start = time.perf_counter()
    reply, frames = conn.run(graph, args, request=m.ProfileGraph, expect=m.ProfileReply, engine=engine,
                             fields=dict(warmups=warmups, repeats=repeats))
    round_trip = (time.perf_counter() - start) * 1e3
    return ProfileResult(unpack_outputs(graph, reply.outputs, frames), list(reply.times_ms), reply.clock,
                         reply.compiled, reply.compile_ms, reply.worker_ms, round_trip, reply.cuda_graph)


def _now() -> float:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()  # local GPU work belongs to the segment that queued it
    return time.perf_counter()


def _max_abs_diff(outputs: list, reference: list) -> float:
    if len(outputs) != len(reference):
        return float("inf")
    worst = 0.0
    for got, want in zip(outputs, reference):
        if isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor):
            if got.shape != want.shape:
                return float("inf")
            if got.numel():
                a, b = got.detach().cpu().double(), want.detach().cpu().double()
                diff = (a - b).abs().masked_fill(a.isnan() & b.isnan(), 0.0)  # NaN where both are NaN agrees
                worst = max(worst, float(torch.nan_to_num(diff, nan=float("inf")).max()))
        elif isinstance(got, (int, float)) and isinstance(want, (int, float)):
            worst = max(worst, abs(float(got) - float(want)))
        elif got != want:
            return float("inf")
    return worst
