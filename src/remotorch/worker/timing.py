"""Timed runs of a compiled graph on the worker: warm-ups, then repeats, each timed alone.

The worker times graphs itself so that network time never mixes into a
graph's time: on CPU with a monotonic clock around each call, on CUDA with a
pair of CUDA events around each call (the device's own clock; one
synchronization at the end, not one per run).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .engines import call

MAX_REPEATS = 100_000
MAX_WARMUPS = 10_000


@dataclass(frozen=True)
class TimedRuns:
    """Outputs of the last run and the time of each timed run, in milliseconds."""

    outputs: object
    times_ms: list[float]
    clock: str  # "monotonic" or "cuda_events"


def time_runs(fn: Callable, values: Sequence, device: torch.device, warmups: int, repeats: int) -> TimedRuns:
    """Call ``fn`` on ``values`` ``warmups`` times untimed, then ``repeats`` times timed (each call gets its own
    list: a boxed ``fn`` empties the one it is given)."""
    with torch.no_grad():
        out = None
        for _ in range(warmups):
            out = call(fn, list(values))
        if device.type == "cuda":
            return _cuda_runs(fn, values, device, repeats, out)
        times = []
        clock = time.perf_counter  # monotonic, highest resolution available
        for _ in range(repeats):
            start = clock()
            out = call(fn, list(values))
            times.append((clock() - start) * 1e3)
        return TimedRuns(out, times, "monotonic")


def _cuda_runs(fn: Callable, values: Sequence, device: torch.device, repeats: int, out) -> TimedRuns:
    torch.cuda.synchronize(device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(repeats)]
    stream = torch.cuda.current_stream(device)
    for start, end in events:
        start.record(stream)
        out = call(fn, list(values))
        end.record(stream)
    torch.cuda.synchronize(device)
    return TimedRuns(out, [start.elapsed_time(end) for start, end in events], "cuda_events")
