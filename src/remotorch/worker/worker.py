"""The worker proper: holds graphs and tensors for sessions and runs graphs on engines.

It knows nothing of sockets: the service (:mod:`remotorch.worker.service`)
decodes messages and calls these methods; tests may call them in-process.
What a session keeps lives in three stores: uploads by content id
(:mod:`remotorch.worker.store`), values by handle id
(:mod:`remotorch.worker.handles`), and parameter slots and optimizers
(:mod:`remotorch.worker.training`). With a disk cache
(:mod:`remotorch.worker.disk`) uploads are also kept on disk, and
:meth:`Worker.have` takes them back for a session that proves it holds them.
Each graph held is a :class:`~remotorch.worker.graphs.GraphEntry` (argument
checks, engines compiled once), argument bindings live in
:mod:`remotorch.worker.bindings`, and every run goes through
:func:`remotorch.worker.guard.guarded` (timeout, out of memory, typed errors).
"""

from __future__ import annotations

import logging
import time
from itertools import chain
from collections.abc import Callable

import torch

from ..codec.graph import decode_graph, graph_id
from ..codec import messages as m
from ..codec.frames import FrameReader
from ..codec.messages import TensorMeta
from ..codec.tensors import content_id
from ..errors import (InvalidRequestError, LimitExceededError, MissingObjectsError, QuotaExceededError,
                      UnsupportedGraphError)
from . import engines, quota, recall
from .bindings import Bindings
from .attention import AttentionChoices
from .calls import Prepared, Ran, storages, taken
from .cudagraphs import CudaGraphs
from .graphs import GraphEntry
from .rng import Generators
from .guard import guarded, timed_call
from .quota import Limits
from .disk import DiskCache
from .store import SharedStore
from .timing import MAX_REPEATS, MAX_WARMUPS, TimedRuns, time_runs
from .handles import HandleStore, held_bytes
from ..codec.args import expand
from .outputs import OutputPlan, Send, dispose, grad_slots, zeros
from .runs import _KEPT, run_kept, short
from .groups import Groups
from .tenancy import check_namespaces
from .training import Trainables
from .roots import Roots
from .weights import Weights

log = logging.getLogger(__name__)

MAX_SPANNED = 1 << 20  # handles one Pending's spans may name
_MISSING = object()  # a RefArg the session does not hold (reported with the others)


