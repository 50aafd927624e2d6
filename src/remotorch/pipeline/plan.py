"""Pipeline schedules as data: which worker runs which stage's forward and backward of which microbatch, when.

A model is split into ``stages``; a batch into ``microbatches``. A
:class:`Schedule` says, for every worker, the ordered list of
actions (:class:`Action`) it executes (``"0F1"``: stage 0, forward, microbatch 1;
``"1B0"``: stage 1, full backward, microbatch 0) and, in ``placement``, which
worker holds each stage. That is all the data there is: one interpreter runs
any valid schedule, :func:`validate` and :mod:`~remotorch.pipeline.simulate`
read the same data, and a user can write a schedule by hand in the text form
(one line per worker, actions separated by spaces; :func:`parse`).

The dependency rules (:func:`dependencies`), the only ones the interpreter
waits on:

- ``F(s, m)`` needs ``F(s-1, m)`` done (for ``s > 0``);
- ``B(s, m)`` needs ``F(s, m)`` done and, unless ``s`` is the last stage,
  ``B(s+1, m)`` done;
- each worker runs its list strictly in order, one action at a time.

:func:`remotorch.pipeline.builders.build` makes the textbook schedules
(``GPipe``, ``1F1B``, ``Interleaved1F1B``) as this data. Import these names
from :mod:`remotorch.pipeline.schedules`, which re-exports them with ``build``.
"""

from __future__ import annotations

import logging
import re
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import ScheduleError

__all__ = ["KINDS", "Action", "Schedule", "ScheduleError", "dependencies", "parse", "check_static", "replay",
           "validate"]

log = logging.getLogger(__name__)

FORWARD, BACKWARD = "F", "B"
KINDS = (FORWARD, BACKWARD)
_ACTION = re.compile(r"(\d+)([A-Za-z]+)(\d+)")


