"""Graph documents with torch's own custom operators (``torch_nn``) and effectful operators (``with_effects``).

Both come from graphs torch itself makes: ``F.linear_cross_entropy`` lowers to
``torch_nn::_linear_cross_entropy_batch_chunked*``, and ``linalg.cholesky``,
``inv``, ``solve``… run ``aten._linalg_check_errors`` wrapped in the
``with_effects`` higher-order operator. Each is captured by torch, encoded,
decoded as a worker does, run, and compared with torch running the function.
"""

from __future__ import annotations

import msgspec
import pytest
import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx

from remotorch.codec.graph import decode_graph, encode_graph
from remotorch.codec.ops import custom_ops
from remotorch.errors import UnsupportedGraphError

CPU = torch.device("cpu")


def decoded(gm: torch.fx.GraphModule, allowed: frozenset[str] = frozenset()):
    payload = encode_graph(gm)
    return payload, decode_graph(payload.doc, [], CPU, allowed).module


def linear_cross_entropy(x, w, t):
    from torch.nn.modules.linear_cross_entropy_options import LinearCrossEntropyOptions

    return torch.nn.functional.linear_cross_entropy(x, w, t, options=LinearCrossEntropyOptions(batch_chunk_size=2))


def test_torch_nn_operators_need_no_allowed_namespace_and_run():
    g = torch.Generator().manual_seed(0)
    x, w, t = torch.randn(5, 3, generator=g), torch.randn(4, 3, generator=g), torch.randint(0, 4, (5,), generator=g)
    gm = make_fx(linear_cross_entropy)(x, w, t)
    assert any(n.op == "call_function" and getattr(n.target, "namespace", "") == "torch_nn" for n in gm.graph.nodes)
    payload, module = decoded(gm)  # a worker that allows no custom namespace
    assert payload.custom_ops == ()  # nothing for the client to ask the worker to allow
    assert torch.equal(module(x, w, t), linear_cross_entropy(x, w, t))
    assert custom_ops(["torch_nn::x.default", "mylib::y.default", "aten::add.Tensor"]) == ("mylib::y.default",)


def test_torch_nn_calls_are_still_checked_against_their_schemas():
    x, w, t = torch.randn(5, 3), torch.randn(4, 3), torch.randint(0, 4, (5,))
    doc = msgspec.msgpack.decode(encode_graph(make_fx(linear_cross_entropy)(x, w, t)).doc)
    call = next(n for n in doc["nodes"] if n.get("target", "").startswith("torch_nn::"))
    call["args"][5] = 7  # `str reduction` given an int
    with pytest.raises(UnsupportedGraphError, match="reduction"):
        decode_graph(msgspec.msgpack.encode(doc), [], CPU)


def effectful_graph(fn, *args) -> torch.fx.GraphModule:
    """The forward graph aot_autograd gives remotorch for ``fn``: effect tokens made and sunk inside."""
    from torch._functorch import config as functorch_config
    from torch._functorch.aot_autograd import aot_function

    from remotorch.capture.backend import _placeholders_first

    graphs = []

    def grab(gm, example_inputs):
        _placeholders_first(gm)
        graphs.append(gm)
        return gm

    with functorch_config.patch(unlift_effect_tokens=True):
        aot_function(fn, fw_compiler=grab)(*args)
    return graphs[0]


def test_with_effects_round_trips_and_keeps_its_effect():
    a = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    spd = a @ a.T + 4 * torch.eye(4)
    gm = effectful_graph(torch.linalg.cholesky, spd)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.higher_order.with_effects in targets and torch.ops.prims._make_token.default in targets
    payload, module = decoded(gm)
    assert {"hop:with_effects", "prims::_make_token.default"} <= {
        n.get("target") for n in msgspec.msgpack.decode(payload.doc)["nodes"]}
    assert torch.equal(module(spd)[0], torch.linalg.cholesky(spd))
    with pytest.raises(torch.linalg.LinAlgError):  # the effect: a matrix that is not positive definite raises
        module(-spd)


