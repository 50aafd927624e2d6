"""The attention kernel a worker picks for each call signature, asked once per connection (protocol.md §8.5).

Capture asks when it traces a graph for a worker that is not a CPU (``remotorch.capture.attention``):
one request for the signatures of a graph it has not asked about before, none for a graph whose
calls it knows, so a warm call never waits for it.
"""

from __future__ import annotations

from collections.abc import Callable

from .. import errors
from ..codec import messages as m


class AttentionKernels:
    """What one worker answered, per call signature (``request``: the connection's blocking request;
    ``on_reset``: the hooks its link calls after a reconnect, when the worker may have restarted)."""

    def __init__(self, request: Callable, on_reset: list | None = None) -> None:
        self._request = request
        self._known: dict[m.AttentionCall, str] = {}
        if on_reset is not None:
            on_reset.append(self.forget)

    def choose(self, calls: list[m.AttentionCall]) -> list[str]:
        """The backend the worker picks for each call (``"flash"``, ``"efficient"``, ``"cudnn"``, ``"math"``…)."""
        todo = [c for c in dict.fromkeys(calls) if c not in self._known]
        for first in range(0, len(todo), m.MAX_ATTENTION_CALLS):
            part = todo[first:first + m.MAX_ATTENTION_CALLS]
            reply, _ = self._request(m.AttentionChoice(part), expect=m.AttentionChoiceReply)
            if len(reply.backends) != len(part):
                raise errors.ProtocolError("the worker answered a different number of attention calls")
            self._known.update(zip(part, reply.backends))
        return [self._known[c] for c in calls]

    def forget(self) -> None:
        """The connection was reset (perhaps to a restarted worker): ask again."""
        self._known.clear()
