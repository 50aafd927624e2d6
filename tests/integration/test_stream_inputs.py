"""Bad input to what protocol 6 added gets typed errors, and the worker keeps serving (rule 4).

The stream's sequence numbers and acknowledgments, runs of handles and slots,
tensors of zeros, promised strides, echoed outputs, generator states, spans of
released handles and tickets the client chooses, each abused over a real
connection to a real worker.
"""

from __future__ import annotations

import pytest
import torch

import remotorch
from remotorch.codec import messages as m
from remotorch.transport import TcpTransport

from conftest import TOKEN
from helpers import assert_still_serves

PROTOCOL = m.PROTOCOL_VERSION


@pytest.fixture
def raw(server):
    transport = TcpTransport(server.url, TOKEN, protocol=PROTOCOL, connect_timeout=5, timeout=30)
    yield transport
    transport.close()


def ask(transport, body, frames=(), **envelope):
    header, _ = transport.request(m.encode(body, **envelope), frames)
    return m.decode(header)


def uploaded_graph(session) -> str:
    """A graph of two tensor arguments (``a * b + 1``) the session ran, and its id."""
    f = remotorch.compile(lambda a, b: a * b + 1, session=session, fallback="raise")
    x, y = torch.randn(3), torch.randn(3)
    assert torch.equal(f(x, y), x * y + 1)
    return next(iter(session.connection.graphs))


def test_sequence_numbers_and_acknowledgments(raw):
    for envelope in (dict(seq=-1), dict(ack=-5), dict(seq=1 << 62, ack=-1)):
        reply = ask(raw, m.Health(), **envelope)
        assert isinstance(reply, m.ErrorReply) and reply.kind == "protocol", envelope
    assert isinstance(ask(raw, m.Health(), seq=1), m.HealthReply)
    again = ask(raw, m.Echo(), seq=1)  # sent again: answered from memory, not run (it was a Health)
    assert isinstance(again, m.HealthReply)
    assert isinstance(ask(raw, m.Echo(), seq=5, ack=1), m.EchoReply)  # a gap (refused before): runs
    forgotten = ask(raw, m.Health(), seq=1, ack=5)  # acknowledged, then sent again: refused, not run
    assert isinstance(forgotten, m.ErrorReply) and "ran already" in forgotten.message


def test_runs_of_handles_and_slots_and_zeros(session, raw):
    gid = uploaded_graph(session)
    cases = [
        [m.HandlesArg(1, 1 << 40)],  # more arguments than a Run may stand for
        [m.HandlesArg(-3, 2)],
        [m.SlotsArg(list(range(70000)))],
        [m.ZerosArg("float32", [1 << 40], [])],  # over the tensor size limit
        [m.ZerosArg("float32", [4, 4], [1, 1]), m.ZerosArg("float32", [3], [])],  # overlapping layout
        [m.ZerosArg("float32", [3], [2]), m.ZerosArg("float32", [3], [])],  # more memory than it holds
        [m.ZerosArg("no_such_dtype", [3], []), m.ZerosArg("float32", [3], [])],
    ]
    for args in cases:
        reply = ask(raw, m.Run(gid, "eager", args))
        assert isinstance(reply, m.ErrorReply) and reply.kind in ("invalid", "limit", "missing"), (args, reply)
    ok = ask(raw, m.Run(gid, "eager", [m.ZerosArg("float32", [3], []), m.ZerosArg("float32", [3], [])]))
    assert isinstance(ok, m.ErrorReply) and ok.kind == "missing"  # this connection's session lacks the graph
    assert_still_serves(session)


