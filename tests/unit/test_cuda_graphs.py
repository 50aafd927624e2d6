"""CUDA graphs on the worker, what can be checked without a GPU: the skip rules, the recording's
bookkeeping (with a stand-in for the CUDA recording), and the plumbing (the option travels; a CPU
worker runs every graph uncaptured and counts it). The recording itself, bit for bit against an
uncaptured run, is checked on a GPU (``tests/integration/test_gpu_parity.py``).
"""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import remotorch
from remotorch.codec import messages as m
from remotorch.worker import cudagraphs
from remotorch.worker.engines import boxed, call

from conftest import TOKEN

CUDA = torch.device("cuda")  # (a device name: nothing runs on it here)


def graph_of(fn, *args) -> torch.fx.GraphModule:
    return make_fx(fn)(*args)


@pytest.mark.parametrize("fn, args, why", [
    (lambda x: x * 2 + 1, (torch.randn(4),), None),
    (lambda x: torch.nn.functional.dropout(x, 0.5, True), (torch.randn(4),), "random numbers"),
    (lambda x: x.nonzero(), (torch.randn(4),), "waits for the device (aten::nonzero)"),
    (lambda x: x.add_(1), (torch.randn(4),), "writes into an argument (aten::add_)"),
    (lambda x: x.view(2, 2).mul_(2), (torch.randn(4),), "writes into an argument (aten::mul_)"),
    (lambda x: x.to("cpu", copy=True) + 1, (torch.randn(4),), "makes a CPU tensor (aten::_to_copy)"),
])
def test_what_cannot_be_recorded_is_told_from_the_graph(fn, args, why):
    assert cudagraphs.skip_reason(graph_of(fn, *args), CUDA) == why
    assert cudagraphs.skip_reason(graph_of(fn, *args), torch.device("cpu")) == "not a CUDA device"


def test_reading_a_value_back_is_not_recorded():
    g = torch.fx.Graph()
    total = g.call_function(torch.ops.aten.sum.default, (g.placeholder("x"),))
    g.output((g.call_function(torch.ops.aten._local_scalar_dense.default, (total,)),))
    assert cudagraphs.skip_reason(torch.fx.GraphModule({}, g), CUDA) == "waits for the device (aten::_local_scalar_dense)"


def test_control_flow_is_not_recorded():
    gm = graph_of(lambda x: torch.cond(x.sum() > 0, lambda t: t + 1, lambda t: t - 1, (x,)), torch.randn(4))
    assert cudagraphs.skip_reason(gm, CUDA) == "control flow"


def _fake_capture(fn, static, device):
    """Stands for a CUDA recording on this CPU: a replay runs ``fn`` on the recorded arguments and
    writes the results into the recording's own outputs, as the recorded kernels would."""
    out = call(fn, list(static))

    def replay():
        for o, fresh in zip(out, call(fn, list(static))):
            o.copy_(fresh)

    return replay, out


def recorded(fn, kept=frozenset()) -> tuple[cudagraphs.Recorded, cudagraphs.CudaGraphs]:
    graphs = cudagraphs.CudaGraphs()
    def run(args: list):  # boxed, as an engine's callable: the list emptied
        taken = list(args)
        args.clear()
        return fn(*taken)

    rec = cudagraphs.Recorded(boxed(run), None, torch.device("cpu"), lambda: kept, graphs)
    rec.capture = _fake_capture
    return rec, graphs


def linear(x, w):
    return [x @ w, (x @ w).sum()]


def test_the_second_call_records_and_later_calls_replay_with_their_own_inputs():
    w = torch.randn(512, 512)
    rec, graphs = recorded(linear, kept=frozenset({w.untyped_storage().data_ptr()}))
    for i in range(4):
        x = torch.randn(600, 512)
        args = [x, w]
        out = rec(args)
        assert torch.equal(out[0], x @ w) and torch.equal(out[1], (x @ w).sum())
        assert args == []  # boxed: handed over and emptied
        assert rec.state == ("its first call (a warm-up)" if i == 0 else "replayed")
        del out
    assert graphs.counts == {"uncaptured: its first call (a warm-up)": 1, "recorded": 1, "replays": 3}
    assert isinstance(rec.static[1], tuple)  # the weight the worker keeps: recorded where it is
    assert isinstance(rec.static[0], torch.Tensor)  # the input: copied into a buffer of the recording


