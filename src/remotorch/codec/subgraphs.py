"""Higher-order operators whose arguments are subgraphs: the exact argument shapes each accepts.

``torch.cond``, ``torch.while_loop``, ``scan``, ``map``, ``flex_attention``
and ``nested_compile_region`` reach an aten graph as calls of higher-order
operators (``torch.ops.higher_order.*``) whose arguments include FX
subgraphs. On the wire a subgraph is a graph document of its own, listed in
the parent document's ``subgraphs`` and named by position (``{"$g": k}``,
docs/protocol.md §12.5); here each operator's arguments are read slot by
slot: a subgraph slot takes only such a reference, every other slot only
ordinary values (never a reference), with the counts each operator needs
(how many inputs each subgraph takes, against the operands the call
passes). Everything is checked while the document is decoded, before
anything runs; what a call reads is handed over as a :class:`Reader` by
``codec/graph.py``, which owns the values and the subgraphs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch.fx

from ..errors import UnsupportedGraphError
from .ops import IDENT

MAX_SUBGRAPHS = 1024  # subgraphs in one document
MAX_SUBGRAPH_DEPTH = 8  # subgraphs inside subgraphs: the longest chain of references from the top graph
BLOCK_MASK_LEN = 17  # torch.nn.attention.flex_attention.BlockMask.as_tuple(): 16 values and the mask_mod
MAX_OPTIONS = 64  # entries of flex_attention's kernel_options


@dataclass(frozen=True)
class Subgraph:
    """What a call may know of a subgraph it names: how many inputs it takes, what it returns
    (a kind, or a tuple of kinds, as codec/ops.py writes what values are)."""

    inputs: int
    outputs: object


class Reader(Protocol):
    """How an operator's checks read the raw (msgpack) arguments of one call."""

    def value(self, raw) -> object:
        """An ordinary argument value (a node, a literal, a list or tuple of them); never a subgraph."""

    def subgraph(self, raw) -> tuple[torch.fx.Node, Subgraph]:
        """A ``{"$g": k}`` reference to a subgraph of the document, as a node of the calling graph."""


def check_call(name: str, raw: list, kwargs: dict, reader: Reader, i: int) -> tuple[tuple, object]:
    """A higher-order call's arguments (nodes, values and subgraph nodes) and what it produces.

    UnsupportedGraphError if ``raw`` does not have the operator's exact shape.
    """
    if kwargs:
        raise _bad(name, i, "takes no keyword arguments")
    if not isinstance(raw, list):
        raise _bad(name, i, "has malformed arguments")
    return _CHECKS[name](name, raw, reader, i)


def _bad(name: str, i: int, what: str) -> UnsupportedGraphError:
    return UnsupportedGraphError(f"graph node {i}: operation {name} {what}")


def _count(name: str, raw: list, i: int, low: int, high: int) -> None:
    if not low <= len(raw) <= high:
        want = str(low) if low == high else f"{low} to {high}"
        raise _bad(name, i, f"takes {want} arguments, the document gives {len(raw)}")


def _values(name: str, reader: Reader, raw, i: int, what: str):
    v = reader.value(raw)
    if not isinstance(v, (list, tuple)):
        raise _bad(name, i, f"takes its {what} as a list or tuple")
    return v


def _takes(name: str, i: int, g: Subgraph, n: int, what: str) -> None:
    if g.inputs != n:
        raise _bad(name, i, f"passes {n} value(s) to its {what}, which takes {g.inputs}")


def _returns(g: Subgraph) -> tuple:
    return g.outputs if isinstance(g.outputs, tuple) else (g.outputs,)


def _node(name: str, reader: Reader, raw, i: int, what: str, optional: bool = False):
    v = reader.value(raw)
    if not (isinstance(v, torch.fx.Node) or (optional and v is None)):
        raise _bad(name, i, f"takes a node as its {what}")
    return v


