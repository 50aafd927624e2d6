"""Inference graphs called without aot_autograd's runtime, and the graphs that must keep it.

The backend skips aot_autograd's runtime wrapper only for an inference graph
it would merely call (``capture.backend._runs_direct``). Each case here runs
on a real worker and is compared with ``aot_eager`` on the same inputs,
including after the call (mutated inputs, aliases of inputs, grad mode).
"""

from __future__ import annotations

import pytest
import torch

import remotorch
import remotorch.capture.backend as backend


@pytest.fixture
def direct_graphs(monkeypatch):
    """The graphs the backend runs direct, as it makes them."""
    made = []
    real = backend._direct

    def spy(graph):
        made.append(graph)
        return real(graph)
    monkeypatch.setattr(backend, "_direct", spy)
    return made


def mutates_input(x):
    x.add_(1)
    return x * 2


def returns_view_of_input(x):
    return x[1:].t(), x.sum()


def returns_input(x, y):
    return x, x + y


def sets_grad_mode(x):
    torch.set_grad_enabled(True)
    return x * 3


def test_plain_inference_runs_direct_and_matches(session, direct_graphs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).eval()
    x = torch.randn(8, 16)
    f = remotorch.compile(model, session=session, fallback="raise")
    with torch.no_grad():
        want = model(x)
        for _ in range(3):
            got = f(x)
            assert torch.allclose(got, want, atol=1e-6)
    assert len(direct_graphs) == 1
    assert session.stats()["remote_calls"] >= 3  # it really ran on the worker
    # grad mode is the caller's again after the call (the direct path turns it off only around the run)
    assert torch.is_grad_enabled()
    torch._dynamo.reset()
    with torch.no_grad():
        g = remotorch.compile(model, session=session, fallback="raise")
        g(x)
        assert not torch.is_grad_enabled()


@pytest.mark.parametrize("fn,make,direct", [
    (mutates_input, lambda: [torch.randn(4, 3)], False),
    (returns_view_of_input, lambda: [torch.randn(4, 3)], False),
    # dynamo itself returns the input object; the graph it hands on computes only x + y
    (returns_input, lambda: [torch.randn(4, 3), torch.randn(4, 3)], True),
    (sets_grad_mode, lambda: [torch.randn(4, 3)], False),
], ids=["mutated input", "output aliases an input", "output is an input", "graph sets grad mode"])
def test_graphs_that_need_aot_runtime_keep_it_and_match_aot_eager(session, direct_graphs, fn, make, direct):
    torch.manual_seed(1)
    base = make()
    theirs = [a.clone() for a in base]
    ours = [a.clone() for a in base]
    grad_before = torch.is_grad_enabled()
    with torch.no_grad():
        want = torch.compile(fn, backend="aot_eager")(*theirs)
        grad_theirs = torch.is_grad_enabled()
    torch.set_grad_enabled(grad_before)
    torch._dynamo.reset()
    with torch.no_grad():
        got = remotorch.compile(fn, session=session, fallback="raise")(*ours)
        grad_ours = torch.is_grad_enabled()
    torch.set_grad_enabled(grad_before)
    assert grad_ours == grad_theirs
    assert len(direct_graphs) == int(direct)
    want = want if isinstance(want, tuple) else (want,)
    got = got if isinstance(got, tuple) else (got,)
    for w, g in zip(want, got, strict=True):
        assert torch.allclose(torch.as_tensor(g), torch.as_tensor(w))
    for t, o in zip(theirs, ours):  # inputs mutated alike
        assert torch.equal(t, o)
    if fn is returns_input:
        assert got[0] is ours[0]  # the very input object, as aot_eager returns it
    if fn is returns_view_of_input:
        got[0].mul_(0)  # a view of the caller's input, as in eager
        assert torch.equal(ours[0][1:], torch.zeros(3, 3))


def test_module_parameters_aot_puts_first_keep_the_runtime(session, direct_graphs):
    """A graph module holding its own parameters (the backend called on ``symbolic_trace``'s module):
    aot_autograd passes them before the caller's arguments, so the aten graph takes more than the
    caller passes and must not run direct."""
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh()).eval()

    class Tupled(torch.nn.Module):  # aot_autograd takes graphs with tuple outputs, as dynamo makes them
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, x):
            return (self.inner(x),)
    gm = torch.fx.symbolic_trace(Tupled())
    assert len(list(gm.parameters())) == 2
    x = torch.randn(3, 6)
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode
    with torch.no_grad():
        with tracing(TracingContext(FakeTensorMode())):  # as under dynamo: aot_autograd leaves its metadata there
            compiled = backend.remotorch_backend(gm, [x], session=session, fallback="raise")
        got = compiled(x)
        want = model(x)
    got = got[0] if isinstance(got, (list, tuple)) else got
    assert torch.allclose(got, want, atol=1e-6)
    assert direct_graphs == []
