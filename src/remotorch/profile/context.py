"""Which profiler (or explainer) is active for the code running now.

``with remotorch.remote_profile(...)`` makes its profiler current for the
duration of the block (a context variable, so threads and async tasks that
did not enter the block are unaffected); ``@accelerate`` functions look it
up on every call. Nothing else is kept at module level.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any, Protocol


class ActiveProfiler(Protocol):
    """What ``@accelerate`` functions and their graphs ask of the profiler of the running block."""

    def run_call(self, accelerated, fn, args: tuple, kwargs: dict): ...

    def run_graph(self, graph, args: list) -> list: ...

    def note_compile(self) -> None: ...

    def note_fallback(self) -> None: ...


_profiler: ContextVar[ActiveProfiler | None] = ContextVar("remotorch_profiler", default=None)
_explainer: ContextVar[Any] = ContextVar("remotorch_explainer", default=None)


def current_profiler() -> ActiveProfiler | None:
    """The profiler whose ``with`` block is running, or None."""
    return _profiler.get()


def current_explainer():
    """The explain collector of ``remotorch explain``, or None."""
    return _explainer.get()


def activate_profiler(profiler: ActiveProfiler | None):
    """Make ``profiler`` current; returns the token for :func:`deactivate_profiler`."""
    return _profiler.set(profiler)


def deactivate_profiler(token) -> None:
    _profiler.reset(token)


def activate_explainer(explainer):
    return _explainer.set(explainer)


def deactivate_explainer(token) -> None:
    _explainer.reset(token)
