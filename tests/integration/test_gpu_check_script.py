"""``scripts/gpu-check.sh`` in its CPU mode (``--device cpu --quick``), so that the script a GPU machine
runs cannot break unseen between two such machines.

It runs in a copy of the checkout: the script builds the compiled framing in
place, which must not touch the files this run's workers have loaded.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

from conftest import clean_env
from helpers import REPO

PARTS = ("src", "tests", "benchmarks", "scripts", "docs")
FILES = ("setup.py", "pyproject.toml", "conftest.py", "README.md")


def test_gpu_check_runs_every_part_on_the_cpu_and_writes_its_report(tmp_path):
    checkout = tmp_path / "checkout"
    for part in PARTS:
        shutil.copytree(REPO / part, checkout / part, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    for name in FILES:
        shutil.copy2(REPO / name, checkout / name)
    out = tmp_path / "out"
    env = clean_env(PYTHON=sys.executable)
    env.pop("PYTHONPATH", None)  # the script's own: the copy's src
    done = subprocess.run(["bash", str(checkout / "scripts" / "gpu-check.sh"), str(out), "--device", "cpu", "--quick"], capture_output=True,
                          text=True, env=env, stdin=subprocess.DEVNULL, timeout=1800)
    assert done.returncode == 0, (done.stdout[-6000:], done.stderr[-3000:])
    assert "gpu_check: every part passed" in (out / "gpu_check.log").read_text()
    assert "pytest -m gpu exit 0; gpu_check.py exit 0" in done.stdout
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["env"]["device"] == "cpu"
    assert {"engines", "data_parallel", "targets", "profile"} <= set(report)
    assert (out / "gpu_check.md").read_text().strip()
    assert (out / "setup.log").read_text().startswith("setup:")
