"""Hostile input: the live worker loop against malformed messages.

(In process, the decoders get the same treatment: ``tests/unit/test_fuzz_decoders.py``.)
Against a real worker, 10,000 seeded malformed requests
(``remotorch.fuzz``, graph documents with subgraphs of higher-order operators
among them) go over authenticated connections and 1,000 framing breakers
over fresh ones, plus hypothesis-built envelopes and every hostile subgraph
document of ``remotorch.devtools.subgraph_docs``: each must be
answered with a typed error (or, for broken framing, a closed connection), no
request may hit the worker's catch-all for its own bugs, and afterwards the
worker must still serve correct results.
"""

from __future__ import annotations

import random
import socket
from collections import Counter

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import remotorch
from remotorch import errors
from remotorch.codec import messages as m
from remotorch.codec.graph import graph_id
from remotorch.devtools import fuzz, subgraph_docs
from remotorch.transport import framing, handshake

from conftest import TOKEN
from fuzz_strategies import envelopes, subgraph_documents
from helpers import Probe, assert_still_serves, tiny_mlp

LIVE_MESSAGES = 10_000
LIVE_FRAMING = 1_000
KINDS = {cls.kind for cls in (errors.ProtocolError, errors.InvalidRequestError, errors.UnsupportedGraphError,
                              errors.MissingObjectsError, errors.LimitExceededError, errors.QuotaExceededError,
                              errors.WorkerError, errors.RemoteOutOfMemoryError, errors.PathRefusedError,
                              errors.CheckpointError)}


# ------------------------------------------------------------------ live worker
@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    """Weight roots for the fuzzed worker: hostile loads and saves reach its name, file and header checks."""
    from safetensors.torch import save_file

    base = tmp_path_factory.mktemp("fuzz-roots")
    weights, checkpoints, outside = base / "w", base / "ck", base / "outside"
    for folder in (weights, checkpoints, outside):
        folder.mkdir()
    save_file({"w": torch.ones(2)}, str(weights / "tiny.safetensors"))
    (weights / "tiny").mkdir()
    save_file({"w": torch.ones(2)}, str(weights / "tiny" / "model.safetensors"))
    save_file({"w": torch.ones(2)}, str(outside / "secret.safetensors"))
    (weights / "escape").symlink_to(outside)
    return weights, checkpoints, outside


@pytest.fixture(scope="module")
def target(start_module_server, roots):
    weights, checkpoints, _ = roots
    return start_module_server(name="fuzzed", extra_args=("--weights", f"w={weights}",
                                                          "--checkpoints", f"ck={checkpoints}"))


class Conn:
    """A raw authenticated connection speaking framed messages."""

    def __init__(self, srv) -> None:
        self.sock = socket.create_connection((srv.host, srv.port), timeout=30)
        key = handshake.client_handshake(self.sock, TOKEN.encode(), m.PROTOCOL_VERSION)
        self.channel = framing.FramedChannel(self.sock, key, role="client", max_frame=1 << 30, max_header=1 << 30)

    def ask(self, header: bytes, frames=()):
        self.channel.send(header, list(frames))
        reply, _, _ = self.channel.recv()
        return m.decode(reply)

    def close(self) -> None:
        self.sock.close()


def check_reply(reply, tally: Counter) -> None:
    if isinstance(reply, m.ErrorReply):
        assert reply.kind in KINDS, reply
        bug = reply.kind == "worker" and not reply.message.startswith("graph failed")
        assert not bug, f"a malformed request hit the worker's catch-all: {reply.message}\n{reply.traceback}"
        tally[reply.kind] += 1
    else:
        tally[type(reply).__name__] += 1  # valid by chance (e.g. a health with extra keys)


def assert_still_correct(srv) -> None:
    assert srv.alive(), srv.stderr_text()[-3000:]
    with remotorch.Session(srv.url, token=TOKEN) as s:
        probe = Probe(s, tiny_mlp(10, 20, 2), lambda: torch.randn(4, 10))
        probe()
        probe()
        assert_still_serves(s, name="fuzzed", probe=probe, server=srv)  # the third call
    assert "unexpected error" not in srv.stderr_text()