def test_a_kept_argument_that_moved_runs_uncaptured():
    w = torch.randn(8, 8)
    rec, graphs = recorded(linear, kept=frozenset({w.untyped_storage().data_ptr()}))
    for _ in range(2):
        rec([torch.randn(4, 8), w])
    other = w.clone()
    out = rec([torch.randn(4, 8), other])
    assert rec.state == "an argument it recorded in place moved" and torch.equal(out[1], out[0].sum())


def test_an_output_still_held_is_not_overwritten_by_the_next_replay():
    w = torch.randn(512, 512)
    rec, graphs = recorded(linear, kept=frozenset({w.untyped_storage().data_ptr()}))
    rec([torch.randn(600, 512), w])
    x1 = torch.randn(600, 512)
    held = rec([x1, w])[0]  # 1.2 MB: handed out over the recording's buffer
    assert rec.state == "replayed"
    small = rec.out[1]
    x2 = torch.randn(600, 512)
    out = rec([x2, w])
    assert rec.state == "an output of its last run is still held"
    assert torch.equal(held, x1 @ w) and torch.equal(out[0], x2 @ w)
    del held, out
    loss = rec([x2, w])[1]  # a small output is a copy: holding it blocks nothing
    assert rec.state == "replayed" and loss is not small
    rec([x1, w])
    assert rec.state == "replayed" and torch.equal(loss, (x2 @ w).sum())


def test_a_recording_that_fails_leaves_the_graph_uncaptured_for_good():
    rec, graphs = recorded(lambda x: [x + 1])

    def refuse(fn, static, device):
        raise RuntimeError("operation not permitted when stream is capturing")

    rec.capture = refuse
    for _ in range(3):
        assert torch.equal(rec([torch.ones(2)])[0], torch.full((2,), 2.0))
    assert rec.state == "recording failed (RuntimeError)"
    assert graphs.counts["uncaptured: recording failed (RuntimeError)"] == 2


def test_a_size_argument_is_dynamic_shapes():
    rec, _ = recorded(lambda x, n: [x.reshape(n, -1)])
    rec([torch.ones(4), 2])
    rec([torch.ones(4), 2])
    assert rec.state == "dynamic shapes (a size argument)"


# ------------------------------------------------------------------ the plumbing, on a real CPU worker
def worker_counts(session) -> dict:
    reply, _ = session.connection_for(None).request(m.Stats(), expect=m.StatsReply)
    return dict(reply.cuda_graphs)


def test_a_worker_started_with_cuda_graphs_runs_every_graph_uncaptured_on_a_cpu(start_server):
    server = start_server(token=TOKEN, name="cg", extra_args=("--cuda-graphs",))
    with remotorch.Session(server.url, token=TOKEN) as s:
        model = torch.nn.Linear(4, 3)
        compiled = remotorch.compile(model, session=s, fallback="raise")
        with torch.no_grad():
            for _ in range(3):
                assert torch.equal(compiled(torch.ones(2, 4)), model(torch.ones(2, 4)))
        assert worker_counts(s) == {"uncaptured: not a CUDA device": 3}


def test_the_per_graph_option_travels_with_its_runs(server):
    with remotorch.Session(server.url, token=TOKEN) as s:
        before = worker_counts(s).get("uncaptured: not a CUDA device", 0)
        a, b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 2)
        with_option = torch.compile(a, backend="remotorch", options={"session": s, "cuda_graphs": True,
                                                                     "fallback": "raise"})
        without = remotorch.compile(b, session=s, fallback="raise")
        with torch.no_grad():
            for _ in range(2):
                with_option(torch.ones(2, 4))
                without(torch.ones(2, 4))
        assert worker_counts(s)["uncaptured: not a CUDA device"] - before == 2


def test_a_profile_counts_the_graphs_that_ran_uncaptured(start_server):
    server = start_server(token=TOKEN, name="cgp", extra_args=("--cuda-graphs",))
    with remotorch.Session(server.url, token=TOKEN) as s:
        model = torch.nn.Linear(4, 3)
        fast = remotorch.accelerate(lambda t: model(t), local_backend="eager")
        with torch.no_grad(), remotorch.remote_profile(s, num_repeats=2, num_warmups=1) as prof:
            for _ in range(2):
                fast(torch.ones(2, 4))
        summary = next(iter(prof.report().summaries.values()))
        assert summary.uncaptured == {"not a CUDA device": 2}
