"""Profiling runs on the worker's one run path: under its request timeout and its out-of-memory handling.

Before the run path was shared, ``ProfileGraph`` ignored ``--request-timeout``
(a profile of 400 repeats of a slow graph held the worker for minutes) and
reported the CPU allocator's out-of-memory as a plain ``WorkerError``
without evicting cached objects and retrying.
"""

from __future__ import annotations

import time

import pytest
import torch

import remotorch
from remotorch.codec import messages as m
from remotorch.codec.frames import FrameWriter
from remotorch.codec.tensors import content_id
from remotorch.worker import engines
from remotorch.worker.service import Service
from remotorch.worker.worker import Limits, Worker

from conftest import TOKEN
from profile_helpers import capture_graph

TIMEOUT_S = 0.5


@pytest.fixture(scope="module")
def timed_worker(start_module_server):
    return start_module_server(name="timed", extra_args=("--request-timeout", str(TIMEOUT_S)))


def chain(x):
    for _ in range(10):
        x = torch.tanh(x @ x)
    return x


def test_a_long_profile_stops_at_the_request_timeout(timed_worker):
    # 100,000 timed repeats of ten 256x256 matmuls are 34 TFLOP: minutes on any CPU,
    # far more than the half second the worker allows one request
    f = remotorch.accelerate(chain, local_backend="eager")
    x = torch.randn(256, 256) / 16
    with remotorch.Session(timed_worker.url, token=TOKEN, timeout=120) as s:
        start = time.monotonic()
        with torch.no_grad(), pytest.warns(remotorch.errors.RemoteFallbackWarning), \
                remotorch.remote_profile(s, backends=["timed/eager"], num_repeats=100_000, num_warmups=0) as prof:
            out = f(x)  # the output backend failed: this call's graph ran locally
        elapsed = time.monotonic() - start
        torch.testing.assert_close(out, chain(x))
        (failure,) = prof.report().summaries["timed/eager"].failures
        assert failure.startswith("RequestTimeoutError"), failure
        assert elapsed < 30, f"the profile was not stopped: {elapsed:.1f}s"
        assert s.health()["name"] == "timed"  # the worker serves on
        with torch.no_grad(), remotorch.remote_profile(s, num_repeats=3) as again:
            f(torch.randn(8, 8) / 3)
        assert not again.report().summaries["timed/eager"].failures


def test_out_of_memory_in_a_profiled_graph_is_typed(server):
    def hungry(x):
        return torch.ones(1 << 42).sum() + x  # 16 TiB: the CPU allocator refuses (a RuntimeError)

    f = remotorch.accelerate(hungry, local_backend="eager")
    with remotorch.Session(server.url, token=TOKEN) as s:
        with torch.no_grad(), pytest.warns(remotorch.errors.RemoteFallbackWarning), \
                remotorch.remote_profile(s, backends=["test/eager"], num_repeats=2) as prof:
            with pytest.raises(RuntimeError, match="allocate"):  # locally it fails as well
                f(torch.randn(3))
        (failure,) = prof.report().summaries["test/eager"].failures
        assert failure.startswith("RemoteOutOfMemoryError"), failure
        assert s.health()["name"] == "test"


# ------------------------------------------------- in-process: the service without sockets
class _OutOfMemoryOnce:
    """An engine whose compiled graph fails its first call the way the CPU allocator does."""

    def __init__(self) -> None:
        self.calls = 0

    def available(self, device) -> bool:
        return True

    def compile(self, graph, device, example_args):
        inner = graph.module.forward

        def run(*args):
            self.calls += 1
            if self.calls == 1:
                raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory")
            return inner(*args)
        return run


def _ask(service: Service, cid: int, body, frames=()) -> tuple[object, list]:
    header, out = service.handle(cid, m.encode(body), list(frames))
    return m.decode(header), out


@pytest.mark.parametrize("kind", ["run", "profile"])
def test_out_of_memory_evicts_cached_objects_and_runs_again(monkeypatch, kind):
    engine = _OutOfMemoryOnce()
    real_load = engines.load
    monkeypatch.setattr(engines, "load", lambda name: engine if name == "oom-once" else real_load(name))
    worker = Worker("cpu", limits=Limits(cache_bytes=1 << 20))
    worker.engines.append("oom-once")
    service = Service(worker)
    # connection 1 uploads a tensor and goes: nobody holds it, the cache keeps it
    w = FrameWriter()
    meta = w.meta(torch.randn(1000))
    _ask(service, 1, m.PutTensors([content_id(meta, w.frames[0])], [meta]), w.frames)
    service.disconnected(1)
    assert worker.memory()["cached_bytes"] == 4000
    graph, args = capture_graph(lambda a, b: a @ b + 1, torch.randn(4, 4), torch.randn(4, 4))
    p = graph.payload
    _ask(service, 2, m.PutGraph(p.graph_id, p.doc, p.consts), p.const_frames)
    w = FrameWriter()
    run_args = w.values(args)
    if kind == "run":
        reply, frames = _ask(service, 2, m.Run(graph.graph_id, "oom-once", run_args), w.frames)
        assert isinstance(reply, m.RunReply), reply
    else:
        reply, frames = _ask(service, 2, m.ProfileGraph(graph.graph_id, "oom-once", run_args, 0, 3), w.frames)
        assert isinstance(reply, m.ProfileReply), reply
        assert len(reply.times_ms) == 3
    assert engine.calls >= 2  # failed once, then ran
    assert worker.memory()["cached_bytes"] == 0  # the cache was given up to make room


def test_profile_in_process_stops_at_the_request_timeout(monkeypatch):
    """The same limit without sockets or a slow machine: a graph that takes 20 ms a run, 1,000 repeats."""
    class Slow:
        def available(self, device):
            return True

        def compile(self, graph, device, example_args):
            def run(*args):
                time.sleep(0.02)
                return graph.module.forward(*args)
            return run

    real_load = engines.load
    monkeypatch.setattr(engines, "load", lambda name: Slow() if name == "slow" else real_load(name))
    worker = Worker("cpu", limits=Limits(request_timeout=0.3))
    worker.engines.append("slow")
    service = Service(worker)
    graph, args = capture_graph(lambda a: a * 2, torch.randn(4))
    p = graph.payload
    _ask(service, 1, m.PutGraph(p.graph_id, p.doc, p.consts), p.const_frames)
    w = FrameWriter()
    start = time.monotonic()
    reply, _ = _ask(service, 1, m.ProfileGraph(graph.graph_id, "slow", w.values(args), 0, 1000), w.frames)
    elapsed = time.monotonic() - start
    assert isinstance(reply, m.ErrorReply) and reply.kind == "timeout", reply
    assert elapsed < 5.0  # 1,000 repeats would take 20 s
    w = FrameWriter()
    reply, _ = _ask(service, 1, m.ProfileGraph(graph.graph_id, "slow", w.values(args), 0, 3), w.frames)
    assert isinstance(reply, m.ProfileReply) and len(reply.times_ms) == 3
