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

