"""Whole models run on the real worker server over loopback, compared with local eager.

The worker runs the same CPU kernels through the eager engine, so results
must be bitwise equal (``torch.equal``); only the inductor engine is compared
with a tolerance.
"""

from __future__ import annotations

import pytest
import torch

import remotorch
from remotorch import models
from remotorch.codec import messages as m
from remotorch.codec.tensors import tensor_to_wire

from conftest import wait_until
from helpers import Probe

SLACK = 1024  # bytes of headers allowed on top of the tensor bytes of a warm call


def compile_remote(fn, session, **kwargs):
    """remotorch.compile that raises instead of silently running locally."""
    return remotorch.compile(fn, session=session, fallback="raise", **kwargs)


def test_health_names_the_fixture_server(session):
    info = session.health()
    assert info["name"] == "test"
    assert info["device"] == "cpu"
    assert "eager" in info["engines"]
    assert info["protocol"] == m.PROTOCOL_VERSION


def test_mlp_uploads_once_and_warm_calls_carry_only_inputs_and_outputs(session):
    torch.manual_seed(0)
    probe = Probe(session, models.mlp(), torch.randn(32, 784))
    probe()
    first = session.stats()
    assert first["graphs_uploaded"] == 1
    assert first["tensors_uploaded"] == 4  # two weights, two biases
    assert first["remote_calls"] == 1
    assert first["fallbacks"] == 0

    for _ in range(3):
        x = torch.randn(32, 784)
        before = session.stats()
        out = probe(x)
        after = session.stats()
        assert after["graphs_uploaded"] == 1
        assert after["tensors_uploaded"] == 4
        assert after["remote_calls"] == before["remote_calls"] + 1
        assert after["bytes_sent"] - before["bytes_sent"] <= x.nbytes + SLACK
        assert after["bytes_received"] - before["bytes_received"] <= out.nbytes + SLACK
    assert session.stats()["fallbacks"] == 0


def test_small_cnn_eval(session):
    torch.manual_seed(1)
    model = models.SmallCNN().eval()
    with torch.no_grad():  # non-trivial running stats, so batch norm in eval mode matters
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    probe = Probe(session, model)
    for _ in range(2):
        probe(torch.randn(4, 3, 32, 32))
    assert session.stats()["graphs_uploaded"] == 1
    assert session.stats()["remote_calls"] == 2


def test_transformer_block_eval(session):
    torch.manual_seed(2)
    probe = Probe(session, models.TransformerBlock())
    for _ in range(2):
        probe(torch.randn(2, 16, 64))
    assert session.stats()["graphs_uploaded"] == 1


def test_bar_graph_breaks_follow_the_sign_of_b(session):
    torch.manual_seed(3)
    compiled = compile_remote(models.bar, session)
    a = torch.randn(10)
    b = torch.randn(10)
    for sign in (1, -1, 1):
        bb = b.abs() * sign
        assert torch.equal(compiled(a, bb), models.bar(a, bb))
    stats = session.stats()
    assert stats["fallbacks"] == 0
    assert stats["graphs_uploaded"] >= 2  # the graph break gives more than one graph
    assert stats["remote_calls"] >= 6


def test_dynamic_shapes_share_one_graph(session):
    torch.manual_seed(4)
    probe = Probe(session, models.mlp(), dynamic=True)
    for batch in (2, 5, 17):
        assert probe(torch.randn(batch, 784)).shape == (batch, 10)
    stats = session.stats()
    assert stats["graphs_uploaded"] == 1
    assert stats["tensors_uploaded"] == 4
    assert stats["remote_calls"] == 3


def test_in_place_parameter_change_is_uploaded(session):
    torch.manual_seed(5)
    model = models.mlp()
    probe = Probe(session, model, torch.randn(8, 784))
    probe()
    uploaded = session.stats()["tensors_uploaded"]
    with torch.no_grad():
        model[0].weight.add_(1.0)
    probe()  # the changed weight is used
    assert session.stats()["tensors_uploaded"] == uploaded + 1  # only the changed weight
    assert session.stats()["graphs_uploaded"] == 1
    probe()  # and the new content stays resident
    assert session.stats()["tensors_uploaded"] == uploaded + 1


