"""Simulated timing of a pipeline schedule: when each action runs, the bubble, the activations held.

:func:`simulate` runs a schedule's order under the dependency rules of
:mod:`~remotorch.pipeline.schedules` (the same reading :func:`validate` and the
interpreter use) with a cost per forward and per backward (one figure for
all stages, or one per stage, e.g. measured) and a cost per hop between
workers. It is a model, not a measurement: compare it with measured step
times rather than quoting it as one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from .schedules import BACKWARD, FORWARD, Action, Schedule, ScheduleError, check_static, replay

__all__ = ["Span", "Timeline", "simulate", "peak_activations"]


class Span(NamedTuple):
    """One action of a worker and when it ran (in the cost unit)."""

    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """What :func:`simulate` found: per worker its spans, and the figures.

    ``total`` is the makespan; ``busy[w]`` the time worker ``w`` computed;
    ``bubble_fraction`` the idle time of all workers over ``workers * total``;
    ``peak_activations[w]`` the most stage-microbatch pairs whose forward ran
    on worker ``w`` and whose backward had not yet (activations it holds).
    """

    schedule: Schedule
    spans: tuple[tuple[Span, ...], ...]
    total: float
    busy: tuple[float, ...]
    bubble_fraction: float
    peak_activations: tuple[int, ...]
    forward: tuple[float, ...]
    backward: tuple[float, ...]
    comm: float

    @property
    def workers(self) -> int:
        """The number of workers (rows of the timeline)."""
        return len(self.spans)

    def to_dict(self) -> dict:
        """The timeline as plain JSON-ready data (costs, figures, and each span as action text and times)."""
        s = self.schedule
        return {
            "schedule": s.name, "stages": s.stages, "microbatches": s.microbatches, "workers": s.workers,
            "placement": list(s.placement), "forward": list(self.forward), "backward": list(self.backward),
            "comm": self.comm, "total": self.total, "busy": list(self.busy),
            "bubble_fraction": self.bubble_fraction, "peak_activations": list(self.peak_activations),
            "spans": [[{"action": str(sp.action), "start": sp.start, "end": sp.end} for sp in row]
                      for row in self.spans],
        }


def simulate(schedule: Schedule, forward: float | Sequence[float] = 1.0,
             backward: float | Sequence[float] = 2.0, comm: float = 0.0) -> Timeline:
    """Time ``schedule``: each action starts when its worker is free and its dependencies are done.

    ``forward`` and ``backward`` are the cost of one microbatch through one
    stage, a number for every stage or a list with one per stage; ``comm``
    is added whenever a dependency ran on another worker. The schedule is
    validated first (:class:`ScheduleError` if it cannot run).
    """
    check_static(schedule)  # replay below finds deadlocks, so this is validate() in full
    fwd = _costs("forward", forward, schedule.stages)
    bwd = _costs("backward", backward, schedule.stages)
    comm = _costs("comm", comm, 1)[0]
    rows = replay(schedule, lambda a: fwd[a.stage] if a.kind == FORWARD else bwd[a.stage], comm)
    spans = tuple(tuple(Span(*span) for span in row) for row in rows)
    total = max((row[-1].end for row in spans if row), default=0.0)
    busy = tuple(sum(sp.end - sp.start for sp in row) for row in spans)
    capacity = schedule.workers * total
    bubble = (capacity - sum(busy)) / capacity if capacity > 0 else 0.0
    return Timeline(schedule, spans, total, busy, bubble, peak_activations(schedule), fwd, bwd, comm)


def peak_activations(schedule: Schedule) -> tuple[int, ...]:
    """Per worker, the most stage-microbatch pairs forwarded and not yet backwarded at any point of its order.

    A worker runs one action at a time, in order, so this depends on the
    order alone, not on costs.
    """
    peaks = []
    for row in schedule.order:
        held = peak = 0
        for a in row:
            held += 1 if a.kind == FORWARD else -1 if a.kind == BACKWARD else 0
            peak = max(peak, held)
        peaks.append(peak)
    return tuple(peaks)


def _costs(what: str, value: float | Sequence[float], stages: int) -> tuple[float, ...]:
    values = [value] * stages if isinstance(value, (int, float)) else list(value)
    if len(values) != stages:
        raise ScheduleError(f"{what} costs: {len(values)} given for {stages} stages (give one number, "
                            f"or one per stage)")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ScheduleError(f"{what} costs must be finite numbers >= 0, got {v!r}")
    return tuple(float(v) for v in values)
