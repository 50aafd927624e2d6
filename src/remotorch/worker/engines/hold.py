"""The hold engine: a debugging aid that runs a graph like eager, then holds the answer back.

Never offered unless a worker is started with it by name:
``remotorch serve --engines eager,hold:2.5`` offers the engine ``hold:2.5``,
whose every run answers 2.5 s late (``hold`` alone: 1 s). Tests use it for a
call that stays in flight as long as they need on any machine, however fast,
where a graph made slow by its FLOPs is slow only on some: a request timeout
stops it (it sleeps in short slices, so the worker's ``SIGALRM`` deadline
lands between them), a SIGTERM waits for it, a killed worker drops it. It
logs a warning as each hold begins, so the worker's log shows that the run
has started.
"""

from __future__ import annotations

import logging
import math
import time

import torch

from . import boxed, eager

log = logging.getLogger(__name__)

DEFAULT_S = 1.0
SLICE_S = 0.01  # the longest stretch a deadline waits for


class Hold:
    """The engine for one hold time: eager's callable, with a pause after each run."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def available(self, device: torch.device) -> bool:
        return True

    def compile(self, graph, device: torch.device, example_args, artifacts=None):
        run = eager.compile(graph, device, example_args)
        seconds = self.seconds

        def held(args):
            out = run(args)
            log.warning("hold engine: holding a graph run for %gs", seconds)
            until = time.monotonic() + seconds
            while (left := until - time.monotonic()) > 0:
                time.sleep(min(left, SLICE_S))
            return out

        return boxed(held)


def configure(arg: str) -> Hold:
    """The engine named ``hold:<arg>``: ``arg`` is the hold in seconds (finite, >= 0); ValueError otherwise."""
    try:
        seconds = float(arg)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"engine hold:{arg}: the hold must be a number of seconds >= 0 (e.g. hold:2.5)")
    return Hold(seconds)


def available(device: torch.device) -> bool:
    return True


def compile(graph, device: torch.device, example_args, artifacts=None):
    return Hold(DEFAULT_S).compile(graph, device, example_args)
