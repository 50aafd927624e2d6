"""Statistics from a profiler's records: per segment and backend, per backend, in total.

A *sequence* groups the calls of one function that ran the same graphs in
the same order; its *segments* alternate local Python (timed by the client)
and graphs (timed by the workers): ``local 0, graph 1, local 1, …, graph n,
local n``. Only timed calls (nothing compiled, nothing fell back, nothing
raised) enter the times; failures are counted over every call. A backend's
estimated total per call is its graph time plus the local time, averaged
over a function's sequences weighted by their timed calls; where several
functions were profiled, the totals add one call of each.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING

import numpy as np

from .records import CallRecord

if TYPE_CHECKING:
    from .profiler import Profiler

CLIENT = "client"  # the "backend" column of local segments: timed on the client


@dataclass(frozen=True)
class Stats:
    """Timed runs of one segment on one backend (milliseconds), and failures by message.

    ``runs`` counts samples: for a graph, ``num_repeats`` per timed call; for
    a local segment, one per timed call.
    """

    runs: int
    mean_ms: float | None
    p50_ms: float | None
    p95_ms: float | None
    failures: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, samples: list[float], failures: Counter | None = None) -> Stats:
        fails = dict(failures or {})
        if not samples:
            return cls(0, None, None, None, fails)
        a = np.asarray(samples, dtype=np.float64)
        return cls(len(samples), float(a.mean()), float(np.percentile(a, 50)), float(np.percentile(a, 95)), fails)


@dataclass(frozen=True)
class Segment:
    """One local segment or one graph of a sequence, with stats per backend (``client`` for local)."""

    name: str
    kind: str  # "local" or "graph"
    stats: dict[str, Stats]
    graph_id: str | None = None
    ops: int | None = None


@dataclass(frozen=True)
class SequenceReport:
    """Calls of one function that ran the same graphs in the same order."""

    function: str
    graph_ids: list[str]
    calls: int
    timed_calls: int
    segments: list[Segment]

    def local_ms(self) -> float | None:
        """Mean local time per call: the local segments summed."""
        means = [s.stats[CLIENT].mean_ms for s in self.segments if s.kind == "local"]
        return None if any(m is None for m in means) else sum(means)

    def graph_ms(self, backend: str) -> float | None:
        """Mean graph time per call on a backend, or None if a graph has no timed run there."""
        means = [s.stats[backend].mean_ms for s in self.segments if s.kind == "graph"]
        return None if any(m is None for m in means) else sum(means)


@dataclass(frozen=True)
class BackendSummary:
    """One backend over the whole profile: estimated time and cost per call, accuracy, failures."""

    backend: str
    worker: str
    engine: str
    graph_ms: float | None  # remote graph time per call (worker-measured)
    local_ms: float | None  # local Python per call (client-measured)
    total_ms: float | None  # graph_ms + local_ms; None where a graph never ran on this backend
    network_ms: float | None  # per call: round trips minus worker time (not part of the total)
    compile_ms: float  # engine compile time spent on the worker, all graphs
    price_per_hour: float
    cost_per_million: float | None  # $ for 1e6 calls at total_ms, the worker held throughout
    max_abs_diff: float | None  # largest |output - local eager output| over every graph run
    failures: dict[str, int]


@dataclass
class Report:
    """What a profile measured; ``print()`` it, ``save()`` it, or read ``totals``."""

    backends: list[str]
    output_backend: str
    num_repeats: int
    num_warmups: int
    workers: dict[str, dict]
    calls: int
    timed_calls: int
    compile_calls: int
    fallback_calls: int
    failed_calls: int
    sequences: list[SequenceReport]
    summaries: dict[str, BackendSummary]

    @property
    def totals(self) -> dict[str, float | None]:
        """Estimated total ms per call for each backend (graphs + local Python); None if unknown."""
        return {b: s.total_ms for b, s in self.summaries.items()}

    def print(self, file: IO[str] | None = None, *, max_graphs: int = 8) -> None:
        """Print the table; sequences with more than ``max_graphs`` graphs are abridged."""
        from .render import render

        print(render(self, max_graphs=max_graphs), file=file)

    def render(self, *, max_graphs: int = 8) -> str:
        """The table :meth:`print` prints, as a string."""
        from .render import render

        return render(self, max_graphs=max_graphs)

    def save(self, output_dir: str | Path) -> dict[str, Path]:
        """Write profile.json, profile.csv and profile.png into ``output_dir`` (created if missing)."""
        from .files import save_report

        return save_report(self, Path(output_dir))

    def to_dict(self) -> dict:
        """Everything in the report as JSON-ready data (the content of profile.json)."""
        data = asdict(self)
        data["totals"] = self.totals
        data["format"] = 1
        return data


# ---------------------------------------------------------------------- building
def build_report(profiler: Profiler) -> Report:
    """Turn a profiler's records into a :class:`Report`."""
    records = list(profiler.records)
    groups: dict[tuple, list[CallRecord]] = {}
    for rec in records:
        groups.setdefault(rec.key, []).append(rec)
    sequences = [_sequence(calls, profiler.backends) for calls in groups.values()]
    summaries = {b: _summary(b, sequences, list(groups.values()), profiler.workers) for b in profiler.backends}
    return Report(backends=list(profiler.backends), output_backend=profiler.output_backend,
                  num_repeats=profiler.num_repeats, num_warmups=profiler.num_warmups,
                  workers=dict(profiler.workers), calls=len(records),
                  timed_calls=sum(r.timed for r in records),
                  compile_calls=sum(r.compiled for r in records),
                  fallback_calls=sum(r.fell_back and not r.compiled for r in records),
                  failed_calls=sum(r.failed and not (r.compiled or r.fell_back) for r in records),
                  sequences=sequences, summaries=summaries)


