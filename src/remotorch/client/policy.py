"""What the client learns about each graph from what the program does, kept by the client.

A captured graph (:class:`remotorch.capture.graph.RemoteGraph`) is immutable
capture output. What the client learns while the program runs lives here, one
:class:`GraphPolicy` per graph id, owned by the connection of the worker that
runs it (as httpx keeps cookies in the client, never on a request):

* ``read_outputs``: outputs Python read before: sent back, not kept on the worker;
* ``reused_inputs``: inputs a later graph of the same call took too: kept there
  (:mod:`remotorch.client.reuse`);
* ``ran``: the graph ran on this connection once, waited for (its upload,
  its compile and any refusal are behind it): from then on its calls are sent
  without waiting (:mod:`remotorch.client.launch`);
* ``prompt``: calls in a row whose outputs Python read right after the call,
  with nothing sent in between (inference in a loop, a token of ``generate``,
  a branch on the result). Such a call gains nothing from being sent without
  waiting, and its placeholders cost more than the wait for the reply: after
  :data:`PROMPT_CALLS` of them, the graph's calls wait for their reply again
  (the 2nd call after, the 4th after that, then one in :data:`PROBE_MAX` is
  sent without waiting, to see whether the program still reads at once). A
  probe costs what the placeholders cost (about 150 µs of Python), so it goes
  out no sooner than :data:`PROBE_MIN_S` after the last: on loopback, where a
  call takes well under a millisecond, one in 8 would cost every call about
  20 µs; across a network, 8 calls take longer than that anyway.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .graph import Graph

PROMPT_CALLS = 2  # calls read at once in a row, after which a graph's calls wait for their reply
PROBE_MAX = 8  # then the 2nd, 4th, 8th, 8th... call is sent without waiting: does the program still read at once?
PROBE_MIN_S = 0.04  # and no sooner than this after the last probe (a probe costs 80-140 µs: under 0.4%)


@dataclass(eq=False)
class GraphPolicy:
    read_outputs: set[int] = field(default_factory=set)
    reused_inputs: set[int] = field(default_factory=set)
    ran: bool = False
    prompt: int = 0
    probe: int = 0  # calls until the next one is sent without waiting (while the graph's calls wait)
    probe_every: int = 2  # doubles while probes find the program still reading at once
    probed_at: float = 0.0  # when the last probe went out (time.perf_counter)
    unread: _Read | None = None  # the last launched call's read, until its outputs are read
    plain_layout: list | None = None  # the last output layout found to have no overlapping output

    def waits(self) -> bool:
        """Should this call of the graph wait for its reply (the program reads its outputs at once)?"""
        if self.prompt < PROMPT_CALLS:
            return False
        self.probe -= 1
        if self.probe > 0:
            return True
        now = time.perf_counter()
        if now - self.probed_at < PROBE_MIN_S:
            return True
        self.probe_every = self.probe = min(self.probe_every * 2, PROBE_MAX)  # this call is a probe
        self.probed_at = now
        return False

    def launched(self) -> Callable[[bool], None]:
        """A call of the graph was sent without waiting; the function to call when Python first reads
        one of its outputs, with whether that was at once (see the module docstring)."""
        if self.unread is not None and not self.unread.done:
            self._later()  # the previous call's outputs were never read
        read = self.unread = _Read(self)
        return read

    def _later(self) -> None:
        self.prompt, self.probe_every = 0, 2

    def keep(self, graph: Graph) -> list[int]:
        """Tensor outputs that stay on the worker: not needed here, and not read by Python before."""
        end = graph.saved_from if graph.saved_from is not None else len(graph.output_devices)
        devices, must_real, read = graph.output_devices, graph.must_real, self.read_outputs
        return [i for i in range(end) if devices[i] is not None and i not in must_real and i not in read]


class _Read:
    """What a launched call does when Python first reads one of its outputs (``read(prompt)``): the
    policy learns whether that was at once. (One small object a call: thousands of eager calls are in
    flight at a time, and each object they hold costs Python's collector.)"""

    __slots__ = ("policy", "done")

    def __init__(self, policy: GraphPolicy) -> None:
        self.policy, self.done = policy, False

    def __call__(self, prompt: bool) -> None:
        self.done = True
        policy = self.policy
        if prompt:
            policy.prompt += 1
            if policy.prompt == PROMPT_CALLS:
                policy.probe, policy.probe_every = 2, 2
        else:
            policy._later()


class Policies:
    """Graph id -> its policy, for one connection."""

    def __init__(self) -> None:
        self._by_id: dict[str, GraphPolicy] = {}

    def of(self, graph: Graph) -> GraphPolicy:
        policy = self._by_id.get(graph.graph_id)
        if policy is None:  # an eager call's graph goes without waiting from its first call (client.eager)
            policy = self._by_id.setdefault(graph.graph_id, GraphPolicy(ran=getattr(graph, "eager_op", False)))
        return policy