def test_promised_strides_echo_and_generator_state(session):
    gid = uploaded_graph(session)
    transport = session.connection.transport  # the session's own connection holds the graph
    session.synchronize()
    meta, buf = remotorch.codec.tensors.tensor_to_wire(torch.randn(3), 0)
    args = [m.TensorArg(meta), m.TensorArg(meta)]  # (the same frame twice)
    cases = [
        dict(keep=[0], strides=[[1], [1]]),  # one list per kept output
        dict(keep=[0], strides=[[5]]),  # spread over more memory than it holds
        dict(keep=[0], strides=[[1, 1]]),  # another rank
        dict(keep=[0], echo=[1]),  # echo only what is kept
        dict(rng=b"\x00" * 7),  # (not a random graph: ignored)
    ]
    for fields in cases:
        reply = m.decode(transport.request(m.encode(m.Run(gid, "eager", args, handle_base=900, **fields)),
                                           [buf])[0])
        if fields.get("rng"):
            assert isinstance(reply, m.RunReply), reply
        else:
            assert isinstance(reply, m.ErrorReply) and reply.kind == "invalid", (fields, reply)
    reply = m.decode(transport.request(m.encode(m.Run(gid, "eager", args, keep=[0], echo=[0], handle_base=950,
                                                      brief=True)), [buf])[0])
    assert isinstance(reply, m.RunReply) and reply.at == [0] and type(reply.outputs[0]) is m.EchoArg
    assert_still_serves(session)


def test_gradients_into_slots_name_outputs_from_a_first_one_and_slots_the_session_holds(session):
    gid = uploaded_graph(session)
    transport = session.connection.transport  # the session's own connection holds the graph
    session.synchronize()
    meta, buf = remotorch.codec.tensors.tensor_to_wire(torch.randn(3), 0)
    args = [m.TensorArg(meta), m.TensorArg(meta)]

    def run(**fields):
        return m.decode(transport.request(m.encode(m.Run(gid, "eager", args, **fields)), [buf])[0])

    negative = run(grads_from=-1, grad_slots=[1])
    assert isinstance(negative, m.ErrorReply) and negative.kind == "invalid", negative
    missing = run(grad_slots=[123456])  # no such slot: refused before the graph runs
    assert isinstance(missing, m.ErrorReply) and missing.kind == "missing" and missing.slots == [123456]
    none = run(grads_from=3, grad_slots=[-1, -1])  # -1: that output is not accumulated
    assert isinstance(none, m.RunReply) and len(none.outputs) == 1, none
    assert_still_serves(session)


def test_a_random_graph_refuses_a_generator_state_of_the_wrong_size(session):
    f = remotorch.compile(lambda a: torch.nn.functional.dropout(a, 0.5), session=session, fallback="raise")
    f(torch.randn(8)).tolist()
    gid = next(iter(session.connection.graphs))
    session.synchronize()
    meta, buf = remotorch.codec.tensors.tensor_to_wire(torch.randn(8), 0)
    reply = m.decode(session.connection.transport.request(
        m.encode(m.Run(gid, "eager", [m.TensorArg(meta)], rng=b"\x01" * 100)), [buf])[0])
    assert isinstance(reply, m.ErrorReply) and reply.kind == "invalid"
    assert_still_serves(session)


def test_spans_and_client_chosen_tickets(session, raw):
    for pending in (m.Pending(spans=[[1, 1 << 30]]), m.Pending(spans=[[1]]), m.Pending(spans=[[1, -2]])):
        reply = ask(raw, m.Flush(), pending=pending)
        assert isinstance(reply, m.ErrorReply) and reply.kind == "invalid", pending
    assert isinstance(ask(raw, m.Flush(), pending=m.Pending(spans=[[10, 20]])), m.Ok)  # not held: ignored
    meta = m.TensorMeta("float32", [2], [1], 0)
    for ticket_id, secret in ((b"short", b"s" * 32), (b"i" * 16, b"short"), (b"i" * 16, b"")):
        reply = ask(raw, m.ExpectHandles([5], [meta], ticket_id=ticket_id, secret=secret))
        assert isinstance(reply, m.ErrorReply) and reply.kind == "invalid", (ticket_id, secret)
    chosen = ask(raw, m.ExpectHandles([6], [meta], ticket_id=b"t" * 16, secret=b"s" * 32))
    assert isinstance(chosen, m.TicketReply) and chosen.ticket_id == b"t" * 16
    twice = ask(raw, m.ExpectHandles([7], [meta], ticket_id=b"t" * 16, secret=b"s" * 32))
    assert isinstance(twice, m.ErrorReply) and twice.kind == "invalid"
    assert_still_serves(session)
