"""A call whose outputs Python reads at once, with nothing else in flight: one exchange on the
transport and no queue record (``Stream.call``), numbered, acknowledged and named in errors like
any other request. The real ``worker.service.Service`` in this process, on an in-memory transport."""

from __future__ import annotations

import pytest
import torch

import remotorch
from remotorch import errors, models
from remotorch.client import launched as launched_module
from remotorch.client import policy as policies
from remotorch.client import stream as stream_module
from remotorch.codec import messages as m
from remotorch.transport.loopback import LoopbackTransport
from remotorch.worker.service import Service
from remotorch.worker.worker import Worker


@pytest.fixture
def service():
    return Service(Worker("cpu", name="inproc"))


@pytest.fixture
def session(service):
    s = remotorch.Session(transport=LoopbackTransport(service.handle, on_disconnect=service.disconnected))
    yield s
    s.close()


@pytest.fixture
def records(monkeypatch) -> list[str]:
    """What every ``Launched`` made from now on is for."""
    made: list[str] = []
    init = launched_module.Launched.__init__

    def counting(self, what, *args, **kwargs):
        made.append(what)
        init(self, what, *args, **kwargs)
    monkeypatch.setattr(launched_module.Launched, "__init__", counting)
    return made


def test_warm_calls_read_at_once_wait_one_exchange_each_and_make_no_queue_record(session, records, monkeypatch):
    monkeypatch.setattr(policies, "PROBE_MIN_S", 1e9)  # no probe: every warm call waits
    # each read counts as "at once" however slow this machine is just now (the rule is tested in
    # test_read_policy.py; here what counts is what a waited call costs)
    monkeypatch.setattr(stream_module, "PROMPT_S", 60.0)
    torch.manual_seed(0)
    model = models.mlp().eval()
    f = remotorch.compile(model, session=session, fallback="raise")
    x = torch.randn(4, 784)
    with torch.no_grad():
        for _ in range(4):  # the first calls go out without waiting, until their reads teach the policy
            f(x).numpy()  # (a read of the output itself: an eager call on it would run on the worker)
        stream = session.connection.link.stream
        seq, reads, queued, made = stream.seq, stream.blocking_reads, stream.requests_queued, len(records)
        for _ in range(10):
            assert torch.equal(f(x), model(x))
    assert stream.seq - seq == 10 and stream.blocking_reads - reads == 10  # one request, one wait each
    assert stream.requests_queued == queued and not stream.inflight
    assert stream.acked == stream.seq  # each reply read and acknowledged on the next request
    assert records[made:] == []


def test_a_waited_request_that_fails_raises_its_typed_error_named_and_the_session_goes_on(session, records):
    link = session.connection.link
    gid = "0123456789abcdef" * 4
    with pytest.raises(errors.MissingObjectsError, match=r"^Run failed: worker does not hold") as failed:
        link.request(m.Run(gid, "eager", []), expect=m.RunReply)
    assert failed.value.graphs == [gid]  # the worker's answer, typed, with what it lacks
    assert records == ["Run"]  # the record is made for the failure only
    with pytest.raises(errors.MissingObjectsError, match=r"^a warm call failed: "):
        link.request(m.Run(gid, "eager", []), expect=m.RunReply, what="a warm call")
    assert not link.stream.inflight and link.stream.acked == link.stream.seq
    torch.manual_seed(1)
    model = models.mlp().eval()
    x = torch.randn(2, 784)
    with torch.no_grad():
        torch.testing.assert_close(remotorch.compile(model, session=session, fallback="raise")(x), model(x),
                                   rtol=0, atol=0)
    session.synchronize()  # the failures were raised where they happened: nothing is raised again
