"""How ``benchmarks/wan.py`` times one system in one case at one round-trip time.

A *unit* is what one sample times: one training step, a block of ten steps
whose loss is read once, one ``generate`` call, one inference call... Units
run in rounds: lead-in units (untimed: the first starts on an idle worker,
which a loop's steps after the first never see; a pipelined peer fills its
window), then ``block`` timed units back to
back (so a step's queued tail overlaps the next step, as in a real loop),
then the system is synchronized (untimed) and the same number of units of the
same code run on the local model, likewise. Remote unit ``i`` and local unit
``i`` get the same data, so both trainings go in lockstep and every result is
checked against the local one. Round trips waited for and requests are
counted over the timed units; bytes over every unit, replies read at the
synchronize included.

The ratio is the median over the samples of (remote - local) per step,
divided by the round-trip time the proxies add (twice the one-way delay).
A *modelled* system (Ray, see ``peers.py``) is timed on loopback and has
``waits`` x RTT added to each unit: the round trips its code blocks on.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Unit:
    """One system running one case: its remote and local units, and how to count what it sent."""

    case: str
    system: str
    per: int  # steps (or tokens) per unit: the table reports per step
    remote: Callable[[int], object]
    local: Callable[[int], object]
    check: Callable[[object, object], float]  # (remote result, local result) -> difference; raises when wrong
    counters: Callable[[], dict] = dict  # blocking_reads, requests (and remotorch's bytes_sent/received)
    sync: Callable[[], None] = lambda: None
    proxies: list = field(default_factory=list)  # the proxies its traffic goes through (``netproc.Proxy``)
    waits: float | None = None  # modelled: round trips per unit added to its loopback time
    scale: float = 1.0  # units timed = max(2, round(steps x scale))
    lead: int = 1  # untimed units at the start of each round (until the loop is in its steady state)
    note: str = ""
    rtt_s: float = 0.0  # the round-trip time it is measured at now (set before each measurement)


WAITS = ("blocking_reads", "requests", "queue_waits")  # counted over the timed units


def _add(total: dict, more: dict) -> None:
    for k, v in more.items():
        total[k] = total.get(k, 0) + v


def warm(unit: Unit, n: int = 2) -> None:
    """Compile, upload and check: ``n`` remote and local units, results compared, the system synchronized."""
    pairs = [(unit.remote(i), unit.local(i)) for i in range(n)]
    unit.sync()
    for r, l_ in pairs:
        unit.check(r, l_)


@dataclass
class Samples:
    """What :func:`measure` saw: seconds per unit each side, counters and wire bytes over every remote unit."""

    remote_s: list[float]
    local_s: list[float]
    counted: dict
    units_run: int
    units_timed: int
    diffs: list[float]
    wire: tuple[int, int] | None  # bytes up, down through the proxies
    relay_s: float = 0.0  # CPU seconds the network process used over the timed units


def measure(unit: Unit, n: int, block: int = 5) -> Samples:
    """Time ``n`` remote and ``n`` local units of ``unit`` in rounds (see the module docstring)."""
    remote_s: list[float] = []
    local_s: list[float] = []
    counted: dict = {}
    units_run = units_timed = 0
    diffs: list[float] = []
    relay_s = 0.0
    for p in unit.proxies:
        p.reset_log()
    i = 0
    clock = time.perf_counter
    while len(remote_s) < n:
        k = min(block, n - len(remote_s))
        lead = unit.lead
        first = unit.counters()
        results = [unit.remote(i + j) for j in range(lead)]
        before = unit.counters()
        relay = unit.proxies[0].cpu_s() if unit.proxies else 0.0
        for j in range(lead, lead + k):
            t0 = clock()
            results.append(unit.remote(i + j))
            remote_s.append(clock() - t0)
        waited = unit.counters()
        if unit.proxies:
            relay_s += unit.proxies[0].cpu_s() - relay
        unit.sync()
        after = unit.counters()
        # waits and requests: the timed units' (the loop's steady state); bytes: every unit's, replies included
        _add(counted, {key: waited[key] - before[key] if key in WAITS else after[key] - first[key] for key in after})
        units_timed += k
        units_run += lead + k
        local = [unit.local(i + j) for j in range(lead)]
        for j in range(lead, lead + k):
            t0 = clock()
            local.append(unit.local(i + j))
            local_s.append(clock() - t0)
        diffs += [unit.check(r, l) for r, l in zip(results, local)]
        i += lead + k
    wire = None
    if unit.proxies:
        totals = [p.totals() for p in unit.proxies]
        wire = (sum(up for up, _ in totals), sum(down for _, down in totals))
    return Samples(remote_s, local_s, counted, units_run, units_timed, diffs, wire, relay_s)


def summarize(unit: Unit, rtt_ms: float, samples: Samples) -> dict:
    """A row: per-step medians (ms), the ratio to the RTT, and what was sent per step."""
    rtt = rtt_ms / 1e3
    extra = (unit.waits or 0.0) * rtt
    remote = [t + extra for t in samples.remote_s]
    local_s, diffs = samples.local_s, samples.diffs
    per_step = samples.units_run * unit.per
    per_timed_step = samples.units_timed * unit.per
    row = {"case": unit.case, "system": unit.system, "rtt_ms": rtt_ms, "n": len(remote), "per": unit.per,
           "modelled": unit.waits is not None, "note": unit.note,
           "remote_ms": statistics.median(remote) / unit.per * 1e3,
           "local_ms": statistics.median(local_s) / unit.per * 1e3,
           "remote_p90_ms": sorted(remote)[min(len(remote) - 1, int(0.9 * len(remote)))] / unit.per * 1e3,
           "over_rtt": statistics.median(r - l for r, l in zip(remote, local_s)) / unit.per / rtt,
           "max_diff": max(diffs) if diffs else None}
    for key, value in samples.counted.items():
        row[f"{key}_per_step"] = value / (per_timed_step if key in WAITS else per_step)
    if unit.waits is not None:
        row["blocking_reads_per_step"] = unit.waits / unit.per
    if unit.proxies:
        row["relay_cpu_ms_per_step"] = samples.relay_s / per_timed_step * 1e3
    if samples.wire is not None:
        row["wire_up_per_step"], row["wire_down_per_step"] = (b / per_step for b in samples.wire)
    return row


def echo_rtt(call: Callable[[], object], n: int = 7) -> float:
    """The median time of ``call`` (one bare round trip), in ms."""
    call()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def loss_diff(remote, local) -> float:
    """Relative difference of two losses (floats); raises when they disagree beyond float noise."""
    d = abs(float(remote) - float(local)) / max(abs(float(local)), 1e-6)
    if not math.isfinite(d) or d > 1e-2:
        raise AssertionError(f"remote loss {remote} differs from the local one {local}")
    return d


def same(remote, local) -> float:
    """0 when two results (lists of numbers) agree to 1e-4; raises otherwise."""
    import torch

    r, l_ = torch.tensor(remote, dtype=torch.float64), torch.tensor(local, dtype=torch.float64)
    if r.shape != l_.shape or not torch.allclose(r, l_, rtol=1e-4, atol=1e-4):
        raise AssertionError("remote result differs from the local one")
    return float((r - l_).abs().max()) if r.numel() else 0.0
