"""Smoke test of ``benchmarks/peers.py``: it runs end to end and reports every figure.

The benchmark runs as a user runs it (a fresh process, ``--quick --json``):
real peer servers, a local Ray, a torch RPC group and four real
``remotorch serve`` workers. Performance is judged by the script's own exit
status (0 or 1, PASS or FAIL), not here: this test only checks that every
system ran every model, that each figure is a finite time, and that every
system's outputs matched the local model's.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

from helpers import REPO

SCRIPT = REPO / "benchmarks" / "peers.py"
SYSTEMS = {"local", "floor", "floor compiled", "pickle/zmq", "torch RPC", "Ray", "remotorch tcp", "remotorch unix",
           "remotorch tcp spin", "remotorch tcp metrics"}
MODELS = {"mlp", "block", "gpt2"}


def run_quick() -> tuple[subprocess.CompletedProcess, dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REMOTORCH_", "RAY_ADDRESS"))}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json"], capture_output=True, text=True,
                          timeout=400, env=env)
    assert proc.returncode in (0, 1), f"exit {proc.returncode}:\n{proc.stderr[-4000:]}"
    return proc, json.loads(proc.stdout)


def test_quick_run_reports_every_system_and_model_with_matching_outputs():
    proc, data = run_quick()
    assert set(data["systems"]) == SYSTEMS and set(data["models"]) == MODELS
    assert data["quick"] is True and len(data["runs"]) == 1
    rows = data["runs"][0]
    assert set(rows) == MODELS
    for model in MODELS:
        assert set(rows[model]["rows"]) == SYSTEMS, model
        for system, row in rows[model]["rows"].items():
            assert math.isfinite(row["median_us"]) and row["median_us"] > 0, (model, system, row)
            assert math.isfinite(row["p99_us"]) and row["p99_us"] >= row["median_us"], (model, system, row)
            assert row["n"] == data["plans"][model][0] * data["plans"][model][1]
        for system in ("remotorch tcp", "remotorch unix", "remotorch tcp spin", "remotorch tcp metrics"):
            assert rows[model]["rows"][system]["worker_graph_mean_us"] > 0
        ratios = rows[model]["ratios"]
        assert ratios["best_peer"] in ("pickle/zmq", "torch RPC", "Ray")
        assert all(math.isfinite(ratios["remotorch tcp"][k]) for k in ("vs_best_peer", "vs_floor", "vs_compiled_floor"))
        assert ratios["compiled_floor_vs_floor"] > 0
        share = data["shares"][model]
        assert share["compiled_floor_vs_floor"] > 0 and share["remotorch_vs_compiled_floor"] > 0
        # every system's output was checked against local after warm-up and after each round
        matched = data["matched"][model]
        assert set(matched) == SYSTEMS
        for system, m in matched.items():
            assert m["checks"] == 1 + data["plans"][model][0], (model, system, m)
            assert m["max_abs_diff"] <= 1e-3, (model, system, m)
    # the verdict and the exit status agree; the targets themselves are the script's business
    names = [t["name"] for t in data["targets"]]
    assert any("best peer" in n for n in names) and any("floor" in n for n in names)
    assert any("--metrics" in n for n in names)
    assert data["passed"] == all(t["pass"] for t in data["targets"]) == (proc.returncode == 0)
    assert "Targets" in proc.stderr and ("PASS" in proc.stderr or "FAIL" in proc.stderr)