def resolve_device(spec: str = "auto") -> torch.device:
    """``auto`` picks CUDA when present, else CPU; ``cpu``/``cuda``/``cuda:N`` are taken as given."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("CUDA was asked for but this machine has none")
    return device


class Worker:
    """Graph cache + tensor store + engines for one device."""

    def __init__(self, device: str | torch.device = "auto", *, name: str = "worker",
                 limits: Limits = Limits(), price_per_hour: float = 0.0,
                 engine_names: list[str] | None = None, allow_ops: frozenset[str] = frozenset(),
                 group_host: str = "127.0.0.1", disk: DiskCache | None = None, cuda_graphs: bool = False,
                 roots: Roots | None = None) -> None:
        self.device = device if isinstance(device, torch.device) else resolve_device(device)
        self.name = name
        self.price_per_hour = price_per_hour  # $ per hour of this worker, for cost reports
        self.handles = HandleStore()  # every value kept for a session, by handle id
        if limits.memory_quota is not None or limits.memory_limit is not None:
            self.handles.track()  # (asked before every output kept: see state_bytes)
        self.limits = limits
        self.engines = engines.available(self.device)
        if engine_names is not None:  # offer only these (in this order); each must load here
            unknown = [e for e in engine_names if e not in self.engines and not engines.is_hidden(e)]
            if unknown:
                raise ValueError(f"engines not available on {self.device}: {', '.join(unknown)} "
                                 f"(available: {', '.join(self.engines)})")
            self.engines = list(engine_names)
        self._graphs = SharedStore(limits.cache_bytes)
        self._short_ids: dict[object, dict[str, str]] = {}  # session -> short graph id -> graph id
        self.generators = Generators(self.device)  # each session's random generator state
        self._tensors = SharedStore(limits.cache_bytes)
        self.stores = (self._tensors, self._graphs)  # (what out of memory may evict: worker/guard.py)
        self.trainables = Trainables(self.device)  # parameter slots and optimizers
        self.groups = Groups(self.trainables, self.device, group_host)  # process groups with other workers
        # namespaces of custom operators graphs may call (registered here: see worker/custom_ops.py)
        self.allow_ops = frozenset(allow_ops)
        self.tenancy = None  # the service's Tenancy: tenant-wide quotas and allowlists (None: no tenants)
        self.disk = disk  # the cache on disk (``serve --cache-dir``): uploads and artifacts across restarts
        self._bindings = Bindings()  # session -> binding id -> argument binding (Run.bind)
        self.attention = AttentionChoices(self.device, limits.max_tensor_bytes)  # kernels torch picks here
        self.cuda_graphs = cuda_graphs  # record every graph as a CUDA graph (``serve --cuda-graphs``)
        self.recordings = CudaGraphs()  # what recording did, counted (worker/cudagraphs.py)
        self.weights = Weights(self, roots or Roots())  # files its operator lets it read and write

    # ------------------------------------------------------------------ sessions
    def _full_graph_id(self, session: object, short: str) -> str:
        """The id of the one graph this session ran whose id starts with ``short`` (else ``missing``)."""
        known = self._short_ids.setdefault(session, {})
        gid = known.get(short)
        if gid is None:
            found = [k for k in self._graphs.session_keys(session) if k.startswith(short)]
            if len(found) != 1:
                raise MissingObjectsError("worker does not hold these objects for this session", graphs=[short])
            gid = known[short] = found[0]
        return gid

    def close_session(self, session: object) -> None:
        """Release everything a session held (objects no one else holds are freed)."""
        self._short_ids.pop(session, None)
        self.generators.forget(session)
        self._graphs.drop_session(session)
        self._tensors.drop_session(session)
        self.handles.drop_session(session)
        self.trainables.drop_session(session)
        self.groups.drop_session(session)
        self._bindings.pop(session, None)

    def apply_pending(self, session: object, p: m.Pending) -> None:
        """The client's deferred housekeeping: zero_grad first, then drop what it no longer references."""
        if p.zero_grad or p.slots or p.optims:
            self.trainables.apply_pending(session, p.zero_grad, p.slots, p.optims)
        if p.handles:
            self.handles.release(session, p.handles)
        if p.spans:
            if not all(len(r) == 2 and r[1] >= 0 for r in p.spans) or sum(r[1] for r in p.spans) > MAX_SPANNED:
                raise InvalidRequestError(f"spans of handles are [first, count] pairs naming at most "
                                          f"{MAX_SPANNED} handles")
            self.handles.release(session, [r[0] + k for r in p.spans for k in range(r[1])])
        if p.tensors:
            self._tensors.release(session, p.tensors)
            self._bindings.unbind(session, p.tensors)

    def kept(self) -> frozenset[int]:
        """The storages (by address) of what the worker keeps between runs: uploads, parameter slots."""
        return storages(list(chain(self._tensors.values(), self.trainables.tensors())))

    def state_bytes(self, session: object | None = None) -> int:
        """Bytes of kept values, parameters, gradients and optimizer state (one session, or all), each
        tensor object once (the kept values' from the sums the handles keep where a quota asks)."""
        return held_bytes(self.handles, session, self.trainables.tensors(session))

    def info(self) -> dict:
        return {"name": self.name, "device": str(self.device), "torch_version": str(torch.__version__),
                "engines": list(self.engines),
                "resident_bytes": self._tensors.total_bytes + self.state_bytes(),
                "cached_bytes": self._tensors.orphan_bytes + self._graphs.orphan_bytes,
                "price_per_hour": self.price_per_hour, "allowed_ops": sorted(self.allow_ops),
                "weight_roots": self.weights.roots.describe(), "weights_read": self.weights.bytes_read,
                "disk_cache": {**self.disk.stats(), **engines.cache_counts()} if self.disk else {}}

    def memory(self) -> dict:
        """Bytes held by sessions and cached for nobody, per store (graphs count documents and constants)."""
        return {"tensor_bytes": self._tensors.total_bytes, "graph_bytes": self._graphs.total_bytes,
                "state_bytes": self.state_bytes(),
                "cached_bytes": self._tensors.orphan_bytes + self._graphs.orphan_bytes}

    def session_bytes(self, session: object) -> int:
        """Bytes a session holds on this worker (what its memory quota counts), kept values included."""
        return (self._tensors.session_bytes(session) + self._graphs.session_bytes(session)
                + self.state_bytes(session))

    def may_keep(self, session: object, nbytes: int) -> bool:
        """Whether a session may keep ``nbytes`` more of outputs here (within its quota and the limit)."""
        limits = self.limits
        if limits.memory_quota is not None and self.session_bytes(session) + nbytes > limits.memory_quota:
            return False
        if self.tenancy is not None and self.tenancy.over_quota(session, nbytes, self.session_bytes):
            return False
        if limits.memory_limit is not None:
            live = self._tensors.total_bytes + self._graphs.total_bytes + self.state_bytes()
            return live + nbytes <= limits.memory_limit
        return True

    def _reserve(self, session: object, nbytes: int) -> None:
        if self.tenancy is not None:
            over = self.tenancy.over_quota(session, nbytes, self.session_bytes)
            if over:
                raise QuotaExceededError(over)
        quota.reserve((self._tensors, self._graphs), session, nbytes,
                      quota=self.limits.memory_quota, limit=self.limits.memory_limit,
                      other_held=self.state_bytes(session), other_live=self.state_bytes())

    def ops_for(self, session: object) -> frozenset[str]:
        """The custom-operator namespaces this session's graphs may call (its tenant's, within the worker's)."""
        return self.allow_ops if self.tenancy is None else self.tenancy.allowed_ops(session, self.allow_ops)

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
            self._store_graph(session, gid, doc, consts, frames, size)

    def _store_graph(self, session: object, gid: str, doc: bytes, consts: list[TensorMeta], frames,
                     size: int) -> None:
        """Hold a verified graph for the session: adopted if stored, else decoded (and written to disk)."""
        self._reserve(session, size)
        if self._adopt_graph(session, gid):  # same verified bytes: reuse (compiled engines too)
            return
        reader = self.reader(frames)
        tensors = [reader.tensor(meta) for meta in consts]
        decoded = decode_graph(doc, tensors, self.device, self.ops_for(session))
        self._graphs.put(session, gid, GraphEntry.build(gid, decoded), size)
        if self.disk is not None:
            self.disk.put_graph(gid, doc, consts, frames)

    def _adopt_graph(self, session: object, gid: str) -> bool:
        """Hold a graph stored already (another session decoded it), if this session's tenant may run it."""
        if not self._graphs.adopt(session, gid):
            return False
        allowed = self.ops_for(session)
        if allowed != self.allow_ops:  # decoded under the worker's allowlist: check this tenant's
            try:
                check_namespaces(self._graphs.get(session, gid).decoded.module, allowed)
            except UnsupportedGraphError:
                self._graphs.release(session, [gid])
                raise
        return True

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
            if self.disk is not None:
                self.disk.put_tensor(tid, meta, frames[meta.frame])
            if self._tensors.adopt(session, tid):
                continue
            tensor = self.reader(frames).tensor(meta).to(self.device)
            self._tensors.put(session, tid, tensor, tensor.numel() * tensor.element_size())

    # ------------------------------------------------------------ the disk cache
    def have(self, session: object, nonce: bytes, graphs: list, tensors: list) -> tuple[list[str], list[str]]:
        """Hold for the session what it proves it has and the disk cache keeps (:func:`recall.have`)."""
        return recall.have(self, session, nonce, graphs, tensors)

    def release_tensors(self, session: object, ids) -> None:
        """Drop this session's hold on uploaded tensors (a superseded version of a buffer)."""
        self._tensors.release(session, ids)

    def resident_tensor(self, session: object, tid: str) -> torch.Tensor:
        """A tensor this session uploaded with ``put_tensors``; MissingObjectsError otherwise."""
        if self._tensors.missing(session, [tid]):
            raise MissingObjectsError("worker does not hold this tensor for this session", tensors=[tid])
        return self._tensors.get(session, tid)

    def reader(self, frames) -> FrameReader:
        """A request's frames as tensors, under this worker's size limit (bad references: InvalidRequestError)."""
        return FrameReader(frames, error=InvalidRequestError, max_bytes=self.limits.max_tensor_bytes)

    # ----------------------------------------------------------------------- run
    def run(self, session: object, req: m.Run, frames, send: Send) -> Ran:
        """Run a graph once on an engine, and dispose of its outputs as the request says.

        ``req.args`` are wire arguments (``TensorArg`` in ``frames``,
        ``RefArg``, ``ScalarArg``, ``HandleArg``/``ViewArg``/``SlotArg``).
        ``req.keep_inputs`` pairs ``[argument index, handle id]``: those inputs
        are kept as handles (before the run, so they are there even if it
        fails). The outputs of the result follow :mod:`remotorch.worker.outputs`.
        ``send`` delivers outputs to another worker.
        """
        if req.brief and not frames and not self.cuda_graphs and short(req):
            ran = run_kept(self, session, req, send)
            if type(ran) is float:  # every output kept as planned
                return Ran([_KEPT] * len(req.keep), ran, False)
            if ran is not None:
                return ran
        plan = None if req.saved_from < 0 and not (req.keep or req.grad_slots or req.send) else OutputPlan.of(req)
        grads = grad_slots(self, session, req) if req.grad_slots else {}
        prep = self._prepare(session, req.graph_id, req.engine, req.args, frames, req.bind, req.bound,
                             req.cuda_graphs)
        if req.keep_inputs:
            self._keep_inputs(session, req.keep_inputs, prep.values)
        inputs = storages(prep.values) if grads else frozenset()  # (before the call frees them)
        if req.take:  # saved activations the run takes: freed as it goes (see worker/calls.py)
            self.handles.release(session, taken(req.take, len(prep.values)))
        else:
            prep.again = lambda: self._prepare(session, req.graph_id, req.engine, req.args, frames, 0,
                                               req.bound, req.cuda_graphs).values

        def call():
            return self._guarded(req.engine, lambda: timed_call(prep.fn, prep.hand_over(), self.device))

        rng = None
        if prep.random:  # from the session's generator state (the client's), as one process would
            out, ms = self.generators.run(session, req.rng, call)
            rng = self.generators.changes(session)
        else:
            out, ms = call()
        outs = _as_list(out)
        if plan is not None:  # (None: every output goes back inline, the common inference call)
            outs = dispose(self, session, plan, outs, inputs, grads, send)
        return Ran(outs, ms, prep.compiled, rng)

    def profile(self, session: object, gid: str, engine: str, args: list, frames, *, warmups: int,
                repeats: int, cuda_graphs: bool = False) -> tuple[list, TimedRuns, bool, float, str]:
        """Run a graph ``warmups`` times untimed, then ``repeats`` times timed, on one engine.

        Returns (outputs of the last run, the timed runs, whether this call compiled the graph for the
        engine, compile milliseconds, with CUDA graphs what its last run did: "replayed", or why it ran
        uncaptured). Compiling is never part of the timed runs; the whole series is one run as far as
        the request timeout and out-of-memory handling go.
        """
        if not (0 <= warmups <= MAX_WARMUPS and 1 <= repeats <= MAX_REPEATS):
            raise InvalidRequestError(f"warmups must be 0…{MAX_WARMUPS} and repeats 1…{MAX_REPEATS}")
        prep = self._prepare(session, gid, engine, args, frames, cuda_graphs=cuda_graphs)
        runs = self._guarded(engine, lambda: time_runs(prep.fn, prep.values, self.device, warmups, repeats))
        return _as_list(runs.outputs), runs, prep.compiled, prep.compile_ms, getattr(prep.fn, "state", "")

    def _prepare(self, session: object, gid: str, engine: str, args: list, frames, bind: int = 0,
                 bound: int = 0, cuda_graphs: bool = False) -> Prepared:
        """The graph, its engine's callable and the argument values, checked; the same for every kind of run.

        ``bound``: ``args`` are the arguments binding ``bound`` does not cover
        (its tensors fill the other positions); ``bind``: remember this call's
        ``RefArg`` arguments as binding ``bind`` (once they are all held and pass the graph's checks).
        """
        if bind and bound:
            raise InvalidRequestError("a run names an argument binding or makes one, not both")
        if len(gid) == m.SHORT_GRAPH_ID:
            gid = self._full_graph_id(session, gid)
        try:
            args = expand(args)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        binding = self._bindings.find(session, bound, gid, len(args)) if bound else None
        values = self.values(session, args, frames)
        missing_t = [a.id for a, v in zip(args, values) if v is _MISSING]
        try:
            graph: GraphEntry = self._graphs.get(session, gid)
        except KeyError:
            graph = None
        if missing_t or graph is None:
            raise MissingObjectsError("worker does not hold these objects for this session",
                                      graphs=[] if graph is not None else [gid], tensors=missing_t)
        if binding is not None:
            values = binding.fill(values)
            graph.check_args(values, binding.free)  # the bound ones passed when they were bound
        else:
            graph.check_args(values)
            if bind:
                self._bindings.bind(session, bind, gid, args, values)
        start = time.perf_counter()
        fn, compiled = graph.engine_fn(engine, values, offered=self.engines, worker=self.name, device=self.device,
                                       disk=self.disk)
        if cuda_graphs or self.cuda_graphs:
            fn = graph.recorded(engine, fn, self.device, self.recordings, self.kept)
        return Prepared(fn, values, compiled, (time.perf_counter() - start) * 1e3 if compiled else 0.0,
                         graph.random)

    def _keep_inputs(self, session: object, pairs: list[list[int]], values: list) -> None:
        if not all(len(p) == 2 and type(p[0]) is int and 0 <= p[0] < len(values)
                   and isinstance(values[p[0]], torch.Tensor) for p in pairs):
            raise InvalidRequestError("keep_inputs must be [tensor argument index, handle id] pairs")
        self.handles.put(session, [p[1] for p in pairs], [values[p[0]] for p in pairs])

    def values(self, session: object, args: list, frames) -> list:
        """Wire arguments as the values a graph takes, on this worker's device.

        A ``RefArg`` the session does not hold becomes ``_MISSING`` (so all
        of them are reported at once); a handle or slot it does not hold
        raises ``MissingObjectsError`` at once (the client cannot re-upload it).
        """
        handles = self.handles.held(session)  # (the usual case; the rest is looked up when met)
        slots = reader = held = None
        values = []
        for a in args:
            kind = type(a)
            if kind is m.HandleArg:
                t = handles.get(a.id)
                values.append(t if t is not None else self.handles.get(session, a.id))
            elif kind is m.SlotArg:
                if slots is None:
                    slots = self.trainables.values_made(session)
                t = slots.get(a.id)
                values.append(t if t is not None else self.trainables.value(session, a.id))
            elif kind is m.RefArg:
                if held is None:
                    held = self._tensors.getter(session, _MISSING)
                values.append(held(a.id))
            elif kind is m.TensorArg:
                if reader is None:
                    reader = self.reader(frames)
                t = reader.tensor(a.meta)
                values.append(t if self.device.type == "cpu" else t.to(self.device))
            elif kind is m.ScalarArg:
                values.append(a.value)
            elif kind is m.ViewArg:
                values.append(self.handles.view(session, a.id, a.shape, a.strides, a.offset))
            elif kind is m.ZerosArg:
                values.append(zeros(a, self.device, self.limits.max_tensor_bytes))
            else:
                raise InvalidRequestError(f"{type(a).__name__} is not a graph argument")
        return values

    def _guarded(self, engine: str, body: Callable[[], object]):
        """``body`` (graph runs) under this worker's request timeout and out-of-memory handling."""
        return guarded(engine, body, timeout=self.limits.request_timeout, stores=self.stores,
                       device=self.device)


def _as_list(out) -> list:
    return list(out) if isinstance(out, (list, tuple)) else [out]
