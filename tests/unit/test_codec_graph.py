"""Unit tests of graph documents: aten FX graph -> msgpack document -> FX graph, through an allowlist."""

from __future__ import annotations

import operator

import msgspec
import pytest
import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx

from remotorch.codec.graph import (DOC_FORMAT, MAX_DEPTH, decode_graph, encode_graph, graph_id,
                                   resolve_target, target_name)
from remotorch.codec.tensors import tensor_from_wire
from remotorch.errors import UnsupportedGraphError

CPU = torch.device("cpu")


def round_trip(gm: torch.fx.GraphModule):
    payload = encode_graph(gm)
    consts = [tensor_from_wire(meta, bytes(buf)) for meta, buf in zip(payload.consts, payload.const_frames)]
    return payload, decode_graph(payload.doc, consts, CPU)


def aten_graph(fn, *args) -> torch.fx.GraphModule:
    gm = make_fx(fn)(*args)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets and all(isinstance(t, torch._ops.OpOverload) or t is operator.getitem for t in targets)
    return gm


def small_fn(x, w, idx):
    h = torch.nn.functional.linear(x, w).relu()
    values, indices = torch.max(h, dim=1)  # a tuple output, read with getitem
    picked = torch.index_select(h, 0, idx)
    return values * 2, indices, picked.sum(dim=0, keepdim=True), h.to(torch.float64), h.transpose(0, 1).contiguous()


def small_args():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 5, generator=g), torch.randn(3, 5, generator=g), torch.tensor([2, 0])


def test_round_trip_of_a_small_aten_graph():
    args = small_args()
    gm = aten_graph(small_fn, *args)
    payload, decoded = round_trip(gm)
    assert sum(1 for n in gm.graph.nodes if n.op == "placeholder") == 3
    assert len(decoded.inputs) == 3
    assert decoded.inputs[0] == {"kind": "tensor", "dtype": "float32", "shape": [4, 5]}
    assert decoded.inputs[2]["dtype"] == "int64"
    expected = gm(*args)
    got = decoded.module(*args)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and torch.equal(g, e)
    # the same calls in the same order
    def calls(graph):
        return [n.target for n in graph.nodes if n.op == "call_function"]
    assert calls(decoded.module.graph) == calls(gm.graph)


def test_document_is_plain_msgpack_with_named_targets():
    gm = aten_graph(small_fn, *small_args())
    payload = encode_graph(gm)
    data = msgspec.msgpack.decode(payload.doc)
    assert data["format"] == DOC_FORMAT
    targets = [n["target"] for n in data["nodes"] if n["op"] == "call"]
    assert all(isinstance(t, str) for t in targets)
    assert "aten::relu.default" in targets
    assert "op:getitem" in targets
    assert [n["op"] for n in data["nodes"]][:3] == ["placeholder"] * 3
    assert data["nodes"][-1]["op"] == "output"


def test_graph_id_is_a_deterministic_content_hash():
    args = small_args()
    p1 = encode_graph(aten_graph(small_fn, *args))
    p2 = encode_graph(aten_graph(small_fn, *args))
    assert p1.graph_id == p2.graph_id == graph_id(p1.doc, p1.consts, p1.const_frames)
    assert len(p1.graph_id) == 64
    p3 = encode_graph(aten_graph(lambda x, w, i: small_fn(x, w, i)[0] + 1, *args))
    assert p3.graph_id != p1.graph_id


def test_graph_id_follows_the_protocol_formula():
    import hashlib

    from remotorch.codec.messages import TensorMeta

    doc = b"document bytes"
    consts = [TensorMeta("float32", [2], [1], 0), TensorMeta("int64", [], [], 1)]
    frames = [b"\x00" * 8, b"\x01" * 8]
    h = hashlib.sha256(doc)
    for meta, frame in zip(consts, frames):
        h.update(msgspec.msgpack.encode([meta.dtype, meta.shape, meta.strides, meta.frame]))
        h.update(frame)
    assert graph_id(doc, consts, frames) == h.hexdigest()
    assert graph_id(doc, [], []) == hashlib.sha256(doc).hexdigest()


