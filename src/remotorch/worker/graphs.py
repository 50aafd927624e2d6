"""A graph the worker holds: its decoded form, what each argument must be, and its compiled engines.

The graph store (:class:`~remotorch.worker.store.SharedStore`) keeps one
:class:`GraphEntry` per content id, shared by every session that uploaded
the same graph: its arguments are checked before every run (cheaply for the
same tensor again), and each engine compiles it once.
"""

from __future__ import annotations

import threading
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..codec.graph import DecodedGraph
from ..codec.rngstate import draws_random
from ..errors import InvalidRequestError, UnsupportedGraphError
from . import engines
from .checks import ArgCheck
from .cudagraphs import CudaGraphs
from .disk import DiskCache


@dataclass
class GraphEntry:
    """One decoded graph, its argument checks and the callables its engines compiled."""

    decoded: DecodedGraph
    checks: list[ArgCheck]  # one per argument
    compiled: dict  # engine name -> callable
    lock: threading.Lock
    # per argument: a weak reference to the tensor that last passed its check. The same
    # object passes again without a check (resident weights, call after call); a stored
    # tensor never changes its dtype or sizes here (only its values, in place)
    passed: list
    gid: str = ""
    random: bool = False  # it draws random numbers: it runs from its session's generator state

    @classmethod
    def build(cls, gid: str, decoded: DecodedGraph) -> GraphEntry:
        checks = [ArgCheck.of(meta) for meta in decoded.inputs]
        return cls(decoded, checks, {}, threading.Lock(), [None] * len(checks), gid,
                   draws_random(decoded.module))

    def check_args(self, values: list, positions=None) -> None:
        """Each value (or those at ``positions``) against the graph's argument checks."""
        if len(values) != len(self.checks):
            raise InvalidRequestError(f"graph takes {len(self.checks)} arguments, got {len(values)}")
        passed, checks = self.passed, self.checks
        for i in range(len(checks)) if positions is None else positions:
            check, v, ref = checks[i], values[i], passed[i]
            if ref is not None and ref() is v:
                continue
            check.check(i, v)
            if type(v) is torch.Tensor:
                passed[i] = weakref.ref(v)

    def engine_fn(self, engine: str, values: list, *, offered: list[str], worker: str, device: torch.device,
                  disk: DiskCache | None) -> tuple[Callable, bool]:
        """The graph compiled for ``engine`` (one of the worker's ``offered`` engines), and whether this
        call compiled it (once per engine; with a disk cache, its artifacts are kept there)."""
        fn = self.compiled.get(engine)
        if fn is not None:
            return fn, False
        if engine not in offered:
            raise UnsupportedGraphError(f"engine {engine!r} is not available on worker {worker} "
                                        f"(has {', '.join(offered)})")
        with self.lock:
            fn = self.compiled.get(engine)
            if fn is not None:
                return fn, False
            try:
                artifacts = engines.Artifacts(disk, engine, self.gid) if disk else None
                fn = engines.compile_graph(engines.load(engine), self.decoded, device, values, artifacts)
            except Exception as exc:
                raise UnsupportedGraphError(f"engine {engine} could not compile the graph: "
                                            f"{type(exc).__name__}: {exc}",
                                            remote_traceback=traceback.format_exc()) from None
            self.compiled[engine] = fn
            return fn, True

    def recorded(self, engine: str, fn: Callable, device: torch.device, graphs: CudaGraphs,
                 kept: Callable[[], frozenset[int]]) -> Callable:
        """``fn`` (this graph compiled for ``engine``) recorded as a CUDA graph on its second call and
        replayed after (:mod:`remotorch.worker.cudagraphs`); one recording per engine."""
        key = f"{engine}+cuda_graphs"
        rec = self.compiled.get(key)
        if rec is None:
            with self.lock:
                rec = self.compiled.get(key) or graphs.wrap(fn, self.decoded.module, device, kept)
                self.compiled[key] = rec
        return rec
