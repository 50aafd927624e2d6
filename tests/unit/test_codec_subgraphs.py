"""Unit tests of subgraphs in graph documents: higher-order operators (torch.cond, while_loop, scan,
map, invoke_subgraph, flex_attention) encoded, decoded, and refused when hostile.

The same documents against a live worker: ``tests/integration/test_fuzz.py``; real models on a
real worker, equal to aot_eager: ``tests/conformance/test_control_flow.py``.
"""

from __future__ import annotations

import re

import msgspec
import pytest
import torch
import torch.fx
from torch._higher_order_ops.map import map as hop_map
from torch._higher_order_ops.scan import scan
from torch.fx.experimental.proxy_tensor import make_fx

from remotorch.codec import subgraphs
from remotorch.codec.graph import decode_graph, encode_graph
from remotorch.codec.ops import SUBGRAPH_OPS, resolve_target, target_name
from remotorch.codec.tensors import tensor_from_wire
from remotorch.devtools import subgraph_docs as docs
from remotorch.errors import UnsupportedGraphError

from helpers import REPO

CPU = torch.device("cpu")


def round_trip(gm: torch.fx.GraphModule):
    payload = encode_graph(gm)
    consts = [tensor_from_wire(meta, bytes(buf)) for meta, buf in zip(payload.consts, payload.const_frames)]
    return payload, decode_graph(payload.doc, consts, CPU)


def decode(body: dict):
    return decode_graph(msgspec.msgpack.encode(body), [], CPU)


def flat(out) -> list[torch.Tensor]:
    return [t for x in (out if isinstance(out, (list, tuple)) else [out]) for t in flat_one(x)]


def flat_one(x):
    return flat(x) if isinstance(x, (list, tuple)) else [x]


def assert_same(got, want) -> None:
    got, want = flat(got), flat(want)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


# ------------------------------------------------------------------ captured graphs round trip
def _cond(x):
    return torch.cond(x.sum() > 0, lambda x: (x.sin() * 2,), lambda x: (x.cos(),), (x,))


def _while(x):
    return torch.while_loop(lambda i, h: i < 3, lambda i, h: (i + 1, h * 2 + 1), (torch.tensor(0), x))


def _scan(xs):
    return scan(lambda c, x: (c + x, c * x), torch.zeros(4), xs)


def _map(xs):
    return hop_map(lambda r: r.relu() + 1, xs)


def _nested(x):
    return torch.cond(x.sum() > 0, lambda x: _cond(x - 1), lambda x: (x.cos(),), (x,))


@pytest.mark.parametrize("fn", [_cond, _while, _scan, _map, _nested], ids=lambda f: f.__name__[1:])
def test_captured_higher_order_graphs_round_trip_and_run(fn):
    gm = make_fx(fn)(torch.randn(3, 4))
    payload, decoded = round_trip(gm)
    assert "subgraphs" in msgspec.msgpack.decode(payload.doc)
    for x in (torch.rand(3, 4), -torch.rand(3, 4)):  # cond: both branches, from one graph
        assert_same(decoded.module(x), fn(x))
    hops = [n.target for n in decoded.module.graph.nodes if n.op == "call_function" and n.target in
            SUBGRAPH_OPS.values()]
    assert hops and all(isinstance(getattr(decoded.module, n.target), torch.fx.GraphModule)
                        for n in decoded.module.graph.nodes if n.op == "get_attr" and n.target.startswith("g"))


def test_a_subgraph_used_twice_travels_once():
    gm = make_fx(_cond)(torch.randn(3))
    gm.false_graph_0 = gm.true_graph_0  # both branches the same module
    gm.recompile()
    payload, decoded = round_trip(gm)
    data = msgspec.msgpack.decode(payload.doc)
    assert len(data["subgraphs"]) == 1
    (call,) = [n for n in data["nodes"] if n["op"] == "call" and n["target"] == "hop:cond"]
    assert call["args"][1] == call["args"][2] == {"$g": 0}
    x = -torch.rand(3)
    assert_same(decoded.module(x), (x.sin() * 2,))


def test_documents_without_subgraphs_are_unchanged():
    """Graphs without higher-order operators keep their documents (and ids): no ``subgraphs`` key."""
    gm = make_fx(lambda x: x.sin() + 1)(torch.randn(3))
    assert set(msgspec.msgpack.decode(encode_graph(gm).doc)) == {"format", "nodes"}


def test_the_graph_id_covers_the_subgraphs():
    def capture(scale):
        torch._dynamo.reset()  # torch.cond traces through dynamo, which would guard on the closure's scale
        return encode_graph(make_fx(lambda x: torch.cond(x.sum() > 0, lambda x: (x * scale,),
                                                         lambda x: (x - 1,), (x,)))(torch.ones(3)))

    assert capture(2.0).graph_id != capture(3.0).graph_id
    assert capture(2.0).graph_id == capture(2.0).graph_id


