"""A profile's report: :func:`build_report` turns records into statistics; :class:`Report` prints and saves them.

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

import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np

from .files import save_report
from .records import CallRecord, ProfileSettings
from .render import render
from .tables import is_terminal, terminal_width
from .stats import CLIENT, BackendSummary, ReportData, Segment, SequenceReport, Stats

__all__ = ["CLIENT", "BackendSummary", "Report", "Segment", "SequenceReport", "Stats", "build_report"]


@dataclass
class Report(ReportData):
    """What a profile measured; ``print()`` it, ``save()`` it, or read ``totals``."""

    def print(self, file: IO[str] | None = None, *, max_graphs: int = 8, terminal: bool | None = None) -> None:
        """Print the tables (drawn by ``rich`` on a terminal, plain text elsewhere, or as ``terminal``
        says); sequences with more than ``max_graphs`` graphs are abridged."""
        out = file if file is not None else sys.stdout
        term = is_terminal(out) if terminal is None else terminal
        print(render(self, max_graphs=max_graphs, terminal=term, width=terminal_width() if term else None),
              file=out)

    def render(self, *, max_graphs: int = 8, terminal: bool = False) -> str:
        """The tables :meth:`print` prints, as a string (plain text unless ``terminal``)."""
        return render(self, max_graphs=max_graphs, terminal=terminal)

    def save(self, output_dir: str | Path) -> dict[str, Path]:
        """Write profile.json, profile.csv and profile.png into ``output_dir`` (created if missing)."""
        return save_report(self, Path(output_dir))


# ---------------------------------------------------------------------- building
def build_report(records: list[CallRecord], plan: ProfileSettings) -> Report:
    """Turn a profile's records, made under ``plan``, into a :class:`Report`."""
    records = list(records)
    groups: dict[tuple, list[CallRecord]] = {}
    for rec in records:
        groups.setdefault(rec.key, []).append(rec)
    sequences = [_sequence(calls, plan.backends) for calls in groups.values()]
    summaries = {b: _summary(b, sequences, list(groups.values()), plan.workers) for b in plan.backends}
    return Report(backends=list(plan.backends), output_backend=plan.output_backend,
                  num_repeats=plan.num_repeats, num_warmups=plan.num_warmups,
                  workers=dict(plan.workers), calls=len(records),
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
        failures=dict(Counter(r.error for _, r in runs if r.error)),
        uncaptured=dict(Counter(r.cuda_graph for _, r in runs if r.cuda_graph not in ("", "replayed"))))