def test_values_of_every_tag_survive():
    def fn(x):
        a = torch.ones(2, 3, dtype=torch.float16, device="cpu", layout=torch.strided)
        b = x.contiguous(memory_format=torch.channels_last)
        c = torch.full((2,), 1.5, dtype=torch.float64)
        d = x.new_zeros((1, 2), dtype=torch.int32)
        e = torch.clamp(x, min=-0.5, max=0.5)
        f = x.view(2, -1).split([3, 9], dim=1)  # list outputs, tuple of ints
        return a, b, c, d, e, f[0], f[1], x.sum(dim=[1, 2]), x.mean(dim=(0,), keepdim=True)

    x = torch.randn(2, 3, 2, 2)
    gm = aten_graph(fn, x)
    payload, decoded = round_trip(gm)
    data = msgspec.msgpack.decode(payload.doc)
    text = repr(data)
    for tag in ("$dt", "$dev", "$mf", "$t"):
        assert tag in text, tag
    for g, e in zip(decoded.module(x), gm(x)):
        assert g.dtype == e.dtype and g.shape == e.shape and torch.equal(g, e)
    b = decoded.module(x)[1]
    assert b.is_contiguous(memory_format=torch.channels_last)


def test_graph_constants_travel_as_tensor_frames():
    class WithConst(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("scale", torch.tensor([1.0, 2.0, 3.0]))

        def forward(self, x):
            return x * self.scale

    gm = torch.fx.symbolic_trace(WithConst())
    # make the multiply an aten op so the graph is allowlisted
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is operator.mul:
            node.target = torch.ops.aten.mul.Tensor
    gm.recompile()
    payload, decoded = round_trip(gm)
    assert len(payload.consts) == 1 and payload.consts[0].dtype == "float32"
    assert bytes(payload.const_frames[0]) == torch.tensor([1.0, 2.0, 3.0]).numpy().tobytes()
    x = torch.randn(3)
    assert torch.equal(decoded.module(x), x * torch.tensor([1.0, 2.0, 3.0]))
    # a different constant is a different graph
    gm.scale.add_(1)
    assert encode_graph(gm).graph_id != payload.graph_id


def test_node_names_come_from_the_decoder():
    doc = msgspec.msgpack.encode({"format": 1, "nodes": [
        {"op": "placeholder", "name": "evil; import os", "kind": "tensor", "dtype": "float32", "shape": [2]},
        {"op": "call", "name": "os.system", "target": "aten::neg.default", "args": [{"$n": "v0"}], "kwargs": {}},
        {"op": "output", "args": [{"$n": "v1"}]}]})
    decoded = decode_graph(doc, [], CPU)
    names = [n.name for n in decoded.module.graph.nodes]
    assert not any("evil" in n or "system" in n for n in names)
    (out,) = decoded.module(torch.tensor([1.0, -2.0]))
    assert torch.equal(out, torch.tensor([-1.0, 2.0]))


# -------------------------------------------------------------------- allowlist
def test_resolve_target_allows_aten_prims_and_named_builtins():
    assert resolve_target("aten::addmm.default") is torch.ops.aten.addmm.default
    assert resolve_target("aten::add.Tensor") is torch.ops.aten.add.Tensor
    assert resolve_target("prims::convert_element_type.default") is torch.ops.prims.convert_element_type.default
    assert resolve_target("op:getitem") is operator.getitem
    assert target_name(torch.ops.aten.addmm.default) == "aten::addmm.default"
    assert target_name(operator.getitem) == "op:getitem"


@pytest.mark.parametrize("name", [
    "aten::from_file.default", "aten::save.default", "aten::_print.default", "aten::set_.source_Tensor",
    "builtins::eval.default", "os::system.default", "torch::load.default", "rmtest::myop.default",
    "aten::no_such_op.default", "aten::add.no_such_overload", "aten::add", "aten::add.Tensor.extra",
    "aten::__class__.default", "aten::add.__call__", "op:eval", "op:system", "math:exec", "eval", "",
    "aten::" + "a" * 300 + ".default", "aten::add.Tensor; import os",
])
def test_resolve_target_refuses_everything_else(name):
    with pytest.raises(UnsupportedGraphError):
        resolve_target(name)


def test_encode_refuses_targets_outside_the_allowlist():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(print, (x,)))
    with pytest.raises(UnsupportedGraphError):
        encode_graph(torch.fx.GraphModule(torch.nn.Module(), graph))

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.ops.aten.from_file.default, ("/etc/passwd", True, 4)))
    with pytest.raises(UnsupportedGraphError):
        encode_graph(torch.fx.GraphModule(torch.nn.Module(), graph))

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.sin, (x,)))  # torch-level function, not an aten overload
    with pytest.raises(UnsupportedGraphError):
        encode_graph(torch.fx.GraphModule(torch.nn.Module(), graph))


