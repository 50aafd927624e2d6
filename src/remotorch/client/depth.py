"""How many optimizer steps the link itself holds, so that the queue's bound counts only steps ahead.

A loop that reads rarely keeps steps in three places: on their way to the
worker, queued there, and answered but on their way back. Only the middle
ones are ahead of the worker (its memory, and what a read waits for); the
others are the link's. Across a 20 ms link a loop of 3.5 ms steps has about
six steps on the wire, so a fixed bound on unanswered steps either starves
the worker on a long link or lets it run far ahead on a short one.
:class:`StepPipe` estimates the steps on the wire as the round trip over
the loop's pace, and :class:`~remotorch.client.stream.Stream` allows
``QueueLimits.steps`` more.

The round trip is the time from sending a request to reading its reply, of
the last request sent while nothing else was in flight: none waited behind
others at the worker, so queueing does not inflate it (a bound that grew
with the queue would feed on itself), and a link that got slower is seen at
the next one. Its own run time counts too (a graph's compile, an optimizer's first
step), and so does a reply read late (the program was busy tracing), so the
estimate errs long rather than short: more steps ahead than asked for (still
within the request and byte bounds) until the next such request, never a
worker left idle because of it. The pace is the median time the program
took from one optimizer step to the next, less the time it waited for room
in the queue (else the bound would set the pace it is computed from); a
loop's occasional read does not move a median. Until both are known, the
link holds none.
"""

from __future__ import annotations

from collections import deque

MAX_PIPE = 64  # steps the link may hold at most (the request and byte bounds still apply)


class StepPipe:
    """The optimizer steps a link holds in a loop's steady state (see the module docstring)."""

    __slots__ = ("_trip", "_gaps", "_last")

    def __init__(self) -> None:
        self._trip: float | None = None  # seconds, send to reply, of the last request sent alone
        self._gaps: deque[float] = deque(maxlen=31)  # seconds between consecutive optimizer steps sent
        self._last: tuple[float, float] | None = None  # (sent at, seconds waited for room until then)

    def stepped(self, now: float, waited: float = 0.0) -> None:
        """An optimizer step was sent at ``now`` (``time.perf_counter()``); ``waited``: the seconds the
        program has waited for room in the queue so far (all told)."""
        if self._last is not None:
            self._gaps.append(max(0.0, now - self._last[0] - (waited - self._last[1])))
        self._last = (now, waited)

    def answered(self, seconds: float) -> None:
        """A request sent while nothing else was in flight was answered ``seconds`` after it was sent."""
        self._trip = seconds

    def steps(self) -> int:
        """Steps on the wire: the round trip over the pace, rounded down (0 until both are known)."""
        if self._trip is None or len(self._gaps) < 3:
            return 0
        pace = sorted(self._gaps)[len(self._gaps) // 2]
        return MAX_PIPE if pace <= 0 else min(MAX_PIPE, int(self._trip / pace + 1e-9))
