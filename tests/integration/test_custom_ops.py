"""Library custom operators on the worker: mixture-of-experts models run remotely, safely.

transformers routes its MoE experts through ``torch.ops.transformers.grouped_mm_fallback``
(and ``grouped_mm_fallback_backward`` in training) when compiled in float32. A
worker started with ``--allow-ops transformers`` runs those operators (registered
by the transformers it has installed); a worker without the flag is never sent
the graph. Hostile documents (unknown operators, other namespaces, arguments
that do not fit the schema, operators that write into their inputs) are typed
errors, and the worker keeps serving. ``custom_ops_lib`` (beside this file) is a
test library a worker imports with ``--import``.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import warnings

import msgspec
import pytest
import torch

import remotorch
from remotorch import models
from remotorch.codec import messages as m
from remotorch.codec.graph import graph_id
from remotorch.codec.tensors import tensor_to_wire
from remotorch.errors import RemoteFallbackWarning, UnsupportedGraphError
from remotorch.optim import RemoteOptimizer

from conftest import TOKEN, clean_env

import custom_ops_lib  # (registers rmtest_lib here too, as the user's process would)

TESTS = os.path.dirname(os.path.abspath(custom_ops_lib.__file__))  # the PYTHONPATH that finds it

GROUPED_MM = "transformers::grouped_mm_fallback.default"


@pytest.fixture(scope="module")
def ops_worker(start_module_server):
    """A worker that allows transformers' operators and the test library's (imported with --import)."""
    return start_module_server(name="ops", extra_args=("--allow-ops", "transformers,rmtest_lib",
                                                       "--import", "custom_ops_lib"), env={"PYTHONPATH": TESTS})


@pytest.fixture
def ops_session(session_for, ops_worker):
    return session_for(ops_worker)


def mixtral(**extra):
    from transformers import MixtralConfig, MixtralForCausalLM
    torch.manual_seed(0)
    cfg = MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=128,
                        max_position_embeddings=64, **extra)
    return MixtralForCausalLM(cfg)


def qwen2_moe():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    torch.manual_seed(0)
    cfg = Qwen2MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, vocab_size=128,
                         max_position_embeddings=64)
    return Qwen2MoeForCausalLM(cfg)


MOE_MODELS = {"mixtral": mixtral, "qwen2_moe": qwen2_moe}


def token_ids(batch=2, length=8):
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(1))


def bar_still_runs(session):
    """The worker answers a real call correctly (it kept serving)."""
    torch._dynamo.reset()
    fn = remotorch.compile(models.bar, session=session, fallback="raise")
    a, b = torch.randn(8), torch.randn(8)
    torch.testing.assert_close(fn(a, b), models.bar(a, b))


# ------------------------------------------------------------------ MoE models, allowed
@pytest.mark.parametrize("name", sorted(MOE_MODELS))
def test_moe_logits_equal_eager_on_a_worker_that_allows_transformers(ops_session, name):
    model = MOE_MODELS[name]().eval()
    ids = token_ids()
    compiled = remotorch.compile(model, session=ops_session, fallback="raise")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", RemoteFallbackWarning)
        got = compiled(ids, use_cache=False).logits
        want = model(ids, use_cache=False).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    stats = ops_session.stats()
    assert stats["fallbacks"] == 0 and stats["remote_calls"] >= 1 and stats["graphs_uploaded"] >= 1
    assert ops_session.health()["allowed_ops"] == ["rmtest_lib", "transformers"]


def test_moe_generate_with_dynamic_shapes_equals_eager(ops_session):
    """Symbolic sizes flow into the operator's schema check; the KV cache stays on the worker."""
    model = mixtral().eval()
    ids = token_ids(batch=1, length=5)
    want = model.generate(ids, max_new_tokens=6, do_sample=False)
    model.forward = remotorch.compile(model.forward, session=ops_session, fallback="raise", dynamic=True)
    uploads = ops_session.connection.uploads
    ensure, model_graphs = uploads.ensure_graph, set()

    def recorded(graph):  # the model's graphs, not the one-call graphs of eager calls (client.eager)
        if not getattr(graph, "eager_op", False):
            model_graphs.add(graph.graph_id)
        return ensure(graph)
    uploads.ensure_graph = recorded
    got = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, want)
    stats = ops_session.stats()
    # six forward calls; generate's own code on the logits (argmax, cat…) ran as eager calls there too
    assert stats["fallbacks"] == 0 and stats["remote_calls"] - stats["eager_ops"] == 6 and stats["eager_ops"] > 0
    assert 1 <= len(model_graphs) <= 2  # symbolic sizes: no graph per length


