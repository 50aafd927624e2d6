"""Capture without a worker: the aten graphs remotorch makes of a function, for a worker of a given device.

A :class:`StubWorker` stands where a session would for the captured graphs: it says which device
its worker has and which attention kernel that worker picks (``remotorch.capture.attention``),
and stops the call at the first run of a graph, so nothing runs. :func:`trace` returns every
graph made, by kind, the backward compiled at once.
"""

from __future__ import annotations

import pytest
import torch

from remotorch.capture import backend


class Stop(Exception):
    """The first run of a captured graph: the test has what it wanted."""


class StubWorker:
    """A runner for a worker on ``device`` that picks ``answer`` for every attention call it is asked about."""

    def __init__(self, answer: str = "efficient", device: str = "cuda") -> None:
        self.answer, self.device, self.asked = answer, device, []

    def trace_device(self) -> str:
        return self.device

    def attention_backends(self, worker, calls: list) -> list[str]:
        self.asked.append(list(calls))
        return [self.answer] * len(calls)

    def run_graph(self, graph, args):
        raise Stop

    def prepare_local(self, graph, args, reached_worker: bool) -> bool:
        return True

    def note_fallback(self) -> None:
        pass


def trace(fn, *args, runner: StubWorker, dynamic: bool | None = False, **kwargs) -> dict:
    """The ``RemoteGraph`` s remotorch captures of ``fn(*args, **kwargs)`` for ``runner``'s worker, by kind
    (``"inference"``, ``"forward"``, ``"backward"``; the last graph of each kind)."""
    made = []

    class Recorded(backend.RemoteGraph):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    torch._dynamo.reset()
    with pytest.MonkeyPatch.context() as mp, torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
        mp.setattr(backend, "RemoteGraph", Recorded)
        compiled = torch.compile(fn, dynamic=dynamic, backend=lambda gm, ex: backend.remotorch_backend(
            gm, ex, session=runner, fallback="raise"))
        with pytest.raises(Stop):
            compiled(*args, **kwargs)
    torch._dynamo.reset()
    return {g.kind: g for g in made}
