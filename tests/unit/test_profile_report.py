"""Report statistics from recorded calls: grouping, discarding, failures, totals, rendering.

These exercise the pure arithmetic of ``remotorch.profile.report`` on
recorded calls built by ``profile_helpers.call``; the tests against real
workers are in integration/test_profile.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from remotorch.profile.report import CLIENT
from remotorch.profile.render import render

from profile_helpers import BACKENDS as B, call, report_of


def test_local_segments_are_the_gaps_between_graphs():
    rec = call("f", ["g1", "g2"], start=5.0, gaps=(1.0, 2.0, 3.0), times={b: [1.0] for b in B})
    assert rec.local_ms() == pytest.approx([1.0, 2.0, 3.0])


def test_compile_calls_are_discarded_but_their_failures_count():
    times = {"w/eager": [1.0, 2.0, 3.0], "w/onnxrt": [4.0, 5.0, 6.0]}
    records = [call("f", ["g"], gaps=(9.0, 9.0), compiled=True, times=times, error=("w/onnxrt", "boom")),
               call("f", ["g"], gaps=(1.0, 2.0), times=times, error=("w/onnxrt", "boom")),
               call("f", ["g"], gaps=(3.0, 4.0), times=times)]
    report = report_of(records)
    assert (report.calls, report.timed_calls, report.compile_calls) == (3, 2, 1)
    (seq,) = report.sequences
    local0, graph, local1 = seq.segments
    assert local0.stats[CLIENT].runs == 2 and local0.stats[CLIENT].mean_ms == pytest.approx(2.0)
    assert local1.stats[CLIENT].mean_ms == pytest.approx(3.0)
    eager = graph.stats["w/eager"]
    assert eager.runs == 6 and eager.mean_ms == pytest.approx(2.0)
    assert eager.p50_ms == pytest.approx(np.percentile([1, 2, 3, 1, 2, 3], 50))
    assert eager.p95_ms == pytest.approx(np.percentile([1, 2, 3, 1, 2, 3], 95))
    onnx = graph.stats["w/onnxrt"]
    assert onnx.failures == {"boom": 2}  # the compile call's failure too
    assert onnx.runs == 3 and onnx.mean_ms == pytest.approx(5.0)  # the one timed call without failure
    assert report.totals["w/eager"] == pytest.approx(2.0 + 5.0)
    s = report.summaries["w/eager"]
    assert s.cost_per_million == pytest.approx(7.2 * 7.0 / 3.6)  # $/h x ms/call / 3.6e6 ms/h x 1e6
    assert s.network_ms == pytest.approx(0.5)
    assert report.summaries["w/onnxrt"].failures == {"boom": 2}


def test_totals_weight_sequences_by_calls_and_add_functions():
    t1 = {b: [1.0] for b in B}
    t2 = {b: [4.0] for b in B}
    records = [call("f", ["a"], gaps=(0.0, 0.0), times=t1) for _ in range(3)]
    records += [call("f", ["b"], gaps=(0.0, 0.0), times=t2)]
    records += [call("g", ["c"], gaps=(10.0, 0.0), times=t1)]
    report = report_of(records)
    assert len(report.sequences) == 3
    f_graph = (3 * 1.0 + 1 * 4.0) / 4
    assert report.summaries["w/eager"].graph_ms == pytest.approx(f_graph + 1.0)
    assert report.summaries["w/eager"].local_ms == pytest.approx(10.0, abs=1e-6)


def test_a_backend_that_never_ran_a_graph_has_no_total():
    records = [call("f", ["g"], gaps=(1.0, 1.0), times={b: [1.0] for b in B}, error=("w/onnxrt", "no"))
               for _ in range(2)]
    report = report_of(records)
    assert report.totals["w/onnxrt"] is None
    assert report.summaries["w/onnxrt"].cost_per_million is None
    text = render(report)
    assert "2x no" in text and "failures (graph runs, all calls)" in text


def test_abridged_rows_sum_the_other_graphs():
    graphs = [f"g{i}" for i in range(6)]
    times = {b: [1.0] for b in B}
    records = [call("f", graphs, gaps=(1.0,) * 7, times=times) for _ in range(2)]
    text = render(report_of(records), max_graphs=2)
    other = [line for line in text.splitlines() if "4 other graphs" in line]
    assert len(other) == 1 and "4.000" in other[0]  # four graphs of 1 ms, summed
    assert "local (7 segments)" in text and "7.000" in text.split("local (7 segments)")[1].splitlines()[0]