def test_moe_training_step_with_remote_optimizer_equals_local(ops_session):
    """Forward runs grouped_mm_fallback, backward grouped_mm_fallback_backward (transformers'
    autograd registration), AdamW steps on the worker: parameters equal a local run."""
    model = mixtral(router_aux_loss_coef=0.0).train()
    reference, initial = copy.deepcopy(model), copy.deepcopy(model)
    ids = token_ids()
    step = remotorch.compile(lambda x: model(x, labels=x).loss, session=ops_session, fallback="raise")
    opt = RemoteOptimizer(torch.optim.AdamW, model.parameters(), session=ops_session, lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for _ in range(2):
        loss = step(ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = reference(ids, labels=ids).loss
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(loss.detach(), ref_loss.detach(), atol=1e-6, rtol=1e-5)
    ops_session.pull(model)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=name)
    experts = [(n, p) for n, p in model.named_parameters() if ".experts." in n]
    assert experts and all(not torch.equal(p, dict(initial.named_parameters())[n]) for n, p in experts)
    assert ops_session.stats()["fallbacks"] == 0


def test_moe_runs_on_onnx_runtime_through_the_translation_transformers_ships(ops_session):
    model = mixtral().eval()
    ids = token_ids()
    compiled = remotorch.compile(model, session=ops_session, fallback="raise", engine="onnxrt")
    with torch.no_grad():
        got = compiled(ids, use_cache=False).logits
        want = model(ids, use_cache=False).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert ops_session.stats()["fallbacks"] == 0


# ------------------------------------------------------------------ not allowed
def test_without_the_flag_a_typed_error_names_operator_and_flag_and_nothing_is_uploaded(session):
    model = mixtral().eval()
    compiled = remotorch.compile(model, session=session, fallback="raise")
    with torch.no_grad(), pytest.raises(UnsupportedGraphError) as info:
        compiled(token_ids(), use_cache=False)
    assert GROUPED_MM in str(info.value) and "--allow-ops transformers" in str(info.value)
    stats = session.stats()
    assert stats["graphs_uploaded"] == 0 and stats["tensors_uploaded"] == 0 and stats["remote_calls"] == 0
    assert stats["bytes_sent"] < 4096  # attach and health: not one weight (the model has ~1 MB)
    bar_still_runs(session)


def test_without_the_flag_local_fallback_runs_the_model_here_once_warned(session):
    model = qwen2_moe().eval()
    ids = token_ids()
    compiled = remotorch.compile(model, session=session)
    with torch.no_grad(), pytest.warns(RemoteFallbackWarning, match="allow-ops transformers"):
        got = compiled(ids, use_cache=False).logits
    with torch.no_grad():
        torch.testing.assert_close(got, model(ids, use_cache=False).logits)
    assert session.stats()["fallbacks"] >= 1 and session.stats()["graphs_uploaded"] == 0


# ------------------------------------------------------------------ a library imported with --import
def uses_scaled_add(x, y):
    return custom_ops_lib.scaled_add(x.sin(), y, 0.5).relu()


def test_imported_library_operator_runs_with_its_scalar_argument(ops_session):
    compiled = remotorch.compile(uses_scaled_add, session=ops_session, fallback="raise")
    x, y = torch.randn(16), torch.randn(16)
    torch.testing.assert_close(compiled(x, y), uses_scaled_add(x, y))
    assert ops_session.stats()["remote_calls"] == 1


def test_imported_library_operator_backward(ops_session):
    x = torch.randn(16, requires_grad=True)
    y = torch.randn(16, requires_grad=True)
    compiled = remotorch.compile(lambda a, b: uses_scaled_add(a, b).sum(), session=ops_session,
                                 fallback="raise")
    compiled(x, y).backward()
    x2, y2 = x.detach().clone().requires_grad_(), y.detach().clone().requires_grad_()
    uses_scaled_add(x2, y2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(y.grad, y2.grad)


def test_inductor_takes_the_custom_operator_as_a_kernel(ops_session):
    compiled = remotorch.compile(uses_scaled_add, session=ops_session, fallback="raise", engine="inductor")
    x, y = torch.randn(16), torch.randn(16)
    torch.testing.assert_close(compiled(x, y), uses_scaled_add(x, y))


def test_onnx_runtime_without_a_translation_is_a_compile_failure_for_that_engine_only(ops_session):
    compiled = remotorch.compile(uses_scaled_add, session=ops_session, fallback="raise", engine="onnxrt")
    x, y = torch.randn(16), torch.randn(16)
    with pytest.raises(UnsupportedGraphError, match="engine onnxrt could not compile.*scaled_add"):
        compiled(x, y)
    torch._dynamo.reset()
    eager = remotorch.compile(uses_scaled_add, session=ops_session, fallback="raise", engine="eager")
    torch.testing.assert_close(eager(x, y), uses_scaled_add(x, y))


def test_decompose_on_the_client_needs_no_flag_on_the_worker(session):
    """custom_ops="decompose": an operator with a registered decomposition becomes aten operators
    before upload, so a worker without --allow-ops runs the graph; without the option it is refused."""
    from torch._decomp import global_decomposition_table, register_decomposition

    op = torch.ops.rmtest_lib.scaled_add.default
    register_decomposition(op)(lambda x, y, alpha: x + alpha * y)
    try:
        x, y = torch.randn(16), torch.randn(16)
        decomposed = remotorch.compile(uses_scaled_add, session=session, fallback="raise", custom_ops="decompose")
        torch.testing.assert_close(decomposed(x, y), uses_scaled_add(x, y))
        assert session.stats()["remote_calls"] == 1
        torch._dynamo.reset()
        as_is = remotorch.compile(uses_scaled_add, session=session, fallback="raise")
        with pytest.raises(UnsupportedGraphError, match="rmtest_lib::scaled_add.default.*--allow-ops rmtest_lib"):
            as_is(x, y)
    finally:
        global_decomposition_table["post_autograd"].pop(op, None)
    with pytest.raises(ValueError, match="custom_ops"):
        remotorch.compile(uses_scaled_add, custom_ops="maybe")


def test_embedded_worker_allows_what_the_environment_says(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", TESTS)
    monkeypatch.setenv("REMOTORCH_ALLOW_OPS", "rmtest_lib")
    monkeypatch.setenv("REMOTORCH_WORKER_IMPORTS", "custom_ops_lib")
    monkeypatch.delenv("REMOTORCH_URL", raising=False)
    with remotorch.Session() as s:
        assert s.health()["allowed_ops"] == ["rmtest_lib"]
        assert "--allow-ops" in s.embedded_worker.args
        compiled = remotorch.compile(uses_scaled_add, session=s, fallback="raise")
        x, y = torch.randn(4), torch.randn(4)
        torch.testing.assert_close(compiled(x, y), uses_scaled_add(x, y))


def test_allow_ops_for_a_worker_at_a_url_is_refused(server):
    with pytest.raises(ValueError, match="embedded worker"):
        remotorch.Session(server.url, token=TOKEN, allow_ops=["transformers"])


def test_embedded_worker_session_option(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", TESTS)
    monkeypatch.delenv("REMOTORCH_URL", raising=False)
    with remotorch.Session(allow_ops=["rmtest_lib"], worker_imports=["custom_ops_lib"]) as s:
        compiled = remotorch.compile(uses_scaled_add, session=s, fallback="raise")
        x, y = torch.randn(4), torch.randn(4)
        torch.testing.assert_close(compiled(x, y), uses_scaled_add(x, y))
        assert s.stats()["fallbacks"] == 0


# ------------------------------------------------------------------ hostile documents
def _doc(nodes: list) -> bytes:
    return msgspec.msgpack.encode({"format": 1, "nodes": nodes})


T = {"op": "placeholder", "kind": "tensor", "dtype": "float32", "shape": [6, 4]}
W = {"op": "placeholder", "kind": "tensor", "dtype": "float32", "shape": [2, 4, 3]}
OFFS = {"op": "placeholder", "kind": "tensor", "dtype": "int32", "shape": [2]}
S = {"op": "placeholder", "kind": "scalar"}


def _grouped(args, kwargs=None, target=GROUPED_MM, inputs=(T, W, OFFS)):
    call = {"op": "call", "target": target, "args": args, "kwargs": kwargs or {}}
    return [*inputs, call, {"op": "output", "args": {"$t": [{"$n": f"v{len(inputs)}"}]}}]


N0, N1, N2 = {"$n": "v0"}, {"$n": "v1"}, {"$n": "v2"}
HOSTILE = {
    "allowed namespace, no such operator": (_grouped([N0, N1, N2], target="transformers::no_such_op.default"),
                                            "does not exist"),
    "allowed operator, no such overload": (_grouped([N0, N1, N2], target="transformers::grouped_mm_fallback.out"),
                                           "does not exist"),
    "dunder of an allowed namespace": (_grouped([N0], target="transformers::__class__.default"), "not allowed"),
    "aten lookalike Aten": (_grouped([N0, N0], target="Aten::add.Tensor"), "--allow-ops Aten"),
    "aten lookalike aten_": (_grouped([N0, N0], target="aten_::add.Tensor"), "--allow-ops aten_"),
    "aten lookalike _aten": (_grouped([N0, N0], target="_aten::add.Tensor"), "--allow-ops _aten"),
    "builtins": (_grouped([N0], target="builtins::eval.default"), "--allow-ops builtins"),
    "os": (_grouped([N0], target="os::system.default"), "--allow-ops os"),
    "registered in the client only": (_grouped([N0], target="rmtest::myop.default"), "--allow-ops rmtest"),
    "too few arguments": (_grouped([N0, N1]), "'offs' is missing"),
    "too many arguments": (_grouped([N0, N1, N2, N2]), "at most 3 positional"),
    "scalar for a tensor": (_grouped([N0, 3, N2]), "'weight' must be Tensor"),
    "list for a tensor": (_grouped([N0, [N1], N2]), "'weight' must be Tensor"),
    "dtype for a tensor": (_grouped([N0, N1, {"$dt": "int32"}]), "'offs' must be Tensor"),
    "scalar input for a tensor": (_grouped([N0, N1, {"$n": "v3"}], inputs=(T, W, OFFS, S)), "'offs' must be Tensor"),
    "unknown keyword": (_grouped([N0, N1], {"offsets": N2}), "no argument 'offsets'"),
    "keyword given twice": (_grouped([N0, N1, N2], {"offs": N2}), "no argument 'offs'"),
    "tensor for a float": (_grouped([N0, N0, N0], target="rmtest_lib::scaled_add.default"), "'alpha' must be float"),
    "string for a float": (_grouped([N0, N0, "1.0"], target="rmtest_lib::scaled_add.default"),
                           "'alpha' must be float"),
    "operator that writes into its input": (_grouped([N0], target="rmtest_lib::fill_ones_.default"), "mutates"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_documents_are_typed_errors_and_the_worker_keeps_serving(ops_session, name):
    nodes, message = HOSTILE[name]
    doc = _doc(nodes)
    with pytest.raises(UnsupportedGraphError, match=message.replace("(", r"\(")):
        ops_session.connection.request(m.PutGraph(graph_id(doc, [], []), doc, []))
    bar_still_runs(ops_session)


def test_a_fitting_document_runs_the_operator(ops_session):
    """The control for the hostile documents: the same shape of document, fitting, runs and is right."""
    doc = _doc(_grouped([N0, N1], {"offs": N2}))
    gid = graph_id(doc, [], [])
    ops_session.connection.request(m.PutGraph(gid, doc, []))
    x, w, offs = torch.randn(6, 4), torch.randn(2, 4, 3), torch.tensor([2, 6], dtype=torch.int32)
    frames, args = [], []
    for t in (x, w, offs):
        meta, buf = tensor_to_wire(t, len(frames))
        frames.append(buf)
        args.append(m.TensorArg(meta))
    reply, out = ops_session.connection.request(m.Run(gid, "eager", args), frames)
    from remotorch.codec.frames import FrameReader
    got = FrameReader(out).value(reply.outputs[0])
    torch.testing.assert_close(got, torch.cat([x[:2] @ w[0], x[2:] @ w[1]]))


# ------------------------------------------------------------------ the command line
def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "remotorch", "serve", "--port", "0", *args],
                          capture_output=True, text=True, timeout=120, env=clean_env(PYTHONPATH=TESTS))


@pytest.mark.parametrize("args, message", [
    (("--allow-ops", "aten"), "always available"),
    (("--allow-ops", "os"), "no operators of namespace 'os'"),
    (("--allow-ops", "rmtest_lib"), "give --import MODULE"),
    (("--allow-ops", "a.b"), "not an operator namespace"),
    (("--allow-ops", "rmtest_lib", "--import", "no_such_module_xyz"), "cannot import no_such_module_xyz"),
    (("--allow-ops", "rmtest_lib", "--import", "os;touch"), "not a module name"),
])
def test_serve_refuses_namespaces_it_cannot_allow(args, message):
    proc = _serve(*args)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "serving on" not in proc.stdout


def test_health_and_backends_list_the_allowed_namespaces(ops_worker):
    env = clean_env()
    health = subprocess.run([sys.executable, "-m", "remotorch", "health", ops_worker.url, "--token", TOKEN],
                            capture_output=True, text=True, timeout=60, env=env)
    assert health.returncode == 0, health.stderr
    assert "allowed_ops" in health.stdout and "rmtest_lib, transformers" in health.stdout
    backends = subprocess.run([sys.executable, "-m", "remotorch", "backends", ops_worker.url, "--token", TOKEN],
                              capture_output=True, text=True, timeout=60, env=env)
    assert backends.returncode == 0, backends.stderr
    assert "custom operators allowed: rmtest_lib, transformers" in backends.stdout
