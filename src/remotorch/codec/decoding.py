"""Graph documents back into GraphModules, through the allowlist; every failure is UnsupportedGraphError.

The worker's side of ``codec/graph.py``: a document's call targets are
resolved only through :func:`~remotorch.codec.ops.resolve_target`, its
values rebuilt only from a closed set of tags, its node names assigned here,
and the subgraphs of higher-order operators (``codec/subgraphs.py``) decoded
first, each before any graph that names it, under the same rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import torch
import torch.fx

from ..errors import UnsupportedGraphError
from . import subgraphs
from .ops import IDENT as _IDENT
from .ops import (CORE_NAMESPACES, OP_ARGUMENT, SUBGRAPH_OPS, check_builtin, check_call, custom_ops,
                  getitem_kind, output_kind, resolve_target, target_name)
from .subgraphs import MAX_SUBGRAPH_DEPTH, MAX_SUBGRAPHS, Subgraph
from .tensors import DTYPE_NAMES, dtype_from_name

DOC_FORMAT = 1
MAX_NODES = 200_000  # all graphs of a document together, each subgraph counted once per call that runs it
MAX_DEPTH = 8

_LAYOUTS = {"strided": torch.strided, "sparse_coo": torch.sparse_coo}
_MEMORY_FORMATS = {"contiguous_format": torch.contiguous_format, "channels_last": torch.channels_last,
                   "preserve_format": torch.preserve_format, "channels_last_3d": torch.channels_last_3d}


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
    operators' schemas here, before anything runs. Subgraphs are decoded
    first, in order (each may name only those before it), and become
    attributes of the graphs that name them.
    """
    try:
        data = msgspec.msgpack.decode(doc)
    except msgspec.DecodeError as exc:
        raise UnsupportedGraphError(f"graph document is not valid msgpack: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != DOC_FORMAT:
        raise UnsupportedGraphError("graph document has an unknown format")
    subs = data.get("subgraphs", [])
    if isinstance(subs, list) and len(subs) > MAX_SUBGRAPHS:
        raise UnsupportedGraphError(f"graph document has {len(subs)} subgraphs, over the limit of {MAX_SUBGRAPHS}")
    if not (isinstance(subs, list)
            and all(isinstance(g, dict) and list(g) == ["nodes"] and isinstance(g["nodes"], list) for g in subs)):
        raise UnsupportedGraphError("graph document has a malformed subgraph list")
    nodes = data.get("nodes")
    if not isinstance(nodes, list) or not nodes or len(nodes) + sum(len(g["nodes"]) for g in subs) > MAX_NODES:
        raise UnsupportedGraphError("graph document has no valid node list")
    ctx = _Document(consts, device, allowed_ops)
    for k, g in enumerate(subs):
        try:
            ctx.subgraphs.append(_decode_nodes(g["nodes"], ctx, k, "graph"))
        except UnsupportedGraphError as exc:
            raise UnsupportedGraphError(f"subgraph {k}: {exc}") from None
    top = _decode_nodes(nodes, ctx, len(subs), "graph")
    unused = set(range(len(subs))) - ctx.named
    if unused:
        raise UnsupportedGraphError(f"graph document has subgraphs no graph names: {sorted(unused)[:10]}")
    used = custom_ops(target_name(n.target) for b in (top, *ctx.subgraphs) for n in b.module.graph.nodes
                      if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload))
    return DecodedGraph(top.module, top.inputs, used)


@dataclass
class _Document:
    """What the graphs of one document share while it is decoded."""

    consts: list[torch.Tensor]
    device: torch.device
    allowed: frozenset[str]
    subgraphs: list[_Built] = field(default_factory=list)  # decoded so far, in document order
    named: set[int] = field(default_factory=set)  # subgraphs some graph names


@dataclass
class _Built:
    """One decoded graph of a document."""

    module: torch.fx.GraphModule
    inputs: list[dict]
    info: Subgraph  # what a higher-order call may know of it
    size: int  # its nodes, and every subgraph it names counted per reference
    height: int  # the longest chain of subgraphs below it


class _Scope:
    """One graph being built: its nodes so far, what each produces, the subgraphs it names.

    It is the :class:`~remotorch.codec.subgraphs.Reader` of its higher-order calls.
    """

    def __init__(self, ctx: _Document, limit: int) -> None:
        self.ctx, self.limit = ctx, limit  # it may name subgraphs 0 .. limit-1
        self.graph, self.root = torch.fx.Graph(), torch.nn.Module()
        self.env: dict[str, torch.fx.Node] = {}
        self.kinds: dict[torch.fx.Node, object] = {}  # what each node produces (see codec/ops.py)
        self.size = self.height = 0

    def value(self, raw):
        return _decode_value(raw, self.env, self.ctx.device)

    def subgraph(self, raw) -> tuple[torch.fx.Node, Subgraph]:
        k = raw.get("$g") if isinstance(raw, dict) and len(raw) == 1 else None
        if type(k) is not int:
            raise UnsupportedGraphError(f"a subgraph is expected, the document gives {str(raw)[:120]}")
        if not 0 <= k < self.limit:
            raise UnsupportedGraphError(f"subgraph reference {k} names no subgraph before this graph "
                                        f"(a subgraph names only those listed before it)")
        built = self.ctx.subgraphs[k]
        self.size += built.size
        self.height = max(self.height, built.height + 1)
        if self.size > MAX_NODES:
            raise UnsupportedGraphError(f"graph with its subgraphs (counted per call) is over the limit of "
                                        f"{MAX_NODES} nodes")
        if self.height > MAX_SUBGRAPH_DEPTH:
            raise UnsupportedGraphError(f"subgraphs nested deeper than {MAX_SUBGRAPH_DEPTH}")
        self.ctx.named.add(k)
        if not hasattr(self.root, f"g{k}"):
            self.root.add_module(f"g{k}", built.module)
        return self.graph.get_attr(f"g{k}"), built.info