def test_encode_refuses_module_calls_and_odd_values():
    gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    with pytest.raises(UnsupportedGraphError):
        encode_graph(gm)

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    add = graph.call_function(torch.ops.aten.add.Tensor, (x, 1))
    graph.output(add)
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    for odd in (object(), slice(1, 2), b"bytes", {"a": 1}, torch.finfo(torch.float32)):
        add.args = (x, odd)
        with pytest.raises(UnsupportedGraphError):
            encode_graph(gm)


# ------------------------------------------------------------- malformed documents
def _doc(nodes, fmt=DOC_FORMAT) -> bytes:
    return msgspec.msgpack.encode({"format": fmt, "nodes": nodes})


PH = {"op": "placeholder", "kind": "tensor", "dtype": "float32", "shape": [2]}
OUT0 = {"op": "output", "args": [{"$n": "v0"}]}


def _nested(depth: int):
    v = {"$n": "v0"}
    for _ in range(depth):
        v = [v]
    return v


MALFORMED = {
    "not-msgpack": b"\xc1\xc1",
    "pickle": b"\x80\x04\x95",
    "a-list": msgspec.msgpack.encode([1, 2, 3]),
    "wrong-format": _doc([PH, OUT0], fmt=2),
    "no-format": msgspec.msgpack.encode({"nodes": [PH, OUT0]}),
    "no-nodes": _doc([]),
    "nodes-not-list": msgspec.msgpack.encode({"format": 1, "nodes": {"a": 1}}),
    "too-many-nodes": _doc([PH] * 200_001),
    "node-not-dict": _doc([PH, 5, OUT0]),
    "no-output": _doc([PH]),
    "after-output": _doc([PH, OUT0, PH]),
    "placeholder-late": _doc([PH, {"op": "call", "target": "aten::neg.default", "args": [{"$n": "v0"}]}, PH,
                              {"op": "output", "args": []}]),
    "unknown-kind": _doc([PH, {"op": "call_module", "target": "x"}, OUT0]),
    "bad-target": _doc([PH, {"op": "call", "target": "builtins::eval.default", "args": ["1"]}, OUT0]),
    "denied-target": _doc([PH, {"op": "call", "target": "aten::from_file.default", "args": ["/x", True, 4]},
                           OUT0]),
    "target-not-string": _doc([PH, {"op": "call", "target": ["aten", "neg"], "args": [{"$n": "v0"}]}, OUT0]),
    "unknown-ref": _doc([PH, {"op": "output", "args": [{"$n": "v7"}]}]),
    "forward-ref": _doc([PH, {"op": "call", "target": "aten::add.Tensor", "args": [{"$n": "v2"}, {"$n": "v0"}]},
                         {"op": "call", "target": "aten::neg.default", "args": [{"$n": "v0"}]}, OUT0]),
    "args-not-list": _doc([PH, {"op": "call", "target": "aten::neg.default", "args": {"$t": [{"$n": "v0"}]}},
                           OUT0]),
    "kwargs-not-dict": _doc([PH, {"op": "call", "target": "aten::neg.default", "args": [{"$n": "v0"}],
                                  "kwargs": [1]}, OUT0]),
    "kwarg-key-not-ident": _doc([PH, {"op": "call", "target": "aten::add.Tensor",
                                      "args": [{"$n": "v0"}, {"$n": "v0"}], "kwargs": {"a-b": 1}}, OUT0]),
    "unknown-tag": _doc([PH, {"op": "call", "target": "aten::add.Tensor",
                              "args": [{"$n": "v0"}, {"$obj": "os.system"}]}, OUT0]),
    "two-key-map": _doc([PH, {"op": "call", "target": "aten::add.Tensor",
                              "args": [{"$n": "v0"}, {"$n": "v0", "$t": []}]}, OUT0]),
    "bad-complex": _doc([PH, {"op": "call", "target": "aten::add.Tensor",
                              "args": [{"$n": "v0"}, {"$c": ["1", "2"]}]}, OUT0]),
    "unknown-layout": _doc([PH, {"op": "call", "target": "aten::add.Tensor",
                                 "args": [{"$n": "v0"}, {"$n": "v0"}], "kwargs": {"alpha": {"$ly": "mkldnn"}}},
                            OUT0]),
    "too-deep": _doc([PH, {"op": "call", "target": "aten::cat.default", "args": [_nested(MAX_DEPTH + 2)]},
                      OUT0]),
    "missing-const": _doc([{"op": "const", "index": 0}, OUT0]),
    "negative-const": _doc([{"op": "const", "index": -1}, OUT0]),
    "string-const": _doc([{"op": "const", "index": "0"}, OUT0]),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_documents_raise_unsupported_graph_error(name):
    with pytest.raises(UnsupportedGraphError):
        decode_graph(MALFORMED[name], [], CPU)


BUGGY_VALUES = {
    "unknown-dtype-name": {"$dt": "not_a_dtype"},
    "layout-list": {"$ly": ["strided"]},
    "memory-format-map": {"$mf": {"x": 1}},
}


@pytest.mark.parametrize("name", list(BUGGY_VALUES))
def test_bad_tagged_values_raise_unsupported_graph_error(name):
    doc = _doc([PH, {"op": "call", "target": "aten::add.Tensor", "args": [{"$n": "v0"}, {"$n": "v0"}],
                     "kwargs": {"alpha": BUGGY_VALUES[name]}}, OUT0])
    with pytest.raises(UnsupportedGraphError):
        decode_graph(doc, [], CPU)


# ------------------------------------------------ symbolic sizes and higher-order operators
def _aot_graphs(fn, *args, dynamic: bool = False, backward: bool = False) -> list[torch.fx.GraphModule]:
    """The aten graphs aot_autograd hands a backend for ``fn`` (forward, and backward if asked)."""
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, _):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    try:
        compiled = torch.compile(fn, dynamic=dynamic, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))
        out = compiled(*args)
        if backward:
            out.sum().backward()
    finally:
        torch._dynamo.reset()
    return graphs


