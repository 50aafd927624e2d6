"""Aten-level FX graphs as portable documents, and back.

A document is plain msgpack data: a list of nodes whose call targets are
*names* (``"aten::addmm.default"``, ``"op:getitem"``). Decoding resolves names
only through :func:`resolve_target`'s allowlist (aten/prims OpOverloads minus
a denylist, a fixed table of builtins) and rebuilds values only from a closed
set of tags, so no bytes from the wire ever become code. Node names are
assigned by the decoder, never taken from the document.
"""

from __future__ import annotations

import hashlib
import math
import operator
import re
from dataclasses import dataclass, field

import msgspec
import torch
import torch.fx

from ..errors import UnsupportedGraphError
from .messages import TensorMeta
from .frames import FrameWriter
from .tensors import DTYPE_NAMES, dtype_from_name, dtype_name

DOC_FORMAT = 1
MAX_NODES = 200_000
MAX_DEPTH = 8

_BUILTINS: dict[str, object] = {
    "op:getitem": operator.getitem, "op:add": operator.add, "op:sub": operator.sub,
    "op:mul": operator.mul, "op:truediv": operator.truediv, "op:floordiv": operator.floordiv,
    "op:mod": operator.mod, "op:pow": operator.pow, "op:neg": operator.neg,
    "op:eq": operator.eq, "op:ne": operator.ne, "op:lt": operator.lt, "op:le": operator.le,
    "op:gt": operator.gt, "op:ge": operator.ge, "op:and_": operator.and_, "op:or_": operator.or_,
    "op:not_": operator.not_, "op:abs": operator.abs,
    "math:ceil": math.ceil, "math:floor": math.floor, "math:sqrt": math.sqrt,
    "torch:sym_float": torch.sym_float, "torch:sym_int": torch.sym_int,
    "torch:sym_max": torch.sym_max, "torch:sym_min": torch.sym_min, "torch:sym_not": torch.sym_not,
}
_BUILTIN_NAMES = {id(fn): name for name, fn in _BUILTINS.items()}
_OP_NAMESPACES = frozenset({"aten", "prims"})
# Ops that reach outside the tensor world (files, process state) are refused
# even though they live in aten.
_DENIED_OPS = frozenset({"aten::from_file", "aten::_print", "aten::set_", "aten::_assert_async",
                         "aten::save", "aten::_debug_has_internal_overlap"})
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")

_LAYOUTS = {"strided": torch.strided, "sparse_coo": torch.sparse_coo}
_MEMORY_FORMATS = {"contiguous_format": torch.contiguous_format, "channels_last": torch.channels_last,
                   "preserve_format": torch.preserve_format, "channels_last_3d": torch.channels_last_3d}


def target_name(target) -> str:
    """The wire name of a call target, or UnsupportedGraphError if it is not allowlisted."""
    if isinstance(target, torch._ops.OpOverload):
        ns, _, op = target._schema.name.partition("::")
        name = f"{ns}::{op}"
        if ns in _OP_NAMESPACES and name not in _DENIED_OPS:
            return f"{name}.{target._overloadname}"
    elif id(target) in _BUILTIN_NAMES:
        return _BUILTIN_NAMES[id(target)]
    raise UnsupportedGraphError(f"operation {getattr(target, '__name__', target)!s} cannot run remotely")


def resolve_target(name: str):
    """Map a wire name back to a callable, through the allowlist only."""
    if name in _BUILTINS:
        return _BUILTINS[name]
    qual, _, overload = name.rpartition(".")
    ns, sep, op = qual.partition("::")
    if not (sep and ns in _OP_NAMESPACES and _IDENT.match(op) and _IDENT.match(overload)):
        raise UnsupportedGraphError(f"target {name[:200]!r} is not allowed")
    if f"{ns}::{op}" in _DENIED_OPS:
        raise UnsupportedGraphError(f"operation {ns}::{op} is not allowed on a worker")
    try:
        packet = getattr(getattr(torch.ops, ns), op)
        overload_fn = getattr(packet, overload)
    except (AttributeError, RuntimeError):
        raise UnsupportedGraphError(f"operation {name[:200]!r} does not exist on this worker") from None
    if not isinstance(overload_fn, torch._ops.OpOverload):
        raise UnsupportedGraphError(f"target {name[:200]!r} is not an operator overload")
    return overload_fn


# ------------------------------------------------------------------------ encoding
def _encode_value(v, names: dict[torch.fx.Node, str], depth: int = 0):
    if depth > MAX_DEPTH:
        raise UnsupportedGraphError("argument nesting too deep")
    if isinstance(v, torch.fx.Node):
        return {"$n": names[v]}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        items = [_encode_value(x, names, depth + 1) for x in v]
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


def encode_graph(gm: torch.fx.GraphModule) -> GraphPayload:
    """Turn an aten-level GraphModule into a document; refuses anything not allowlisted."""
    names: dict[torch.fx.Node, str] = {}
    nodes, consts, writer = [], [], FrameWriter()
    for i, node in enumerate(gm.graph.nodes):
        names[node] = f"v{i}"
        if node.op == "placeholder":
            nodes.append({"op": "placeholder", **_placeholder_meta(node)})
        elif node.op == "call_function":
            nodes.append({"op": "call", "target": target_name(node.target),
                          "args": _encode_value(list(node.args), names),
                          "kwargs": {k: _encode_value(v, names) for k, v in node.kwargs.items()}})
        elif node.op == "get_attr":
            value = _get_attr(gm, node.target)
            if not isinstance(value, torch.Tensor):
                raise UnsupportedGraphError(f"graph attribute {node.target} is not a tensor")
            consts.append(writer.meta(value))
            nodes.append({"op": "const", "index": len(consts) - 1})
        elif node.op == "output":
            nodes.append({"op": "output", "args": _encode_value(node.args[0], names)})
        else:
            raise UnsupportedGraphError(f"FX node kind {node.op} cannot run remotely")
    doc = msgspec.msgpack.encode({"format": DOC_FORMAT, "nodes": nodes})
    return GraphPayload(graph_id(doc, consts, writer.frames), doc, consts, writer.frames)


