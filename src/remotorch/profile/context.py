"""Which profiler (or explainer) is active for the code running now.

``with remotorch.remote_profile(...)`` makes its profiler current for the
duration of the block (a context variable, so threads and async tasks that
did not enter the block are unaffected); ``@accelerate`` functions look it
up on every call. Nothing else is kept at module level.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .profiler import Profiler

_profiler: ContextVar[Profiler | None] = ContextVar("remotorch_profiler", default=None)
_explainer: ContextVar[Any] = ContextVar("remotorch_explainer", default=None)


def current_profiler() -> Profiler | None:
    """The profiler whose ``with`` block is running, or None."""
    return _profiler.get()


def current_explainer():
    """The explain collector of ``remotorch explain``, or None."""
    return _explainer.get()


def activate_profiler(profiler: Profiler | None):
    """Make ``profiler`` current; returns the token for :func:`deactivate_profiler`."""
    return _profiler.set(profiler)


def deactivate_profiler(token) -> None:
    _profiler.reset(token)


def activate_explainer(explainer):
    return _explainer.set(explainer)


def deactivate_explainer(token) -> None:
    _explainer.reset(token)