@dataclass(frozen=True)
class Action:
    """One step of a worker: stage ``stage`` runs its forward (``"F"``) or full backward (``"B"``) of a microbatch.

    ``str(action)`` is the text form, ``"0F1"``; :meth:`parse` reads it back.
    """

    stage: int
    kind: str
    microbatch: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ScheduleError(f"{self.stage}{self.kind}{self.microbatch}: unknown kind {self.kind!r} "
                                f"(F = forward, B = backward)", action=f"{self.stage}{self.kind}{self.microbatch}")
        for field in ("stage", "microbatch"):
            value = getattr(self, field)
            if type(value) is not int or value < 0:
                raise ScheduleError(f"an action's {field} must be an integer >= 0, got {value!r}")

    @property
    def key(self) -> tuple[int, str, int]:
        """``(stage, kind, microbatch)``: the action as a plain tuple (cheap to hash)."""
        return (self.stage, self.kind, self.microbatch)

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """The action written as ``text`` (``"0F1"``, ``"1B0"``); a clear :class:`ScheduleError` otherwise."""
        match = _ACTION.fullmatch(text.strip())
        if not match:
            raise ScheduleError(f"{text!r} is not an action: write STAGE KIND MICROBATCH, e.g. 0F1 "
                                f"(stage 0, forward, microbatch 1) or 1B0", action=text)
        return cls(int(match[1]), match[2].upper(), int(match[3]))


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: per worker, the actions it executes in order.

    ``stages`` model stages, ``microbatches`` microbatches; ``placement[s]``
    is the index of the worker that holds stage ``s``; ``order[w]`` the
    actions worker ``w`` runs, in that order (there are no idle entries: a
    worker waits until its next action's dependencies are done). Lists and
    action texts given to the constructor are turned into tuples and
    actions. Construction checks nothing else: :func:`validate` does.
    """

    name: str
    stages: int
    microbatches: int
    placement: tuple[int, ...]
    order: tuple[tuple[Action, ...], ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "placement", tuple(self.placement))
        object.__setattr__(self, "order", tuple(tuple(_as_action(a, w, i) for i, a in enumerate(row))
                                                for w, row in enumerate(self.order)))

    @property
    def workers(self) -> int:
        """The number of workers (lines of ``order``)."""
        return len(self.order)

    def stages_of(self, worker: int) -> tuple[int, ...]:
        """The stages placed on ``worker``, in increasing order."""
        return tuple(s for s, w in enumerate(self.placement) if w == worker)

    def text(self) -> str:
        """The text form: one line per worker, its actions separated by spaces (``"0F0 0F1 0B0 ..."``)."""
        return "\n".join(" ".join(str(a) for a in row) for row in self.order)


def _as_action(item: Action | str, worker: int, position: int) -> Action:
    if isinstance(item, Action):
        return item
    if isinstance(item, str):
        return Action.parse(item)
    raise ScheduleError(f"worker {worker}, position {position}: {item!r} is not an action (a schedule has no "
                        "idle entries: a worker waits for its next action's dependencies by itself)",
                        worker=worker, position=position, action=repr(item))


def parse(text: str, name: str = "custom", stages: int | None = None,
          microbatches: int | None = None) -> Schedule:
    """Read a schedule from its text form: one line per worker, actions separated by spaces (or commas).

    Blank lines and ``#`` comments are skipped. ``stages`` and
    ``microbatches`` default to one more than the largest seen; stage ``s``
    is placed on the (first) line that holds it. Parsing checks the syntax
    only: call :func:`validate` to check that the schedule can run.
    """
    rows: list[tuple[Action, ...]] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        items = [t for t in re.split(r"[\s,]+", line.split("#", 1)[0]) if t]
        if not items:
            continue
        row = []
        for i, item in enumerate(items):
            try:
                row.append(Action.parse(item))
            except ScheduleError as exc:
                raise ScheduleError(f"line {lineno}, item {i + 1}: {exc.message}", worker=len(rows), position=i,
                                    action=item) from None
        rows.append(tuple(row))
    if not rows:
        raise ScheduleError("the schedule has no actions: write one line per worker, e.g. '0F0 0B0'")
    actions = [a for row in rows for a in row]
    stages = 1 + max(a.stage for a in actions) if stages is None else stages
    microbatches = 1 + max(a.microbatch for a in actions) if microbatches is None else microbatches
    placement = []
    for s in range(stages):
        line = next((w for w, row in enumerate(rows) if any(a.stage == s for a in row)), None)
        if line is None:
            raise ScheduleError(f"stage {s} appears on no line, so no worker runs it (the schedule has "
                                f"{stages} stages, 0..{stages - 1})")
        placement.append(line)
    return Schedule(name, stages, microbatches, tuple(placement), tuple(rows))


def dependencies(action: Action, stages: int) -> tuple[Action, ...]:
    """The actions that must be done before ``action`` may start (the module's dependency rules)."""
    return tuple(Action(*key) for key in _needs(action.key, stages))


def _needs(key: tuple[int, str, int], stages: int) -> tuple[tuple[int, str, int], ...]:
    # the dependency rules on (stage, kind, microbatch) tuples; dependencies() is the public face
    s, kind, m = key
    if kind == FORWARD:
        return ((s - 1, FORWARD, m),) if s > 0 else ()
    if s + 1 < stages:
        return ((s, FORWARD, m), (s + 1, BACKWARD, m))
    return ((s, FORWARD, m),)


# ---------------------------------------------------------------- validation

def validate(schedule: Schedule) -> Schedule:
    """Return ``schedule`` if it can run; else raise :class:`ScheduleError` naming the first bad action and why.

    Checks, in this order: the shape (stages, microbatches, placement); each
    action (stage and microbatch in range, on the worker ``placement`` names,
    not a duplicate); that every stage has one forward and one backward of
    every microbatch; that no backward comes before its own forward; and, by
    running the order under the dependency rules (:func:`replay`), that no
    deadlock leaves the workers waiting on each other.
    """
    check_static(schedule)
    replay(schedule)
    return schedule


def check_static(schedule: Schedule) -> None:
    """Every check of :func:`validate` but the deadlock one (which needs :func:`replay`)."""
    _check_shape(schedule)
    _check_actions(schedule)
    _check_missing(schedule)
    _check_backward_after_forward(schedule)


def _check_shape(schedule: Schedule) -> None:
    for field in ("stages", "microbatches"):
        value = getattr(schedule, field)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ScheduleError(f"a schedule needs {field} >= 1, got {value!r}")
    if schedule.workers < 1:
        raise ScheduleError("a schedule needs at least one worker (a line of actions)")
    if len(schedule.placement) != schedule.stages:
        raise ScheduleError(f"placement names a worker for {len(schedule.placement)} stages, "
                            f"the schedule has {schedule.stages}")
    for s, w in enumerate(schedule.placement):
        if not isinstance(w, int) or isinstance(w, bool) or not 0 <= w < schedule.workers:
            raise ScheduleError(f"placement puts stage {s} on worker {w!r}; the schedule has workers "
                                f"0..{schedule.workers - 1}")


def _bad(worker: int, position: int, action: Action, why: str) -> ScheduleError:
    return ScheduleError(f"worker {worker}, position {position}: {action} {why}", worker=worker,
                         position=position, action=str(action))


def _check_actions(schedule: Schedule) -> None:
    seen: dict[Action, tuple[int, int]] = {}
    for w, row in enumerate(schedule.order):
        for i, a in enumerate(row):
            if a.stage >= schedule.stages:
                raise _bad(w, i, a, f"names stage {a.stage}; the schedule has {schedule.stages} stages "
                                    f"(0..{schedule.stages - 1})")
            if a.microbatch >= schedule.microbatches:
                raise _bad(w, i, a, f"names microbatch {a.microbatch}; the schedule has "
                                    f"{schedule.microbatches} microbatches (0..{schedule.microbatches - 1})")
            if schedule.placement[a.stage] != w:
                raise _bad(w, i, a, f"is on the wrong worker: stage {a.stage} is placed on worker "
                                    f"{schedule.placement[a.stage]}")
            if a in seen:
                raise _bad(w, i, a, "is a duplicate of worker {}, position {}".format(*seen[a]))
            seen[a] = (w, i)


def _check_missing(schedule: Schedule) -> None:
    present = {a.key for row in schedule.order for a in row}
    missing = [Action(s, k, m) for s in range(schedule.stages) for m in range(schedule.microbatches)
               for k in KINDS if (s, k, m) not in present]
    if missing:
        first = missing[0]
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ScheduleError(f"{first} is missing{more}: worker {schedule.placement[first.stage]} (which holds stage "
                            f"{first.stage}) must run one forward and one backward of each of the "
                            f"{schedule.microbatches} microbatches", worker=schedule.placement[first.stage],
                            action=str(first))


def _check_backward_after_forward(schedule: Schedule) -> None:
    for w, row in enumerate(schedule.order):
        done: set[tuple[int, str, int]] = set()
        for i, a in enumerate(row):
            if a.kind == BACKWARD and (a.stage, FORWARD, a.microbatch) not in done:
                forward = Action(a.stage, FORWARD, a.microbatch)
                raise _bad(w, i, a, f"comes before its own forward {forward} (position {row.index(forward)})")
            done.add(a.key)


def replay(schedule: Schedule, duration: Callable[[Action], float] | None = None,
           comm: float = 0.0) -> tuple[tuple[tuple[Action, float, float], ...], ...]:
    """Run the schedule's order under the dependency rules; per worker, ``(action, start, end)`` in order.

    Each action starts as soon as its worker is free and its dependencies are
    done (``comm`` later when a dependency ran on another worker) and lasts
    ``duration(action)`` (0 when not given). This is the one reading of the
    rules that :func:`validate` and the simulator share. Raises
    :class:`ScheduleError` on a deadlock, naming every worker's stuck action
    and what it waits for. Assumes the other checks of :func:`validate` passed.
    """
    order, placement, stages = schedule.order, schedule.placement, schedule.stages
    end: dict[tuple[int, str, int], float] = {}
    free = [0.0] * schedule.workers
    heads = [0] * schedule.workers
    spans: list[list[tuple[Action, float, float]]] = [[] for _ in order]
    waiting: dict[tuple[int, str, int], list[int]] = {}
    queue = deque(range(schedule.workers))
    while queue:
        w = queue.popleft()
        row = order[w]
        while heads[w] < len(row):
            a = row[heads[w]]
            needs = _needs(a.key, stages)
            blocker = next((d for d in needs if d not in end), None)
            if blocker is not None:
                waiting.setdefault(blocker, []).append(w)
                break
            start = max([free[w], *(end[d] + (comm if placement[d[0]] != w else 0.0) for d in needs)])
            end[a.key] = free[w] = start + (duration(a) if duration else 0.0)
            spans[w].append((a, start, free[w]))
            heads[w] += 1
            queue.extend(waiting.pop(a.key, ()))
    if any(h < len(row) for h, row in zip(heads, order)):
        raise _deadlock(schedule, heads, end)
    return tuple(tuple(row) for row in spans)


def _deadlock(schedule: Schedule, heads: list[int], end: dict[tuple[int, str, int], float]) -> ScheduleError:
    where = {a: (w, i) for w, row in enumerate(schedule.order) for i, a in enumerate(row)}
    stuck = []
    for w, (h, row) in enumerate(zip(heads, schedule.order)):
        if h < len(row):
            wanted = [d for d in dependencies(row[h], schedule.stages) if d.key not in end]
            needs = ", ".join("{} (worker {}, position {})".format(d, *where[d]) for d in wanted)
            stuck.append((w, h, row[h], f"worker {w} waits at position {h} ({row[h]}) for {needs}"))
    w, h, a, _ = stuck[0]
    return ScheduleError("deadlock: no worker can go on; " + "; ".join(s[3] for s in stuck),
                         worker=w, position=h, action=str(a))


# ---------------------------------------------------------------- building