def _sequence(calls: list[CallRecord], backends: list[str]) -> SequenceReport:
    timed = [c for c in calls if c.timed]
    first = calls[0]
    segments = []
    locals_ = [c.local_ms() for c in timed]
    for i in range(len(first.graphs) + 1):
        segments.append(Segment(f"local {i}", "local", {CLIENT: Stats.of([ms[i] for ms in locals_])}))
        if i == len(first.graphs):
            break
        stats = {}
        for b in backends:
            samples = [t for c in timed for t in c.graphs[i].runs[b].times_ms]
            fails = Counter(c.graphs[i].runs[b].error for c in calls if c.graphs[i].runs[b].error)
            stats[b] = Stats.of(samples, fails)
        g = first.graphs[i]
        segments.append(Segment(f"graph {i + 1}", "graph", stats, g.graph_id, g.ops))
    return SequenceReport(first.function, [g.graph_id for g in first.graphs], len(calls), len(timed), segments)


def _per_call(sequences: list[SequenceReport], value) -> float | None:
    """Mean of ``value(seq)`` per call of each function (weighted by timed calls), summed over functions."""
    total = 0.0
    by_function: dict[str, list[SequenceReport]] = {}
    for s in sequences:
        by_function.setdefault(s.function, []).append(s)
    for seqs in by_function.values():
        pairs = [(s.timed_calls, value(s)) for s in seqs if s.timed_calls > 0]
        if not pairs or any(v is None for _, v in pairs):
            return None
        total += sum(w * v for w, v in pairs) / sum(w for w, _ in pairs)
    return total if by_function else None


def _summary(backend: str, sequences: list[SequenceReport], groups: list[list[CallRecord]],
             workers: dict[str, dict]) -> BackendSummary:
    worker, engine = backend.split("/", 1)
    graph_ms = _per_call(sequences, lambda s: s.graph_ms(backend))
    local_ms = _per_call(sequences, SequenceReport.local_ms)
    total = None if graph_ms is None or local_ms is None else graph_ms + local_ms
    runs = [(c, g.runs[backend]) for calls in groups for c in calls for g in c.graphs]
    per_call: dict[int, float] = {}
    for c, r in runs:
        if c.timed and r.error is None:
            per_call[id(c)] = per_call.get(id(c), 0.0) + r.network_ms
    diffs = [r.max_abs_diff for _, r in runs if r.max_abs_diff is not None]
    price = float(workers.get(worker, {}).get("price_per_hour", 0.0))
    return BackendSummary(
        backend=backend, worker=worker, engine=engine, graph_ms=graph_ms, local_ms=local_ms, total_ms=total,
        network_ms=float(np.mean(list(per_call.values()))) if per_call else None,
        compile_ms=sum(r.compile_ms for _, r in runs), price_per_hour=price,
        cost_per_million=None if total is None else price * total / 3.6,  # $/h × ms/call ÷ 3.6e6 ms/h × 1e6
        max_abs_diff=max(diffs) if diffs else None,
        failures=dict(Counter(r.error for _, r in runs if r.error)))
