"""Behind a real network delay: only a read waits, errors arrive late but exactly, nothing runs twice.

Every session here reaches the shared worker through a user-space relay that
holds each chunk 5 ms in each direction (``remotorch.devtools.netem``), as a
worker in the next rack or another zone would be. The tests count what is
deterministic, never time: the values the code read (``stats()["reads"]``,
each waiting once at most: ``blocking_reads``, which a loaded machine can
make smaller, never larger), requests and bytes.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

import remotorch
from remotorch import errors
from remotorch.client.depth import StepPipe
from remotorch.codec import messages as m
from remotorch.devtools.netem import DelayProxy
from remotorch.optim import RemoteOptimizer

from conftest import TOKEN
from helpers import tiny_gpt2, tiny_mlp
from helpers import token_batch as batch

DELAY_MS = 5


def _line() -> int:
    """The caller's line number."""
    import sys
    return sys._getframe(1).f_lineno


@pytest.fixture(scope="module")
def relay(server):
    with DelayProxy(server.url, delay_ms=DELAY_MS) as proxy:
        yield proxy


@pytest.fixture
def wan(relay, session_for):
    """A session to the shared worker through the relay."""
    return session_for(relay.url)


STEP_BYTES = 1024 + 128  # a training step's requests beyond its inputs: about 1 KiB (1049 B measured past 2**16 ids)


def train_step(f, opt, b: torch.Tensor, read: bool = True):
    """The issue's training step: its loss read (``.item()``) or left unread (the tensor)."""
    loss = f(b, labels=b).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item() if read else loss


def delta(session, before: dict) -> dict:
    now = session.stats()
    return {k: now[k] - before[k] for k in ("reads", "blocking_reads", "requests_queued", "bytes_sent", "bytes_received",
                                             "remote_calls")}


def waited(d: dict, reads: int) -> bool:
    """``reads`` values read, each waiting once at most (a reply already here, on a loaded machine, none)."""
    return d["reads"] == reads and d["blocking_reads"] <= reads


# ---------------------------------------------------------------- round trips
def test_a_training_step_that_reads_its_loss_waits_once_and_one_that_reads_nothing_never(wan):
    model = tiny_gpt2()
    reference = copy.deepcopy(model)
    f = remotorch.compile(model, session=wan, fallback="raise")
    opt = RemoteOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-3, session=wan)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)

    def step(b, read: bool):
        return train_step(f, opt, b, read)

    def reference_step(b) -> float:
        ref_loss = reference(b, labels=b).loss
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        return ref_loss.item()

    got = [step(batch(i), read=True) for i in range(2)]  # cold: uploads, compiles
    before = wan.stats()
    got += [step(batch(i), read=True) for i in range(2, 6)]
    d = delta(wan, before)
    assert waited(d, 4), d  # exactly one read a step, the .item(): one round trip at most
    # what a step sends: its inputs (the tokens, twice: as input and as labels) and about 1 KiB, with the
    # the runs of saved activations the backward takes (Run.take)
    assert d["bytes_sent"] / 4 <= 2 * batch(0).nbytes + STEP_BYTES, d

    before = wan.stats()
    unread = [step(batch(i), read=False) for i in range(6, 10)]
    assert waited(delta(wan, before), 0)  # nothing read: nothing waited for
    got += [loss.item() for loss in unread]  # read afterwards, each is its own step's loss
    assert got == pytest.approx([reference_step(batch(i)) for i in range(10)], rel=1e-4)
    wan.pull(model)  # (AdamW: a tiny gradient's sign decides a whole step, hence the conformance suite's 1e-4)
    torch.testing.assert_close(dict(model.named_parameters()), dict(reference.named_parameters()),
                               rtol=1e-4, atol=1e-4)


