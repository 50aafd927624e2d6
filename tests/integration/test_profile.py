"""remote_profile and accelerate against real worker servers on loopback.

Two workers (the shared ``test`` server and a module-scoped ``gpu0``), three
engines, a failing engine, graph breaks, a recompile, dynamic shapes, and
the saved files read back.
"""

from __future__ import annotations

import csv
import json
import time

import pytest
import torch

import remotorch
from remotorch import errors, models
from remotorch.errors import RemoteFallbackWarning

from conftest import TOKEN

SLEEP = 0.03
PRICE = 2.5  # $/hour of gpu0: not 3.6, the ms-per-hour constant, so a swap of the two shows


@pytest.fixture(scope="module")
def gpu0(start_module_server):
    return start_module_server(name="gpu0", extra_args=("--price-per-hour", str(PRICE)))


@pytest.fixture(scope="module")
def flaky(start_module_server):
    """A worker that also offers the failing engine (a debugging aid)."""
    return start_module_server(name="flaky", extra_args=("--engines", "eager,failing"))


@pytest.fixture
def two(session_for, server, gpu0):
    return session_for(server, gpu0)


def mlp_fn():
    torch.manual_seed(0)
    return models.mlp().eval()


def test_outside_a_profile_accelerate_is_torch_compile_with_the_local_backend():
    seen = []

    def local_backend(gm, example_inputs):
        seen.append(gm)
        return gm.forward

    @remotorch.accelerate(local_backend=local_backend)
    def f(x):
        return torch.tanh(x) * 2

    x = torch.randn(4, 4)
    assert torch.equal(f(x), torch.tanh(x) * 2)
    assert len(seen) == 1  # compiled by the local backend, once
    f(torch.randn(4, 4))
    assert len(seen) == 1
    assert f.__name__ == "f"


def test_three_engines_on_one_worker(session):
    model = mlp_fn()
    fast = remotorch.accelerate(model, local_backend="eager")
    backends = ["test/eager", "test/inductor", "test/onnxrt"]
    x = torch.randn(16, 784)
    with torch.no_grad(), remotorch.remote_profile(session, backends=backends, num_repeats=4) as prof:
        outs = [fast(x) for _ in range(3)]
    assert all(torch.equal(o, model(x)) for o in outs)  # outputs from test/eager: bitwise local eager
    report = prof.report()
    assert (report.calls, report.compile_calls, report.timed_calls) == (3, 1, 2)
    assert report.output_backend == "test/eager"
    (seq,) = report.sequences
    (graph,) = [s for s in seq.segments if s.kind == "graph"]
    for b in backends:
        assert graph.stats[b].runs == 2 * 4
        assert graph.stats[b].mean_ms > 0 and graph.stats[b].p50_ms <= graph.stats[b].p95_ms
        assert not graph.stats[b].failures
        assert report.totals[b] == pytest.approx(report.summaries[b].graph_ms + report.summaries[b].local_ms)
    assert report.summaries["test/eager"].max_abs_diff == 0.0
    assert 0 < report.summaries["test/onnxrt"].max_abs_diff < 1e-3
    assert report.summaries["test/inductor"].max_abs_diff < 1e-3
    assert report.summaries["test/inductor"].compile_ms > 0
    text = report.render()
    for b in backends:
        assert b in text


def heavy(x, w):
    for _ in range(3):
        x = torch.tanh(x @ w)
    return x


def test_workers_run_at_the_same_time_and_engines_of_one_worker_one_after_another(two):
    fast = remotorch.accelerate(heavy, local_backend="eager")
    backends = ["test/eager", "test/onnxrt", "gpu0/eager"]
    x, w = torch.randn(256, 256), torch.randn(256, 256) / 16
    with torch.no_grad(), remotorch.remote_profile(two, backends=backends, num_repeats=20, num_warmups=0) as prof:
        for _ in range(3):
            fast(x, w)
    overlapped = 0
    for call in prof.records:
        (g,) = call.graphs
        a, b, c = (g.runs[name] for name in backends)
        assert a.finished <= b.started  # one worker: its engines one after another
        overlapped += c.started < a.finished and a.started < c.finished or c.started < b.finished and b.started < c.finished
    assert overlapped == len(prof.records)  # two workers: at the same time
    report = prof.report()
    assert set(report.workers) == {"test", "gpu0"}
    assert report.workers["gpu0"]["price_per_hour"] == PRICE
    gpu = report.summaries["gpu0/eager"]
    # $ per hour x hours per call (total_ms / 3.6e6 ms per hour) x a million calls
    assert gpu.cost_per_million == pytest.approx(PRICE * gpu.total_ms / 3.6e6 * 1e6)
    assert gpu.price_per_hour == PRICE
    assert report.summaries["test/eager"].cost_per_million == 0.0


