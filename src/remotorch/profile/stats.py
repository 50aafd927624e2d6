"""The statistics of a profile, as data: per segment and backend, per backend, in total.

Built by :func:`remotorch.profile.report.build_report` (whose docstring says
how sequences, segments and totals are formed); read by the renderers
(:mod:`~remotorch.profile.render`, :mod:`~remotorch.profile.files`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

import numpy as np


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
    # graph runs a worker recording CUDA graphs ran uncaptured, by why (``serve --cuda-graphs``)
    uncaptured: dict[str, int] = field(default_factory=dict)


@dataclass
class ReportData:
    """What a profile measured, as plain data (:class:`remotorch.profile.report.Report` adds print and save)."""

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

    def to_dict(self) -> dict:
        """Everything in the report as JSON-ready data (the content of profile.json)."""
        data = asdict(self)
        data["totals"] = self.totals
        data["format"] = 1
        return data


