"""The worker proper: holds graphs and tensors for sessions and runs graphs on engines.

It knows nothing of sockets: the server (``remotorch.server``) decodes
messages and calls these methods; tests may call them in-process.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from dataclasses import dataclass

import torch

from ..codec.graph import DecodedGraph, decode_graph, graph_id
from ..codec.messages import TensorMeta
from ..codec.tensors import content_id, dtype_from_name, tensor_from_wire
from ..errors import (InvalidRequestError, LimitExceededError, MissingObjectsError,
                      RemoteOutOfMemoryError, RequestTimeoutError, UnsupportedGraphError, WorkerError)
from . import engines, quota
from .deadline import DeadlineExpired, deadline
from .store import SharedStore
from .timing import MAX_REPEATS, MAX_WARMUPS, TimedRuns, time_runs
from .training import TrainingState

log = logging.getLogger(__name__)


def resolve_device(spec: str = "auto") -> torch.device:
    """``auto`` picks CUDA when present, else CPU; ``cpu``/``cuda``/``cuda:N`` are taken as given."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("CUDA was asked for but this machine has none")
    return device


@dataclass
class _Graph:
    decoded: DecodedGraph
    checks: list  # per argument: None (anything), "scalar", or (dtype, rank, ((dim, size), ...))
    compiled: dict  # engine name -> callable
    lock: threading.Lock

    @classmethod
    def build(cls, decoded: DecodedGraph) -> _Graph:
        checks = []
        for meta in decoded.inputs:
            if meta.get("kind") == "tensor":
                shape = list(meta.get("shape") or [])
                fixed = {i: d for i, d in enumerate(shape) if isinstance(d, int)}
                checks.append((dtype_from_name(str(meta.get("dtype"))), len(shape), tuple(fixed.items())))
            else:
                checks.append("scalar" if meta.get("kind") == "scalar" else None)
        return cls(decoded, checks, {}, threading.Lock())


@dataclass(frozen=True)
class Limits:
    """Size, memory and time limits a worker enforces on every request."""

    max_tensor_bytes: int = 1 << 36
    max_graph_bytes: int = 256 << 20
    memory_quota: int | None = None  # bytes one session may hold (resident tensors, graphs)
    memory_limit: int | None = None  # bytes all sessions and the cache may hold together
    cache_bytes: int = 0  # per store: objects no session holds, kept for re-adoption (0: none)
    request_timeout: float | None = None  # seconds one graph may run (checked between operators)


