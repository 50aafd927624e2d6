"""Worker-side timed runs (ProfileGraph) and the engines, over a real worker server on loopback."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from remotorch import errors
from remotorch.client.connection import Connection
from remotorch.codec import messages as m
from remotorch.profile.profiler import profile_graph

from conftest import TOKEN, clean_env
from profile_helpers import capture_graph


def connect(url: str, token: str) -> Connection:
    return Connection(lambda: (url, token))


def mm_relu(x, w):
    return torch.relu(x @ w) + 1


@pytest.fixture
def link(server):
    lk = connect(server.url, TOKEN)
    yield lk
    lk.close()


def test_timed_runs_give_one_time_per_repeat_and_the_outputs(link):
    x, w = torch.randn(16, 32), torch.randn(32, 8)
    graph, args = capture_graph(mm_relu, x, w)
    first = profile_graph(link, graph, args, "eager", warmups=2, repeats=7)
    assert len(first.times_ms) == 7 and all(t > 0 for t in first.times_ms)
    assert first.clock == "monotonic"
    assert first.compiled
    assert torch.equal(first.outputs[0], mm_relu(x, w))
    again = profile_graph(link, graph, args, "eager", warmups=0, repeats=3)
    assert len(again.times_ms) == 3 and not again.compiled and again.compile_ms == 0.0
    # the worker's own time holds the timed runs; the client's round trip holds the worker's time
    assert sum(again.times_ms) <= again.worker_ms <= again.round_trip_ms
    assert again.network_ms == pytest.approx(again.round_trip_ms - again.worker_ms)


def test_timed_runs_measure_the_work(link):
    small, _ = capture_graph(mm_relu, torch.randn(8, 8), torch.randn(8, 8))
    big, _ = capture_graph(mm_relu, torch.randn(512, 512), torch.randn(512, 512))
    s = profile_graph(link, small, [torch.randn(8, 8), torch.randn(8, 8)], "eager", warmups=1, repeats=5)
    b = profile_graph(link, big, [torch.randn(512, 512), torch.randn(512, 512)], "eager", warmups=1, repeats=5)
    assert min(b.times_ms) > 5 * min(s.times_ms)


@pytest.mark.parametrize("warmups,repeats", [(0, 0), (-1, 3), (1, 10**6)])
def test_bad_repeat_counts_are_invalid_and_the_worker_keeps_serving(link, warmups, repeats):
    graph, args = capture_graph(mm_relu, torch.randn(4, 4), torch.randn(4, 4))
    with pytest.raises(errors.InvalidRequestError, match="repeats"):
        profile_graph(link, graph, args, "eager", warmups=warmups, repeats=repeats)
    assert len(profile_graph(link, graph, args, "eager", warmups=0, repeats=2).times_ms) == 2


def test_a_dropped_connection_resumes_and_a_forgotten_session_uploads_again(link):
    graph, args = capture_graph(mm_relu, torch.randn(4, 4), torch.randn(4, 4))
    profile_graph(link, graph, args, "eager", warmups=0, repeats=1)
    link.drop()  # the next request opens a new connection and re-attaches: the upload is still there
    res = profile_graph(link, graph, args, "eager", warmups=0, repeats=1)
    assert torch.equal(res.outputs[0], mm_relu(*args))
    assert link.stats.graphs_uploaded == 1
    link.transport.request(m.encode(m.Detach()))  # the worker frees the session now
    link.drop()
    res = profile_graph(link, graph, args, "eager", warmups=0, repeats=1)
    assert torch.equal(res.outputs[0], mm_relu(*args))
    assert link.stats.graphs_uploaded == 2


def test_three_engines_compile_the_same_graph_and_agree(link):
    x, w = torch.randn(8, 16), torch.randn(16, 4)
    graph, args = capture_graph(mm_relu, x, w)
    want = mm_relu(x, w)
    for engine in ("eager", "inductor", "onnxrt"):
        res = profile_graph(link, graph, args, engine, warmups=1, repeats=3)
        assert res.compiled and res.compile_ms > 0 or engine == "eager"
        assert torch.allclose(res.outputs[0], want, atol=1e-5), engine


def test_onnxrt_one_export_serves_every_batch_size(link):
    w = torch.randn(16, 4)
    graph, args = capture_graph(mm_relu, torch.randn(5, 16), w, dynamic=True)
    sizes = [i for i, a in enumerate(args) if isinstance(a, int)]
    assert sizes, "a dynamic graph takes its symbolic sizes as scalar arguments"
    for n, batch in enumerate((5, 9, 33)):
        x = torch.randn(batch, 16)
        call = [batch if isinstance(a, int) else x if a.shape[1:] == (16,) and a.shape != w.shape else w
                for a in args]
        res = profile_graph(link, graph, call, "onnxrt", warmups=0, repeats=2)
        assert res.compiled == (n == 0)
        assert res.outputs[0].shape == (batch, 4)
        assert torch.allclose(res.outputs[0], mm_relu(x, w), atol=1e-5)
    assert link.stats.graphs_uploaded == 1


def test_an_engine_that_cannot_take_a_graph_fails_only_there(link):
    graph, args = capture_graph(lambda x: torch.special.bessel_j0(x) * 2, torch.rand(4, 4))
    with pytest.raises(errors.UnsupportedGraphError, match="bessel_j0"):
        profile_graph(link, graph, args, "onnxrt", warmups=0, repeats=1)
    res = profile_graph(link, graph, args, "eager", warmups=0, repeats=1)
    assert torch.equal(res.outputs[0], torch.special.bessel_j0(args[0]) * 2)


def test_serve_price_and_engine_list_reach_the_health_reply(start_server, server):
    srv = start_server(name="priced", extra_args=("--price-per-hour", "2.5", "--engines", "eager,failing"))
    lk = connect(srv.url, TOKEN)
    try:
        info = lk.info()
        assert info["price_per_hour"] == 2.5
        assert info["engines"] == ["eager", "failing"]
        graph, args = capture_graph(mm_relu, torch.randn(4, 4), torch.randn(4, 4))
        with pytest.raises(errors.UnsupportedGraphError, match="refuses every graph"):
            profile_graph(lk, graph, args, "failing", warmups=0, repeats=1)
        assert profile_graph(lk, graph, args, "eager", warmups=0, repeats=1).times_ms
    finally:
        lk.close()
    default = connect(server.url, TOKEN)
    try:
        assert default.info()["price_per_hour"] == 0.0
        assert "failing" not in default.info()["engines"]  # a debugging aid, offered only by name
    finally:
        default.close()


def test_serve_refuses_an_engine_it_cannot_offer():
    proc = subprocess.run([sys.executable, "-m", "remotorch", "serve", "--port", "0", "--engines", "eager,nope"],
                          capture_output=True, text=True, timeout=120, env=clean_env())
    assert proc.returncode == 2
    assert "nope" in proc.stderr


def test_ordinary_calls_can_use_the_onnxrt_engine(session):
    import remotorch

    fn = remotorch.compile(mm_relu, session=session, engine="onnxrt", fallback="raise")
    x, w = torch.randn(6, 10), torch.randn(10, 3)
    assert torch.allclose(fn(x, w), mm_relu(x, w), atol=1e-5)
    assert session.stats()["remote_calls"] == 1 and session.stats()["fallbacks"] == 0
