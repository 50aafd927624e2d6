"""Profiling across workers and engines: ``accelerate``, ``remote_profile``, reports, ``explain``.

Importing the package imports none of its modules (each name below is
imported on first use), so that the command line's tables
(:mod:`remotorch.profile.tables`) come without torch. The functions
``accelerate`` and ``explain`` are ``remotorch.accelerate`` and
``remotorch.explain`` (or :mod:`.accelerate`'s and :mod:`.explain`'s): here
those two names are their modules, as Python binds a package's submodules.
"""

from __future__ import annotations

import importlib

# name -> the module (of this package) that holds it; imported on first use
_PUBLIC = {"Accelerated": "accelerate", "BackendSummary": "report", "Explanation": "explain", "Profiler": "profiler",
           "Report": "report", "Segment": "report", "SequenceReport": "report", "Stats": "report",
           "remote_profile": "profiler"}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    """A public name, imported on first use; later uses find it directly."""
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
