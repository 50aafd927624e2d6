"""Hypothesis strategies for hostile protocol messages, shared by the fuzz tests (unit and integration)."""

from __future__ import annotations

from hypothesis import strategies as st

from remotorch.codec import messages as m

msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**63, max_value=2**64 - 1) | st.floats()
    | st.text(max_size=20) | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
bodies = st.fixed_dictionaries({"type": st.sampled_from(["health", "put_graph", "put_tensors", "run", "echo",
                                                         "attach", "detach", "heartbeat", "ok", "zz"])},
                               optional={k: msgpack_values for k in ("graph_id", "doc", "consts", "ids", "metas",
                                                                    "engine", "args", "session_id", "bind",
                                                                    "bound")})
envelopes = st.tuples(st.sampled_from([m.PROTOCOL_VERSION, m.PROTOCOL_VERSION, 0, 2]), bodies)



# ------------------------------------------------------------------ graph documents with subgraphs
# What a hostile client may put where a valid document of each higher-order operator has a value:
# references to subgraphs in and out of range, references where a value belongs, values where a
# subgraph belongs, maps and tuples of them.
graph_values = st.recursive(
    msgpack_values | st.fixed_dictionaries({"$g": st.integers(min_value=-2, max_value=8) | msgpack_values})
    | st.sampled_from([{"$n": "v0"}, {"$n": "v1"}, {"$n": "v9"}, {"$op": "aten::sin.default"},
                       {"$d": [["BACKEND", "AUTO"]]}, {"$dt": "float32"}]),
    lambda inner: st.lists(inner, max_size=4) | st.builds(lambda xs: {"$t": xs}, st.lists(inner, max_size=4)),
    max_leaves=8)
_KEYS = st.sampled_from(["args", "target", "op", "kwargs", "kind", "nodes"])
_TARGETS = st.sampled_from(["hop:cond", "hop:while_loop", "hop:while_loop_stack_output", "hop:scan",
                            "hop:map_impl", "hop:invoke_subgraph", "hop:flex_attention",
                            "hop:flex_attention_backward", "hop:nope", "op:getitem", "aten::save.default"])


@st.composite
def subgraph_documents(draw) -> dict:
    """A valid document of :data:`remotorch.devtools.subgraph_docs.VALID`, changed in one to four places:
    a node's field replaced, a call's target swapped, a subgraph dropped, added or swapped."""
    from remotorch.devtools import subgraph_docs

    body = subgraph_docs.VALID[draw(st.sampled_from(sorted(subgraph_docs.VALID)))]()
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        subs = body["subgraphs"]
        graphs = [g for g in [body["nodes"]] + [s.get("nodes") for s in subs if isinstance(s, dict)]
                  if isinstance(g, list) and g and all(isinstance(x, dict) for x in g)]
        nodes = graphs[draw(st.integers(min_value=0, max_value=len(graphs) - 1))] if graphs else [{}]
        i = draw(st.integers(min_value=0, max_value=len(nodes) - 1))
        how = draw(st.integers(min_value=0, max_value=3))
        if how == 0:
            nodes[i] = dict(nodes[i], **{draw(_KEYS): draw(graph_values)})
        elif how == 1:
            nodes[i] = dict(nodes[i], target=draw(_TARGETS))
        elif how == 2 and subs:
            subs.pop(draw(st.integers(min_value=0, max_value=len(subs) - 1)))
        else:
            made = st.builds(lambda v: {"nodes": v}, graph_values)
            subs.insert(draw(st.integers(min_value=0, max_value=len(subs))),
                        draw(st.sampled_from(subs) | made if subs else made))
    return body
