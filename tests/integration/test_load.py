"""Load: 16 client processes x 500 calls each against one real worker, mixed graphs.

Runs ``benchmarks/load.py`` (the same code that reports throughput and p99)
and requires zero errors and zero wrong results; the figures themselves are
the benchmark's to print, not this test's to judge.
"""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import clean_env
from helpers import REPO

SCRIPT = REPO / "benchmarks" / "load.py"


def test_sixteen_clients_five_hundred_calls_each():
    done = subprocess.run([sys.executable, str(SCRIPT), "--clients", "16", "--calls", "500", "--no-baseline",
                           "--json"], capture_output=True, text=True, env=clean_env(), timeout=540)
    assert done.returncode in (0, 1), done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])["load"]
    assert report["calls"] == 16 * 500
    assert report["errors"] == 0, report["error_samples"]
    assert report["wrong"] == 0
    assert report["ok"] == 16 * 500
    assert done.returncode == 0
