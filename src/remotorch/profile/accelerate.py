"""``@remotorch.accelerate``: torch.compile locally, every backend inside a profile.

Outside a ``remote_profile`` block an accelerated function is exactly
``torch.compile(fn, backend=local_backend, dynamic=dynamic)``. Inside one, the
same function is compiled with remotorch's capture (aot_autograd lowering to
aten, graphs encoded once) and every graph goes to the active profiler, which
runs it on each backend. The two compilations are separate dynamo cache
entries (dynamo guards on the backend), so switching costs nothing after the
first call of each.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from .. import errors
from .context import current_explainer, current_profiler


class Accelerated:
    """A function or module compiled locally, or profiled remotely inside ``remote_profile``."""

    def __init__(self, fn: Callable, *, dynamic: bool | None = None, local_backend: str | Callable = "inductor") -> None:
        self.fn = fn
        self.dynamic = dynamic
        self.local_backend = local_backend
        self.name = getattr(fn, "__qualname__", None) or type(fn).__name__
        self._local = None
        self._profiled = None
        if not isinstance(fn, torch.nn.Module):
            functools.update_wrapper(self, fn, updated=())

    def __call__(self, *args, **kwargs):
        explainer = current_explainer()
        if explainer is not None:
            return explainer.run_call(self, args, kwargs)
        profiler = current_profiler()
        if profiler is None:
            if self._local is None:
                self._local = torch.compile(self.fn, backend=self.local_backend, dynamic=self.dynamic)
            return self._local(*args, **kwargs)
        if self._profiled is None:
            self._profiled = torch.compile(self.fn, backend=_profiling_backend, dynamic=self.dynamic)
        return profiler.run_call(self, self._profiled, args, kwargs)

    def __get__(self, obj, objtype=None):
        # used as a method decorator: bind the instance like a plain function would
        return self if obj is None else functools.partial(self, obj)

    def __getattr__(self, name: str):
        # a wrapped module keeps its attributes (parameters, eval(), …) reachable
        if name in ("fn", "_local", "_profiled"):
            raise AttributeError(name)
        return getattr(self.fn, name)

    def __repr__(self) -> str:
        return f"<remotorch.accelerate {self.name} dynamic={self.dynamic} local_backend={self.local_backend!r}>"


def accelerate(fn: Callable | None = None, *, dynamic: bool | None = None,
               local_backend: str | Callable = "inductor"):
    """Mark a function or module for profiling on remote backends.

    ``@accelerate`` or ``@accelerate(dynamic=True, local_backend="eager")``.
    Outside ``remote_profile`` the result behaves like ``torch.compile`` with
    ``local_backend``; inside, its graphs run on the profile's backends.
    """
    if fn is None:
        return functools.partial(accelerate, dynamic=dynamic, local_backend=local_backend)
    return Accelerated(fn, dynamic=dynamic, local_backend=local_backend)


def _profiling_backend(gm: torch.fx.GraphModule, example_inputs):
    """Dynamo backend used inside a profile: remotorch's capture, graphs sent to the profiler."""
    from ..capture.backend import remotorch_backend

    profiler = current_profiler()
    if profiler is not None:
        profiler.note_compile()
    return remotorch_backend(gm, example_inputs, session=_ToProfiler(), fallback="local")


class _ToProfiler:
    """Stands where a Session would for captured graphs: hands each run to the active profiler."""

    def run_graph(self, graph, args):
        profiler = current_profiler()
        if profiler is None:
            raise errors.RemoteError("a profiled graph ran outside remote_profile")
        return profiler.run_graph(graph, args)

    def prepare_local(self, graph, args, reached_worker: bool) -> bool:
        return True  # profiled graphs keep no state on workers

    def trace_device(self) -> str:
        """The device type to trace graphs for: one graph runs on every profiled worker, so any worker
        that is not a CPU makes it "cuda"-portable (attention as its math: see ``portable_attention``)."""
        profiler = current_profiler()
        devices = {str(w.get("device", "cpu")).partition(":")[0] for w in (profiler.workers if profiler else {}).values()}
        return next((d for d in sorted(devices) if d != "cpu"), "cpu")

    def note_fallback(self) -> None:
        profiler = current_profiler()
        if profiler is not None:
            profiler.note_fallback()
