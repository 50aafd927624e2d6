"""``benchmarks/wan.py``'s verdicts: targets judged on the median of the runs, and, for the cases with a
control row, what remotorch costs beyond a bare round trip through the same proxy."""

from __future__ import annotations

import sys

import pytest

from helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
report = pytest.importorskip("_wan.report")


def row(case: str, system: str, remote_ms: float, local_ms: float, rtt_ms: float = 20.0) -> dict:
    return {"case": case, "system": system, "rtt_ms": rtt_ms, "remote_ms": remote_ms, "local_ms": local_ms,
            "over_rtt": (remote_ms - local_ms) / rtt_ms, "note": None}


def test_the_generate_target_is_judged_on_the_median_run_and_the_cost_beyond_an_echo_is_printed():
    runs = [[row("generate", report.REMOTORCH, 24.0, 1.0), row("generate", report.CONTROL, 21.5, 1.0),
             row("generate", report.REMOTORCH, 9.0, 1.0, rtt_ms=2.0)],  # another RTT: not judged
            [row("generate", report.REMOTORCH, 22.0, 1.0), row("generate", report.CONTROL, 21.2, 1.0)],
            [row("generate", report.REMOTORCH, 23.0, 1.5), row("generate", report.CONTROL, 21.9, 1.5)]]
    targets = report.judge(runs, step_inputs=512)
    assert [t["per_run"] for t in targets] == [[23 / 20, 21 / 20, 21.5 / 20]]
    assert targets[0]["value"] == pytest.approx(21.5 / 20) and not targets[0]["pass"]  # 1.075 > 1.05

    lines: list[str] = []
    report.print_targets(targets, runs, lines.append, echo_ms=[20.25, 20.5, 20.4])
    text = "\n".join(lines)
    assert "FAIL" in text and "runs 1.150, 1.050, 1.075" in text
    assert "gives 1.020, runs 1.025, 1.010, 1.020" in text  # the control's floor
    beyond = [line for line in lines if "beyond the round trip" in line]
    assert len(beyond) == 1 and "ms per token" in beyond[0]
    assert "proxy 2.75, 0.50, 1.10;" in beyond[0]  # remote - local - echo, per run
    assert "20 ms 0.50, 0.20, 0.40)" in beyond[0]  # the control's remote - local - RTT

    lines.clear()
    report.print_targets(targets, runs, lines.append)  # no echo measured: no such line
    assert not [line for line in lines if "beyond the round trip" in line]