def test_inductor_engine_mlp(session):
    torch.manual_seed(6)
    model = models.mlp().eval()
    compiled = compile_remote(model, session, engine="inductor")
    for _ in range(2):
        x = torch.randn(16, 784)
        with torch.no_grad():  # (the output read: assert_close's own ops on it would be eager calls, graphs too)
            torch.testing.assert_close(torch.from_numpy(compiled(x).numpy()), model(x), atol=1e-5, rtol=1e-5)
    assert session.stats()["graphs_uploaded"] == 1
    assert session.stats()["fallbacks"] == 0


# ------------------------------------------------------------------- training
def test_backward_gradients_match_eager_and_updated_weights_are_reuploaded(session):
    torch.manual_seed(10)
    model = models.mlp()
    reference = models.mlp()
    reference.load_state_dict(model.state_dict())
    compiled = compile_remote(model, session)
    x = torch.randn(8, 784)
    compiled(x).pow(2).sum().backward()
    reference(x).pow(2).sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name
    stats = session.stats()
    assert stats["graphs_uploaded"] == 2  # forward and backward
    assert stats["tensors_uploaded"] == 4
    assert stats["remote_calls"] == 2

    for m in (model, reference):
        torch.optim.SGD(m.parameters(), lr=0.1).step()
    with torch.no_grad():
        assert torch.equal(compiled(x), reference(x))
    assert session.stats()["tensors_uploaded"] == 8  # every parameter changed, each sent once more


# ------------------------------------------------------------- worker-side state
def test_closing_a_session_frees_what_it_uploaded(start_server, make_session):
    srv = start_server(name="store")  # its own server: nothing else uploads or frees meanwhile
    observer = make_session(srv.url)
    before = observer.health()
    uploader = make_session(srv.url)
    torch.manual_seed(12)
    model = models.mlp().eval()
    compiled = compile_remote(model, uploader)
    with torch.no_grad():
        compiled(torch.randn(2, 784))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    during = observer.health()
    assert during["resident_bytes"] == before["resident_bytes"] + weights
    assert during["sessions"] == before["sessions"] + 1

    # a second session uploading the same content shares it: nothing more is resident
    twin = make_session(srv.url)
    torch._dynamo.reset()
    with torch.no_grad():
        compile_remote(model, twin)(torch.randn(2, 784))
    assert twin.stats()["tensors_uploaded"] == 4  # it still had to send them (it cannot see others')
    assert observer.health()["resident_bytes"] == before["resident_bytes"] + weights
    twin.close()
    uploader.close()
    assert wait_until(lambda: observer.health()["resident_bytes"] == before["resident_bytes"])
    assert wait_until(lambda: observer.health()["sessions"] == before["sessions"])


def test_sessions_cannot_use_each_others_tensors(make_session):
    owner, other = make_session(), make_session()
    torch.manual_seed(13)
    model = models.mlp().eval()
    compiled = compile_remote(model, owner)
    with torch.no_grad():
        compiled(torch.randn(2, 784))
    tensor_ids = sorted(owner.connection.tensors)
    assert len(tensor_ids) == 4
    graph_ids = sorted(owner.connection.graphs)
    meta, buf = tensor_to_wire(torch.randn(2, 784), 0)
    args = [m.TensorArg(meta)] + [m.RefArg(t) for t in tensor_ids]
    # the other session knows the ids but never uploaded the content: the worker says they are missing
    with pytest.raises(remotorch.errors.MissingObjectsError) as info:
        other.connection.request(m.Run(graph_ids[0], "eager", args), [buf])
    assert set(info.value.graphs) == set(graph_ids)
    assert set(info.value.tensors) == set(tensor_ids)