def test_live_worker_answers_every_malformed_request(target, roots):
    tally: Counter = Counter()
    conn = Conn(target)
    try:
        for i, (header, frames) in enumerate(fuzz.stream(seed=20251121, n=LIVE_MESSAGES)):
            reply = conn.ask(header, frames)
            check_reply(reply, tally)
            if isinstance(reply, m.AttachReply) or i % 500 == 499:
                conn.close()  # start over unattached now and then, as a fresh client would
                conn = Conn(target)
    finally:
        conn.close()
    errors_seen = sum(tally[k] for k in KINDS)
    assert errors_seen > LIVE_MESSAGES * 0.8, tally
    assert len([k for k in KINDS if tally[k]]) >= 4, tally  # the requests reach several checks
    assert tally["refused"] and tally["checkpoint"], tally  # hostile loads and saves reach the weight checks
    assert_still_correct(target)
    assert_nothing_escaped(roots)


def assert_nothing_escaped(roots) -> None:
    """Saves wrote only under the checkpoints root; nothing outside it changed."""
    weights, checkpoints, outside = roots
    assert sorted(p.name for p in outside.iterdir()) == ["secret.safetensors"]
    assert sorted(p.name for p in weights.iterdir()) == ["escape", "tiny", "tiny.safetensors"]
    written = [p for p in checkpoints.rglob("*") if p.is_file()]
    assert all(p.suffix in (".safetensors", ".json") and not p.name.endswith(".tmp") for p in written), written


def test_live_worker_survives_broken_framing(target):
    rng = random.Random(7)
    answered = closed = 0
    for _ in range(LIVE_FRAMING):
        conn = Conn(target)
        try:
            conn.sock.sendall(fuzz.framing_garbage(rng, 0))
            conn.sock.shutdown(socket.SHUT_WR)
            try:
                header, _, _ = conn.channel.recv()
                reply = m.decode(header)
                assert isinstance(reply, m.ErrorReply) and reply.kind == "protocol", reply
                answered += 1
            except (ConnectionError, OSError, framing.FramingError):
                closed += 1
        finally:
            conn.close()
    assert answered + closed == LIVE_FRAMING and answered and closed
    assert_still_correct(target)


@pytest.fixture(scope="module")
def shared_conn(target):
    conn = Conn(target)
    yield conn
    conn.close()


@settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck))
@given(env=envelopes, frames=st.lists(st.binary(max_size=64), max_size=3))
def test_live_worker_answers_hypothesis_envelopes(target, shared_conn, env, frames):
    check_reply(shared_conn.ask(msgspec.msgpack.encode(list(env)), frames), Counter())


def test_live_worker_correct_after_hypothesis(target):
    assert_still_correct(target)


# ------------------------------------------------------------------ subgraphs of higher-order operators
def put_graph(conn: Conn, body: dict):
    doc = msgspec.msgpack.encode(body)
    return conn.ask(m.encode(m.PutGraph(graph_id(doc, [], []), doc, [])))


def test_live_worker_refuses_every_hostile_subgraph_document(target, shared_conn):
    """An unknown operator inside a subgraph, a subgraph naming itself, a missing one, nesting too
    deep, a tensor where a subgraph belongs, ...: refused as a hostile graph is, before anything runs."""
    for name, make in subgraph_docs.HOSTILE.items():
        reply = put_graph(shared_conn, make())
        assert isinstance(reply, m.ErrorReply) and reply.kind == "unsupported", (name, reply)
    for name, make in subgraph_docs.VALID.items():  # the same connection still stores valid ones
        assert isinstance(put_graph(shared_conn, make()), m.Ok), name
    assert_still_correct(target)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=subgraph_documents())
def test_live_worker_answers_hypothesis_subgraph_documents(target, shared_conn, body):
    reply = put_graph(shared_conn, body)
    assert isinstance(reply, m.Ok) or (isinstance(reply, m.ErrorReply) and reply.kind == "unsupported"), reply


def test_live_worker_correct_after_subgraph_documents(target):
    assert_still_correct(target)