def test_with_effects_takes_a_token_first_and_names_only_allowed_operators():
    spd = torch.eye(3) * 2
    doc = msgspec.msgpack.decode(encode_graph(effectful_graph(torch.linalg.cholesky, spd)).doc)
    at = next(i for i, n in enumerate(doc["nodes"]) if n.get("target") == "hop:with_effects")

    def refused(change) -> str:
        bad = msgspec.msgpack.decode(msgspec.msgpack.encode(doc))
        change(bad["nodes"][at])
        with pytest.raises(UnsupportedGraphError) as info:
            decode_graph(msgspec.msgpack.encode(bad), [], CPU)
        return str(info.value)

    assert "token" in refused(lambda n: n["args"].__setitem__(0, 1.5))
    assert "mylib" in refused(lambda n: n["args"].__setitem__(1, {"$op": "mylib::effect.default"}))
    assert "not allowed" in refused(lambda n: n["args"].__setitem__(1, {"$op": "aten::_print.default"}))


def test_calls_among_placeholders_move_after_the_last_one_and_nothing_else_moves():
    from remotorch.capture.backend import _placeholders_first

    g = torch.fx.Graph()
    a = g.placeholder("a")
    token = g.call_function(torch.ops.prims._make_token.default, ())
    b = g.placeholder("b")
    g.output((g.call_function(torch.ops.aten.add.Tensor, (a, b)), token))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    _placeholders_first(gm)
    assert [n.op for n in gm.graph.nodes] == ["placeholder", "placeholder", "call_function", "call_function", "output"]
    assert torch.equal(gm(torch.ones(2), torch.ones(2))[0], torch.full((2,), 2.0))

    g = torch.fx.Graph()  # no placeholders at all (torch.ones(10)): left as it is
    g.output(g.call_function(torch.ops.aten.ones.default, ([3],)))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    _placeholders_first(gm)
    assert [n.op for n in gm.graph.nodes] == ["call_function", "output"]
    assert torch.equal(gm(), torch.ones(3))