def test_constants_inside_subgraphs_travel_as_frames():
    x = torch.randn(3)
    payload, decoded = round_trip(make_fx(_while)(x))
    assert len(payload.consts) == 1 and payload.consts[0].dtype == "int64"
    assert_same(decoded.module(x), _while(x))


def test_the_encoder_refuses_a_subgraph_that_names_itself():
    gm = make_fx(_cond)(torch.randn(3))
    inner = gm.true_graph_0
    graph = inner.graph
    (out,) = [n for n in graph.nodes if n.op == "output"]
    inner.loop = inner  # the subgraph is its own attribute
    with graph.inserting_before(out):
        graph.call_function(torch.ops.higher_order.cond, (True, graph.get_attr("loop"), graph.get_attr("loop"), ()))
    with pytest.raises(UnsupportedGraphError, match="refers to itself"):
        encode_graph(gm)


def test_the_encoder_refuses_nesting_past_the_limit():
    fn = lambda x: (x.sin(),)  # noqa: E731
    for _ in range(subgraphs.MAX_SUBGRAPH_DEPTH + 1):
        fn = (lambda inner: lambda x: torch.cond(x.sum() > 0, inner, lambda x: (x.cos(),), (x,)))(fn)
    with pytest.raises(UnsupportedGraphError, match="nested deeper"):
        encode_graph(make_fx(fn)(torch.randn(3)))


def test_a_subgraph_outside_a_higher_order_call_is_not_encoded():
    gm = make_fx(_cond)(torch.randn(3))
    graph = gm.graph
    (out,) = [n for n in graph.nodes if n.op == "output"]
    with graph.inserting_before(out):
        ref = graph.get_attr("true_graph_0")
    out.args = ((out.args[0][0], ref),)
    with pytest.raises(UnsupportedGraphError, match="only be an argument of a higher-order operator"):
        encode_graph(gm)


# ------------------------------------------------------------------ hand-written documents
REFERENCE = {
    "cond": lambda x: torch.cond(x.sum() > 0, torch.sin, torch.cos, (x,)),
    "while_loop": lambda x: x * 8,
    "scan": lambda xs: scan(lambda c, x: (c + x, c * x), torch.zeros(2), xs),
    "map": lambda xs, w: xs * w,
    "invoke_subgraph": lambda x: x.sin().sin(),
    "nested": lambda x: (torch.where(x.sum() < 1, x.neg(), x.exp()) if x.sum() > 0 else x.cos()),
}


@pytest.mark.parametrize("name", list(docs.VALID))
def test_valid_documents_decode_and_run(name):
    decoded = decode(docs.VALID[name]())
    args = [torch.randn(m["shape"]) for m in decoded.inputs]
    assert_same(decoded.module(*args), REFERENCE[name](*args))


@pytest.mark.parametrize("name", list(docs.HOSTILE))
def test_hostile_subgraph_documents_are_refused(name):
    with pytest.raises(UnsupportedGraphError):
        decode(docs.HOSTILE[name]())


def test_a_subgraph_error_names_the_subgraph():
    with pytest.raises(UnsupportedGraphError, match=r"^subgraph 0: .*builtins::eval"):
        decode(docs.HOSTILE["unknown-op-inside"]())


def test_node_count_limit_counts_each_call_of_a_subgraph():
    """Small on the wire, huge to run: a chain of subgraphs each invoking the one before 80 times."""
    body = docs.HOSTILE["expands-past-the-node-limit"]()
    assert len(msgspec.msgpack.encode(body)) < 20_000
    with pytest.raises(UnsupportedGraphError, match="counted per call"):
        decode(body)
    decode(docs._chain(3, calls=80))  # 80 x 80 calls: within the limit


def test_invoke_subgraph_identifiers_come_from_the_decoder():
    decoded = decode(docs.VALID["invoke_subgraph"]())
    calls = [n for n in decoded.module.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
    assert [c.args[1] for c in calls] == ["g0", "g0"]  # the document said "subgraph_0"


# ------------------------------------------------------------------ the allowlist
def test_every_subgraph_operator_has_its_argument_check_and_a_wire_name():
    assert set(SUBGRAPH_OPS) == set(subgraphs._CHECKS)
    for name, op in SUBGRAPH_OPS.items():
        assert target_name(op) == name and resolve_target(name) is op


def test_block_mask_length_is_torchs():
    from torch.nn.attention.flex_attention import create_block_mask

    mask = create_block_mask(lambda b, h, q, k: q >= k, None, None, 16, 16, device="cpu")
    assert len(mask.as_tuple()) == subgraphs.BLOCK_MASK_LEN


def test_the_protocol_documents_every_subgraph_operator():
    text = (REPO / "docs" / "protocol.md").read_text(encoding="utf-8")
    section = text[text.index("### 12.5"):]
    section = section[:section.index("\n## ")]
    for name in SUBGRAPH_OPS:
        assert f'`"{name}"`' in section, name
    for constant in ("MAX_SUBGRAPHS", "MAX_SUBGRAPH_DEPTH"):
        assert re.search(rf"\b{getattr(subgraphs, constant):,}\b|\b{getattr(subgraphs, constant)}\b", section)
