"""remotorch.explain, and the CLI's explain and backends commands (real worker servers on loopback)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import torch

import remotorch

from conftest import TOKEN, clean_env
from helpers import REPO


def with_a_break(x):
    y = torch.relu(x) * 2
    time.sleep(0.001)
    return y.sum(0) + 1


def test_explain_counts_graphs_and_shows_where_breaks_happen():
    e = remotorch.explain(with_a_break, torch.randn(4, 4))
    assert e.graph_count == 2 and e.graph_break_count == 1
    assert len(e.ops_per_graph) == 2
    assert "torch.relu" in e.ops_per_graph[0]
    (brk,) = e.breaks
    assert any(__file__ in frame and "time.sleep(0.001)" in frame for frame in brk.user_stack)
    assert "2 graph(s), 1 graph break(s)" in e.render()


def test_explain_takes_accelerated_functions_and_modules():
    fast = remotorch.accelerate(with_a_break, local_backend="eager")
    assert remotorch.explain(fast, torch.randn(3, 3)).graph_count == 2
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    e = remotorch.explain(model, torch.randn(2, 4))
    assert e.graph_count == 1 and e.graph_break_count == 0


def run_cli(*args, **env):
    src = str(REPO / "src")
    extra = {"PYTHONPATH": os.pathsep.join(filter(None, [src, env.pop("PYTHONPATH", "")]))}
    return subprocess.run([sys.executable, "-m", "remotorch", *args], capture_output=True, text=True,
                          timeout=300, env=clean_env(**extra, **env))


def test_cli_explain_runs_a_script_and_explains_its_accelerated_calls(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent("""
        import sys, time, torch, remotorch

        @remotorch.accelerate(local_backend="eager")
        def step(x):
            x = torch.cos(x) + 1
            time.sleep(0.001)
            return x * 3

        for _ in range(2):
            print(step(torch.randn(5)).shape, sys.argv[1:])
    """))
    proc = run_cli("explain", str(script), "--flag")
    assert proc.returncode == 0, proc.stderr
    assert "['--flag']" in proc.stdout  # the script got its own arguments
    assert "step: 2 graph(s), 1 graph break(s)" in proc.stdout
    assert f"{script}:7 in step: time.sleep(0.001)" in proc.stdout


def test_cli_explain_calls_module_functions(tmp_path):
    (tmp_path / "prog_mod.py").write_text(textwrap.dedent("""
        import torch, remotorch

        @remotorch.accelerate(local_backend="eager")
        def double(x):
            return x * 2

        def main():
            double(torch.ones(3))
    """))
    proc = run_cli("explain", "prog_mod:main", PYTHONPATH=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "double: 1 graph(s), 0 graph break(s)" in proc.stdout
    nothing = run_cli("explain", "prog_mod:double", PYTHONPATH=str(tmp_path))
    assert nothing.returncode == 1 and "raised TypeError" in nothing.stderr  # called without its argument


def test_cli_backends_lists_every_worker(server, start_server):
    other = start_server(name="gpu0", extra_args=("--price-per-hour", "1.5"))
    proc = run_cli("backends", server.url, other.url, "--token", TOKEN)
    assert proc.returncode == 0, proc.stderr
    lines = [line.split() for line in proc.stdout.splitlines()]
    assert lines[0] == ["backend", "device", "$/hour", "worker", "url"]  # a plain table: not a terminal
    assert ["test/eager", "cpu", "0", server.url] in lines and ["gpu0/onnxrt", "cpu", "1.5", other.url] in lines
    assert ["gpu0/eager", "cpu", "1.5", other.url] in lines and "\x1b[" not in proc.stdout
    bad = run_cli("backends", server.url, "--token", "wrong-token-000000000")
    assert bad.returncode == 1 and "AuthenticationError" in bad.stderr
