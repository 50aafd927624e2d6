"""The callable that stands in for one captured aten graph: runs it remotely, or locally.

aot_autograd calls it with the flat argument list (boxed convention). It
asks its runner (a :class:`GraphRunner`: a session, or the profiler) to run
the graph; on a remote failure it follows its fallback policy: ``"local"``
runs the same aten graph here (one warning per graph, counted in
``stats()["fallbacks"]``) where the runner allows it, ``"raise"`` lets the
typed ``RemoteError`` through. How a graph runs remotely (plain, or with
state kept on the worker for training) is the runner's business.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from ..client.remote import fetch_all
from ..client.writes import modes_off
from ..codec.graph import GraphPayload
from ..codec.ops import refused
from ..errors import RemoteError, RemoteFallbackWarning, UnsupportedGraphError

log = logging.getLogger(__name__)

FALLBACKS = ("local", "raise")


class GraphRunner(Protocol):
    """What a captured graph asks to run it (a ``Session``, or the profiler while profiling)."""

    def run_graph(self, graph: RemoteGraph, args: Sequence) -> list:
        """Run the graph remotely; its outputs, or a ``RemoteError``."""

    def prepare_local(self, graph: RemoteGraph, args: Sequence, reached_worker: bool) -> bool:
        """May the graph run locally after a failure? (It may bring values back first.)"""

    def note_fallback(self) -> None:
        """The graph ran locally."""

    def attention_backends(self, worker: int | str | None, calls: list) -> list[str]:
        """The attention kernel (``"flash"``, ``"efficient"``, ``"cudnn"``, ``"math"``) the worker
        picks for each call signature (``codec.attention.AttentionCall``), asked at capture, once per
        signature. Optional: without it, a graph for an accelerator traces attention as its math."""

    # Optional: ``allowed_ops(graph) -> frozenset[str]``, the namespaces of custom operators
    # the graph's worker allows. A runner that has it lets a graph that calls others run
    # locally (or raise) before anything is uploaded; one without it leaves that to the worker.


class RemoteGraph:
    """One uploaded-once graph, its resident arguments, and its fallback."""

    def __init__(self, payload: GraphPayload | None, *, runner: Callable[[], GraphRunner], engine: str,
                 fallback: str, resident: list[int], output_devices: list, local: Callable | None,
                 unsupported: RemoteError | None = None, kind: str = "inference",
                 saved_from: int | None = None, must_real: frozenset[int] = frozenset(),
                 fetch_first: frozenset[int] = frozenset(), worker: int | str | None = None,
                 layouts: Callable[[Sequence], list | None] | None = None, random: bool = False,
                 cuda_graphs: bool = False) -> None:
        # Instance attribute, not class: dynamo wraps backward graphs with
        # functools.wraps, which copies __dict__ and so keeps the boxed convention.
        self._boxed_call = True
        self.payload = payload
        self.graph_id = payload.graph_id if payload else ""
        self.engine = engine
        self.fallback = fallback
        self.resident = resident
        self.resident_set = frozenset(resident)
        self.output_devices = output_devices
        self._runner = runner
        self._local = local  # the graph run here (None: it holds a kernel only its worker has)
        self._unsupported = unsupported
        self._warned = False
        self.kind = kind  # "inference", "forward" (of a training pair) or "backward"
        # forward: outputs from this index on are saved for backward (they stay on the worker)
        self.saved_from = saved_from
        self.must_real = must_real  # outputs aot_autograd's runtime reads here: always sent back
        self.fetch_first = fetch_first  # inputs it reads here: fetched before the run if remote
        self.worker = worker  # which of the runner's workers runs it (None: the first)
        self.layouts = layouts  # args -> each output's layout or value, None when unknown (capture.layout)
        self.random = random  # it draws random numbers (from this process's generator: client.rng)
        self.cuda_graphs = cuda_graphs  # the worker records it as a CUDA graph (Run.cuda_graphs)
        # what the client learns of the graph while the program runs is the client's own
        # (client.policy.GraphPolicy); nothing here changes after construction

    def __call__(self, *args) -> list:
        # Boxed (one list) or unboxed (aot wraps backward graphs): graph
        # arguments are never lists themselves, so the two cannot be confused.
        if len(args) == 1 and isinstance(args[0], list):
            args = args[0]
        runner = self._runner()
        if self._unsupported is not None:
            return self._fall_back(runner, args, self._unsupported, reached_worker=False)
        # aot_autograd analyses the first call under a dispatch mode that refuses tensor
        # subclasses; the runner's own local work (packing, placeholders) is not the graph's
        refusal = None
        try:
            refusal = self._refusal(runner) if self.payload.custom_ops else None
            if refusal is None:
                if torch._C._len_torch_dispatch_stack():
                    with modes_off():
                        return self._run(runner, args)
                return self._run(runner, args)
        except RemoteError as exc:
            error = exc
        if refusal is not None:  # a custom operator the worker does not allow: nothing was uploaded
            return self._fall_back(runner, args, refusal, reached_worker=False)
        return self._fall_back(runner, args, error, reached_worker=True)

    def _refusal(self, runner: GraphRunner) -> UnsupportedGraphError | None:
        """Why the worker would refuse this graph's custom operators (None: it allows them all).

        Asked before any upload, from the namespaces the worker's health
        reply lists (one request per worker, remembered).
        """
        allowed_ops = getattr(runner, "allowed_ops", None)
        if allowed_ops is None:
            return None
        return refused(self.payload.custom_ops, allowed_ops(self))

    def _run(self, runner: GraphRunner, args: list) -> list:
        for i in self.fetch_first:
            fetch_all((args[i],))
        return runner.run_graph(self, args)

    def run_locally(self, args: list, exc: RemoteError) -> list:
        """Run the graph here on the inputs of an earlier call whose kept outputs were lost with their
        worker (``fallback="local"``); ``exc`` (the failed read's error) when the policy says raise."""
        return self._fall_back(self._runner(), args, exc, reached_worker=True)

    def _fall_back(self, runner: GraphRunner, args: list, exc: RemoteError, *, reached_worker: bool) -> list:
        if self.fallback == "raise" or self._local is None or not runner.prepare_local(self, args, reached_worker):
            raise exc  # (no local run: the graph holds a kernel of its worker's device, fused attention)
        runner.note_fallback()
        if not self._warned:
            self._warned = True
            short = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            warnings.warn(f"remotorch: graph {self.graph_id[:12] or '(not encodable)'} runs locally "
                          f"({type(exc).__name__}: {short})", RemoteFallbackWarning, stacklevel=3)
        log.debug("local fallback for graph %s", self.graph_id[:12], exc_info=exc)
        with modes_off():
            fetch_all(args)  # values still on a worker are read here (a failure to: raised)
        return list(self._local(*args))


def output_devices(gm: torch.fx.GraphModule) -> list:
    """The device each output is expected on (None for non-tensor outputs)."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    values = out.args[0] if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    devices = []
    for v in values:
        val = v.meta.get("val") if isinstance(v, torch.fx.Node) else None
        devices.append(val.device if isinstance(val, torch.Tensor) else None)
    return devices