def test_a_failing_engine_is_reported_for_its_backend_only(flaky):
    fast = remotorch.accelerate(lambda x: torch.sigmoid(x) + 1, local_backend="eager")
    with remotorch.Session(flaky.url, token=TOKEN) as s:
        with torch.no_grad(), remotorch.remote_profile(s, num_repeats=3) as prof:
            x = torch.randn(8, 8)
            for _ in range(3):
                assert torch.equal(fast(x), torch.sigmoid(x) + 1)
        report = prof.report()
    assert report.backends == ["flaky/eager", "flaky/failing"]
    (graph,) = [seg for seg in report.sequences[0].segments if seg.kind == "graph"]
    fails = graph.stats["flaky/failing"].failures
    assert len(fails) == 1 and list(fails.values()) == [3]
    assert "refuses every graph" in next(iter(fails))
    assert graph.stats["flaky/failing"].runs == 0
    assert report.totals["flaky/failing"] is None
    assert report.totals["flaky/eager"] > 0 and not report.summaries["flaky/eager"].failures
    assert "refuses every graph" in report.render()


def test_the_output_backend_is_the_one_the_user_sees(flaky):
    fast = remotorch.accelerate(lambda x: torch.cos(x) * 2, local_backend="eager")
    with remotorch.Session(flaky.url, token=TOKEN) as s:
        with torch.no_grad(), remotorch.remote_profile(s, output_backend="flaky/failing") as prof:
            x = torch.randn(4, 4)
            with pytest.warns(RemoteFallbackWarning, match="refuses every graph"):
                out = fast(x)  # never silently from another backend: it falls back with a warning
            assert torch.equal(out, torch.cos(x) * 2)
        report = prof.report()
    assert report.output_backend == "flaky/failing"
    assert report.calls == 1 and report.timed_calls == 0


def test_an_onnx_export_failure_names_the_operator(session):
    fast = remotorch.accelerate(lambda x: torch.special.bessel_j0(x) + x, local_backend="eager")
    with torch.no_grad(), remotorch.remote_profile(session, backends=["test/eager", "test/onnxrt"],
                                                   num_repeats=2) as prof:
        for _ in range(2):
            fast(torch.rand(4, 4))
    summary = prof.report().summaries["test/onnxrt"]
    assert sum(summary.failures.values()) == 2
    assert "bessel_j0" in next(iter(summary.failures))
    assert prof.report().totals["test/eager"] is not None


def breaks(x):
    y = torch.relu(x) * 2
    time.sleep(SLEEP)
    z = y @ y.T
    time.sleep(SLEEP / 2)
    return z


def test_graph_breaks_give_local_segments_timed_on_the_client(session):
    fast = remotorch.accelerate(breaks, local_backend="eager")
    with torch.no_grad(), remotorch.remote_profile(session, backends=["test/eager"], num_repeats=50) as prof:
        for _ in range(7):
            fast(torch.randn(64, 64))
    report = prof.report()
    (seq,) = report.sequences
    names = [s.name for s in seq.segments]
    assert names == ["local 0", "graph 1", "local 1", "graph 2", "local 2"]
    local = {s.name: s.stats["client"] for s in seq.segments if s.kind == "local"}
    assert local["local 0"].runs == 6
    # every sample holds its sleep (a sleep is never shorter); the medians are near it (a busy
    # host delays a few samples, rarely most of them)
    samples = [c.local_ms() for c in prof.records if c.timed]
    assert len(samples) == 6
    assert all(s[1] >= SLEEP * 1e3 and s[2] >= SLEEP * 1e3 / 2 for s in samples), samples
    assert SLEEP * 1e3 <= local["local 1"].p50_ms < SLEEP * 1e3 + 25
    assert SLEEP * 1e3 / 2 <= local["local 2"].p50_ms < SLEEP * 1e3 / 2 + 25
    assert local["local 0"].p50_ms < SLEEP * 1e3 / 2
    assert local["local 1"].mean_ms == pytest.approx(sum(s[1] for s in samples) / 6)
    # remote time (50 runs of each graph, and the round trips) is not in the local segments
    call = prof.records[-1]
    remote = sum((g.end - g.start) * 1e3 for g in call.graphs)
    assert sum(call.local_ms()) + remote == pytest.approx((call.end - call.start) * 1e3)
    assert report.totals["test/eager"] == pytest.approx(seq.local_ms() + seq.graph_ms("test/eager"))