# ------------------------------------------------------------------ control flow
def _cond(name, raw, reader, i):
    """``cond(pred, true_fn, false_fn, operands)``: both branches take the operands."""
    _count(name, raw, i, 4, 4)
    pred = reader.value(raw[0])
    if not (isinstance(pred, torch.fx.Node) or type(pred) is bool):
        raise _bad(name, i, "takes a node or a bool as its predicate")
    (t, tg), (f, fg) = reader.subgraph(raw[1]), reader.subgraph(raw[2])
    operands = _values(name, reader, raw[3], i, "operands")
    _takes(name, i, tg, len(operands), "true branch")
    _takes(name, i, fg, len(operands), "false branch")
    return (pred, t, f, operands), _returns(tg)


def _while(name, raw, reader, i):
    """``while_loop(cond_fn, body_fn, carried, additional)`` (and ``while_loop_stack_output``, what
    aot_autograd makes of it for a backward): both take carried + additional, the body returns
    the carried values (stacked over the iterations for ``_stack_output``)."""
    _count(name, raw, i, 4, 4)
    (c, cg), (b, bg) = reader.subgraph(raw[0]), reader.subgraph(raw[1])
    carried = _values(name, reader, raw[2], i, "carried inputs")
    extra = _values(name, reader, raw[3], i, "additional inputs")
    _takes(name, i, cg, len(carried) + len(extra), "condition")
    _takes(name, i, bg, len(carried) + len(extra), "body")
    out = _returns(bg)
    if len(out) != len(carried):
        raise _bad(name, i, f"has a body returning {len(out)} value(s) for {len(carried)} carried")
    kinds = ("tensor",) * len(out) if name == "hop:while_loop_stack_output" else out
    return (c, b, carried, extra), kinds


def _scan(name, raw, reader, i):
    """``scan(combine_fn, init, xs, additional)``: combine takes a carry, a slice of each xs and the
    additional inputs, and returns the next carry and the slices stacked into the outputs."""
    _count(name, raw, i, 4, 4)
    g, sg = reader.subgraph(raw[0])
    init = _values(name, reader, raw[1], i, "initial carry")
    xs = _values(name, reader, raw[2], i, "scanned inputs")
    extra = _values(name, reader, raw[3], i, "additional inputs")
    _takes(name, i, sg, len(init) + len(xs) + len(extra), "combine function")
    out = _returns(sg)
    if len(out) < len(init):
        raise _bad(name, i, f"has a combine function returning {len(out)} value(s) for a carry of {len(init)}")
    return (g, init, xs, extra), ("tensor",) * len(out)


def _map(name, raw, reader, i):
    """``map_impl(body, xs, args)``: the body takes a slice of each xs and the args; its outputs are stacked."""
    _count(name, raw, i, 3, 3)
    g, sg = reader.subgraph(raw[0])
    xs = _values(name, reader, raw[1], i, "mapped inputs")
    args = _values(name, reader, raw[2], i, "other inputs")
    _takes(name, i, sg, len(xs) + len(args), "body")
    return (g, xs, args), ("tensor",) * len(_returns(sg))


def _invoke(name, raw, reader, i):
    """``invoke_subgraph(subgraph, identifier, *operands)`` (``nested_compile_region``).

    The identifier only keys torch's caches while a graph is traced: the
    document's (a string or nil) is replaced by the subgraph's own name, so
    two different subgraphs never share one.
    """
    _count(name, raw, i, 2, 1 << 16)
    g, sg = reader.subgraph(raw[0])
    if not (raw[1] is None or isinstance(raw[1], str) and len(raw[1]) <= 256):
        raise _bad(name, i, "takes a string or nil as its identifier")
    operands = tuple(reader.value(x) for x in raw[2:])
    _takes(name, i, sg, len(operands), "subgraph")
    return (g, g.target, *operands), _returns(sg)


