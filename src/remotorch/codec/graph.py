"""Aten-level FX graphs as portable documents, and back (decoding: ``codec/decoding.py``).

A document is plain msgpack data: a list of nodes whose call targets are
*names* (``"aten::addmm.default"``, ``"op:getitem"``,
``"transformers::grouped_mm_fallback.default"``). Decoding resolves names
only through :func:`~remotorch.codec.ops.resolve_target` (aten/prims
OpOverloads minus a denylist, a fixed table of builtins, and custom operators
registered in the worker's process in namespaces it allows, their arguments
checked against their schemas) and rebuilds values only from a closed set of
tags, so no bytes from the wire ever become code. Node names are assigned by
the decoder, never taken from the document. The subgraphs of higher-order
operators (``torch.cond``'s branches, a ``while_loop``'s body…) travel in the
same document, under the same rules (``codec/subgraphs.py``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec
import torch
import torch.fx

from ..errors import UnsupportedGraphError
from .decoding import DOC_FORMAT, MAX_DEPTH, MAX_NODES, DecodedGraph, decode_graph  # noqa: F401
from .frames import FrameWriter
from .messages import TensorMeta
from .ops import (BUILTINS, CORE_NAMESPACES, SUBGRAPH_OPS, custom_ops, resolve_target,  # noqa: F401
                  target_name)
from .subgraphs import MAX_SUBGRAPH_DEPTH, MAX_SUBGRAPHS
from .tensors import dtype_name


# ------------------------------------------------------------------------ encoding
class _GraphRef(NamedTuple):
    """A subgraph of the document (``{"$g": index}``), standing for an FX ``get_attr`` of a GraphModule."""

    index: int


def _encode_value(v, names: dict, depth: int = 0, hop: bool = False):
    if depth > MAX_DEPTH:
        raise UnsupportedGraphError("argument nesting too deep")
    if isinstance(v, torch.fx.Node):
        ref = names[v]
        if isinstance(ref, _GraphRef):
            if not hop:
                raise UnsupportedGraphError("a subgraph can only be an argument of a higher-order operator")
            return {"$g": ref.index}
        return {"$n": ref}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        items = [_encode_value(x, names, depth + 1, hop) for x in v]
        return items if isinstance(v, list) else {"$t": items}
    if isinstance(v, torch.dtype):
        return {"$dt": dtype_name(v)}
    if isinstance(v, torch.device):
        return {"$dev": v.type}
    if isinstance(v, torch.layout):
        return {"$ly": str(v).removeprefix("torch.")}
    if isinstance(v, torch.memory_format):
        return {"$mf": str(v).removeprefix("torch.")}
    if isinstance(v, complex):
        return {"$c": [v.real, v.imag]}
    if isinstance(v, torch._ops.OpOverload):  # the operator a higher-order operator runs
        return {"$op": target_name(v)}
    if hop and isinstance(v, dict) and all(isinstance(k, str) for k in v):  # flex_attention's kernel_options
        return {"$d": [[k, _encode_value(x, names, depth + 1, hop)] for k, x in v.items()]}
    raise UnsupportedGraphError(f"argument of type {type(v).__name__} cannot travel on the wire")


def _placeholder_meta(node: torch.fx.Node) -> dict:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return {"kind": "tensor", "dtype": dtype_name(val.dtype),
                "shape": [d if isinstance(d, int) else str(d) for d in val.shape]}
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)):
        return {"kind": "scalar"}
    return {"kind": "any"}


@dataclass
class GraphPayload:
    """A graph ready for upload: its id, document bytes, and constant tensors."""

    graph_id: str
    doc: bytes
    consts: list[TensorMeta] = field(default_factory=list)
    const_frames: list[memoryview] = field(default_factory=list)
    custom_ops: tuple[str, ...] = ()  # wire names of custom operators: the worker must allow their namespaces


class _Encoder:
    """Encodes a GraphModule and, children first, the subgraphs its higher-order calls name.

    Subgraphs are listed so that one refers only to those before it (the
    decoder's rule, which makes a cycle impossible); the same module, or two
    with the same document, is listed once. Constants of every graph share
    one list, each tensor once.
    """

    def __init__(self) -> None:
        self.consts: list[TensorMeta] = []
        self.writer = FrameWriter()
        self.const_index: dict[int, int] = {}  # id(tensor) -> its index in consts
        self.subgraphs: list[dict] = []
        self.sizes: list[int] = []  # per subgraph: its nodes, each subgraph it names counted per reference
        self.heights: list[int] = []  # per subgraph: the longest chain of subgraphs below it
        self.by_module: dict[int, int] = {}
        self.by_doc: dict[bytes, int] = {}
        self.open: list[int] = []  # ids of the modules being encoded, outermost first

    def nodes(self, gm: torch.fx.GraphModule) -> tuple[list[dict], int, int]:
        """The document nodes of one graph, its size with its subgraphs' and its height (as the decoder counts)."""
        names: dict[torch.fx.Node, object] = {}
        nodes: list[dict] = []
        size = height = 0
        for node in gm.graph.nodes:
            names[node] = f"v{len(nodes)}"
            if node.op == "placeholder":
                nodes.append({"op": "placeholder", **_placeholder_meta(node)})
            elif node.op == "call_function":
                name = target_name(node.target)
                hop = name in SUBGRAPH_OPS
                args = _encode_value(list(node.args), names, hop=hop)
                nodes.append({"op": "call", "target": name, "args": args,
                              "kwargs": {k: _encode_value(v, names, hop=hop) for k, v in node.kwargs.items()}})
                for k in _graph_refs(args) if hop else ():
                    size, height = size + self.sizes[k], max(height, 1 + self.heights[k])
            elif node.op == "get_attr":
                value = _get_attr(gm, node.target)
                if isinstance(value, torch.fx.GraphModule):
                    names[node] = _GraphRef(self.subgraph(value))
                    continue
                if not isinstance(value, torch.Tensor):
                    raise UnsupportedGraphError(f"graph attribute {node.target} is not a tensor or a subgraph")
                nodes.append({"op": "const", "index": self.const(value)})
            elif node.op == "output":
                nodes.append({"op": "output", "args": _encode_value(node.args[0], names)})
            else:
                raise UnsupportedGraphError(f"FX node kind {node.op} cannot run remotely")
        return nodes, size + len(nodes), height

    def const(self, value: torch.Tensor) -> int:
        if id(value) not in self.const_index:
            self.consts.append(self.writer.meta(value))
            self.const_index[id(value)] = len(self.consts) - 1
        return self.const_index[id(value)]

    def subgraph(self, gm: torch.fx.GraphModule) -> int:
        """The index of a subgraph in the document, encoding it (and its own subgraphs) first if new."""
        if id(gm) in self.by_module:
            return self.by_module[id(gm)]
        if id(gm) in self.open:
            raise UnsupportedGraphError("a subgraph refers to itself")
        if len(self.open) >= MAX_SUBGRAPH_DEPTH:
            raise UnsupportedGraphError(f"subgraphs nested deeper than {MAX_SUBGRAPH_DEPTH}")
        self.open.append(id(gm))
        try:
            nodes, size, height = self.nodes(gm)
        finally:
            self.open.pop()
        key = msgspec.msgpack.encode(nodes)
        if key not in self.by_doc:
            if len(self.subgraphs) >= MAX_SUBGRAPHS:
                raise UnsupportedGraphError(f"more than {MAX_SUBGRAPHS} subgraphs")
            self.by_doc[key] = len(self.subgraphs)
            self.subgraphs.append({"nodes": nodes})
            self.sizes.append(size)
            self.heights.append(height)
        self.by_module[id(gm)] = self.by_doc[key]
        return self.by_doc[key]


def _graph_refs(v, depth: int = 0) -> list[int]:
    """The subgraph indices an encoded argument names."""
    if isinstance(v, list) and depth <= MAX_DEPTH:
        return [k for x in v for k in _graph_refs(x, depth + 1)]
    if isinstance(v, dict) and len(v) == 1:
        (tag, x), = v.items()
        return [x] if tag == "$g" else _graph_refs(x, depth + 1) if tag in ("$t", "$d") else []
    return []


def encode_graph(gm: torch.fx.GraphModule) -> GraphPayload:
    """Turn an aten-level GraphModule into a document; refuses anything not allowlisted.

    Subgraphs of higher-order operators (``torch.cond``'s branches…) travel
    in the same document (``subgraphs``), so its id covers them.
    """
    enc = _Encoder()
    nodes, size, height = enc.nodes(gm)
    if size > MAX_NODES or height > MAX_SUBGRAPH_DEPTH:
        raise UnsupportedGraphError(f"graph of {size} nodes (its subgraphs counted per call) and {height} levels "
                                    f"of subgraphs is over the limits of {MAX_NODES} and {MAX_SUBGRAPH_DEPTH}")
    body = {"format": DOC_FORMAT, "nodes": nodes}
    if enc.subgraphs:
        body["subgraphs"] = enc.subgraphs
    doc = msgspec.msgpack.encode(body)
    ops = custom_ops(n["target"] for g in (nodes, *(s["nodes"] for s in enc.subgraphs))
                     for n in g if n["op"] == "call")
    return GraphPayload(graph_id(doc, enc.consts, enc.writer.frames), doc, enc.consts, enc.writer.frames, ops)


def graph_id(doc: bytes, consts: list[TensorMeta], frames) -> str:
    """Content id of a graph: sha256 over the document (its subgraphs included) and its constants."""
    h = hashlib.sha256(doc)
    for meta, buf in zip(consts, frames):
        h.update(msgspec.msgpack.encode(meta))
        h.update(buf)
    return h.hexdigest()


def _get_attr(gm: torch.nn.Module, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
