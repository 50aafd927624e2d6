"""Argument bindings (``Run.bind`` / ``Run.bound``, protocol.md §8.1), without sockets.

A session names a graph's weights once; warm calls send only the other
arguments. These tests drive the real ``worker.service.Service`` in this
process through a Session on an in-memory transport, read the requests the
session sends, and send hand-made ones for the worker's refusals. End to end
against ``remotorch serve`` with a Hugging Face model: ``tests/integration/test_bindings.py``.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import remotorch
from remotorch import errors, models
from remotorch.codec import messages as m
from remotorch.transport.loopback import LoopbackTransport
from remotorch.worker.service import Service
from remotorch.worker.worker import Worker


@pytest.fixture
def service():
    return Service(Worker("cpu", name="inproc"))


@pytest.fixture
def session(service):
    loop = LoopbackTransport(service.handle, on_disconnect=service.disconnected)
    s = remotorch.Session(transport=loop, retry_after=30.0)
    s.loop = loop
    yield s
    s.close()


def runs(session) -> list[m.Run]:
    """Every ``Run`` the session sends from now on, in order."""
    stream, sent = session.connection.link.stream, []
    encode = stream._encode  # every request's header is made by it, waited for or not

    def recording(body, *args):
        if type(body) is m.Run:
            sent.append(body)
        return encode(body, *args)
    stream._encode = recording
    return sent


def mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return models.mlp().eval()


def test_warm_calls_name_the_weights_by_binding_and_send_only_the_input(session):
    model = mlp(0)
    f = remotorch.compile(model, session=session, fallback="raise")
    sent = runs(session)
    x = torch.randn(4, 784)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(f(x), model(x), rtol=0, atol=0)
    first, *warm = sent
    assert first.bind >= 1 and first.bound == 0
    refs = [a for a in first.args if type(a) is m.RefArg]
    assert len(refs) == 4 and len(first.args) == 5  # two weights, two biases, the input
    for run in warm:
        assert (run.bind, run.bound) == (0, first.bind)
        assert len(run.args) == 1 and type(run.args[0]) is m.TensorArg
    assert len(m.encode(warm[0])) <= len(m.encode(first)) - 4 * 64  # each RefArg names a 64-digit id


def test_a_weight_changed_in_place_is_bound_again(session):
    model = mlp(1)
    f = remotorch.compile(model, session=session, fallback="raise")
    sent = runs(session)
    x = torch.randn(3, 784)
    with torch.no_grad():
        f(x), f(x)
        model[0].weight.mul_(2)  # in place: the version counter moves
        torch.testing.assert_close(f(x), model(x), rtol=0, atol=0)
        torch.testing.assert_close(f(x), model(x), rtol=0, atol=0)
    first, warm, changed, after = sent
    assert changed.bind == first.bind and changed.bound == 0 and len(changed.args) == 5
    assert [a for a in changed.args if type(a) is m.RefArg] != [a for a in first.args if type(a) is m.RefArg]
    assert after.bound == first.bind and len(after.args) == 1
    assert session.stats()["tensors_uploaded"] == 5


def test_two_models_of_one_graph_taking_turns_each_get_their_own_weights(session):
    a, b = mlp(2), mlp(3)
    fa = remotorch.compile(a, session=session, fallback="raise")
    fb = remotorch.compile(b, session=session, fallback="raise")
    sent = runs(session)
    x = torch.randn(2, 784)
    with torch.no_grad():
        for f, model in [(fa, a), (fb, b), (fa, a), (fa, a), (fb, b), (fb, b), (fa, a)]:
            assert torch.equal(f(x), model(x))  # (a read of the output: an eager call on it would run remotely)
    assert len({r.graph_id[:16] for r in sent}) == 1  # one graph (warm calls name it by its short id), two sets of weights
    # a turn of the other model binds its weights again; a call repeating the last model's uses the binding
    assert [bool(r.bound) for r in sent] == [False, False, False, True, False, True, False]


def test_a_binding_the_worker_lost_is_made_again_from_the_arguments(session, service):
    model = mlp(4)
    f = remotorch.compile(model, session=session, fallback="raise")
    x = torch.randn(2, 784)
    with torch.no_grad():
        f(x), f(x)
        sent = runs(session)
        lease = service.leases.key(session.loop.connection_id)
        service.worker._bindings.pop(lease)  # the worker no longer holds the session's bindings
        # a warm call is sent without waiting: its read raises what the worker answered, naming the call
        with pytest.raises(errors.MissingObjectsError, match=r"graph [0-9a-f]{12} \(issued at .*test_bindings"):
            f(x).sum().item()
        torch.testing.assert_close(f(x), model(x), rtol=0, atol=0)  # the next call names the weights again
        torch.testing.assert_close(f(x), model(x), rtol=0, atol=0)
    refused, again, warm = sent
    assert refused.bound and again.bind == refused.bound and len(again.args) == 5
    assert warm.bound == refused.bound and len(warm.args) == 1
    assert session.stats()["tensors_uploaded"] == 4  # nothing went up twice


def test_the_worker_refuses_bad_bindings_with_typed_errors_and_keeps_serving(session, service):
    model, other = mlp(5), torch.nn.Sequential(torch.nn.Linear(784, 8)).eval()
    f = remotorch.compile(model, session=session, fallback="raise")
    g = remotorch.compile(other, session=session, fallback="raise")
    sent = runs(session)
    x = torch.randn(2, 784)
    with torch.no_grad():
        f(x), f(x), g(x), g(x)
    bind_f, bound_f, bind_g, bound_g = sent
    link = session.connection.link

    def run(base: m.Run, args=None, **fields) -> None:
        body = m.Run(base.graph_id, base.engine, base.args if args is None else args, **fields)
        link.request(body, [memoryview(x.numpy()).cast("B")], expect=m.RunReply)

    with pytest.raises(errors.MissingObjectsError) as missing:
        run(bound_f, bound=999)
    assert missing.value.bindings == [999] and missing.value.recoverable
    with pytest.raises(errors.InvalidRequestError, match="another graph"):
        run(bound_f, bound=bind_g.bind)  # g's binding for f's graph
    with pytest.raises(errors.InvalidRequestError, match="takes 1 arguments, not 2"):
        run(bound_f, args=[*bound_f.args, m.ScalarArg(1)], bound=bind_f.bind)
    with pytest.raises(errors.InvalidRequestError, match="not both"):
        run(bound_f, bind=7, bound=bind_f.bind)
    for bad in (m.MAX_BINDINGS + 1, -1):
        with pytest.raises(errors.InvalidRequestError, match="binding id"):
            run(bind_f, bind=bad)
    with torch.no_grad():  # the same worker and session go on, bindings intact
        torch.testing.assert_close(f(x), model(x), rtol=0, atol=0)
        torch.testing.assert_close(g(x), other(x), rtol=0, atol=0)
    assert sent[-2].bound == bind_f.bind and sent[-1].bound == bind_g.bind


def test_a_released_weight_ends_its_binding_and_is_freed(session, service):
    model = mlp(6)
    f = remotorch.compile(model, session=session, fallback="raise")
    sent = runs(session)
    x = torch.randn(2, 784)
    with torch.no_grad():
        f(x), f(x)
    bind, bound = sent
    lease = service.leases.key(session.loop.connection_id)
    tid = next(a.id for a in bind.args if type(a) is m.RefArg)
    held = weakref.ref(service.worker.resident_tensor(lease, tid))
    link = session.connection.link
    link.request(m.Flush(), pending=m.Pending(tensors=[tid]), expect=m.Ok)  # the session lets it go
    gc.collect()
    assert held() is None  # the binding did not keep it alive
    with pytest.raises(errors.MissingObjectsError) as missing:
        link.request(m.Run(bound.graph_id, bound.engine, bound.args, bound=bound.bound),
                     [memoryview(x.numpy()).cast("B")], expect=m.RunReply)
    assert missing.value.bindings == [bind.bind]


def test_a_binding_ends_with_its_session(session, service):
    f = remotorch.compile(mlp(7), session=session, fallback="raise")
    with torch.no_grad():
        f(torch.randn(2, 784))
    lease = service.leases.key(session.loop.connection_id)
    assert service.worker._bindings[lease]
    service.worker.close_session(lease)
    assert lease not in service.worker._bindings
