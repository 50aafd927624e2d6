"""The client's policy, unit-tested without sockets: a Session over an in-memory transport to the worker's service.

Upload-if-missing, retry after the worker forgot, back-off after a failure,
fallback and statistics live in one place (``client.connection``); these
tests drive it against the real ``worker.service.Service`` in this process.
The same behaviours are tested end to end against ``remotorch serve`` elsewhere.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.nn import functional as F

import remotorch
from remotorch import errors, models
from remotorch.codec import messages as m
from remotorch.optim import RemoteOptimizer
from remotorch.transport.loopback import LoopbackTransport
from remotorch.worker.service import Service
from remotorch.worker.worker import Worker


@pytest.fixture
def service():
    return Service(Worker("cpu", name="inproc"))


@pytest.fixture
def loop(service):
    return LoopbackTransport(service.handle, on_disconnect=service.disconnected)


@pytest.fixture
def session(loop):
    s = remotorch.Session(transport=loop, retry_after=30.0)
    yield s
    s.close()


def test_weights_are_uploaded_once_and_warm_calls_send_only_inputs(session):
    torch.manual_seed(0)
    model = models.mlp().eval()
    f = remotorch.compile(model, session=session, fallback="raise")
    x = torch.randn(4, 784)
    with torch.no_grad():
        torch.testing.assert_close(f(x), model(x), rtol=0, atol=0)
        first = session.stats()
        for _ in range(3):
            f(x)
        warm = session.stats()
    assert (first["graphs_uploaded"], first["tensors_uploaded"]) == (1, 4)
    assert (warm["graphs_uploaded"], warm["tensors_uploaded"]) == (1, 4)
    assert warm["remote_calls"] == 4 and warm["fallbacks"] == 0
    per_call = (warm["bytes_sent"] - first["bytes_sent"]) / 3
    assert x.nbytes <= per_call <= x.nbytes + 1024  # inputs and a small header, no weights


def test_a_worker_that_forgot_gets_graph_and_weights_again_once(session, service, loop):
    model = models.mlp().eval()
    f = remotorch.compile(model, session=session, fallback="raise")
    x = torch.randn(2, 784)
    with torch.no_grad():
        f(x)
        lease = service.leases.key(loop.connection_id)
        service.worker.close_session(lease)  # the worker lost everything the session held
        # the next call was sent without waiting: its read raises what the worker answered...
        with pytest.raises(errors.MissingObjectsError, match="graph"):
            f(x).numpy()
        torch.testing.assert_close(f(x), model(x), rtol=0, atol=0)  # ...and the one after uploads again
    stats = session.stats()
    assert (stats["graphs_uploaded"], stats["tensors_uploaded"]) == (2, 8)


def test_a_changed_weight_is_uploaded_again(session):
    model = models.mlp().eval()
    f = remotorch.compile(model, session=session, fallback="raise")
    x = torch.randn(2, 784)
    with torch.no_grad():
        f(x)
        model[0].weight.mul_(2)  # in place: the version counter moves
        torch.testing.assert_close(f(x), model(x), rtol=0, atol=0)
    assert session.stats()["tensors_uploaded"] == 5


def test_a_down_worker_falls_back_once_and_is_not_retried_during_the_back_off(session, loop):
    f = remotorch.compile(lambda a: torch.sin(a) * 2, session=session)  # fallback="local"
    x = torch.randn(5)
    with torch.no_grad():
        f(x)
        loop.down = True
        with pytest.warns(errors.RemoteFallbackWarning, match="WorkerUnavailableError"):
            assert torch.equal(f(x), torch.sin(x) * 2)
        asked = loop.requests
        loop.down = False  # back, but the session waits out its back-off before asking again
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # one warning per graph: no second one
            assert torch.equal(f(x), torch.sin(x) * 2)
    assert loop.requests == asked
    assert session.stats()["fallbacks"] == 2


def test_raise_policy_gives_the_typed_error(session, loop):
    f = remotorch.compile(lambda a: a + 1, session=session, fallback="raise")
    loop.down = True
    with torch.no_grad(), pytest.raises(errors.WorkerUnavailableError):
        f(torch.ones(2))


def test_a_dropped_connection_resumes_the_session_without_uploads(session, loop):
    model = models.mlp().eval()
    f = remotorch.compile(model, session=session, fallback="raise")
    x = torch.randn(2, 784)
    with torch.no_grad():
        f(x)
        loop.close()  # connection lost; the worker keeps the session for its lease
        f(x)
    assert session.stats()["graphs_uploaded"] == 1 and session.stats()["tensors_uploaded"] == 4


def test_training_over_the_in_memory_transport_equals_local(session):
    torch.manual_seed(3)
    model = models.mlp()
    reference = copy.deepcopy(model)
    step = remotorch.compile(lambda x, y: F.cross_entropy(model(x), y), session=session, fallback="raise")
    opt = RemoteOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for _ in range(3):
        x, y = torch.randn(8, 784), torch.randint(0, 10, (8,))
        loss = step(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref = F.cross_entropy(reference(x), y)
        ref.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(loss, ref, atol=1e-6, rtol=1e-5)
    session.pull(model)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)


def test_health_counts_sessions_and_connections(session, service, loop):
    first = session.health()
    assert first["name"] == "inproc" and first["sessions"] == 1 and first["connections"] == 1
    other = remotorch.Session(transport=LoopbackTransport(service.handle, on_disconnect=service.disconnected))
    assert other.health()["sessions"] == 2
    other.close()
    assert session.health()["sessions"] == 1


def test_every_message_of_the_protocol_gets_an_answer_in_process(service):
    """The socket-free service answers each request type (errors included) with one reply."""
    requests = [m.Health(), m.Heartbeat(), m.Echo(), m.Flush(), m.OptimStep(7), m.PullSlots([1]),
                m.Run("0" * 64, "eager", []), m.ProfileGraph("0" * 64, "eager", [])]
    for req in requests:
        header, _ = service.handle(9, m.encode(req), [])
        assert isinstance(m.decode(header), (m.HealthReply, m.Ok, m.EchoReply, m.ErrorReply)), req