class Worker:
    """Graph cache + tensor store + engines for one device."""

    def __init__(self, device: str | torch.device = "auto", *, name: str = "worker",
                 limits: Limits = Limits(), price_per_hour: float = 0.0,
                 engine_names: list[str] | None = None) -> None:
        self.device = device if isinstance(device, torch.device) else resolve_device(device)
        self.name = name
        self.price_per_hour = price_per_hour  # $ per hour of this worker, for cost reports
        self.limits = limits
        self.engines = engines.available(self.device)
        if engine_names is not None:  # offer only these (in this order); each must load here
            unknown = [e for e in engine_names if e not in self.engines and not engines.is_hidden(e)]
            if unknown:
                raise ValueError(f"engines not available on {self.device}: {', '.join(unknown)} "
                                 f"(available: {', '.join(self.engines)})")
            self.engines = list(engine_names)
        self._graphs = SharedStore(limits.cache_bytes)
        self._tensors = SharedStore(limits.cache_bytes)
        self.training = TrainingState(self.device)

    # ------------------------------------------------------------------ sessions
    def close_session(self, session: object) -> None:
        """Release everything a session held (objects no one else holds are freed)."""
        self._graphs.drop_session(session)
        self._tensors.drop_session(session)
        self.training.drop_session(session)

    def info(self) -> dict:
        return {"name": self.name, "device": str(self.device), "torch_version": str(torch.__version__),
                "engines": list(self.engines),
                "resident_bytes": self._tensors.total_bytes + self.training.total_bytes(),
                "cached_bytes": self._tensors.orphan_bytes + self._graphs.orphan_bytes,
                "price_per_hour": self.price_per_hour}

    def memory(self) -> dict:
        """Bytes held by sessions and cached for nobody, per store (graphs count documents and constants)."""
        return {"tensor_bytes": self._tensors.total_bytes, "graph_bytes": self._graphs.total_bytes,
                "training_bytes": self.training.total_bytes(),
                "cached_bytes": self._tensors.orphan_bytes + self._graphs.orphan_bytes}

    def session_bytes(self, session: object) -> int:
        """Bytes a session holds on this worker (what its memory quota counts), training state included."""
        return (self._tensors.session_bytes(session) + self._graphs.session_bytes(session)
                + self.training.session_bytes(session))

    def _reserve(self, session: object, nbytes: int) -> None:
        quota.reserve((self._tensors, self._graphs), session, nbytes,
                      quota=self.limits.memory_quota, limit=self.limits.memory_limit,
                      other_held=self.training.session_bytes(session),
                      other_live=self.training.total_bytes())

    # ------------------------------------------------------------------- uploads
    def put_graph(self, session: object, gid: str, doc: bytes, consts: list[TensorMeta], frames) -> None:
        """Store a graph document after checking its id is its content hash and it decodes."""
        size = len(doc) + sum(f.nbytes for f in frames)
        if size > self.limits.max_graph_bytes:
            raise LimitExceededError(f"graph of {size} bytes (document and constants) is over the "
                                     f"worker's limit of {self.limits.max_graph_bytes}")
        if len(consts) != len(frames) or any(c.frame != i for i, c in enumerate(consts)):
            raise InvalidRequestError("graph constant i must be in frame i")
        if graph_id(doc, consts, frames) != gid:
            raise InvalidRequestError("graph id does not match its content")
        if self._graphs.missing(session, [gid]):
            self._reserve(session, size)
            if self._graphs.adopt(session, gid):  # same verified bytes: reuse (compiled engines too)
                return
            tensors = [self.wire_tensor(m, frames) for m in consts]
            decoded = decode_graph(doc, tensors, self.device)
            self._graphs.put(session, gid, _Graph.build(decoded), size)

    def put_tensors(self, session: object, ids: list[str], metas: list[TensorMeta], frames) -> None:
        """Store resident tensors under their content ids (verified, then moved to the device)."""
        if len(ids) != len(metas):
            raise InvalidRequestError("tensor ids and metas disagree")
        for f in frames:
            if f.nbytes > self.limits.max_tensor_bytes:
                raise LimitExceededError(f"tensor of {f.nbytes} bytes is over the worker's limit of "
                                         f"{self.limits.max_tensor_bytes}")
        held = self._tensors.session_keys(session)
        new = {tid: frames[meta.frame].nbytes for tid, meta in zip(ids, metas)
               if tid not in held and 0 <= meta.frame < len(frames)}
        self._reserve(session, sum(new.values()))
        for tid, meta in zip(ids, metas):
            if not 0 <= meta.frame < len(frames):
                raise InvalidRequestError("tensor names a frame the message does not have")
            if content_id(meta, memoryview(frames[meta.frame])) != tid:
                raise InvalidRequestError(f"tensor id {tid[:16]}… does not match its content")
            if self._tensors.adopt(session, tid):
                continue
            tensor = self.wire_tensor(meta, frames).to(self.device)
            self._tensors.put(session, tid, tensor, tensor.numel() * tensor.element_size())

    def release_tensors(self, session: object, ids) -> None:
        """Drop this session's hold on uploaded tensors (a superseded version of a buffer)."""
        self._tensors.release(session, ids)

    def resident_tensor(self, session: object, tid: str) -> torch.Tensor:
        """A tensor this session uploaded with ``put_tensors``; MissingObjectsError otherwise."""
        if self._tensors.missing(session, [tid]):
            raise MissingObjectsError("worker does not hold this tensor for this session", tensors=[tid])
        return self._tensors.get(session, tid)

    def wire_tensor(self, meta: TensorMeta, frames) -> torch.Tensor:
        if not 0 <= meta.frame < len(frames):
            raise InvalidRequestError("tensor names a frame the message does not have")
        if frames[meta.frame].nbytes > self.limits.max_tensor_bytes:
            raise LimitExceededError(f"tensor of {frames[meta.frame].nbytes} bytes is over the worker's limit")
        try:
            return tensor_from_wire(meta, frames[meta.frame])
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None

    # ----------------------------------------------------------------------- run
    def run(self, session: object, gid: str, engine: str, args: list, frames) -> tuple[list, float, bool]:
        """Run a graph; ``args`` are tensors/scalars or ``("ref", id)``. Returns (outputs, ms, compiled)."""
        values, missing_t = [], []
        tensors, on_cpu = self._tensors, self.device.type == "cpu"
        for a in args:
            if type(a) is tuple:
                try:
                    values.append(tensors.get(session, a[1]))
                except KeyError:
                    missing_t.append(a[1])
            elif on_cpu or not isinstance(a, torch.Tensor):
                values.append(a)
            else:
                values.append(a.to(self.device))
        missing_g = self._graphs.missing(session, [gid])
        if missing_t or missing_g:
            raise MissingObjectsError("worker does not hold these objects for this session",
                                      graphs=missing_g, tensors=missing_t)
        graph: _Graph = self._graphs.get(session, gid)
        self._check_args(graph, values)
        fn, compiled = self._compiled(graph, engine, values)
        try:
            out, ms = self._call_with_retry(fn, values, engine)
        except DeadlineExpired:
            raise RequestTimeoutError(f"graph ran longer than the worker's request timeout of "
                                      f"{self.limits.request_timeout:g}s and was stopped") from None
        outs = list(out) if isinstance(out, (list, tuple)) else [out]
        return outs, ms, compiled

    def _call_with_retry(self, fn, values: list, engine: str) -> tuple:
        """Run once; out of memory evicts cached objects no session holds and runs once more."""
        try:
            return self._call(fn, values)
        except Exception as exc:
            if not quota.is_out_of_memory(exc) or not quota.release_cached(
                    (self._tensors, self._graphs), self.device):
                raise self._run_error(exc, engine) from None
        try:
            return self._call(fn, values)
        except Exception as exc:
            raise self._run_error(exc, engine) from None

    def _call(self, fn, values: list) -> tuple:
        with torch.no_grad(), deadline(self.limits.request_timeout):
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            start = time.perf_counter()
            out = fn(*values)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return out, (time.perf_counter() - start) * 1e3

    @staticmethod
    def _run_error(exc: BaseException, engine: str) -> WorkerError:
        """The typed error for a graph that raised (out of memory, or anything else)."""
        tb = "".join(traceback.format_exception(exc))
        if quota.is_out_of_memory(exc):
            return RemoteOutOfMemoryError(f"out of memory running graph: {type(exc).__name__}: {exc}",
                                          remote_traceback=tb)
        return WorkerError(f"graph failed on {engine}: {type(exc).__name__}: {exc}", remote_traceback=tb)

    def _compiled(self, graph: _Graph, engine: str, values: list):
        fn = graph.compiled.get(engine)
        if fn is not None:
            return fn, False
        if engine not in self.engines:
            raise UnsupportedGraphError(f"engine {engine!r} is not available on worker {self.name} "
                                        f"(has {', '.join(self.engines)})")
        with graph.lock:
            fn = graph.compiled.get(engine)
            if fn is not None:
                return fn, False
            try:
                fn = engines.load(engine).compile(graph.decoded, self.device, values)
            except Exception as exc:
                raise UnsupportedGraphError(f"engine {engine} could not compile the graph: "
                                            f"{type(exc).__name__}: {exc}",
                                            remote_traceback=traceback.format_exc()) from None
            graph.compiled[engine] = fn
            return fn, True

    @staticmethod
    def _check_args(graph: _Graph, values: list) -> None:
        if len(values) != len(graph.checks):
            raise InvalidRequestError(f"graph takes {len(graph.checks)} arguments, got {len(values)}")
        for i, (check, v) in enumerate(zip(graph.checks, values)):
            if check is None:
                continue
            if check == "scalar":
                if isinstance(v, torch.Tensor):
                    raise InvalidRequestError(f"argument {i} must be a scalar")
                continue
            dtype, rank, fixed = check
            if not isinstance(v, torch.Tensor):
                raise InvalidRequestError(f"argument {i} must be a tensor")
            ok = v.dtype == dtype and v.dim() == rank
            if ok:
                shape = v.shape
                for d, n in fixed:
                    if shape[d] != n:
                        ok = False
                        break
            if not ok:
                raise InvalidRequestError(f"argument {i}: expected {dtype} of rank {rank} with sizes "
                                          f"{dict(fixed)}, got {v.dtype}{list(v.shape)}")

    # ------------------------------------------------------------------- profile
    def profile(self, session: object, gid: str, engine: str, args: list, frames, *,
                warmups: int, repeats: int) -> tuple[list, TimedRuns, bool, float]:
        """Run a graph ``warmups`` times untimed, then ``repeats`` times timed, on one engine.

        Returns (outputs of the last run, the timed runs, whether this call
        compiled the graph for the engine, compile milliseconds). Compiling is
        never part of the timed runs.
        """
        if not (0 <= warmups <= MAX_WARMUPS and 1 <= repeats <= MAX_REPEATS):
            raise InvalidRequestError(f"warmups must be 0…{MAX_WARMUPS} and repeats 1…{MAX_REPEATS}")
        missing_t = self._tensors.missing(session, [a[1] for a in args if isinstance(a, tuple)])
        missing_g = self._graphs.missing(session, [gid])
        if missing_t or missing_g:
            raise MissingObjectsError("worker does not hold these objects for this session",
                                      graphs=missing_g, tensors=missing_t)
        graph: _Graph = self._graphs.get(session, gid)
        values = [self._tensors.get(session, a[1]) if isinstance(a, tuple) else a for a in args]
        values = [v.to(self.device) if isinstance(v, torch.Tensor) and v.device != self.device else v
                  for v in values]
        self._check_args(graph, values)
        start = time.perf_counter()
        fn, compiled = self._compiled(graph, engine, values)
        compile_ms = (time.perf_counter() - start) * 1e3 if compiled else 0.0
        try:
            runs = time_runs(fn, values, self.device, warmups, repeats)
        except (torch.OutOfMemoryError, MemoryError) as exc:
            raise RemoteOutOfMemoryError(f"out of memory running graph: {exc}",
                                         remote_traceback=traceback.format_exc()) from None
        except Exception as exc:
            raise WorkerError(f"graph failed on {engine}: {type(exc).__name__}: {exc}",
                              remote_traceback=traceback.format_exc()) from None
        out = runs.outputs
        return (list(out) if isinstance(out, (list, tuple)) else [out]), runs, compiled, compile_ms
