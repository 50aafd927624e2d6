"""Control flow and other higher-order operators with subgraphs, on a real worker, equal to aot_eager.

``torch.cond`` (a data-dependent predicate, both branches), ``torch.while_loop``,
``scan``, ``map``, ``flex_attention`` and ``nested_compile_region``
(``invoke_subgraph``) reach the aten graph as higher-order operators whose
arguments are subgraphs; they travel as subgraphs of the graph document
(docs/protocol.md §12.5). Each model runs once under
``torch.compile(backend="aot_eager")`` and once on remotorch
(``backend="remotorch"``, ``fullgraph=True``, ``fallback="raise"``, a real
``remotorch serve``); outputs, and input and parameter gradients where the
operator trains, must agree.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch._higher_order_ops.map import map as hop_map
from torch._higher_order_ops.scan import scan
from torch.nn.attention import flex_attention as flex

import remotorch
from remotorch import errors
from remotorch.devtools import conformance

from conftest import TOKEN

TOL = dict(rtol=conformance.RTOL, atol=conformance.ATOL)


class Cond(nn.Module):
    """``torch.cond`` on a predicate computed from the input."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda x: self.lin(x).sin(), lambda x: self.lin(x).cos() * 2, (x,))


class While(nn.Module):
    """``torch.while_loop``: three steps of a small recurrence through a parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4) * 0.5)

    def forward(self, x):
        def body(i, h):
            return i + 1, torch.tanh(h @ self.w)

        return torch.while_loop(lambda i, h: i < 3, body, (torch.tensor(0), x))[1]


class Scan(nn.Module):
    """An RNN cell over the first dimension with ``scan``: the last state and every step's output."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4) * 0.5)

    def forward(self, xs):
        def step(h, x):
            h = torch.tanh(h @ self.w + x)
            return h, h * 2

        return scan(step, torch.zeros(2, 4), xs)


class Map(nn.Module):
    """``map`` of a row-wise function with a parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, xs):
        return hop_map(lambda x, w: (x @ w).relu(), xs, self.w)


@torch.compiler.nested_compile_region
def _block(x, w):
    return (x @ w).relu() + x


class Invoke(nn.Module):
    """The same ``nested_compile_region`` called twice: one subgraph, two ``invoke_subgraph`` calls."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4) * 0.5)

    def forward(self, x):
        return _block(_block(x, self.w), self.w)


class Flex(nn.Module):
    """``flex_attention`` with a relative-position ``score_mod`` and a causal ``mask_mod``."""

    def forward(self, q, k, v):
        mask = flex.create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, q.shape[2], k.shape[2],
                                      device="cpu")
        return flex.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + (qi - ki) * 0.1,
                                   block_mask=mask)


def run(server, make: Callable[[], nn.Module], inputs: tuple, train: bool) -> tuple[dict, dict]:
    """The model under aot_eager and on remotorch: outputs, and (training) gradients of inputs and parameters."""
    results = []
    for backend in ("aot_eager", "remotorch"):
        conformance._seed()
        torch._dynamo.reset()
        model = make()
        args = tuple(a.clone().requires_grad_(train) for a in inputs)
        if backend == "aot_eager":
            held = _call(torch.compile(model, backend="aot_eager", fullgraph=True), model, args, train)
        else:
            with remotorch.Session(server.url, token=TOKEN) as session:  # fullgraph: no piece runs here
                compiled = torch.compile(model, backend="remotorch", fullgraph=True,
                                         options={"session": session, "fallback": "raise"})
                held = _call(compiled, model, args, train)
                assert session.stats()["remote_calls"] > 0 and session.stats()["fallbacks"] == 0
        results.append(conformance._read(held))
    return results[0], results[1]


def _call(compiled, model: nn.Module, args: tuple, train: bool) -> dict:
    with torch.set_grad_enabled(train):
        out = compiled(*args)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    held = {f"out{i}": o for i, o in enumerate(outs)}
    if train:
        sum((o * (i + 1)).sum() for i, o in enumerate(outs)).backward()
        held |= {f"grad:arg{i}": a.grad for i, a in enumerate(args)}
        held |= {f"grad:{n}": p.grad for n, p in model.named_parameters()}
    return held


def assert_same(reference: dict, got: dict) -> None:
    assert reference.keys() == got.keys()
    for name, want in reference.items():
        torch.testing.assert_close(got[name], want, **TOL, msg=lambda m: f"{name}: {m}")


def x34(sign: float = 1.0):
    return (sign * (torch.rand(3, 4) + 0.1),)


