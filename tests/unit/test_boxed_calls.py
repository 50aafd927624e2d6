"""Graphs take their arguments boxed on the worker, so a backward frees each saved activation as it goes.

aot_autograd hands a compiled graph one list and the graph empties it as it takes its arguments
(``_boxed_call``); a backward whose autograd graph is not kept first clears its saved tensors
(``ctx.maybe_clear_saved_tensors()``). remotorch does the same on the worker: the eager engine's
callable is boxed, the run path keeps no other reference, and such a backward names its saved
activations in ``Run.take``. Here a worker in this process counts, at every operator of a
backward, how many of the forward's saved activations are still alive.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import remotorch
from remotorch.transport.loopback import LoopbackTransport
from remotorch.worker import engines
from remotorch.worker.engines import eager
from remotorch.worker.service import Service
from remotorch.worker.worker import Worker


class _Alive(TorchDispatchMode):
    """At each operator: how many of ``refs`` are alive."""

    def __init__(self, refs: list) -> None:
        super().__init__()
        self.refs, self.counts = refs, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts.append(sum(r() is not None for r in self.refs))
        return func(*args, **(kwargs or {}))


class Counting:
    """The eager engine, counting the live saved activations of ``worker`` during each backward."""

    def __init__(self) -> None:
        self.saved: list = []  # the last forward's tensor outputs (its saved activations among them)
        self.backwards: list = []
        self.compiled = 0

    def available(self, device) -> bool:
        return True

    def compile(self, graph, device, example_args, artifacts=None):
        run = eager.compile(graph, device, example_args)
        self.compiled += 1
        backward = self.compiled == 2  # the forward compiles at its first run, the backward at its own

        def counted(args: list):
            if not backward:
                out = run(args)
                self.saved = [weakref.ref(o) for o in out if isinstance(o, torch.Tensor)]
                return out
            mode = _Alive(self.saved)
            with mode:
                out = run(args)  # (the list itself, handed over)
            self.backwards.append((len(self.saved), mode.counts))
            return out

        return engines.boxed(counted)


@pytest.fixture
def counting(monkeypatch):
    worker = Worker("cpu", name="inproc")
    engine = Counting()
    real_load = engines.load
    monkeypatch.setattr(engines, "load", lambda name: engine if name == "counting" else real_load(name))
    worker.engines.append("counting")
    service = Service(worker)
    with remotorch.Session(transport=LoopbackTransport(service.handle, on_disconnect=service.disconnected),
                           retry_after=30.0) as s:
        yield s, engine


def _chain(depth: int = 6) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(32, 32), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


@pytest.mark.parametrize("retain", [False, True])
def test_a_backward_frees_each_saved_activation_after_its_last_use(counting, retain):
    session, engine = counting
    model = _chain()
    compiled = remotorch.compile(model, session=session, engine="counting", fallback="raise")
    x = torch.randn(16, 32)
    for _ in range(2):  # the first call compiles; the second is a warm one, sent without waiting
        compiled(x).square().sum().backward(retain_graph=retain)
    for saved, counts in engine.backwards:
        if retain:  # the autograd graph is kept: a second backward needs them all
            assert min(counts) == counts[0], counts
        else:  # each freed after its last use: at least one per layer before the backward ends
            assert counts == sorted(counts, reverse=True) and counts[-1] <= counts[0] - 6, counts
    assert len(engine.backwards) == 2


def test_run_take_is_runs_of_ids_and_bad_runs_are_refused():
    from remotorch.errors import InvalidRequestError
    from remotorch.worker.calls import taken

    assert taken([(5, 3), (20, 1)], arguments=4) == [5, 6, 7, 20]
    for runs in ([(5, 0)], [(5, -2)], [(1, 2, 3)], [(5, 3), (9, 2)]):  # the last: more than 4 arguments
        with pytest.raises(InvalidRequestError, match="Run.take"):
            taken(runs, arguments=4)