def test_a_recompile_is_discarded_and_counted(session):
    fast = remotorch.accelerate(lambda x: torch.exp(x).sum(1), local_backend="eager")
    with torch.no_grad(), remotorch.remote_profile(session, backends=["test/eager"], num_repeats=2) as prof:
        for shape in [(4, 8), (4, 8), (6, 8), (6, 8), (4, 8)]:
            fast(torch.randn(*shape))
    report = prof.report()
    assert report.calls == 5
    assert report.compile_calls == 2  # the first call, and the one that recompiled for a new shape
    assert report.timed_calls == 3
    assert len(report.sequences) == 2  # a static graph, then the dynamic one dynamo recompiled to
    assert [s.timed_calls for s in report.sequences] == [1, 2]


def test_dynamic_shapes_one_upload_serves_every_batch_size_on_every_engine(session):
    model = mlp_fn()
    fast = remotorch.accelerate(model, dynamic=True, local_backend="eager")
    with torch.no_grad(), remotorch.remote_profile(session, backends=["test/eager", "test/onnxrt"],
                                                   num_repeats=2) as prof:
        for batch in (3, 5, 8, 13):
            x = torch.randn(batch, 784)
            assert torch.equal(fast(x), model(x))
        (link,) = session.connections()
        assert link.stats.graphs_uploaded == 1
    report = prof.report()
    assert report.compile_calls == 1 and report.timed_calls == 3
    assert len(report.sequences) == 1
    assert not any(s.failures for s in report.summaries.values())
    assert report.summaries["test/onnxrt"].max_abs_diff < 1e-3


