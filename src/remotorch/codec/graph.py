"""Aten-level FX graphs as portable documents, and back.

A document is plain msgpack data: a list of nodes whose call targets are
*names* (``"aten::addmm.default"``, ``"op:getitem"``,
``"transformers::grouped_mm_fallback.default"``). Decoding resolves names
only through :func:`~remotorch.codec.ops.resolve_target` (aten/prims
OpOverloads minus a denylist, a fixed table of builtins, and custom operators
registered in the worker's process in namespaces it allows, their arguments
checked against their schemas) and rebuilds values only from a closed set of
tags, so no bytes from the wire ever become code. Node names are assigned by
the decoder, never taken from the document.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import msgspec
import torch
import torch.fx

from ..errors import UnsupportedGraphError
from .messages import TensorMeta
from .frames import FrameWriter
from .ops import IDENT as _IDENT
from .ops import (BUILTINS, CORE_NAMESPACES, OP_ARGUMENT, check_builtin, check_call,  # noqa: F401
                  custom_ops, getitem_kind, output_kind, resolve_target, target_name)
from .tensors import DTYPE_NAMES, dtype_from_name, dtype_name

DOC_FORMAT = 1
MAX_NODES = 200_000
MAX_DEPTH = 8

_LAYOUTS = {"strided": torch.strided, "sparse_coo": torch.sparse_coo}
_MEMORY_FORMATS = {"contiguous_format": torch.contiguous_format, "channels_last": torch.channels_last,
                   "preserve_format": torch.preserve_format, "channels_last_3d": torch.channels_last_3d}


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
    if isinstance(v, torch._ops.OpOverload):  # the operator a higher-order operator runs
        return {"$op": target_name(v)}
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
    ops = custom_ops(n["target"] for n in nodes if n["op"] == "call")
    return GraphPayload(graph_id(doc, consts, writer.frames), doc, consts, writer.frames, ops)


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
    custom_ops: tuple[str, ...] = ()  # wire names of the custom operators it calls


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


def decode_graph(doc: bytes, consts: list[torch.Tensor], device: torch.device,
                 allowed_ops: frozenset[str] = frozenset()) -> DecodedGraph:
    """Rebuild a GraphModule from a document; every failure is UnsupportedGraphError.

    ``allowed_ops``: namespaces of custom operators this worker allows
    (``remotorch serve --allow-ops``); their calls are checked against the
    operators' schemas here, before anything runs.
    """
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
    kinds: dict[torch.fx.Node, object] = {}  # what each node produces (see codec/ops.py)
    inputs: list[dict] = []
    saw_output = False
    for i, spec in enumerate(nodes):
        if not isinstance(spec, dict) or saw_output:
            raise UnsupportedGraphError(f"graph node {i} is malformed")
        op = spec.get("op")
        if op == "placeholder":
            if len(inputs) != len(env):
                raise UnsupportedGraphError("placeholders must come first")
            node = env[f"v{i}"] = graph.placeholder(f"arg{len(inputs)}")
            inputs.append(_input_meta(spec, i))
            kinds[node] = {"tensor": "tensor", "scalar": "scalar"}.get(inputs[-1]["kind"], "unknown")
        elif op == "call":
            env[f"v{i}"] = _decode_call(graph, spec, i, env, device, allowed_ops, kinds)
        elif op == "const":
            idx = spec.get("index")
            if not isinstance(idx, int) or not 0 <= idx < len(consts):
                raise UnsupportedGraphError(f"graph node {i} names a missing constant")
            root.register_buffer(f"c{idx}", consts[idx].to(device), persistent=False)
            node = env[f"v{i}"] = graph.get_attr(f"c{idx}")
            kinds[node] = "tensor"
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
    used = custom_ops(target_name(n.target) for n in graph.nodes
                      if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload))
    return DecodedGraph(module, inputs, used)


def _decode_call(graph: torch.fx.Graph, spec: dict, i: int, env: dict, device: torch.device,
                 allowed: frozenset[str], kinds: dict) -> torch.fx.Node:
    """One ``call`` node: its target resolved, its arguments decoded and checked (custom
    operators against their schemas, builtins against their arity and operand kinds), what
    it produces noted in ``kinds``."""
    name = str(spec.get("target"))
    target = resolve_target(name, allowed)
    raw, kwargs = spec.get("args", []), spec.get("kwargs", {})
    if not isinstance(raw, list) or not isinstance(kwargs, dict):
        raise UnsupportedGraphError(f"graph node {i} has malformed arguments")
    inner, at = None, OP_ARGUMENT.get(name)
    if at is not None:  # a higher-order operator: one argument names the operator it runs
        inner = _operator_argument(raw, at, i, allowed)
        raw = raw[:at] + raw[at + 1:]
    args = _decode_value(raw, env, device)
    kw = {str(k): _decode_value(x, env, device) for k, x in kwargs.items()
          if isinstance(k, str) and _IDENT.match(k)}
    if len(kw) != len(kwargs):
        raise UnsupportedGraphError(f"graph node {i} has a malformed keyword")
    if inner is not None:
        kind = _check_higher_order(name, inner, args, kw, kinds)
        args.insert(at, inner)
    elif isinstance(target, torch._ops.OpOverload):
        if target.namespace not in CORE_NAMESPACES:
            check_call(target, tuple(args), kw, kinds)
        kind = output_kind(target)
    else:
        check_builtin(name, tuple(args), kw, kinds)
        kind = getitem_kind(kinds.get(args[0], "unknown"), args[1]) if name == "op:getitem" else "scalar"
    node = graph.call_function(target, tuple(args), kw)
    kinds[node] = kind
    return node


def _operator_argument(raw: list, at: int, i: int, allowed: frozenset[str]) -> torch._ops.OpOverload:
    """The operator a higher-order call names at argument ``at`` (``{"$op": name}``), resolved
    through the same allowlist as a call target."""
    ref = raw[at] if len(raw) > at else None
    if not (isinstance(ref, dict) and len(ref) == 1 and isinstance(ref.get("$op"), str)):
        raise UnsupportedGraphError(f"graph node {i} must name an operator as argument {at}")
    op = resolve_target(ref["$op"], allowed)
    if not isinstance(op, torch._ops.OpOverload):
        raise UnsupportedGraphError(f"graph node {i}: {ref['$op'][:200]!r} is not an operator overload")
    return op


def _check_higher_order(name: str, op: torch._ops.OpOverload, args: list, kwargs: dict, kinds: dict):
    """Check a ``run_and_save_rng_state(op, *args)`` / ``run_with_rng_state(state, op, *args)``
    call; what it produces."""
    if name == "hop:run_with_rng_state":
        if not args or not (isinstance(args[0], torch.fx.Node) and kinds.get(args[0]) == "tensor"):
            raise UnsupportedGraphError(f"operation {name} takes a random-number state tensor first")
        op_args = args[1:]
    else:
        op_args = args
    if op.namespace not in CORE_NAMESPACES:
        check_call(op, tuple(op_args), kwargs, kinds)
    produced = output_kind(op)
    return ("tensor", produced) if name == "hop:run_and_save_rng_state" else produced
