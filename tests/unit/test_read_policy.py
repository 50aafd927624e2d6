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
