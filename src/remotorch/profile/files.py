"""A profile report as files: profile.json (everything), profile.csv (the full table), profile.png.

Only the folder the caller names is written; the chart is drawn on a
matplotlib ``Figure`` with the Agg canvas, so no global pyplot state or GUI
backend is touched.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from .stats import ReportData

CSV_FIELDS = ("sequence", "function", "segment", "kind", "graph_id", "ops", "backend", "runs",
              "mean_ms", "p50_ms", "p95_ms", "failures")


def save_report(report: ReportData, output_dir: Path) -> dict[str, Path]:
    """Write the three files; returns their paths by kind (json, csv, png)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": output_dir / "profile.json", "csv": output_dir / "profile.csv",
             "png": output_dir / "profile.png"}
    paths["json"].write_text(json.dumps(_finite(report.to_dict()), indent=2), encoding="utf-8")
    write_csv(report, paths["csv"])
    write_chart(report, paths["png"])
    return paths


def _finite(value):
    """JSON has no infinity or NaN: such numbers are written as strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def write_csv(report: ReportData, path: Path) -> None:
    """One row per segment and backend (every graph, never abridged), then one per backend total."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for n, seq in enumerate(report.sequences, 1):
            for seg in seq.segments:
                for backend, st in seg.stats.items():
                    writer.writerow(dict(sequence=n, function=seq.function, segment=seg.name, kind=seg.kind,
                                         graph_id=seg.graph_id or "", ops="" if seg.ops is None else seg.ops,
                                         backend=backend, runs=st.runs, mean_ms=_num(st.mean_ms),
                                         p50_ms=_num(st.p50_ms), p95_ms=_num(st.p95_ms),
                                         failures=json.dumps(st.failures) if st.failures else ""))
        for s in report.summaries.values():
            writer.writerow(dict(sequence="", function="", segment="total", kind="total", graph_id="", ops="",
                                 backend=s.backend, runs="", mean_ms=_num(s.total_ms), p50_ms="", p95_ms="",
                                 failures=json.dumps(s.failures) if s.failures else ""))


def _num(v: float | None) -> str:
    return "" if v is None else repr(v)


def write_chart(report: ReportData, path: Path) -> None:
    """Horizontal bars: estimated ms per call for each backend, local Python and remote graphs."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    summaries = list(report.summaries.values())
    fig = Figure(figsize=(8, 1.6 + 0.45 * len(summaries)), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    names = [s.backend for s in summaries]
    local = [s.local_ms or 0.0 for s in summaries]
    graph = [s.graph_ms or 0.0 for s in summaries]
    y = list(range(len(names)))
    ax.barh(y, local, color="#9aa5b1", label="local Python (client)")
    ax.barh(y, graph, left=local, color="#3b82f6", label="graphs (worker)")
    for i, s in enumerate(summaries):
        text = "failed on some graph" if s.total_ms is None else f"{s.total_ms:.3f} ms"
        ax.text(local[i] + graph[i], i, "  " + text, va="center", fontsize=8)
    ax.set_yticks(y, names)
    ax.invert_yaxis()
    ax.set_xlabel("estimated ms per call")
    ax.set_title("remotorch profile: time per call by backend")
    ax.margins(x=0.25)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.5 / (1 + 0.3 * len(summaries))), ncol=2,
              fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, format="png")