def test_saved_files_hold_the_full_report(session, tmp_path):
    fast = remotorch.accelerate(breaks, local_backend="eager")
    with torch.no_grad(), remotorch.remote_profile(session, backends=["test/eager", "test/onnxrt"],
                                                   num_repeats=3) as prof:
        for _ in range(3):
            fast(torch.randn(8, 8))
    report = prof.report()
    paths = report.save(tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["profile.csv", "profile.json", "profile.png"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # nothing written anywhere else

    data = json.loads(paths["json"].read_text())
    assert data["totals"] == pytest.approx(report.totals)
    assert data["backends"] == ["test/eager", "test/onnxrt"]
    assert data["calls"] == 3 and data["compile_calls"] == 1
    seg = data["sequences"][0]["segments"][1]
    assert seg["kind"] == "graph" and seg["stats"]["test/onnxrt"]["runs"] == 2 * 3

    with open(paths["csv"], newline="") as f:
        rows = list(csv.DictReader(f))
    segments = report.sequences[0].segments
    assert len(rows) == sum(len(s.stats) for s in segments) + len(report.backends)
    for row, (seg, backend) in zip(rows, [(s, b) for s in segments for b in s.stats]):
        assert (row["segment"], row["backend"]) == (seg.name, backend)
        assert float(row["mean_ms"]) == pytest.approx(seg.stats[backend].mean_ms)
    totals = {r["backend"]: float(r["mean_ms"]) for r in rows if r["kind"] == "total"}
    assert totals == pytest.approx(report.totals)

    png = paths["png"].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image
    img = matplotlib.image.imread(paths["png"])
    assert img.shape[0] > 100 and img.shape[1] > 400


def many_breaks(x):  # written out: dynamo skips a whole frame that breaks inside a loop
    x = torch.sin(x) + 0
    torch._dynamo.graph_break()
    x = torch.sin(x) + 1
    torch._dynamo.graph_break()
    x = torch.sin(x) + 2
    torch._dynamo.graph_break()
    x = torch.sin(x) + 3
    torch._dynamo.graph_break()
    x = torch.sin(x) + 4
    torch._dynamo.graph_break()
    x = torch.sin(x) + 5
    torch._dynamo.graph_break()
    x = torch.sin(x) + 6
    torch._dynamo.graph_break()
    x = torch.sin(x) + 7
    torch._dynamo.graph_break()
    x = torch.sin(x) + 8
    torch._dynamo.graph_break()
    x = torch.sin(x) + 9
    torch._dynamo.graph_break()
    x = torch.sin(x) + 10
    torch._dynamo.graph_break()
    x = torch.sin(x) + 11
    torch._dynamo.graph_break()
    return x * 2


def test_many_graph_breaks_are_abridged_in_the_table_but_not_in_the_files(session, tmp_path):
    fast = remotorch.accelerate(many_breaks, local_backend="eager")
    with torch.no_grad(), remotorch.remote_profile(session, backends=["test/eager"], num_repeats=2) as prof:
        for _ in range(2):
            fast(torch.randn(4))
    report = prof.report()
    graphs = [s for s in report.sequences[0].segments if s.kind == "graph"]
    assert len(graphs) >= 12
    text = report.render(max_graphs=4)
    assert "abridged" in text and f"{len(graphs) - 4} other graphs" in text
    assert "local (" in text
    assert sum(line.startswith("  graph ") for line in text.splitlines()) == 4
    full = report.render(max_graphs=100)
    assert "abridged" not in full
    with open(report.save(tmp_path)["csv"], newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["kind"] == "graph"]
    assert len(rows) == len(graphs)


def test_unknown_backends_are_typed_errors(session):
    with pytest.raises(errors.UnknownBackendError, match="nope/eager"):
        with remotorch.remote_profile(session, backends=["test/eager", "nope/eager"]):
            pass
    with pytest.raises(errors.UnknownBackendError):
        with remotorch.remote_profile(session, backends=["test/eager"], output_backend="test/onnxrt"):
            pass
    assert issubclass(errors.UnknownBackendError, errors.RemoteError)


def test_print_writes_the_table(session, capsys):
    fast = remotorch.accelerate(lambda x: x * 2 + 1, local_backend="eager")
    with torch.no_grad(), remotorch.remote_profile(session, backends=["test/eager"], num_repeats=2) as prof:
        for _ in range(2):
            fast(torch.randn(3))
    prof.report().print()
    out = capsys.readouterr().out
    assert "remotorch profile: 2 calls, 1 timed, 1 discarded (compiled)" in out
    assert "test/eager" in out and "local 0" in out


def test_a_worker_that_dies_fails_its_backends_and_the_others_go_on(server, start_server):
    doomed = start_server(name="doomed")
    fast = remotorch.accelerate(lambda x: torch.tanh(x) - 1, local_backend="eager")
    with remotorch.Session([server.url, doomed.url], token=TOKEN) as s:
        with torch.no_grad(), remotorch.remote_profile(s, backends=["test/eager", "doomed/eager"],
                                                       num_repeats=2) as prof:
            x = torch.randn(4, 4)
            for _ in range(2):
                fast(x)
            doomed.stop()
            for _ in range(2):
                assert torch.equal(fast(x), torch.tanh(x) - 1)  # the output backend's worker is alive
        report = prof.report()
    assert report.timed_calls == 3
    failures = report.summaries["doomed/eager"].failures
    assert sum(failures.values()) == 2
    assert all("WorkerUnavailableError" in msg or "TransportError" in msg for msg in failures)
    assert not report.summaries["test/eager"].failures
    assert server.alive()


class Scaler:
    def __init__(self, k: float) -> None:
        self.k = k

    @remotorch.accelerate(local_backend="eager")
    def apply(self, x):
        return torch.sin(x) * self.k


def test_accelerated_methods_bind_and_a_profiler_serves_one_block(session):
    s = Scaler(3.0)
    x = torch.randn(5)
    assert torch.equal(s.apply(x), torch.sin(x) * 3.0)
    with torch.no_grad(), remotorch.remote_profile(session, backends=["test/eager"], num_repeats=2) as prof:
        for _ in range(2):
            assert torch.equal(s.apply(x), torch.sin(x) * 3.0)
    assert prof.report().sequences[0].function == "Scaler.apply"
    with pytest.raises(RuntimeError, match="one with-block"):
        with prof:
            pass


def test_a_transformers_model_on_eager_and_onnxrt(session):
    import transformers  # part of the test extra: a missing one fails, not skips
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=64)
    torch.manual_seed(3)
    model = transformers.BertModel(config).eval()

    @remotorch.accelerate(local_backend="eager")
    def encode(ids):
        return model(input_ids=ids).last_hidden_state

    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), remotorch.remote_profile(session, backends=["test/eager", "test/onnxrt"],
                                                   num_repeats=2) as prof:
        for _ in range(2):
            out = encode(ids)
        assert torch.equal(out, model(input_ids=ids).last_hidden_state)
    report = prof.report()
    assert not any(s.failures for s in report.summaries.values())
    assert report.summaries["test/onnxrt"].max_abs_diff < 1e-4
    (graph,) = [s for s in report.sequences[0].segments if s.kind == "graph"]
    assert graph.ops > 50 and graph.stats["test/onnxrt"].runs == 2
