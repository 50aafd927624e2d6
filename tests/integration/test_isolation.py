"""One session can never read, run on, overwrite or free another's graphs and tensors.

Objects are shared by content id between sessions, but a session sees an id
only after uploading its bytes itself: the answers a session gets about ids it
did not upload are the same whether or not anyone else holds them.
"""

from __future__ import annotations

import secrets

import pytest
import torch

import remotorch
from remotorch import errors
from remotorch.codec import messages as m
from remotorch.codec.tensors import content_id, tensor_to_wire
from remotorch.transport import TcpTransport

from conftest import TOKEN


def model_and_owner(make_session, seed: int):
    owner = make_session()
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.ReLU(), torch.nn.Linear(30, 5)).eval()
    compiled = remotorch.compile(model, session=owner, fallback="raise")
    x = torch.randn(3, 20)
    with torch.no_grad():
        assert torch.equal(compiled(x), model(x))
    return owner, model, compiled, x


def run_request(gid: str, tensor_ids: list[str], x: torch.Tensor) -> tuple[m.Run, list]:
    meta, buf = tensor_to_wire(x, 0)
    return m.Run(gid, "eager", [m.TensorArg(meta)] + [m.RefArg(t) for t in tensor_ids]), [buf]


def ask(session: remotorch.Session, body, frames=()) -> m.ErrorReply | object:
    """The worker's raw answer (errors as ErrorReply, not raised)."""
    header, _ = session.connection.transport.request(m.encode(body), frames)
    return m.decode(header)


def test_another_session_cannot_run_the_graph_even_with_the_weights(make_session):
    owner, model, _, x = model_and_owner(make_session, 1)
    (gid,) = owner.connection.graphs
    tids = sorted(owner.connection.tensors)
    other = make_session()
    with pytest.raises(errors.MissingObjectsError) as info:
        other.connection.request(*run_request(gid, tids, x))
    assert info.value.graphs == [gid] and sorted(info.value.tensors) == tids
    # uploading the weights' bytes gives it the weights, not the graph it never sent
    for p in model.parameters():
        meta, buf = tensor_to_wire(p.detach(), 0)
        other.connection.request(m.PutTensors([content_id(meta, buf)], [meta]), [buf])
    with pytest.raises(errors.MissingObjectsError) as info:
        other.connection.request(*run_request(gid, tids, x))
    assert info.value.graphs == [gid] and info.value.tensors == []


def test_answers_about_ids_held_by_others_equal_answers_about_ids_nobody_holds(make_session):
    owner, _, _, x = model_and_owner(make_session, 2)
    (gid,) = owner.connection.graphs
    tids = sorted(owner.connection.tensors)
    fake_gid, fake_tids = secrets.token_hex(32), [secrets.token_hex(32) for _ in tids]
    other = make_session()
    real = ask(other, *run_request(gid, tids, x))
    fake = ask(other, *run_request(fake_gid, fake_tids, x))
    assert isinstance(real, m.ErrorReply) and isinstance(fake, m.ErrorReply)
    assert (real.kind, real.message, real.traceback) == (fake.kind, fake.message, fake.traceback)
    assert (real.graphs, real.tensors) == ([gid], tids) and (fake.graphs, fake.tensors) == ([fake_gid], fake_tids)
    health = other.health()
    assert not any(gid in str(v) or any(t in str(v) for t in tids) for v in health.values())


def test_another_session_cannot_put_other_bytes_under_an_owners_id(make_session):
    owner, model, compiled, x = model_and_owner(make_session, 3)
    (gid,) = owner.connection.graphs
    tids = sorted(owner.connection.tensors)
    other = make_session()
    for tid in tids:
        meta, buf = tensor_to_wire(torch.zeros(30, 20), 0)
        with pytest.raises(errors.InvalidRequestError, match="does not match"):
            other.connection.request(m.PutTensors([tid], [meta]), [buf])
    doc = m.encode(m.Health())  # any bytes that are not the owner's document
    with pytest.raises(errors.InvalidRequestError, match="does not match"):
        other.connection.request(m.PutGraph(gid, doc, []))
    with torch.no_grad():
        assert torch.equal(compiled(x), model(x))  # the owner's objects are untouched


def test_closing_a_session_never_frees_what_another_holds(make_session):
    owner, model, compiled, x = model_and_owner(make_session, 4)
    twin = make_session()
    torch._dynamo.reset()
    twin_compiled = remotorch.compile(model, session=twin, fallback="raise")
    with torch.no_grad():
        assert torch.equal(twin_compiled(x), model(x))  # the same content, uploaded by twin too
        twin.close()  # Detach: twin's hold ends at once
        before = owner.stats()
        for _ in range(3):
            assert torch.equal(compiled(x), model(x))
    after = owner.stats()
    assert after["tensors_uploaded"] == before["tensors_uploaded"]  # nothing had to go up again
    assert after["graphs_uploaded"] == before["graphs_uploaded"]


