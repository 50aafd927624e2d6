"""Failure policy: unreachable or dead workers, unsupported ops, wrong tokens.

``fallback="local"`` must give the right answer with one RemoteFallbackWarning
per graph; ``fallback="raise"`` must raise the typed ``RemoteError``.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import remotorch
from remotorch import models
from remotorch.errors import (AuthenticationError, RemoteError, RemoteFallbackWarning,
                              UnsupportedGraphError, WorkerUnavailableError)

from conftest import TOKEN, closed_port
from helpers import Probe, assert_still_serves


def fallback_warnings(record) -> list:
    return [w for w in record if issubclass(w.category, RemoteFallbackWarning)]


def unreachable_session(**kwargs) -> remotorch.Session:
    return remotorch.Session(f"tcp://127.0.0.1:{closed_port()}", token=TOKEN, connect_timeout=2.0, **kwargs)


# --------------------------------------------------------------- unreachable worker
def test_unreachable_worker_falls_back_locally_with_one_warning_per_graph():
    session = unreachable_session()  # creating it must not contact anyone, so must not raise
    try:
        torch.manual_seed(0)
        probe = Probe(session, models.mlp(), lambda: torch.randn(8, 784), fallback="local")
        calls = 4
        with pytest.warns(RemoteFallbackWarning) as record:
            for _ in range(calls):
                probe()
        assert len(fallback_warnings(record)) == 1
        stats = session.stats()
        assert stats["fallbacks"] == calls
        assert stats["remote_calls"] == 0
        assert stats["graphs_uploaded"] == 0
    finally:
        session.close()


def test_unreachable_worker_warns_once_per_graph_across_graph_breaks():
    session = unreachable_session(retry_after=0.0)
    try:
        compiled = remotorch.compile(models.bar, session=session, fallback="local")
        a, b = torch.randn(10), torch.randn(10).abs()
        with pytest.warns(RemoteFallbackWarning) as first:
            assert torch.equal(compiled(a, b), models.bar(a, b))
        graphs = len(fallback_warnings(first))
        assert graphs >= 2  # one warning for each graph of the break
        fallbacks = session.stats()["fallbacks"]
        assert fallbacks == graphs
        with warnings.catch_warnings(record=True) as later:
            warnings.simplefilter("always")
            for _ in range(3):
                assert torch.equal(compiled(a, b), models.bar(a, b))
        assert fallback_warnings(later) == []  # the same graphs never warn twice
        assert session.stats()["fallbacks"] == fallbacks + 3 * graphs
    finally:
        session.close()


def test_unreachable_worker_with_raise_policy_raises_worker_unavailable():
    session = unreachable_session(retry_after=0.0)
    try:
        model = models.mlp().eval()
        compiled = remotorch.compile(model, session=session, fallback="raise")
        with torch.no_grad(), pytest.raises(WorkerUnavailableError) as info:
            compiled(torch.randn(2, 784))
        assert isinstance(info.value, RemoteError)
        assert issubclass(WorkerUnavailableError, RemoteError)
        assert session.stats()["fallbacks"] == 0
        with pytest.raises(WorkerUnavailableError):
            session.health()
    finally:
        session.close()


def test_invalid_fallback_policy_is_refused():
    with pytest.raises(ValueError):
        remotorch.compile(models.bar, fallback="maybe")


# ------------------------------------------------------------------- dead worker
def test_worker_killed_mid_session_falls_back_then_recovers_on_restart(start_server):
    srv = start_server(name="doomed")
    session = remotorch.Session(srv.url, token=TOKEN, retry_after=0.0, connect_timeout=2.0)
    try:
        torch.manual_seed(1)
        probe = Probe(session, models.mlp(), torch.randn(4, 784), fallback="local")
        probe()
        assert session.stats()["remote_calls"] == 1

        srv.stop()
        with pytest.warns(RemoteFallbackWarning):
            probe()
        assert session.stats()["fallbacks"] == 1

        # a new worker on the same port knows nothing: the session uploads everything again
        port = srv.port
        srv2 = start_server(name="reborn", extra_args=("--port", str(port)))
        assert srv2.port == port
        for _ in range(3):
            probe()
        stats = session.stats()
        assert stats["remote_calls"] >= 3
        assert stats["graphs_uploaded"] == 2
        assert stats["tensors_uploaded"] == 8
        assert session.health()["name"] == "reborn"
    finally:
        session.close()


# --------------------------------------------------------------- unsupported ops
@torch.library.custom_op("rmtest::myop", mutates_args=())
def _myop(x: torch.Tensor) -> torch.Tensor:
    return x * 3 + 1


@_myop.register_fake
def _myop_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def uses_custom_op(x: torch.Tensor) -> torch.Tensor:
    return _myop(x.sin()) + 1


def test_custom_op_with_raise_policy_raises_unsupported(session):
    compiled = remotorch.compile(uses_custom_op, session=session, fallback="raise")
    with pytest.raises(UnsupportedGraphError, match="myop"):
        compiled(torch.randn(5))
    assert session.stats()["graphs_uploaded"] == 0


def test_custom_op_with_local_policy_warns_and_is_correct(session):
    compiled = remotorch.compile(uses_custom_op, session=session, fallback="local")
    x = torch.randn(5)
    with pytest.warns(RemoteFallbackWarning, match="UnsupportedGraphError") as record:
        for _ in range(3):
            assert torch.equal(compiled(x), uses_custom_op(x))
    assert len(fallback_warnings(record)) == 1
    assert session.stats()["fallbacks"] == 3
    assert session.stats()["graphs_uploaded"] == 0


def test_graph_with_tensor_constant(session):
    """Graphs whose aten form holds tensor constants (get_attr) encode and run remotely."""
    def fn(x):
        return x + torch.tensor([1.0, 2.0])

    compiled = remotorch.compile(fn, session=session, fallback="raise")
    x = torch.randn(2)
    assert torch.equal(compiled(x), fn(x))
    assert session.stats()["remote_calls"] == 1


def test_unknown_engine_raises_unsupported(session):
    compiled = remotorch.compile(models.bar, session=session, engine="no-such-engine", fallback="raise")
    with pytest.raises(UnsupportedGraphError, match="no-such-engine"):
        compiled(torch.randn(3), torch.randn(3))


# --------------------------------------------------------------------- wrong token
@pytest.mark.parametrize("token", ["wrong-token", None])
def test_wrong_token_raises_authentication_error(server, session, token, monkeypatch):
    monkeypatch.delenv("REMOTORCH_TOKEN", raising=False)
    bad = remotorch.Session(server.url, token=token, retry_after=0.0)
    try:
        compiled = remotorch.compile(models.mlp().eval(), session=bad, fallback="raise")
        with torch.no_grad(), pytest.raises(AuthenticationError):
            compiled(torch.randn(2, 784))
        with pytest.raises(AuthenticationError):
            bad.health()
    finally:
        bad.close()
    # the server goes on serving sessions that hold the right token
    torch._dynamo.reset()
    assert_still_serves(session, probe=Probe(session, models.mlp(), torch.randn(3, 784)), server=server)


def test_wrong_token_with_local_policy_falls_back(server):
    bad = remotorch.Session(server.url, token="nope")
    try:
        probe = Probe(bad, models.mlp(), torch.randn(2, 784), fallback="local")
        with pytest.warns(RemoteFallbackWarning, match="AuthenticationError"):
            probe()
        assert bad.stats()["fallbacks"] == 1
    finally:
        bad.close()


def test_closed_session_refuses_work(session):
    session.close()
    with pytest.raises(WorkerUnavailableError):
        session.health()