def test_a_long_training_run_still_sends_its_inputs_and_about_1_kib_a_step(wan):
    """Each step keeps dozens of activations as new handles, and ids are never reused: after a
    few thousand steps they pass 2**16, where msgpack spends 5 bytes on each, not 3; after some
    13,000 steps (5 requests each) so do the requests' sequence numbers. Both counters are moved
    there at once (the client's own: what those steps would have left)."""
    model = tiny_gpt2()
    f = remotorch.compile(model, session=wan, fallback="raise")
    opt = RemoteOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-3, session=wan)

    for i in range(2):
        train_step(f, opt, batch(i))
    wan.synchronize()  # (nothing in flight while the numbers jump)
    wan.connection.handles.reserve(1 << 17)
    wan.connection.link.stream.seq += 1 << 17
    for i in range(2, 4):  # the first steps past the jump release the handles made below it
        train_step(f, opt, batch(i))
    before = wan.stats()
    losses = [train_step(f, opt, batch(i)) for i in range(4, 8)]
    d = delta(wan, before)
    assert waited(d, 4) and all(math.isfinite(x) for x in losses), d
    assert d["bytes_sent"] / 4 <= 2 * batch(0).nbytes + STEP_BYTES, d


def test_state_dict_after_queued_steps_waits_once_and_holds_the_stepped_values(wan):
    class Regression(torch.nn.Module):  # the loss inside the module: computed on the worker too
        def __init__(self):
            super().__init__()
            self.net = tiny_mlp(16, 32, 1)

        def forward(self, x):
            return self.net(x).pow(2).mean()

    model = Regression()
    reference = copy.deepcopy(model)
    f = remotorch.compile(model, session=wan, fallback="raise")
    opt = RemoteOptimizer(torch.optim.SGD, model.parameters(), lr=0.1, session=wan)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    xs = [torch.randn(8, 16, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    for x in xs[:1]:  # cold
        f(x).backward()
        opt.step()
        opt.zero_grad()
    before = wan.stats()
    for x in xs[1:]:
        f(x).backward()
        opt.step()
        opt.zero_grad()
    assert waited(delta(wan, before), 0)  # three steps queued, none read
    state = model.state_dict()  # a read: waits for the steps sent before it, once
    assert waited(delta(wan, before), 1)
    for x in xs:
        reference(x).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    torch.testing.assert_close(state, reference.state_dict())
    # a copy of the compiled model (a checkpoint, an EMA) is a plain module with the same values
    twin = copy.deepcopy(model)
    torch.testing.assert_close(twin.state_dict(), reference.state_dict())
    assert twin(xs[0]).item() == pytest.approx(reference(xs[0]).item())


def branchy(x, w):
    h = torch.tanh(x @ w)
    if h.sum() > 0:  # a read: data-dependent control flow, and a graph break
        h = h * 2
    return (h @ w.t()).relu()


def test_a_function_with_a_data_dependent_branch_waits_for_its_branch_and_its_result(wan):
    f = remotorch.compile(branchy, session=wan, fallback="raise")
    w = torch.randn(32, 32)
    base = torch.randn(8, 32)
    xs = [base * (1 if i % 2 else -1) + 0.01 * i for i in range(8)]  # tanh is odd: the branch alternates
    assert [bool(torch.tanh(x @ w).sum() > 0) for x in xs[:2]] == [False, True] or \
        [bool(torch.tanh(x @ w).sum() > 0) for x in xs[:2]] == [True, False]
    with torch.no_grad():
        for x in xs[:2]:
            torch.testing.assert_close(f(x, w), branchy(x, w), rtol=0, atol=0)
        before = wan.stats()
        for x in xs[2:]:  # both branches taken, repeatedly, equal to eager
            torch.testing.assert_close(f(x, w), branchy(x, w), rtol=0, atol=0)
    assert waited(delta(wan, before), 2 * 6)  # the branch's read and the result's


def test_a_warm_inference_call_whose_output_is_read_waits_once(wan):
    model = tiny_mlp(64, 128, 10).eval()
    f = remotorch.compile(model, session=wan, fallback="raise")
    x = torch.randn(16, 64)
    with torch.no_grad():
        f(x).numpy()  # (a read of the output itself: an eager call on it, .sum(), would run on the worker)
        before = wan.stats()
        for _ in range(5):
            assert torch.equal(f(x), model(x))
    assert waited(delta(wan, before), 5)


def test_a_graph_read_at_once_waits_for_its_reply_and_one_left_unread_is_sent_without_waiting(wan, monkeypatch):
    from remotorch.client import stream
    monkeypatch.setattr(stream, "PROMPT_S", 60.0)  # "at once" by order alone (nothing sent between), not by time
    model = tiny_mlp(64, 128, 10).eval()
    f = remotorch.compile(model, session=wan, fallback="raise")
    x = torch.randn(16, 64)
    with torch.no_grad():
        f(x).numpy()  # runs once, waited for
        before = wan.stats()
        for _ in range(30):  # read at once: after two calls the graph's calls wait, probing now and then
            assert torch.equal(f(x), model(x))  # (a read: an eager call on the output would run remotely)
        read = delta(wan, before)
        before = wan.stats()
        outs = [f(x * i) for i in range(20)]  # now nothing is read until the end
        unread = delta(wan, before)
        for i, out in enumerate(outs):
            assert torch.equal(out, model(x * i))
        before = wan.stats()
        outs = [f(x * i) for i in range(20)]  # and again: every call is sent without waiting
        again = delta(wan, before)
        for i, out in enumerate(outs):
            assert torch.equal(out, model(x * i))
    assert waited(read, 30), read
    # sent without waiting: the two calls that taught it, then probes 2, 4, 8 and 8 calls apart (calls 4, 8, 16, 24)
    assert read["requests_queued"] == 2 + 4
    # the program changed its habit: calls wait until the next probe, sent without waiting, is not read at once
    assert unread["reads"] <= 8 and unread["requests_queued"] >= 12, unread
    assert waited(again, 0) and again["requests_queued"] == 20, again


def test_greedy_generate_waits_once_per_token(wan):
    model = tiny_gpt2(3).eval()
    model.forward = remotorch.compile(model.forward, session=wan, fallback="raise", dynamic=True)
    prompt = batch(7)[:1, :8]
    with torch.no_grad():
        model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)  # compiles
        before = wan.stats()
        out = model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
    reads = delta(wan, before)["reads"]
    reference = tiny_gpt2(3).eval()
    with torch.no_grad():
        want = reference.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(out, want)
    assert reads <= 12 + 1, reads  # one round trip per token (HF reads its stop check each token)


# -------------------------------------------------------------------- late errors
def test_a_failure_inside_a_queued_step_is_raised_at_the_read_naming_graph_and_line_and_the_next_step_works(wan):
    model = tiny_gpt2(5)
    f = remotorch.compile(model, session=wan, fallback="raise")
    opt = RemoteOptimizer(torch.optim.SGD, model.parameters(), lr=0.1, session=wan)
    good = batch(11)
    for _ in range(2):
        loss = f(good, labels=good).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss.item()
    bad = good.clone()
    bad[0, 3] = 500  # past the embedding's 128 rows: the worker's graph raises
    loss = f(bad, labels=good).loss  # the line that issued the failing graph, named in the error
    line = f"test_wan.py:{_line() - 1} in test_a_failure"
    with pytest.raises(errors.WorkerError, match=r"depends on graph [0-9a-f]{12} \(issued at .*" + line) as caught:
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss.item()
    assert "index out of range" in str(caught.value)
    wan.synchronize()  # raised once: the session goes on
    loss = f(good, labels=good).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    assert torch.isfinite(loss).item()


def test_a_failure_nobody_read_is_raised_at_synchronize_and_close(relay):
    s = remotorch.Session(relay.url, token=TOKEN)
    f = remotorch.compile(lambda x: torch.nn.functional.embedding(x, torch.randn(4, 3)).sum(), session=s,
                          fallback="raise")
    f(torch.tensor([0, 1])).item()
    f(torch.tensor([0, 9]))  # fails on the worker; nobody reads it
    with pytest.raises(errors.WorkerError, match="issued at"):
        s.synchronize()
    s.synchronize()  # reported once
    f(torch.tensor([0, 9]))
    with pytest.raises(errors.WorkerError, match="issued at"):
        s.close()
    assert s.closed


# ------------------------------------------------------------------------ faults
def cut_once_a_reply_is_held(proxy: DelayProxy, delay_ms: float):
    """From now on ``proxy`` holds the worker's replies; a thread cuts the link as soon as one is there
    (its exchange log shows it), then lets replies through again. The thread, and a list that gets the
    bytes the cut lost (the reply, at least: a request the worker ran, its answer lost)."""
    import threading
    import time

    proxy.set_delay(delay_ms, down_ms=3600e3)  # (then a reply logged from now on is one held)
    proxy.reset_log()
    lost: list[int] = []

    def cut() -> None:
        try:
            deadline = time.monotonic() + 120
            while not any(e.down for e in proxy.exchanges()) and time.monotonic() < deadline:
                time.sleep(0.001)
            held, gone = any(e.down for e in proxy.exchanges()), proxy.cut()
            lost.append(gone if held else 0)  # (0: no reply was there to lose)
        finally:
            proxy.set_delay(delay_ms)

    thread = threading.Thread(target=cut, daemon=True)
    thread.start()
    return thread, lost


def test_a_link_cut_mid_queue_applies_no_step_twice_and_loses_none(relay, session_for):
    s = session_for(relay.url)
    model = tiny_mlp(16, 32, 1)
    reference = copy.deepcopy(model)
    f = remotorch.compile(lambda x, y: F.mse_loss(model(x), y), session=s, fallback="raise")
    opt = RemoteOptimizer(torch.optim.SGD, model.parameters(), lr=0.05, momentum=0.9, session=s)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    data = [(torch.randn(8, 16, generator=torch.Generator().manual_seed(i)),
             torch.randn(8, 1, generator=torch.Generator().manual_seed(100 + i))) for i in range(12)]
    losses, want, cuts = [], [], []
    for i, (x, y) in enumerate(data):
        if i in (4, 8):  # the link is cut once a reply of this step's is in the relay: everything in flight
            cuts.append(cut_once_a_reply_is_held(relay, DELAY_MS))  # is lost; the client sends it again
        loss = f(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss)
        ref = F.mse_loss(reference(x), y)
        ref.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        want.append(ref.item())
        if cuts and i in (4, 8):
            cuts[-1][0].join(120)
    lost = [bytes_lost for _, bytes_lost in cuts]
    assert len(lost) == 2 and all(len(n) == 1 and n[0] > 0 for n in lost), lost  # replies lost, twice
    got = [loss.item() for loss in losses]
    assert got == pytest.approx(want, rel=1e-5)  # step by step: none lost, none applied twice
    s.pull(model)
    torch.testing.assert_close(dict(model.named_parameters()), dict(reference.named_parameters()))


def test_a_call_read_at_once_whose_link_is_cut_in_flight_runs_once(start_server, session_for, monkeypatch):
    """A warm call read at once with nothing else in flight is one exchange on the transport; the link
    is cut while its reply is on the way back: the client reconnects and sends it again, and the
    worker answers from its memory instead of running it twice."""
    from remotorch.client import stream
    monkeypatch.setattr(stream, "PROMPT_S", 60.0)  # "at once" by order alone, not by time
    srv = start_server(name="cut-once")
    with DelayProxy(srv.url, delay_ms=100) as far:
        s = session_for(far.url)
        model = tiny_mlp(24, 40, 3, seed=5).eval()
        f = remotorch.compile(model, session=s, fallback="raise")
        x = torch.randn(4, 24)

        def runs() -> int:
            reply, _ = s.connection.request(m.Stats(), expect=m.StatsReply)
            return sum(g.runs for g in reply.slowest)

        with torch.no_grad():
            for _ in range(5):  # the 1st compiles; the 2nd and 3rd teach it "read at once"; the 4th
                f(x).numpy()  # waits, the 5th is a probe; the next four wait (a read of the output itself)
            ran = runs()
            before = s.stats()
            cutter, lost = cut_once_a_reply_is_held(far, 100)  # cut once the reply is in the relay
            out = f(x)  # the 6th: waits
            cutter.join(120)
        torch.testing.assert_close(out, model(x), rtol=0, atol=0)
        assert lost and lost[0] > 0, lost  # the cut caught it on its way
        d = delta(s, before)
        assert d["requests_queued"] == 0 and d["blocking_reads"] == 1, d
        assert runs() == ran + 1  # run once, answered twice at most


def test_a_worker_that_dies_mid_queue_is_raised_at_the_next_read_naming_what_was_lost(start_server, session_for):
    srv = start_server(name="dies")
    with DelayProxy(srv.url, delay_ms=DELAY_MS) as proxy:
        s = session_for(proxy.url, retry_after=0.0)
        model = tiny_mlp(16, 8)
        f = remotorch.compile(model, session=s, fallback="raise")
        x = torch.randn(4, 16)
        with torch.no_grad():
            f(x).sum().item()
            ys = [f(x) for _ in range(3)]
            srv.stop()
            with pytest.raises(errors.WorkerUnavailableError, match=r"lost with it: graph [0-9a-f]{12}"):
                ys[-1].sum().item()


# -------------------------------------------------------------------- the bound
def sgd_loop(s, steps: int, each) -> torch.nn.Module:
    """Train a small MLP with SGD on the worker for ``steps`` steps that never read (the first call is
    read: it compiles); ``each()`` after every step. The model, its weights still on the worker."""
    model = tiny_mlp(16, 32, 1)
    f = remotorch.compile(lambda x, y: F.mse_loss(model(x), y), session=s, fallback="raise")
    opt = RemoteOptimizer(torch.optim.SGD, model.parameters(), lr=0.01, session=s)
    x, y = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)), torch.zeros(8, 1)
    f(x, y).item()
    for _ in range(steps):
        loss = f(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        each()
    return model


def test_a_loop_that_never_reads_stays_within_its_bound(relay, session_for):
    limits = remotorch.QueueLimits(requests=8)
    s = session_for(relay.url, queue=limits)
    stream = s.connection.link.stream
    held = []

    def each():
        assert len(stream.inflight) <= limits.requests
        held.append(s.connection.handles.live)
    sgd_loop(s, 40, each)
    assert s.stats()["queue_waits"] > 0  # the bound held the loop back
    assert max(held[10:]) <= max(held[:10]) + 2  # nothing piles up on the worker either
    s.synchronize()


def test_a_loop_that_never_reads_stays_within_its_bound_of_bytes(server, session_for):
    """``QueueLimits.nbytes``: requests of 64 KiB each, never read, across a 100 ms round trip: the bytes
    in flight never pass the bound by more than the request that found room under it."""
    limits = remotorch.QueueLimits(nbytes=256 << 10)
    with DelayProxy(server.url, delay_ms=50) as far:
        s = session_for(far.url, queue=limits)
        stream = s.connection.link.stream
        f = remotorch.compile(lambda a: a.sum(0), session=s, fallback="raise")
        xs = [torch.randn(128, 128, generator=torch.Generator().manual_seed(i)) for i in range(4)]  # 64 KiB
        with torch.no_grad():
            f(xs[0]).tolist()  # compiled; the calls below are sent without waiting
            outs, peak = [], 0
            for i in range(48):
                outs.append(f(xs[i % 4]))
                peak = max(peak, stream._bytes)
            assert s.stats()["queue_waits"] > 0  # the bound held the loop back
            assert limits.nbytes // 2 < peak < limits.nbytes + xs[0].nbytes + 4096, peak
            for i, out in enumerate(outs):
                torch.testing.assert_close(out, xs[i % 4].sum(0))


def test_the_step_bound_counts_steps_ahead_of_the_worker_not_those_on_the_wire(server, session_for):
    # across a 40 ms round trip a loop of short steps has several on the wire: one step ahead of the
    # worker (steps=1) still lets them all be sent, and the bound holds what is beyond them
    limits = remotorch.QueueLimits(steps=1)
    with DelayProxy(server.url, delay_ms=20) as far:
        s = session_for(far.url, queue=limits)
        stream = s.connection.link.stream
        sent: list[tuple[int, int]] = []  # at each step sent: (steps unanswered, the link's estimate)

        class Watched(StepPipe):  # the estimate the step was let through on: before its own pace counts
            __slots__ = ()

            def stepped(self, now: float, waited: float = 0.0) -> None:
                sent.append((stream._steps, self.steps()))
                super().stepped(now, waited)
        stream.pipe = Watched()
        model = sgd_loop(s, 30, lambda: None)
        assert len(sent) == 30
        over = [(n, est) for n, est in sent if n > limits.steps + est]
        assert not over, over  # never more ahead than asked for, beyond what the link held then
        assert stream.pipe.steps() >= 2  # it measured the link: the round trip is several steps long
        assert max(n for n, _ in sent) > limits.steps + 1  # and let that many through
        s.synchronize()
        ref = tiny_mlp(16, 32, 1)  # the same steps locally
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01)
        x, y = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)), torch.zeros(8, 1)
        for _ in range(30):  # none lost, none applied twice
            F.mse_loss(ref(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        s.pull(model)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q)
        s.close()


# -------------------------------------------------------------------- the timeline
def test_trace_records_requests_their_round_trips_worker_runs_and_each_wait_with_its_line(wan, tmp_path):
    import json

    model = tiny_mlp(16, 32, 1)
    f = remotorch.compile(lambda x, y: F.mse_loss(model(x), y), session=wan, fallback="raise")
    opt = RemoteOptimizer(torch.optim.SGD, model.parameters(), lr=0.01, session=wan)
    x, y = torch.randn(8, 16), torch.randn(8, 1)
    for _ in range(2):  # cold, outside the trace: uploads, compiles
        f(x, y).backward()
        opt.step()
        opt.zero_grad()
    wan.synchronize()
    path = tmp_path / "step.json"
    with remotorch.trace(path):
        for _ in range(3):
            loss = f(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        loss.item()
        read_line = _line() - 1
        wan.synchronize()  # the last step's replies are read before the trace ends
        sync_line = _line() - 1
    events = json.loads(path.read_text())["traceEvents"]
    issued = [e for e in events if e["ph"] == "i"]
    flights = [e for e in events if e["ph"] == "X" and e["tid"].endswith("in flight")]
    runs = [e for e in events if e["ph"] == "X" and e["tid"].endswith("worker runs")]
    waits = [e for e in events if e["ph"] == "X" and e["pid"] == 0]
    assert len(issued) == 3 * 3 and len(flights) == len(issued)  # forward, backward, step: each answered
    assert [e["args"]["seq"] for e in issued] == sorted(e["args"]["seq"] for e in issued)
    assert all(e["args"]["status"] == "ok" for e in flights)
    assert all(e["dur"] >= 2 * DELAY_MS * 1e3 for e in flights)  # each crossed the relay both ways
    assert runs and all(e["dur"] > 0 for e in runs)
    assert len(waits) == 2  # only the read waited, and synchronize
    assert f"test_wan.py:{read_line}" in waits[0]["args"]["line"], waits
    assert f"test_wan.py:{sync_line}" in waits[1]["args"]["line"], waits
    assert {e["args"]["name"] for e in events if e["ph"] == "M"} == {
        "python (blocking waits)", "requests", "workers"}
