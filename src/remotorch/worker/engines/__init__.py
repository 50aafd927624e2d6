"""Worker engines: each turns a decoded aten graph into a callable for a device.

An engine is a module with ``compile(graph: DecodedGraph, device, example_args)
-> callable`` and ``available(device) -> bool``. Engines import their heavy
dependencies inside ``compile``, so a worker lists only what really loads.

A callable marked ``_boxed_call`` (aot_autograd's convention) takes its arguments
as one list and empties it as it takes them, so each input is freed once the graph
last used it, not when the call returns (:func:`call`); the eager engine's is. Any
other callable is called with the arguments spread.

A name ``base:arg`` is engine ``base`` set up with ``arg`` by its module's
``configure(arg)`` (only the debugging engines take one, e.g. ``hold:2.5``).

``compile`` also takes ``artifacts``: an :class:`Artifacts` over the worker's disk
cache, where an engine may keep what it made of the graph (ONNX models), or None.
TorchInductor keeps its own caches, pointed into the same folder by the worker's
command line (:func:`remotorch.cli.make_server`).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import logging
import sys
from collections.abc import Callable
from typing import Protocol

import torch
import torch.fx

from ...codec.ops import DEVICE_ASSERTS
from ...errors import UnsupportedGraphError

ENGINE_MODULES = {
    "eager": "remotorch.worker.engines.eager",
    "inductor": "remotorch.worker.engines.inductor",
    "onnxrt": "remotorch.worker.engines.onnxrt",
    "tensorrt": "remotorch.worker.engines.tensorrt",
    "failing": "remotorch.worker.engines.failing",
    "hold": "remotorch.worker.engines.hold",
}
# Engines a worker offers only when asked by name (``remotorch serve --engines``).
HIDDEN = frozenset({"failing", "hold"})


class Engine(Protocol):
    """What ``load`` returns: an engine module, or an object made by a module's ``configure``."""

    def available(self, device: torch.device) -> bool: ...

    def compile(self, graph, device: torch.device, example_args,
                artifacts: Artifacts | None = None) -> Callable: ...


class Artifacts:
    """What one engine made of one graph, kept in the worker's disk cache (checked on read).

    ``options`` names everything besides the graph the artifact depends on (library
    versions, device, settings): the entry's key is a hash of the graph id, the engine
    and the options.
    """

    def __init__(self, disk, engine: str, graph_id: str) -> None:
        self.disk = disk
        self.engine = engine.partition(":")[0]
        self.graph_id = graph_id

    def _key(self, options: str) -> str:
        return hashlib.sha256(f"{self.graph_id}|{self.engine}|{options}".encode()).hexdigest()

    def get(self, options: str) -> bytes | None:
        return self.disk.read_artifact(self.engine, self._key(options)) if self.graph_id else None

    def put(self, options: str, body: bytes) -> None:
        if self.graph_id:
            self.disk.put_artifact(self.engine, self._key(options), body)


def compile_graph(engine: Engine, graph, device: torch.device, example_args, artifacts: Artifacts | None):
    """``engine.compile(...)``, with ``artifacts`` only for an engine whose ``compile`` takes them
    (an engine written before the disk cache takes three arguments, and still works)."""
    refuse_device_asserts(graph.module, device)
    if artifacts is not None and "artifacts" in inspect.signature(engine.compile).parameters:
        return engine.compile(graph, device, example_args, artifacts=artifacts)
    return engine.compile(graph, device, example_args)


def call(fn: Callable, args: list):
    """``fn`` on ``args``: boxed (``fn._boxed_call``: the list is handed over and emptied by ``fn``,
    as aot_autograd's runtime calls a compiled graph) or with the arguments spread."""
    return fn(args) if getattr(fn, "_boxed_call", False) else fn(*args)


def boxed(fn: Callable) -> Callable:
    """``fn`` marked as taking its arguments boxed (see :func:`call`)."""
    fn._boxed_call = True
    return fn


def refuse_device_asserts(module: torch.fx.GraphModule, device: torch.device) -> None:
    """Refuse, on an accelerator, a graph calling ``aten._assert_async`` (``one_hot`` checks its classes
    with it): there a failing one is a device-side assertion, which leaves the device unusable for
    every session of the worker. On a CPU it is a plain check, which raises."""
    if device.type == "cpu":
        return
    for node in (n for m in module.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes):
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and \
                node.target._schema.name in DEVICE_ASSERTS:
            raise UnsupportedGraphError(f"operation {node.target._schema.name} is refused on a {device.type} "
                                        f"worker (a failing one would leave the device unusable)")


def cache_counts() -> dict[str, int]:
    """TorchInductor's own cache hits and misses in this process (FX graphs, AOT autograd)."""
    counters = getattr(sys.modules.get("torch._dynamo.utils"), "counters", None)  # None: not (yet) imported
    if counters is None:
        return {}
    return {"inductor_hits": counters["inductor"]["fxgraph_cache_hit"],
            "inductor_misses": counters["inductor"]["fxgraph_cache_miss"],
            "aot_autograd_hits": counters["aot_autograd"]["autograd_cache_hit"]}


def load(name: str) -> Engine:
    """The engine for a name: its module, or what ``configure`` makes for ``base:arg``.

    KeyError for unknown engines (and for an argument to one that takes
    none); ValueError for an argument the engine refuses.
    """
    base, sep, arg = name.partition(":")
    module = importlib.import_module(ENGINE_MODULES[base])
    if not sep:
        return module
    if not hasattr(module, "configure"):
        raise KeyError(name)
    return module.configure(arg)


def is_hidden(name: str) -> bool:
    """Whether ``name`` is a hidden engine (offered only by name); ValueError for a bad argument."""
    if name.partition(":")[0] not in HIDDEN:
        return False
    try:
        load(name)
    except KeyError:
        return False
    return True


def available(device: torch.device) -> list[str]:
    """Names of the engines that can run on this device here."""
    names = []
    for name in ENGINE_MODULES:
        if name in HIDDEN:
            continue
        try:
            if load(name).available(device):
                names.append(name)
        except Exception:  # an engine whose dependencies fail to import is just absent
            continue
    return names


def prewarm(names, device: torch.device) -> None:
    """Load engines now, before the worker serves, so the first graph a client sends does not pay for it.

    An engine module may define ``prewarm(device)``; inductor compiles a one-operator function, which
    imports its compiler and fills the process's first cache lookups (about 3 s here; a restarted
    worker's first cached graph then loads in a tenth of a second). This runs on the thread that
    will serve: tried on a background thread, it made the serving thread's next inductor compile
    skip its frames ("found no compiled frames"), and two threads importing dynamo at once saw
    each other's half-made modules.
    """
    for name in names:
        try:
            warm = getattr(load(name), "prewarm", None)
            if warm is not None:
                warm(device)
        except Exception:  # a warm-up is an optimisation: the engine's own compile reports problems
            logging.getLogger(__name__).warning("warming up engine %s failed", name, exc_info=True)