def test_symbolic_size_arithmetic_round_trips_and_runs():
    def f(a, b, c):
        x = torch.cat([a, b, c])  # the new size is a sym_sum of three sizes
        n = torch.sym_max(a.shape[0], b.shape[0])
        return x.sin() * n, torch.arange(x.shape[0] + a.shape[1])

    (gm,) = _aot_graphs(f, torch.randn(3, 4), torch.randn(4, 4), torch.randn(6, 4), dynamic=True)
    names = {target_name(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert "torch:sym_sum" in names and "torch:sym_max" in names, names
    _, decoded = round_trip(gm)
    # other sizes, same document (dynamo guarded b square and as wide as a and c: duck sizing)
    other = (torch.randn(5, 6), torch.randn(6, 6), torch.randn(7, 6))
    placeholders = [p.meta["val"] for p in gm.graph.nodes if p.op == "placeholder"]
    tensors = [v for v in placeholders if isinstance(v, torch.Tensor)]
    symbols = {d.node.expr: n for t, o in zip(tensors, other) for d, n in zip(t.shape, o.shape)
               if isinstance(d, torch.SymInt)}  # each size symbol -> its value for the new inputs
    it = iter(other)
    args = [next(it) if isinstance(v, torch.Tensor) else symbols[v.node.expr] for v in placeholders]
    for got, want in zip(decoded.module(*args), f(*other)):
        assert torch.equal(got, want)


def test_every_symbolic_builtin_resolves_by_name():
    from remotorch.codec.ops import SYMBOLIC

    for name, (fn, _) in SYMBOLIC.items():
        assert resolve_target(name) is fn
        assert target_name(fn) == name
    for fn in (torch.sym_sum, torch.sym_ite, torch.sym_not, torch._sym_sqrt, operator.xor, operator.rshift):
        assert resolve_target(target_name(fn)) is fn


SIZE = {"op": "call", "target": "aten::sym_size.int", "args": [{"$n": "v0"}, 0]}  # v1: a scalar
BAD_BUILTIN_CALLS = {
    "add-a-tensor": {"target": "op:add", "args": [{"$n": "v0"}, 1]},
    "mul-a-list": {"target": "op:mul", "args": [[1, 2], {"$n": "v1"}]},
    "mul-a-string": {"target": "op:mul", "args": ["ab", {"$n": "v1"}]},
    "add-three": {"target": "op:add", "args": [{"$n": "v1"}, 1, 2]},
    "add-one": {"target": "op:add", "args": [{"$n": "v1"}]},
    "neg-keyword": {"target": "op:neg", "args": [{"$n": "v1"}], "kwargs": {"x": 1}},
    "sum-not-a-list": {"target": "torch:sym_sum", "args": [{"$n": "v1"}, 2]},
    "sum-empty": {"target": "torch:sym_sum", "args": [[]]},
    "sum-of-a-tensor": {"target": "torch:sym_sum", "args": [[{"$n": "v1"}, {"$n": "v0"}]]},
    "ite-two": {"target": "torch:sym_ite", "args": [True, {"$n": "v1"}]},
    "getitem-string": {"target": "op:getitem", "args": [{"$n": "v0"}, "x"]},
    "getitem-literal": {"target": "op:getitem", "args": [[1, 2], 0]},
}


@pytest.mark.parametrize("name", list(BAD_BUILTIN_CALLS))
def test_builtin_calls_that_do_not_fit_are_refused(name):
    call = dict({"op": "call", "kwargs": {}}, **BAD_BUILTIN_CALLS[name])
    doc = _doc([PH, SIZE, call, {"op": "output", "args": [{"$n": "v2"}]}])
    with pytest.raises(UnsupportedGraphError):
        decode_graph(doc, [], CPU)


def test_builtin_calls_that_fit_decode():
    for call in ({"target": "op:add", "args": [{"$n": "v1"}, 1]},
                 {"target": "torch:sym_sum", "args": [[{"$n": "v1"}, 2, {"$n": "v1"}]]},
                 {"target": "torch:sym_ite", "args": [True, {"$n": "v1"}, 3]},
                 {"target": "torch:sym_float", "args": [{"$n": "v1"}]}):
        doc = _doc([PH, SIZE, dict(call, op="call"), {"op": "output", "args": [{"$n": "v2"}]}])
        decoded = decode_graph(doc, [], CPU)
        assert decoded.module(torch.zeros(2)) is not None


def _checkpointed_dropout_graphs():
    """The forward and backward aten graphs of a checkpointed dropout (aot_autograd saves the rng state)."""
    def f(x, w):
        inner = lambda y: torch.nn.functional.dropout(y, 0.5, training=True) * w  # noqa: E731
        return torch.utils.checkpoint.checkpoint(inner, x, use_reentrant=False)

    return _aot_graphs(f, torch.randn(4, 8), torch.randn(8, requires_grad=True), backward=True)


def test_checkpointing_rng_operators_round_trip_naming_their_operator():
    forward, backward = _checkpointed_dropout_graphs()
    for gm in (forward, backward):
        payload = encode_graph(gm)
        nodes = msgspec.msgpack.decode(payload.doc)["nodes"]
        hops = [n for n in nodes if n["op"] == "call" and n["target"].startswith("hop:")]
        assert hops, [n.get("target") for n in nodes]
        assert any({"$op": "aten::native_dropout.default"} in n["args"] for n in hops)
        decoded = decode_graph(payload.doc, [], CPU)
        assert any(a is torch.ops.aten.native_dropout.default
                   for node in decoded.module.graph.nodes for a in node.args)


@pytest.mark.parametrize("args", [
    [{"$op": "aten::save.default"}, {"$n": "v0"}, 0.5, True],  # a denied operator
    [{"$op": "os::system.default"}, {"$n": "v0"}, 0.5, True],  # not an allowed namespace
    [{"$op": "op:add"}, {"$n": "v0"}, 0.5, True],  # a builtin, not an operator overload
    ["aten::native_dropout.default", {"$n": "v0"}, 0.5, True],  # a plain string
    [{"$n": "v0"}, 0.5, True],  # no operator at all
])
def test_higher_order_calls_name_only_allowed_operators(args):
    doc = _doc([PH, {"op": "call", "target": "hop:run_and_save_rng_state", "args": args}, OUT0])
    with pytest.raises(UnsupportedGraphError):
        decode_graph(doc, [], CPU)


def test_an_operator_reference_is_refused_outside_a_higher_order_call():
    doc = _doc([PH, {"op": "call", "target": "aten::add.Tensor",
                     "args": [{"$n": "v0"}, {"$op": "aten::neg.default"}]}, OUT0])
    with pytest.raises(UnsupportedGraphError):
        decode_graph(doc, [], CPU)
    replay = _doc([PH, {"op": "call", "target": "hop:run_with_rng_state",
                        "args": [1, {"$op": "aten::native_dropout.default"}, {"$n": "v0"}, 0.5, True]}, OUT0])
    with pytest.raises(UnsupportedGraphError, match="state tensor"):
        decode_graph(replay, [], CPU)