def graph_id(doc: bytes, consts: list[TensorMeta], frames) -> str:
    """Content id of a graph: sha256 over the document and its constants."""
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


# ------------------------------------------------------------------------ decoding
@dataclass
class DecodedGraph:
    """A rebuilt graph plus what the worker checks arguments against."""

    module: torch.fx.GraphModule
    inputs: list[dict]  # placeholder metas, in argument order


def _decode_value(v, env: dict[str, torch.fx.Node], device: torch.device, depth: int = 0):
    if depth > MAX_DEPTH:
        raise UnsupportedGraphError("argument nesting too deep")
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, list):
        return [_decode_value(x, env, device, depth + 1) for x in v]
    if isinstance(v, dict) and len(v) == 1:
        (tag, x), = v.items()
        if tag == "$n" and isinstance(x, str) and x in env:
            return env[x]
        if tag == "$t" and isinstance(x, list):
            return tuple(_decode_value(y, env, device, depth + 1) for y in x)
        if tag == "$dt" and isinstance(x, str) and x in DTYPE_NAMES:
            return dtype_from_name(x)
        if tag == "$dev":
            return device  # the whole graph runs on the worker's device
        if tag == "$ly" and isinstance(x, str) and x in _LAYOUTS:
            return _LAYOUTS[x]
        if tag == "$mf" and isinstance(x, str) and x in _MEMORY_FORMATS:
            return _MEMORY_FORMATS[x]
        if tag == "$c" and isinstance(x, list) and len(x) == 2 and all(isinstance(y, float) for y in x):
            return complex(x[0], x[1])
    raise UnsupportedGraphError(f"malformed argument in graph document: {str(v)[:120]}")


def _input_meta(spec: dict, i: int) -> dict:
    kind = spec.get("kind")
    if kind not in ("tensor", "scalar", "any"):
        raise UnsupportedGraphError(f"graph input {i} has unknown kind")
    if kind != "tensor":
        return {"kind": kind}
    dtype, shape = spec.get("dtype"), spec.get("shape")
    if not (isinstance(dtype, str) and dtype in DTYPE_NAMES and isinstance(shape, list) and len(shape) <= 64
            and all(isinstance(d, str) or (isinstance(d, int) and 0 <= d < 1 << 62) for d in shape)):
        raise UnsupportedGraphError(f"graph input {i} has a malformed tensor description")
    return {"kind": kind, "dtype": dtype, "shape": shape}


def decode_graph(doc: bytes, consts: list[torch.Tensor], device: torch.device) -> DecodedGraph:
    """Rebuild a GraphModule from a document; every failure is UnsupportedGraphError."""
    try:
        data = msgspec.msgpack.decode(doc)
    except msgspec.DecodeError as exc:
        raise UnsupportedGraphError(f"graph document is not valid msgpack: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != DOC_FORMAT:
        raise UnsupportedGraphError("graph document has an unknown format")
    nodes = data.get("nodes")
    if not isinstance(nodes, list) or not nodes or len(nodes) > MAX_NODES:
        raise UnsupportedGraphError("graph document has no valid node list")
    graph, root = torch.fx.Graph(), torch.nn.Module()
    env: dict[str, torch.fx.Node] = {}
    inputs: list[dict] = []
    saw_output = False
    for i, spec in enumerate(nodes):
        if not isinstance(spec, dict) or saw_output:
            raise UnsupportedGraphError(f"graph node {i} is malformed")
        op = spec.get("op")
        if op == "placeholder":
            if len(inputs) != len(env):
                raise UnsupportedGraphError("placeholders must come first")
            env[f"v{i}"] = graph.placeholder(f"arg{len(inputs)}")
            inputs.append(_input_meta(spec, i))
        elif op == "call":
            target = resolve_target(str(spec.get("target")))
            args = _decode_value(spec.get("args", []), env, device)
            kwargs = spec.get("kwargs", {})
            if not isinstance(args, list) or not isinstance(kwargs, dict):
                raise UnsupportedGraphError(f"graph node {i} has malformed arguments")
            kw = {str(k): _decode_value(x, env, device) for k, x in kwargs.items()
                  if isinstance(k, str) and _IDENT.match(k)}
            if len(kw) != len(kwargs):
                raise UnsupportedGraphError(f"graph node {i} has a malformed keyword")
            env[f"v{i}"] = graph.call_function(target, tuple(args), kw)
        elif op == "const":
            idx = spec.get("index")
            if not isinstance(idx, int) or not 0 <= idx < len(consts):
                raise UnsupportedGraphError(f"graph node {i} names a missing constant")
            root.register_buffer(f"c{idx}", consts[idx].to(device), persistent=False)
            env[f"v{i}"] = graph.get_attr(f"c{idx}")
        elif op == "output":
            graph.output(_decode_value(spec.get("args"), env, device))
            saw_output = True
        else:
            raise UnsupportedGraphError(f"graph node {i} has unknown kind {str(op)[:40]!r}")
    if not saw_output:
        raise UnsupportedGraphError("graph document has no output")
    try:
        graph.lint()
        module = torch.fx.GraphModule(root, graph)
    except Exception as exc:  # lint/codegen reject structurally broken graphs
        raise UnsupportedGraphError(f"graph document is inconsistent: {exc}") from None
    return DecodedGraph(module, inputs)