def _decode_nodes(nodes: list, ctx: _Document, limit: int, what: str) -> _Built:
    """One graph of the document (the top graph, or subgraph ``limit``), naming subgraphs below ``limit``."""
    if not nodes:
        raise UnsupportedGraphError(f"{what} of the document has no nodes")
    scope = _Scope(ctx, limit)
    graph, env, kinds = scope.graph, scope.env, scope.kinds
    inputs: list[dict] = []
    out_kind: object = "unknown"
    saw_output = False
    for i, spec in enumerate(nodes):
        if not isinstance(spec, dict) or saw_output:
            raise UnsupportedGraphError(f"{what} node {i} is malformed")
        op = spec.get("op")
        if op == "placeholder":
            if len(inputs) != len(env):
                raise UnsupportedGraphError("placeholders must come first")
            node = env[f"v{i}"] = graph.placeholder(f"arg{len(inputs)}")
            inputs.append(_input_meta(spec, i))
            kinds[node] = {"tensor": "tensor", "scalar": "scalar"}.get(inputs[-1]["kind"], "unknown")
        elif op == "call":
            env[f"v{i}"] = _decode_call(scope, spec, i)
        elif op == "const":
            idx = spec.get("index")
            if not isinstance(idx, int) or not 0 <= idx < len(ctx.consts):
                raise UnsupportedGraphError(f"{what} node {i} names a missing constant")
            if not hasattr(scope.root, f"c{idx}"):
                scope.root.register_buffer(f"c{idx}", ctx.consts[idx].to(ctx.device), persistent=False)
            node = env[f"v{i}"] = graph.get_attr(f"c{idx}")
            kinds[node] = "tensor"
        elif op == "output":
            out = _decode_value(spec.get("args"), env, ctx.device)
            graph.output(out)
            out_kind, saw_output = _kind_of(out, kinds), True
        else:
            raise UnsupportedGraphError(f"{what} node {i} has unknown kind {str(op)[:40]!r}")
    if not saw_output:
        raise UnsupportedGraphError(f"{what} of the document has no output")
    try:
        graph.lint()
        module = torch.fx.GraphModule(scope.root, graph)
    except Exception as exc:  # lint/codegen reject structurally broken graphs
        raise UnsupportedGraphError(f"{what} of the document is inconsistent: {exc}") from None
    return _Built(module, inputs, Subgraph(len(inputs), out_kind), scope.size + len(nodes), scope.height)


def _kind_of(out, kinds: dict):
    """What a graph returns, as a higher-order call that runs it produces it."""
    if isinstance(out, (list, tuple)):
        return tuple(_kind_of(x, kinds) if isinstance(x, torch.fx.Node) else
                     "scalar" if type(x) in (int, float, bool) else "unknown" for x in out)
    return kinds.get(out, "unknown") if isinstance(out, torch.fx.Node) else "unknown"


def _decode_call(scope: _Scope, spec: dict, i: int) -> torch.fx.Node:
    """One ``call`` node: its target resolved, its arguments decoded and checked (custom
    operators against their schemas, builtins against their arity and operand kinds,
    higher-order operators against their exact shapes), what it produces noted in ``kinds``."""
    allowed, kinds = scope.ctx.allowed, scope.kinds
    name = str(spec.get("target"))
    target = resolve_target(name, allowed)
    raw, kwargs = spec.get("args", []), spec.get("kwargs", {})
    if not isinstance(raw, list) or not isinstance(kwargs, dict):
        raise UnsupportedGraphError(f"graph node {i} has malformed arguments")
    if name in SUBGRAPH_OPS:
        args, kind = subgraphs.check_call(name, raw, kwargs, scope, i)
        node = scope.graph.call_function(target, tuple(args), {})
        kinds[node] = kind
        return node
    inner, at = None, OP_ARGUMENT.get(name)
    if at is not None:  # a higher-order operator: one argument names the operator it runs
        inner = _operator_argument(raw, at, i, allowed)
        raw = raw[:at] + raw[at + 1:]
    args = scope.value(raw)
    kw = {str(k): scope.value(x) for k, x in kwargs.items() if isinstance(k, str) and _IDENT.match(k)}
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
    node = scope.graph.call_function(target, tuple(args), kw)
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
    """Check a ``run_and_save_rng_state(op, *args)`` / ``run_with_rng_state(state, op, *args)`` /
    ``with_effects(token, op, *args)`` call; what it produces."""
    if name in ("hop:run_with_rng_state", "hop:with_effects"):
        if not args or not (isinstance(args[0], torch.fx.Node) and kinds.get(args[0]) == "tensor"):
            what = "an effect token" if name == "hop:with_effects" else "a random-number state tensor"
            raise UnsupportedGraphError(f"operation {name} takes {what} first")
        op_args = args[1:]
    else:
        op_args = args
    if op.namespace not in CORE_NAMESPACES:
        check_call(op, tuple(op_args), kwargs, kinds)
    produced = output_kind(op)
    if name == "hop:with_effects":  # (new token, *the operator's results)
        return ("tensor", *produced) if isinstance(produced, tuple) else ("tensor", produced)
    return ("tensor", produced) if name == "hop:run_and_save_rng_state" else produced