CASES = {
    "cond": (Cond, x34(1.0)), "while_loop": (While, x34()),  # cond's other branch: the next test
    "scan": (Scan, (torch.randn(5, 2, 4),)), "map": (Map, (torch.randn(5, 4),)), "invoke_subgraph": (Invoke, x34()),
}


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("case", CASES)
def test_higher_order_operator_matches_aot_eager(server, case, train):
    make, inputs = CASES[case]
    # while_loop's backward reads each step's index with .item(): torch traces it only with scalar
    # outputs captured (aot_eager as well; without, dynamo falls back to running the loop eagerly)
    with torch._dynamo.config.patch(capture_scalar_outputs=case == "while_loop" and train):
        assert_same(*run(server, make, inputs, train))


def test_cond_takes_the_branch_of_each_call(server):
    """One uploaded graph, both branches: the predicate is computed on the worker, call by call."""
    conformance._seed()
    model = Cond()
    with remotorch.Session(server.url, token=TOKEN) as session:
        compiled = remotorch.compile(model, session=session, fallback="raise")
        inputs = [x34(1.0)[0], x34(-1.0)[0], x34(1.0)[0]]
        with torch.no_grad():
            got = [compiled(x) for x in inputs]
            want = [model(x) for x in inputs]
        assert session.stats()["graphs_uploaded"] == 1
    assert not torch.allclose(got[0], got[1])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)


QKV = tuple(torch.randn(1, 2, 16, 8) for _ in range(3))


def test_flex_attention_inference(server):
    assert_same(*run(server, Flex, QKV, train=False))


def test_flex_attention_backward_operator(server, monkeypatch):
    """torch's ``flex_attention`` refuses ``requires_grad`` inputs on CPU before tracing
    (``_validate_device``); its higher-order operators compute forward and backward on CPU all
    the same. With that check lifted, the training graphs carry ``flex_attention`` and
    ``flex_attention_backward``, with their score_mod, joint and mask_mod subgraphs."""
    monkeypatch.setattr(flex, "_validate_device", lambda *args: None)
    assert_same(*run(server, Flex, QKV, train=True))


# ------------------------------------------------------------------ engines and limits
# What the compiling engines do with these graphs (torch 2.13, CPU; docs/architecture.md says the same):
# inductor runs cond, while_loop, scan and map and refuses invoke_subgraph and flex_attention; onnxrt
# exports cond, while_loop, scan and invoke_subgraph and refuses map and flex_attention.
ENGINE_CASES = [("cond", "inductor", True), ("invoke_subgraph", "inductor", False), ("cond", "onnxrt", True),
                ("map", "onnxrt", False)]


@pytest.mark.parametrize("case, engine, runs", ENGINE_CASES,
                         ids=[f"{c}-{e}-{'runs' if r else 'refused'}" for c, e, r in ENGINE_CASES])
def test_compiling_engines_run_it_or_refuse_it_typed(server, engine, case, runs):
    """An engine that cannot take a graph with subgraphs refuses it as unsupported (naming itself),
    and the worker goes on serving; one that can gives aot_eager's results."""
    make, inputs = CASES[case]
    conformance._seed()
    model = make()
    with torch.no_grad():
        want = torch.compile(model, backend="aot_eager", fullgraph=True)(*inputs)
    torch._dynamo.reset()
    with remotorch.Session(server.url, token=TOKEN) as session:
        assert engine in session.health()["engines"]  # (the test extra installs onnxruntime)
        compiled = remotorch.compile(model, session=session, engine=engine, fallback="raise")
        if runs:
            with torch.no_grad():
                got = compiled(*inputs)
            assert_same(conformance._read({"out": want}), conformance._read({"out": got}))
            assert session.stats()["remote_calls"] > 0 and session.stats()["fallbacks"] == 0
        else:
            with pytest.raises(errors.UnsupportedGraphError, match=f"engine {engine} could not compile the graph"):
                with torch.no_grad():
                    compiled(*inputs)
        torch._dynamo.reset()
        with torch.no_grad():
            again = remotorch.compile(model, session=session, fallback="raise")(*inputs)
    assert_same(conformance._read({"out": want}), conformance._read({"out": again}))


@pytest.fixture(scope="module")
def timed_worker(start_module_server):
    return start_module_server(name="timed-loops", extra_args=("--request-timeout", "1"))


def test_a_while_loop_that_never_ends_stops_at_the_request_timeout(timed_worker):
    def forever(x):
        return torch.while_loop(lambda i, h: i >= 0, lambda i, h: (i + 1, h.clone()), (torch.tensor(0), x))[1]

    with remotorch.Session(timed_worker.url, token=TOKEN) as session:
        with pytest.raises(errors.RequestTimeoutError):
            with torch.no_grad():
                remotorch.compile(forever, session=session, fallback="raise")(torch.ones(2))
        torch._dynamo.reset()
        x = torch.randn(5, 4)
        model = Map()
        with torch.no_grad():
            got = remotorch.compile(model, session=session, fallback="raise")(x)
            want = model(x)
    torch.testing.assert_close(got, want, **TOL)  # the worker serves on, and right
    assert timed_worker.alive()
