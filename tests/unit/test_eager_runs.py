"""Eager calls queued together (``Runs``, protocol.md §18.4), unit-tested without sockets.

The worker's service runs a ``Runs`` message's runs in order, each after its
own housekeeping, answers one that fails with its error and runs the rest;
the client sends the eager calls it queues back to back as one such message
and hands each its own reply or failure. Against the real
``worker.service.Service`` in this process (the same end to end against
``remotorch serve``: ``tests/integration/test_eager_ops.py``).
"""

from __future__ import annotations

import pytest
import torch

import remotorch
from remotorch import errors
from remotorch.client import coalesce
from remotorch.codec import messages as m
from remotorch.codec.frames import FrameReader, FrameWriter
from remotorch.codec.graph import encode_graph
from torch.fx.experimental.proxy_tensor import make_fx

from remotorch.transport.loopback import LoopbackTransport
from remotorch.worker.service import Service
from remotorch.worker.worker import Worker


@pytest.fixture
def service():
    return Service(Worker("cpu", name="inproc"))


def _ask(service, body, frames=(), pending=None, seq=0):
    header, out = service.handle(1, m.encode(body, pending, seq=seq), list(frames))
    return m.decode(header), out


def _double(service) -> str:
    gm = make_fx(lambda x: x * 2)(torch.ones(4))
    payload = encode_graph(gm)
    reply, _ = _ask(service, m.PutGraph(payload.graph_id, payload.doc, payload.consts), payload.const_frames)
    assert type(reply) is m.Ok
    return payload.graph_id


def test_runs_run_in_order_each_after_its_housekeeping_and_a_failure_stops_none(service):
    gid = _double(service)
    x = torch.arange(4.0)
    warm = FrameWriter()
    _ask(service, m.Run(gid, args=[warm.value(x)]), warm.frames)  # compiled for its engine before
    first, last = FrameWriter(), FrameWriter()  # (each run numbers its own frames from 0)
    runs = [m.Run(gid, args=[first.value(x)], keep=[0], handle_base=10, brief=True),  # kept as handle 10
            m.Run(gid, args=[m.HandleArg(10)], keep=[0], handle_base=11, brief=True),  # 10 dropped first: fails
            m.Run(gid, args=[m.HandleArg(99)], brief=True),  # a handle it never had: fails
            m.Run(gid, args=[last.value(x)], brief=True)]  # sent back
    reply, frames = _ask(service, m.Runs(runs, [1, 0, 0, 1], [None, m.Pending(handles=[10]), None, None]),
                         first.frames + last.frames, seq=1)
    assert type(reply) is m.RunsReply and len(reply.run_ms) == 4
    assert 0 not in reply.said  # an empty brief reply goes unsaid
    assert reply.said[1].kind == "missing" and reply.said[1].handles == [10]
    assert reply.said[2].kind == "missing"
    back = reply.said[3]
    assert torch.equal(FrameReader(frames).tensor(back.outputs[0].meta), x * 2)


def test_a_runs_message_that_does_not_give_each_run_its_frames_is_refused(service):
    gid = _double(service)
    w = FrameWriter()
    runs = [m.Run(gid, args=[w.value(torch.ones(2))], brief=True)]
    reply, _ = _ask(service, m.Runs(runs, [2]), w.frames, seq=1)
    assert type(reply) is m.ErrorReply and reply.kind == "invalid"


def test_eager_calls_queued_back_to_back_leave_as_one_message(service):
    loop = LoopbackTransport(service.handle, on_disconnect=service.disconnected)
    with remotorch.Session(transport=loop, keep_min_bytes=0) as s:
        keep = remotorch.compile(lambda a: a.clone(), session=s, fallback="raise")
        x = torch.randn(64)
        with torch.no_grad():
            y = keep(x)
        ((y * 2 + 1).relu() - 3).sum()  # once: every call's graph made and uploaded
        s.synchronize()
        before = s.stats()
        got = ((y * 2 + 1).relu() - 3).sum()
        assert s.stats()["messages_sent"] == before["messages_sent"]  # queued here, nothing sent yet
        assert got.item() == ((x * 2 + 1).relu() - 3).sum().item()
        after = s.stats()
    assert after["eager_ops"] - before["eager_ops"] == 5
    assert after["messages_sent"] - before["messages_sent"] == 2  # the five calls in one message, and the read


def test_a_full_batch_leaves_at_once(service, monkeypatch):
    monkeypatch.setattr(coalesce, "BATCH_RUNS", 3)
    loop = LoopbackTransport(service.handle, on_disconnect=service.disconnected)
    with remotorch.Session(transport=loop, keep_min_bytes=0) as s:
        keep = remotorch.compile(lambda a: a.clone(), session=s, fallback="raise")
        with torch.no_grad():
            y = keep(torch.randn(8))
        y = y * 2
        s.synchronize()
        before = s.stats()["messages_sent"]
        for _ in range(7):
            y = y * 2
        assert s.stats()["messages_sent"] - before == 2  # two full batches of three; the seventh waits
        with pytest.raises(errors.RemoteError):  # (a failure among them is still raised at its read)
            torch.linalg.cholesky(-torch.eye(3) + y[:3].sum() * 0).tolist()
