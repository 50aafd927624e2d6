"""The textbook pipeline schedules, built as data (:class:`~remotorch.pipeline.schedules.Schedule`).

:func:`build` makes ``GPipe``, ``1F1B`` and ``Interleaved1F1B`` for any
number of stages, microbatches and workers: each worker's forwards and
backwards in the order the schedule wants them (``_sequences``), merged by a
small event simulation that respects the dependency rules of
:mod:`remotorch.pipeline.schedules` (``_merge``). There is no zero-bubble
(input/weight-gradient split) variant: ``B`` is always the full backward.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Sequence

from .plan import BACKWARD, FORWARD, Action, Schedule, ScheduleError, _needs, validate

__all__ = ["SCHEDULES", "build"]

log = logging.getLogger(__name__)


SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")


def build(name: str, stages: int, microbatches: int, chunks: int = 1, workers: int | None = None) -> Schedule:
    """The schedule ``name`` (``"GPipe"``, ``"1F1B"``, ``"Interleaved1F1B"``; any case) for ``stages`` model stages.

    Stage ``s`` runs on worker ``s % W``, where ``W = workers`` when given,
    else ``stages // chunks`` (``chunks`` stages per worker). So
    ``build("1F1B", 4, 8)`` is textbook 1F1B on 4 workers,
    ``build("Interleaved1F1B", 8, 8, chunks=2)`` 4 workers with 2 chunks each,
    and ``build("1F1B", 3, 4, workers=2)`` puts stages 0 and 2 on worker 0.

    - GPipe: each worker runs all its forwards, then all its backwards.
    - 1F1B (PipeDream-flush): after a warm-up of forwards, worker ``w``
      alternates one forward, one backward, holding at most ``W - w``
      microbatches (more chunks per worker: ``(chunks - 1) * round`` more).
    - Interleaved1F1B: Megatron-LM's interleaved schedule; each worker's
      forwards go through its chunks in rounds of about ``W`` microbatches, with
      a warm-up of ``(chunks - 1) * round + 2 * (W - 1 - w)`` forwards. With
      one chunk per worker it is 1F1B.

    Every schedule built passes :func:`validate`.
    """
    kind = {n.lower(): n for n in SCHEDULES}.get(str(name).lower())
    if kind is None:
        raise ScheduleError(f"unknown schedule {name!r}: the known ones are {', '.join(SCHEDULES)}")
    n_workers = _workers(stages, microbatches, chunks, workers)
    placement = tuple(s % n_workers for s in range(stages))
    forwards, backwards = _sequences(placement, n_workers, microbatches)
    if kind == "GPipe":
        order = [f + b for f, b in zip(forwards, backwards)]
    else:
        per_round = _round_size(microbatches, n_workers)
        n_chunks = -(-stages // n_workers)
        hops = 2 if kind == "Interleaved1F1B" and n_chunks > 1 else 1
        caps = [(n_chunks - 1) * per_round + hops * (n_workers - 1 - w) + 1 for w in range(n_workers)]
        order = _merge(forwards, backwards, caps, placement)
    return validate(Schedule(kind, stages, microbatches, placement, tuple(map(tuple, order))))


def _workers(stages: int, microbatches: int, chunks: int, workers: int | None) -> int:
    for what, value in (("stages", stages), ("microbatches", microbatches), ("chunks", chunks)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ScheduleError(f"{what} must be an integer >= 1, got {value!r}")
    if workers is None:
        if stages % chunks:
            raise ScheduleError(f"{stages} stages do not split into {chunks} chunks per worker "
                                f"(give a multiple of {chunks}, or workers=)")
        return stages // chunks
    if not isinstance(workers, int) or isinstance(workers, bool) or not 1 <= workers <= stages:
        raise ScheduleError(f"workers must be an integer from 1 to the number of stages ({stages}), got "
                            f"{workers!r}: a worker without a stage has nothing to run")
    if chunks != 1 and chunks != -(-stages // workers):
        raise ScheduleError(f"{stages} stages on {workers} workers make {-(-stages // workers)} chunks on the "
                            f"first worker, not {chunks}: give chunks or workers, not both")
    return workers


def _round_size(microbatches: int, n_workers: int) -> int:
    # microbatches per round through a worker's chunks: about W, in rounds of equal size (torch's choice)
    rounds = max(1, microbatches // n_workers)
    return -(-microbatches // rounds)


def _sequences(placement: Sequence[int], n_workers: int,
               microbatches: int) -> tuple[list[list[Action]], list[list[Action]]]:
    """Per worker, its forwards and its backwards in the order it should run each kind.

    Microbatches go through a worker's chunks (chunk ``c`` = stage ``s //
    W``) in rounds of about ``W`` (Megatron-LM): forwards of round 0 through
    chunk 0, then chunk 1, ...; backwards through the chunks in reverse. Both
    orders agree with one global order of all forwards (and one of all
    backwards) that respects the dependencies, so running all of a worker's
    forwards and then all its backwards can never deadlock.
    """
    per_round = _round_size(microbatches, n_workers)
    forwards: list[list[Action]] = [[] for _ in range(n_workers)]
    backwards: list[list[Action]] = [[] for _ in range(n_workers)]
    for s, w in enumerate(placement):
        forwards[w].extend(Action(s, FORWARD, m) for m in range(microbatches))
        backwards[w].extend(Action(s, BACKWARD, m) for m in range(microbatches))
    for w in range(n_workers):
        forwards[w].sort(key=lambda a: (a.microbatch // per_round, a.stage // n_workers, a.microbatch))
        backwards[w].sort(key=lambda a: (a.microbatch // per_round, -(a.stage // n_workers), a.microbatch))
    return forwards, backwards


def _merge(forwards: list[list[Action]], backwards: list[list[Action]], caps: list[int],
           placement: Sequence[int]) -> list[list[Action]]:
    """Interleave each worker's forwards and backwards 1F1B-style, by running them (forward 1, backward 2).

    A worker's next action is its next forward while it holds fewer than
    ``caps[w]`` forwards without their backward, else its next backward; it
    waits until that one is ready (so after the warm-up it alternates
    forward, backward, as in Megatron-LM). Should every worker wait on the
    others (few microbatches, uneven placements), the lowest one with a
    ready action of the other kind runs it. An order produced by an execution
    never deadlocks, whatever the real costs.
    """
    n_workers, stages = len(forwards), len(placement)
    nxt_f, nxt_b, free = [0] * n_workers, [0] * n_workers, [0] * n_workers
    end: dict[tuple[int, str, int], int] = {}
    order: list[list[Action]] = [[] for _ in range(n_workers)]
    events: list[int] = []
    left, now = sum(len(f) + len(b) for f, b in zip(forwards, backwards)), 0

    def ready(a: Action | None) -> bool:
        return a is not None and all(end.get(d, now + 1) <= now for d in _needs(a.key, stages))

    def run(w: int, a: Action) -> None:
        nonlocal left
        end[a.key] = free[w] = now + (1 if a.kind == FORWARD else 2)
        heapq.heappush(events, free[w])
        order[w].append(a)
        left -= 1
        if a.kind == FORWARD:
            nxt_f[w] += 1
        else:
            nxt_b[w] += 1

    while left:
        for w in range(n_workers):
            f = forwards[w][nxt_f[w]] if nxt_f[w] < len(forwards[w]) else None
            b = backwards[w][nxt_b[w]] if nxt_b[w] < len(backwards[w]) else None
            wanted = f if f is not None and nxt_f[w] - nxt_b[w] < caps[w] else b
            if free[w] <= now and ready(wanted):
                run(w, wanted)
        while events and events[0] <= now:
            heapq.heappop(events)
        if events:
            now = events[0]
        elif left:
            _unstall(forwards, backwards, nxt_f, nxt_b, ready, run)
    return order


def _unstall(forwards, backwards, nxt_f, nxt_b, ready, run) -> None:
    # every worker waits for an action that waits on another worker: the lowest worker with a ready
    # action runs it out of turn. One exists: the first forward left in the global order of
    # _sequences is at the head of its worker's forwards and ready (or, with none left, the first backward).
    for w in range(len(forwards)):
        for seq, i in ((forwards[w], nxt_f[w]), (backwards[w], nxt_b[w])):
            if i < len(seq) and ready(seq[i]):
                log.debug("schedule build: worker %d runs %s out of turn", w, seq[i])
                return run(w, seq[i])
    raise ScheduleError("internal error: schedule construction stalled")


def from_args(name: str | None, *, file: str | None = None, stages: int | None = None,
              microbatches: int | None = None, chunks: int = 1, workers: int | None = None) -> Schedule:
    """The schedule ``remotorch schedule`` names: built by ``name``, or read from ``file`` and validated
    (``ScheduleError`` saying what is missing or wrong; ``OSError`` for a file that cannot be read)."""
    import os

    from . import plan as schedules

    if file:
        if name:
            raise schedules.ScheduleError("give a schedule name or --file, not both")
        with open(file, encoding="utf-8") as f:
            text = f.read()
        return schedules.validate(schedules.parse(text, name=os.path.basename(file), stages=stages,
                                                  microbatches=microbatches))
    if not name or stages is None or microbatches is None:
        raise schedules.ScheduleError("give a schedule name (one of " + ", ".join(SCHEDULES) +
                                      ") with --stages and --microbatches, or --file FILE")
    return build(name, stages, microbatches, chunks=chunks, workers=workers)
