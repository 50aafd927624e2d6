"""Hostile input, in process: hypothesis drives the envelope decoder, the graph decoder (subgraphs of
higher-order operators included) and the tensor view checks.

The same malformed messages against a live worker: ``tests/integration/test_fuzz.py``.
"""

from __future__ import annotations

import random

import msgspec
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from remotorch import errors
from remotorch.codec import messages as m
from remotorch.codec.graph import decode_graph
from remotorch.codec.ops import BUILTINS, CORE_NAMESPACES
from remotorch.codec.tensors import tensor_from_wire
from remotorch.devtools import fuzz, subgraph_docs

from fuzz_strategies import envelopes, subgraph_documents


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=300))
def test_envelope_decoder_on_random_bytes(data):
    try:
        m.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        pass


@settings(max_examples=500, deadline=None)
@given(envelopes)
def test_envelope_decoder_on_random_structures(env):
    try:
        m.decode(msgspec.msgpack.encode(list(env)))
    except (msgspec.DecodeError, msgspec.ValidationError):
        pass


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=0, max_value=2**32))
def test_graph_decoder_on_hostile_documents(seed):
    doc = fuzz._doc(random.Random(seed))
    try:
        decode_graph(doc, [], torch.device("cpu"))
    except errors.UnsupportedGraphError:
        pass


@settings(max_examples=500, deadline=None)
@given(st.sampled_from(["float32", "int64", "bool", "float16", "nope"]),
       st.lists(st.integers(min_value=-3, max_value=2**63), max_size=5),
       st.lists(st.integers(min_value=-3, max_value=2**63), max_size=5),
       st.integers(min_value=0, max_value=256))
def test_tensor_views_stay_inside_their_frame(dtype, shape, strides, nbytes):
    buf = bytearray(nbytes)
    try:
        t = tensor_from_wire(m.TensorMeta(dtype, shape, strides, 0), buf)
    except ValueError:
        return
    if t.numel():
        span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        assert span * t.element_size() <= nbytes
        t.sum()  # touches every element: must not read outside the frame


def _allowlisted(module: torch.fx.GraphModule) -> None:
    """Every call of a decoded graph, and of each subgraph it holds, is an allowlisted target."""
    allowed = set(map(id, BUILTINS.values()))
    for node in module.graph.nodes:
        if node.op == "call_function":
            assert id(node.target) in allowed or (isinstance(node.target, torch._ops.OpOverload)
                                                  and node.target.namespace in CORE_NAMESPACES), node.target
        elif node.op == "get_attr" and isinstance(getattr(module, node.target), torch.fx.GraphModule):
            _allowlisted(getattr(module, node.target))
        else:
            assert node.op in ("placeholder", "output", "get_attr"), node.op


@settings(max_examples=400, deadline=None)
@given(subgraph_documents())
def test_graph_decoder_on_hostile_subgraph_documents(body):
    try:
        decoded = decode_graph(msgspec.msgpack.encode(body), [], torch.device("cpu"))
    except errors.UnsupportedGraphError:
        return
    _allowlisted(decoded.module)


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=0, max_value=2**32))
def test_graph_decoder_on_the_fuzzers_subgraph_documents(seed):
    try:
        decoded = decode_graph(msgspec.msgpack.encode(subgraph_docs.mutated(random.Random(seed))), [],
                               torch.device("cpu"))
    except errors.UnsupportedGraphError:
        return
    _allowlisted(decoded.module)