# ------------------------------------------------------------------ flex attention
def _block_mask(name, raw, reader, i):
    """The block mask as a tuple: 16 values, then the mask_mod subgraph."""
    items = raw.get("$t") if isinstance(raw, dict) and len(raw) == 1 else None
    if not isinstance(items, list) or len(items) != BLOCK_MASK_LEN:
        raise _bad(name, i, f"takes its block mask as a tuple of {BLOCK_MASK_LEN}")
    values = _values(name, reader, items[:-1], i, "block mask")
    mask, mg = reader.subgraph(items[-1])
    return (*values, mask), mg


def _options(name, raw, i) -> dict:
    """kernel_options: ``{"$d": [[key, value], ...]}``, identifier keys, scalar or string values."""
    pairs = raw.get("$d") if isinstance(raw, dict) and len(raw) == 1 else None
    if not isinstance(pairs, list) or len(pairs) > MAX_OPTIONS:
        raise _bad(name, i, "takes its kernel options as a map")
    out = {}
    for p in pairs:
        if not (isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and IDENT.match(p[0])
                and p[0] not in out and (p[1] is None or type(p[1]) in (bool, int, float)
                                         or isinstance(p[1], str) and len(p[1]) <= 64)):
            raise _bad(name, i, "has a malformed kernel option")
        out[p[0]] = p[1]
    return out


def _scale(name, reader, raw, i):
    v = reader.value(raw)
    if not (type(v) in (int, float) or isinstance(v, torch.fx.Node)):
        raise _bad(name, i, "takes a number as its scale")
    return v


def _flex(name, raw, reader, i):
    """``flex_attention(q, k, v, score_mod, block_mask, scale, kernel_options,
    score_mod_other_buffers=(), mask_mod_other_buffers=())``."""
    _count(name, raw, i, 7, 9)
    qkv = tuple(_node(name, reader, x, i, "query, key and value") for x in raw[:3])
    score, sg = reader.subgraph(raw[3])
    block, mg = _block_mask(name, raw[4], reader, i)
    rest = (_scale(name, reader, raw[5], i), _options(name, raw[6], i))
    buffers = tuple(_values(name, reader, x, i, "other buffers") for x in raw[7:])
    score_buffers, mask_buffers = (*buffers, (), ())[:2]
    _takes(name, i, sg, 5 + len(score_buffers), "score_mod")
    _takes(name, i, mg, 4 + len(mask_buffers), "mask_mod")
    return (*qkv, score, block, *rest, *buffers), ("tensor", "tensor", "tensor")


def _flex_backward(name, raw, reader, i):
    """``flex_attention_backward(q, k, v, out, logsumexp, grad_out, grad_logsumexp, fw_graph,
    joint_graph, block_mask, scale, kernel_options, score_mod_other_buffers=(),
    mask_mod_other_buffers=())``."""
    _count(name, raw, i, 12, 14)
    tensors = tuple(_node(name, reader, x, i, "tensor arguments", optional=n >= 5) for n, x in enumerate(raw[:7]))
    (fw, fg), (joint, jg) = reader.subgraph(raw[7]), reader.subgraph(raw[8])
    block, mg = _block_mask(name, raw[9], reader, i)
    rest = (_scale(name, reader, raw[10], i), _options(name, raw[11], i))
    buffers = tuple(_values(name, reader, x, i, "other buffers") for x in raw[12:])
    score_buffers, mask_buffers = (*buffers, (), ())[:2]
    _takes(name, i, fg, 5 + len(score_buffers), "forward score_mod")
    _takes(name, i, jg, 6 + len(score_buffers), "joint score_mod")
    _takes(name, i, mg, 4 + len(mask_buffers), "mask_mod")
    return (*tensors, fw, joint, block, *rest, *buffers), ("tensor", "tensor", "tensor", "unknown")


_CHECKS: dict[str, Callable] = {
    "hop:cond": _cond, "hop:while_loop": _while, "hop:while_loop_stack_output": _while, "hop:scan": _scan,
    "hop:map_impl": _map, "hop:invoke_subgraph": _invoke, "hop:flex_attention": _flex,
    "hop:flex_attention_backward": _flex_backward,
}
