"""When a graph's calls wait for their reply, and when one goes out without waiting as a probe
(``remotorch.client.policy.GraphPolicy``), on a clock the test moves."""

from __future__ import annotations

import pytest

from helpers import Clock
from remotorch.client import policy as policies


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(policies.time, "perf_counter", c)
    return c


def taught() -> policies.GraphPolicy:
    """A policy that saw two calls read at once: its calls wait from now on, probing now and then."""
    p = policies.GraphPolicy()
    for _ in range(policies.PROMPT_CALLS):
        p.launched()(True)
    return p


def probes(p: policies.GraphPolicy, clock: Clock, calls: int, every_s: float) -> list[int]:
    """The calls (1-based) sent without waiting among the next ``calls``, one every ``every_s``."""
    out = []
    for i in range(1, calls + 1):
        clock.now += every_s
        if not p.waits():
            out.append(i)
            p.launched()(True)  # read at once: the probe finds the habit unchanged
    return out


def test_calls_slower_than_the_floor_probe_2_4_then_8_calls_apart(clock):
    assert probes(taught(), clock, 40, every_s=0.020) == [2, 6, 14, 22, 30, 38]


def test_fast_calls_probe_no_sooner_than_the_floor(clock):
    got = probes(taught(), clock, 400, every_s=0.0005)  # a warm loopback call
    assert len(got) >= 3
    gaps_s = [(b - a) * 0.0005 for a, b in zip(got, got[1:])]
    assert all(g >= policies.PROBE_MIN_S for g in gaps_s), gaps_s
    assert max(gaps_s) < policies.PROBE_MIN_S + 0.001  # and not much later: the first call after it
    assert len(got) < 400 // policies.PROBE_MAX  # fewer than one in 8


def test_a_probe_not_read_at_once_stops_the_waiting(clock):
    p = taught()
    got = probes(p, clock, 2, every_s=0.010)
    assert got == [2]
    clock.now += 0.010
    p.launched()(False)  # the program kept the outputs for later
    assert [p.waits() for _ in range(5)] == [False] * 5


def test_a_call_whose_outputs_were_never_read_stops_the_waiting_too(clock):
    p = taught()
    p.launched()  # its outputs are never read
    p.launched()(True)  # the next one's are, at once: one read at once, not two in a row
    assert p.prompt == 1 and [p.waits() for _ in range(3)] == [False] * 3
    p.launched()(True)
    assert p.prompt == policies.PROMPT_CALLS and p.waits()  # two in a row again: it waits


def test_after_prompt_calls_in_a_row_the_next_call_waits_and_the_2nd_after_is_a_probe(clock):
    p = policies.GraphPolicy()
    read = p.launched()
    assert not p.waits() and p.prompt == 0  # nothing learned yet: sent without waiting
    read(True)
    assert p.prompt == 1 and not p.waits()
    p.launched()(True)
    assert (p.probe, p.probe_every) == (2, 2)
    clock.now += 1.0
    assert [p.waits() for _ in range(2)] == [True, False]  # the 2nd is a probe
    assert p.probed_at == clock.now and p.probe == p.probe_every == 4


def test_outputs_kept_on_the_worker_are_those_not_needed_here_nor_read_before():
    from types import SimpleNamespace

    graph = SimpleNamespace(graph_id="g", saved_from=None, output_devices=["cpu", None, "cpu", "cpu", "cpu"],
                            must_real={3})
    p = policies.GraphPolicy()
    assert p.keep(graph) == [0, 2, 4]  # 1: not a tensor; 3: needed here
    p.read_outputs.add(2)
    assert p.keep(graph) == [0, 4]  # read before: sent back from now on
    training = SimpleNamespace(graph_id="g", saved_from=2, output_devices=["cpu"] * 5, must_real=set())
    assert policies.GraphPolicy().keep(training) == [0, 1]  # saved activations are not outputs to keep
    ps = policies.Policies()
    assert ps.of(graph) is ps.of(SimpleNamespace(graph_id="g")) and ps.of(graph) is not p
    assert ps.of(SimpleNamespace(graph_id="other")) is not ps.of(graph)


def test_a_probe_goes_out_once_exactly_the_floor_has_passed(clock, monkeypatch):
    monkeypatch.setattr(policies, "PROBE_MIN_S", 0.25)  # (sums exact in binary)
    clock.now = 64.0
    p = taught()
    assert [p.waits() for _ in range(2)] == [True, False]  # the first probe
    clock.now = 64.125
    assert [p.waits() for _ in range(4)] == [True] * 4  # probe_every 4, but within the floor: all wait
    clock.now = 64.25
    assert not p.waits()  # the floor has passed: this one probes