def test_engines_that_trace_again_get_the_graph_without_effect_tokens():
    from remotorch.worker.engines.effects import without_effect_tokens

    a = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    spd = a @ a.T + 4 * torch.eye(4)
    module = decoded(effectful_graph(torch.linalg.cholesky, spd))[1]
    plain = without_effect_tokens(module)
    targets = [n.target for n in plain.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten._linalg_check_errors.default in targets  # the effectful operator stays, in its place
    assert not {torch.ops.higher_order.with_effects, torch.ops.prims._make_token.default,
                torch.ops.prims._sink_tokens.default} & set(targets)
    assert torch.ops.higher_order.with_effects in [n.target for n in module.graph.nodes]  # a copy: unchanged
    # dynamo traces it whole (it cannot trace with_effects), and aot_autograd threads the tokens again
    compiled = torch.compile(plain, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(spd)[0], module(spd)[0])
    with pytest.raises(torch.linalg.LinAlgError):
        plain(-spd)
    assert without_effect_tokens(plain) is plain  # nothing to take out: itself


def test_one_hots_class_checks_run_on_a_cpu_worker_and_are_refused_on_an_accelerator():
    from torch._functorch.aot_autograd import aot_function

    from remotorch.worker import engines

    graphs = []
    aot_function(lambda t: torch.nn.functional.one_hot(t, 4), fw_compiler=lambda gm, ex: graphs.append(gm) or gm)(
        torch.tensor([0, 2, 1]))
    assert torch.ops.aten._assert_async.msg in [n.target for n in graphs[0].graph.nodes]
    graph = decode_graph(encode_graph(graphs[0]).doc, [], CPU)
    eager = engines.load("eager")
    run = engines.compile_graph(eager, graph, CPU, [torch.tensor([0, 2, 1])], None)
    assert torch.equal(engines.call(run, [torch.tensor([3, 0])])[0],
                       torch.nn.functional.one_hot(torch.tensor([3, 0]), 4))
    with pytest.raises(RuntimeError, match="smaller than num_classes"):  # the check runs: a plain error here
        engines.call(run, [torch.tensor([4])])
    with pytest.raises(UnsupportedGraphError, match="_assert_async"):  # a device-side assertion there
        engines.compile_graph(eager, graph, torch.device("cuda"), [torch.tensor([0])], None)


def _attention_ops(device_type: str) -> set[str]:
    """The aten operators aot_autograd traces for attention and its backward, traced for a worker of
    ``device_type`` (forward and backward graphs together)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from remotorch.capture.backend import portable_attention

    seen: set[str] = set()

    def collect(gm, example_inputs):
        seen.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm.forward)

    def attend(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum()

    q, k, v = (torch.randn(2, 2, 8, 4, requires_grad=True) for _ in range(3))
    torch._dynamo.reset()
    with portable_attention(device_type):
        compiled = torch.compile(attend, backend=aot_autograd(fw_compiler=collect, bw_compiler=collect),
                                 fullgraph=True)
        compiled(q, k, v).backward()
    torch._dynamo.reset()
    return seen


def test_attention_traced_here_for_a_cuda_worker_is_its_math_not_this_cpus_kernel():
    cpu, cuda = _attention_ops("cpu"), _attention_ops("cuda")
    assert any("_for_cpu" in op for op in cpu)  # a CPU worker keeps the fused CPU kernel
    assert not any("_for_cpu" in op for op in cuda), sorted(cuda)
    assert any("bmm" in op for op in cuda) and any("softmax" in op for op in cuda), sorted(cuda)


def test_the_inductor_engine_runs_a_view_whose_input_inductor_lays_out_otherwise():
    """A ``cat`` with an empty operand (an empty key cache) becomes its other operand, transposed,
    when inductor traces the graph again: a ``view`` traced after it would fail; the engine's
    reshape runs it."""
    from types import SimpleNamespace

    from remotorch.worker.engines import inductor

    def f(x, past):
        k = x.view(2, 4, 2, 3).transpose(1, 2)
        t = torch.cat([past, k], -2).transpose(-2, -1) * 0.5
        return (t.expand(2, 2, 3, 4).view(4, 3, 4) + 1,)

    x, past = torch.randn(2, 4, 6), torch.empty(2, 2, 0, 3)
    gm = make_fx(f)(x, past)
    assert torch.ops.aten.view.default in {n.target for n in gm.graph.nodes}
    with pytest.raises(Exception, match="Cannot view"):  # what inductor alone does with this graph
        torch.compile(gm, backend="inductor", fullgraph=True)(x, past)
    torch._dynamo.reset()
    fn = inductor.compile(SimpleNamespace(module=gm, inputs=[{}, {}]), torch.device("cpu"), [x, past])
    torch.testing.assert_close(fn(x, past)[0], f(x, past)[0])
    assert torch.ops.aten.view.default in {n.target for n in gm.graph.nodes}  # the graph itself is unchanged
    torch._dynamo.reset()


def test_a_profile_traces_attention_portably_when_any_profiled_worker_is_not_a_cpu(monkeypatch):
    # one captured graph runs on every profiled worker: a CUDA worker among them cannot run the CPU kernel
    import importlib
    from types import SimpleNamespace

    from remotorch.capture.backend import _worker_device

    accelerate = importlib.import_module("remotorch.profile.accelerate")  # (the package exports a function so named)

    for workers, want in (({"a": {"device": "cpu"}, "b": {"device": "cuda:0"}}, "cuda"),
                          ({"a": {"device": "cpu"}}, "cpu")):
        monkeypatch.setattr(accelerate, "current_profiler", lambda w=workers: SimpleNamespace(workers=w))
        assert _worker_device(accelerate._ToProfiler(), None) == want
    monkeypatch.setattr(accelerate, "current_profiler", lambda: None)
    assert _worker_device(accelerate._ToProfiler(), None) == "cpu"