def test_a_session_id_names_only_its_own_session(server, make_session):
    owner, _, _, x = model_and_owner(make_session, 5)
    (gid,) = owner.connection.graphs
    transport = TcpTransport(server.url, TOKEN, protocol=m.PROTOCOL_VERSION)
    try:
        def raw(body, frames=()):
            header, _ = transport.request(m.encode(body), frames)
            return m.decode(header)

        for bad in ("", "short", "x" * 129, "../../etc/passwd-0123456789", "ids with spaces 0123456"):
            reply = raw(m.Attach(bad))
            assert isinstance(reply, m.ErrorReply) and reply.kind == "invalid", bad
        reply = raw(m.Attach(secrets.token_urlsafe(24)))  # a fresh id: a new, empty session
        assert isinstance(reply, m.AttachReply) and not reply.resumed
        reply = raw(*run_request(gid, sorted(owner.connection.tensors), x))
        assert isinstance(reply, m.ErrorReply) and reply.kind == "missing"
        reply = raw(m.Attach(owner.connection.session_id + "x"))  # no switching sessions on one connection
        assert isinstance(reply, m.ErrorReply) and reply.kind == "invalid"
    finally:
        transport.close()
    assert owner.health()["name"] == "test"


@pytest.mark.parametrize("token", [None, "", "wrong-token-0123456789"])
def test_a_wrong_or_missing_token_changes_nothing_on_the_worker(server, make_session, token):
    observer = make_session()
    before = observer.health()
    intruder = remotorch.Session(server.url, token=token, retry_after=0)
    try:
        meta, buf = tensor_to_wire(torch.randn(1000), 0)
        with pytest.raises(errors.AuthenticationError):
            intruder.connection.request(m.PutTensors([content_id(meta, buf)], [meta]), [buf])
    finally:
        intruder.close()
    after = observer.health()
    assert (after["sessions"], after["resident_bytes"]) == (before["sessions"], before["resident_bytes"])


def test_training_slots_optimizers_and_handles_are_per_session(make_session):
    """Slot and optimizer ids are small integers a client picks: another session using the same
    numbers reaches nothing of the owner's, and cannot free it."""
    owner, other = make_session(), make_session()
    value = torch.arange(6, dtype=torch.float32)
    meta, buf = tensor_to_wire(value, 0)
    owner.connection.request(m.BindSlots([9001], [m.TensorArg(meta)]), [buf])
    owner.connection.request(m.OptimCreate(9006, "SGD", [[9001]], [{"lr": 0.1}]))
    with pytest.raises(errors.MissingObjectsError):
        other.connection.request(m.PullSlots([9001]))
    with pytest.raises(errors.MissingObjectsError):
        other.connection.request(m.OptimStep(9006))
    with pytest.raises(errors.MissingObjectsError):
        other.connection.request(m.OptimCreate(9007, "SGD", [[9001]], [{"lr": 0.1}]))
    other.connection.request(m.Flush(), pending=m.Pending(handles=[0, 1, 2], slots=[9001], optims=[9006]))  # ignored: not its ids
    reply, frames = owner.connection.request(m.PullSlots([9001]))
    assert torch.equal(remotorch.codec.tensors.tensor_from_wire(reply.values[0], frames[0]), value)
    owner.connection.request(m.OptimStep(9006))  # the owner's optimizer is still there


def test_tenants_cannot_reach_each_others_values_graphs_or_sessions(start_server, tmp_path):
    """Two tenants of one worker (``--tokens``): bob, knowing alice's ids, reaches nothing of hers."""
    from test_tenants import ALICE, BOB, mlp, table

    path = tmp_path / "tokens.toml"
    path.write_text(table("alice", ALICE) + table("bob", BOB))
    srv = start_server(token=None, name="shared", extra_args=("--tokens", str(path)))
    model, x = mlp(1), torch.randn(3, 16)
    with remotorch.Session(srv.url, token=ALICE) as alice, remotorch.Session(srv.url, token=BOB) as bob:
        compiled = remotorch.compile(model, session=alice, fallback="raise")
        with torch.no_grad():
            kept = compiled(x) * 1  # (a value computed on the worker)
            assert torch.equal(compiled(x), model(x))
        (gid,) = alice.connection.graphs
        tids = sorted(alice.connection.tensors)
        meta, buf = tensor_to_wire(x, 0)
        run = m.Run(gid, "eager", [m.TensorArg(meta)] + [m.RefArg(t) for t in tids])
        with pytest.raises(errors.MissingObjectsError) as info:  # alice's graph and weights, by id
            bob.connection.request(run, [buf])
        assert info.value.graphs == [gid] and sorted(info.value.tensors) == tids
        for handle in range(1, 64):  # alice's kept values, by handle
            with pytest.raises(errors.MissingObjectsError):
                bob.connection.request(m.Fetch([m.HandleArg(handle)]))
        bob.connection.request(m.Flush(), pending=m.Pending(handles=list(range(64)), tensors=tids))  # not its ids
        # alice's session id (a secret of hers, learned somehow) attaches no connection of bob's
        reply, _ = bob.connection.transport.request(m.encode(m.Attach(alice.connection.session_id)))
        refused = m.decode(reply)
        assert isinstance(refused, m.ErrorReply) and refused.kind == errors.InvalidRequestError.kind
        assert "no such session for this token" in refused.message
        # the bytes of alice's weights give bob the weights, not alice's graph
        for p in model.parameters():
            pmeta, pbuf = tensor_to_wire(p.detach(), 0)
            bob.connection.request(m.PutTensors([content_id(pmeta, pbuf)], [pmeta]), [pbuf])
        with pytest.raises(errors.MissingObjectsError) as info:
            bob.connection.request(run, [buf])
        assert info.value.graphs == [gid] and info.value.tensors == []
        with torch.no_grad():  # alice is untouched
            assert torch.equal(compiled(x), model(x))
            torch.testing.assert_close(kept, model(x))
