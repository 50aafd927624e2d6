"""The printed view of a profile report: one table per sequence, then totals per backend.

Tables are drawn by :mod:`~remotorch.profile.tables` (``rich`` on a terminal,
plain text elsewhere). A sequence with more graphs than ``max_graphs`` is abridged: its local
segments are summed into one row, the ``max_graphs`` slowest graphs are
shown, and the rest are summed into one row per backend. The saved files
always hold the full table.
"""

from __future__ import annotations

from .stats import CLIENT, ReportData, SequenceReport, Stats
from .tables import table, to_text

_HEAD = ("segment", "backend", "runs", "mean ms", "p50 ms", "p95 ms", "failures")


def render(report: ReportData, *, max_graphs: int = 8, terminal: bool = False, width: int | None = None) -> str:
    """The whole report as text: plain, or with ``terminal`` drawn for a terminal (escape codes)."""
    parts: list = [_header(report)]
    for n, seq in enumerate(report.sequences, 1):
        title, rows = _sequence(n, seq, report.backends, max_graphs)
        parts += ["", table(_HEAD, rows, terminal=terminal, title=title)]
    parts += ["", _totals(report, terminal), *_failures(report)]
    return to_text(*parts, terminal=terminal, width=width)


def _header(report: ReportData) -> str:
    return (f"remotorch profile: {report.calls} calls, {report.timed_calls} timed, "
            f"{report.compile_calls} discarded (compiled), {report.fallback_calls} fell back, "
            f"{report.failed_calls} raised\n"
            f"workers: {', '.join(_worker(n, w) for n, w in report.workers.items())}\n"
            f"backends: {', '.join(report.backends)}; outputs from {report.output_backend}; "
            f"per call and graph: {report.num_warmups} warm-up, {report.num_repeats} timed runs")


def _worker(name: str, w: dict) -> str:
    return f"{name} ({w.get('device', '?')}, ${w.get('price_per_hour', 0.0):g}/h, {w.get('url', '')})"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _fails(failures: dict[str, int]) -> str:
    return "; ".join(f"{n}x {msg[:60]}{'…' if len(msg) > 60 else ''}" for msg, n in failures.items())


def _row(name: str, backend: str, st: Stats) -> list[str]:
    return [name, backend, str(st.runs), _ms(st.mean_ms), _ms(st.p50_ms), _ms(st.p95_ms), _fails(st.failures)]


def _sequence(n: int, seq: SequenceReport, backends: list[str], max_graphs: int) -> tuple[str, list[list[str]]]:
    graphs = [s for s in seq.segments if s.kind == "graph"]
    title = (f"sequence {n}: {seq.function}, {len(graphs)} graph(s), {seq.calls} call(s), "
             f"{seq.timed_calls} timed")
    rows: list[list[str]] = []
    if len(graphs) <= max_graphs:
        for seg in seq.segments:
            label = seg.name if seg.kind == "local" else f"{seg.name} ({seg.graph_id[:8]}, {seg.ops} ops)"
            for i, (b, st) in enumerate(seg.stats.items()):
                rows.append(_row(label if i == 0 else "", b, st))
    else:
        title += f" (abridged: {max_graphs} slowest graphs shown, the rest summed; full table in saved files)"
        locals_ = [s for s in seq.segments if s.kind == "local"]
        rows.append(_row(f"local ({len(locals_)} segments)", CLIENT, _summed([s.stats[CLIENT] for s in locals_])))
        slowest = sorted(graphs, key=lambda s: -max((st.mean_ms or 0.0) for st in s.stats.values()))
        shown, rest = slowest[:max_graphs], slowest[max_graphs:]
        for seg in sorted(shown, key=lambda s: seq.segments.index(s)):
            for i, b in enumerate(backends):
                rows.append(_row(f"{seg.name} ({seg.graph_id[:8]}, {seg.ops} ops)" if i == 0 else "", b, seg.stats[b]))
        for i, b in enumerate(backends):
            rows.append(_row(f"{len(rest)} other graphs" if i == 0 else "", b, _summed([s.stats[b] for s in rest])))
    return title, rows


def _summed(stats: list[Stats]) -> Stats:
    """Several segments as one row: runs and means added up (percentiles do not add)."""
    fails: dict[str, int] = {}
    for st in stats:
        for msg, k in st.failures.items():
            fails[msg] = fails.get(msg, 0) + k
    means = [st.mean_ms for st in stats]
    total = None if any(m is None for m in means) else sum(means)
    return Stats(sum(st.runs for st in stats), total, None, None, fails)


def _totals(report: ReportData, terminal: bool):
    head = ("backend", "graph ms", "local ms", "total ms", "network ms", "compile ms", "$/hour",
            "$ per 1M calls", "max |diff| vs eager", "failures")
    rows = []
    for s in report.summaries.values():
        rows.append([s.backend, _ms(s.graph_ms), _ms(s.local_ms), _ms(s.total_ms), _ms(s.network_ms),
                     f"{s.compile_ms:.0f}", f"{s.price_per_hour:g}",
                     "-" if s.cost_per_million is None else f"{s.cost_per_million:.4f}",
                     "-" if s.max_abs_diff is None else f"{s.max_abs_diff:.3g}",
                     str(sum(s.failures.values())) if s.failures else ""])
    return table(head, rows, terminal=terminal,
                 title="per call, estimated (total = graph + local; network is reported apart, not in the total)")


def _failures(report: ReportData) -> list[str]:
    """Every failure message in full, per backend (the tables shorten them)."""
    lines = []
    for s in report.summaries.values():
        lines += [f"  {s.backend}: {n}x {msg}" for msg, n in s.failures.items()]
    return ["", "failures (graph runs, all calls)", *lines] if lines else []
