"""Graph documents with subgraphs, valid and hostile, for hardening tests and the fuzzer (a debug helper).

:data:`VALID` holds small documents of each higher-order operator that
decode and run (``torch.cond``, ``while_loop``, ``scan``, ``map``,
``invoke_subgraph``, a cond inside a cond); :func:`hostile` names documents
that must be refused with ``UnsupportedGraphError`` before anything runs (an
unknown operator inside a subgraph, a subgraph naming itself, a reference to
a missing subgraph, nesting too deep, a tensor where a subgraph is expected,
a call whose subgraphs take the wrong number of inputs, ...);
:func:`mutated` breaks a valid one at random for the fuzzer
(``codec/subgraphs.py`` and docs/protocol.md §12.5 say what is checked).
Documents are plain dicts here; ``msgspec.msgpack.encode`` makes the bytes.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable

from ..codec.subgraphs import BLOCK_MASK_LEN, MAX_SUBGRAPH_DEPTH, MAX_SUBGRAPHS

PH = {"op": "placeholder", "kind": "tensor", "dtype": "float32", "shape": [2]}
PH_INDEX = {"op": "placeholder", "kind": "tensor", "dtype": "int64", "shape": []}


def n(i: int) -> dict:
    return {"$n": f"v{i}"}


def g(k) -> dict:
    return {"$g": k}


def call(target: str, *args, **kwargs) -> dict:
    return {"op": "call", "target": target, "args": list(args), "kwargs": kwargs}


def out(*values) -> dict:
    return {"op": "output", "args": {"$t": list(values)}}


def doc(nodes: list, subgraphs: list | None = None) -> dict:
    body = {"format": 1, "nodes": nodes}
    if subgraphs is not None:
        body["subgraphs"] = [{"nodes": s} for s in subgraphs]
    return body


def unary(target: str) -> list:
    """A subgraph of one input, one operator, one output."""
    return [PH, call(target, n(0)), out(n(1))]


def cond(true: list | None = None, false: list | None = None) -> dict:
    """``cond(x.sum() > 0, sin, cos, (x,))[0]``."""
    return doc([PH, call("aten::sum.default", n(0)), call("aten::gt.Scalar", n(1), 0),
                call("hop:cond", n(2), g(0), g(1), {"$t": [n(0)]}), call("op:getitem", n(3), 0), out(n(4))],
               [true or unary("aten::sin.default"), false or unary("aten::cos.default")])


def while_loop() -> dict:
    """``while_loop(i < 3, (i + 1, x * 2), (zeros([]), x))[1]``: three steps."""
    two = [PH_INDEX, PH]
    return doc([PH, call("aten::zeros.default", [], dtype={"$dt": "int64"}),
                call("hop:while_loop", g(0), g(1), {"$t": [n(1), n(0)]}, {"$t": []}),
                call("op:getitem", n(2), 1), out(n(3))],
               [two + [call("aten::lt.Scalar", n(0), 3), {"op": "output", "args": n(2)}],
                two + [call("aten::add.Tensor", n(0), 1), call("aten::mul.Tensor", n(1), 2), out(n(2), n(3))]])


def scan() -> dict:
    """``scan(lambda c, x: (c + x, c * x), zeros(2), xs)`` over the rows of a [3, 2] input."""
    xs = dict(PH, shape=[3, 2])
    return doc([xs, call("aten::zeros.default", [2]), call("hop:scan", g(0), [n(1)], [n(0)], []),
                call("op:getitem", n(2), 0), call("op:getitem", n(2), 1), out(n(3), n(4))],
               [[PH, PH, call("aten::add.Tensor", n(0), n(1)), call("aten::mul.Tensor", n(0), n(1)),
                 out(n(2), n(3))]])


def map_impl() -> dict:
    """``map(lambda x, w: x * w, xs, w)`` over the rows of a [3, 2] input."""
    return doc([dict(PH, shape=[3, 2]), PH, call("hop:map_impl", g(0), [n(0)], [n(1)]),
                call("op:getitem", n(2), 0), out(n(3))],
               [[PH, PH, call("aten::mul.Tensor", n(0), n(1)), out(n(2))]])


def invoke() -> dict:
    """The same subgraph invoked twice (``nested_compile_region``)."""
    return doc([PH, call("hop:invoke_subgraph", g(0), "subgraph_0", n(0)), call("op:getitem", n(1), 0),
                call("hop:invoke_subgraph", g(0), "subgraph_0", n(2)), call("op:getitem", n(3), 0), out(n(4))],
               [unary("aten::sin.default")])


def nested() -> dict:
    """A cond whose true branch holds a cond: subgraphs 0 and 1 are the inner branches."""
    inner = [PH, call("aten::sum.default", n(0)), call("aten::lt.Scalar", n(1), 1),
             call("hop:cond", n(2), g(0), g(1), {"$t": [n(0)]}), call("op:getitem", n(3), 0), out(n(4))]
    body = cond(true=inner)
    body["subgraphs"] = [{"nodes": unary("aten::neg.default")}, {"nodes": unary("aten::exp.default")},
                         {"nodes": inner}, {"nodes": unary("aten::cos.default")}]
    body["nodes"][3] = call("hop:cond", n(2), g(2), g(3), {"$t": [n(0)]})
    return body


VALID: dict[str, Callable[[], dict]] = {"cond": cond, "while_loop": while_loop, "scan": scan, "map": map_impl,
                                        "invoke_subgraph": invoke, "nested": nested}


# ------------------------------------------------------------------ hostile documents
def _chain(levels: int, calls: int = 1) -> dict:
    """Subgraph k invokes subgraph k-1 ``calls`` times; the top graph invokes the last one."""
    subs = [unary("aten::neg.default")]
    for k in range(1, levels):
        body = [PH] + [call("hop:invoke_subgraph", g(k - 1), None, n(0)) for _ in range(calls)]
        subs.append(body + [call("op:getitem", n(1), 0), out(n(calls + 1))])
    return doc([PH, call("hop:invoke_subgraph", g(levels - 1), None, n(0)), call("op:getitem", n(1), 0),
                out(n(2))], subs)


def _with(base: dict, path: tuple, value) -> dict:
    """``base`` with the value at ``path`` (keys and indices) replaced."""
    d = copy.deepcopy(base)
    target = d
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return d


def _flex(block_mask: list, options) -> dict:
    qkv = [dict(PH, shape=[1, 1, 4, 2])] * 3
    return doc(qkv + [call("hop:flex_attention", n(0), n(1), n(2), g(0), {"$t": block_mask}, 0.5, options),
                      call("op:getitem", n(3), 0), out(n(4))],
               [[dict(PH, shape=[])] * 5 + [out(n(0))], [dict(PH_INDEX, dtype="int32")] * 4 + [out(n(0))]])


def _cond_call(*args, **kwargs) -> dict:
    return _with(cond(), ("nodes", 3), call("hop:cond", *args, **kwargs))


HOSTILE: dict[str, Callable[[], dict]] = {
    "unknown-op-inside": lambda: cond(true=unary("builtins::eval.default")),
    "denied-op-inside": lambda: cond(false=[PH, call("aten::save.default", n(0), "/tmp/x"), out(n(0))]),
    "custom-op-inside": lambda: cond(true=unary("rmtest::myop.default")),
    "self-reference": lambda: _with(cond(), ("subgraphs", 0, "nodes"),
                                    cond()["nodes"][:3] + [call("hop:cond", n(2), g(0), g(0), [n(0)]),
                                                            call("op:getitem", n(3), 0), out(n(4))]),
    "forward-reference": lambda: _with(cond(), ("subgraphs", 0, "nodes"),
                                       cond()["nodes"][:3] + [call("hop:cond", n(2), g(1), g(1), [n(0)]),
                                                               call("op:getitem", n(3), 0), out(n(4))]),
    "missing-subgraph": lambda: _cond_call(n(2), g(0), g(7), {"$t": [n(0)]}),
    "negative-subgraph": lambda: _cond_call(n(2), g(-1), g(1), {"$t": [n(0)]}),
    "subgraph-index-not-int": lambda: _cond_call(n(2), g("0"), g(1), {"$t": [n(0)]}),
    "subgraph-index-bool": lambda: _cond_call(n(2), g(True), g(1), {"$t": [n(0)]}),
    "tensor-for-subgraph": lambda: _cond_call(n(2), n(0), g(1), {"$t": [n(0)]}),
    "operator-for-subgraph": lambda: _cond_call(n(2), {"$op": "aten::sin.default"}, g(1), {"$t": [n(0)]}),
    "subgraph-for-tensor": lambda: _with(cond(), ("nodes", 1), call("aten::sum.default", g(0))),
    "subgraph-as-operand": lambda: _cond_call(n(2), g(0), g(1), {"$t": [g(0)]}),
    "subgraph-as-output": lambda: _with(cond(), ("nodes", 5), out(g(0))),
    "subgraph-in-a-builtin": lambda: _with(cond(), ("nodes", 4), call("op:getitem", g(0), 0)),
    "too-deep": lambda: _chain(MAX_SUBGRAPH_DEPTH + 1),
    "expands-past-the-node-limit": lambda: _chain(4, calls=80),
    "too-many-subgraphs": lambda: _with(cond(), ("subgraphs",), [{"nodes": unary("aten::sin.default")}]
                                        * (MAX_SUBGRAPHS + 1)),
    "unreferenced-subgraph": lambda: _with(cond(), ("subgraphs",), cond()["subgraphs"]
                                           + [{"nodes": unary("aten::sin.default")}]),
    "subgraphs-not-a-list": lambda: _with(cond(), ("subgraphs",), {"0": unary("aten::sin.default")}),
    "subgraph-not-a-map": lambda: _with(cond(), ("subgraphs", 0), unary("aten::sin.default")),
    "subgraph-extra-key": lambda: _with(cond(), ("subgraphs", 0, "code"), "__import__('os')"),
    "subgraph-without-nodes": lambda: _with(cond(), ("subgraphs", 0, "nodes"), []),
    "subgraph-without-output": lambda: _with(cond(), ("subgraphs", 0, "nodes"),
                                             [PH, call("aten::sin.default", n(0))]),
    "subgraph-reaches-into-parent": lambda: _with(cond(), ("subgraphs", 0, "nodes", 1),
                                                  call("aten::sin.default", n(2))),
    "cond-operand-count": lambda: _cond_call(n(2), g(0), g(1), {"$t": [n(0), n(0)]}),
    "cond-three-arguments": lambda: _cond_call(n(2), g(0), g(1)),
    "cond-keyword": lambda: _cond_call(n(2), g(0), g(1), {"$t": [n(0)]}, evil=1),
    "cond-predicate-a-string": lambda: _cond_call("x.sum() > 0", g(0), g(1), {"$t": [n(0)]}),
    "while-body-result-count": lambda: _with(while_loop(), ("subgraphs", 1, "nodes", 4), out(n(2))),
    "scan-operands-not-a-list": lambda: _with(scan(), ("nodes", 2), call("hop:scan", g(0), n(1), [n(0)], [])),
    "map-input-count": lambda: _with(map_impl(), ("nodes", 2), call("hop:map_impl", g(0), [n(0)], [])),
    "invoke-identifier-not-a-string": lambda: _with(invoke(), ("nodes", 1),
                                                    call("hop:invoke_subgraph", g(0), 5, n(0))),
    "flex-block-mask-short": lambda: _flex([1, 1, g(1)], {"$d": []}),
    "flex-block-mask-without-mask_mod": lambda: _flex([None] * BLOCK_MASK_LEN, {"$d": []}),
    "flex-options-not-a-map": lambda: _flex([None] * (BLOCK_MASK_LEN - 1) + [g(1)], {"BACKEND": "AUTO"}),
    "flex-option-a-list": lambda: _flex([None] * (BLOCK_MASK_LEN - 1) + [g(1)], {"$d": [["BACKEND", [1]]]}),
    "dict-outside-flex": lambda: _with(cond(), ("nodes", 1), call("aten::sum.default", n(0), {"$d": []})),
}


# ------------------------------------------------------------------ the fuzzer's share
def mutated(rng: random.Random) -> dict:
    """A document with subgraphs: a hostile one, or a valid one broken in one to three random places
    (it may, rarely, still be valid: the fuzzer only uploads documents, it never runs them)."""
    if rng.random() < 0.4:
        return HOSTILE[rng.choice(list(HOSTILE))]()
    d = VALID[rng.choice(list(VALID))]()
    for _ in range(rng.randrange(1, 4)):
        graphs = [d["nodes"]] + [s["nodes"] for s in d.get("subgraphs", [])]
        nodes = rng.choice(graphs)
        i = rng.randrange(len(nodes))
        nodes[i] = _break(rng, nodes[i], len(graphs))
    return d


_VALUES = [None, 0, -1, 7, 2**63 - 1, "v0", [], {}, {"$g": 0}, {"$g": 99}, {"$g": -1}, {"$g": "0"},
           {"$n": "v0"}, {"$n": "v99"}, {"$op": "aten::sin.default"}, {"$d": [["BACKEND", "AUTO"]]},
           {"$t": [{"$g": 0}]}, {"$dt": "float32"}]


def _break(rng: random.Random, node: dict, n_graphs: int) -> dict:
    node = dict(node)
    how = rng.randrange(5)
    if how == 0:
        node["target"] = rng.choice(["hop:cond", "hop:while_loop", "hop:scan", "hop:map_impl",
                                     "hop:invoke_subgraph", "hop:flex_attention", "hop:nope",
                                     "aten::save.default", "builtins::eval.default", "op:getitem"])
    elif how == 1 and isinstance(node.get("args"), list) and node["args"]:
        args = list(node["args"])
        args[rng.randrange(len(args))] = rng.choice(_VALUES + [{"$g": rng.randrange(-1, n_graphs + 1)}])
        node["args"] = args
    elif how == 2:
        node["args"] = rng.choice(_VALUES)
    elif how == 3:
        node["op"] = rng.choice(["call", "output", "placeholder", "subgraph", "get_attr"])
    else:
        node["kwargs"] = rng.choice([{"x": {"$g": 0}}, {"mutated_arg_indices": "0"}, {"a b": 1}, []])
    return node
