"""``remotorch top``: the operator's live view of real workers, in a pipe and at a terminal, and the
``Stats`` request it is built on (an operator's token only)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
import torch

import remotorch
from remotorch import errors
from remotorch.codec import messages as m

from conftest import TOKEN, clean_env
from helpers import Lines, default_ctrl_c
from test_rich_output_terminal import ESC, run_in_terminal
from test_tenants import ALICE, mlp, table

OPS = "rmt_ops-0123456789abcdef"


@pytest.fixture
def shared(start_server, tmp_path):
    path = tmp_path / "tokens.toml"
    path.write_text(table("alice", ALICE) + table("ops", OPS, operator=True))
    return start_server(token=None, name="shared", extra_args=("--tokens", str(path)))


def busy_alice(url: str) -> str:
    """Alice runs a model a few times and makes one error; the graph id her runs used."""
    torch._dynamo.reset()
    model, x = mlp(40), torch.randn(4, 16)
    with remotorch.Session(url, token=ALICE) as s, torch.no_grad():
        compiled = remotorch.compile(model, session=s, fallback="raise")
        for _ in range(5):
            assert torch.equal(compiled(x), model(x))
        with pytest.raises(errors.MissingObjectsError):
            s.connection.request(m.Fetch([m.HandleArg(424242)]))
        (gid,) = s.connection.graphs
    torch._dynamo.reset()
    return gid


def test_stats_counts_tenants_graphs_and_errors_for_an_operator_only(shared):
    gid = busy_alice(shared.url)
    with remotorch.Session(shared.url, token=ALICE) as s:
        with pytest.raises(errors.AuthenticationError, match="only an operator"):
            s.connection.request(m.Stats(), expect=m.StatsReply)
    with remotorch.Session(shared.url, token=OPS) as s:
        reply, _ = s.connection.request(m.Stats(), expect=m.StatsReply)
    tenants = {t.name: t for t in reply.tenants}
    assert tenants["alice"].requests >= 7 and tenants["alice"].errors == 2  # the Fetch, and asking Stats
    assert tenants["alice"].sessions == 0 and tenants["ops"].sessions == 1
    (graph,) = [g for g in reply.slowest if gid.startswith(g.graph)]
    assert (graph.engine, graph.tenant, graph.runs) == ("eager", "alice", 5) and graph.max_ms >= graph.mean_ms > 0
    kinds = [(e.tenant, e.request, e.kind) for e in reply.recent_errors]
    assert ("alice", "fetch", "missing") in kinds and ("alice", "stats", "auth") in kinds
    assert reply.host_memory_bytes > 10 << 20 and reply.requests == sum(t.requests for t in reply.tenants)
    for e in reply.recent_errors:
        assert ALICE not in e.message and OPS not in e.message


def test_top_in_a_pipe_prints_each_refresh_as_plain_text(shared):
    busy_alice(shared.url)
    done = subprocess.run([sys.executable, "-m", "remotorch", "top", shared.url, "--token", OPS, "--count", "2",
                           "--interval", "0.3"], capture_output=True, text=True, timeout=120,
                          env=clean_env())
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert ESC not in out and out.count("shared (tcp://") == 2  # two refreshes
    assert "tenants" in out and "alice" in out and "ops" in out and "requests/s" in out
    assert "slowest graphs" in out and "eager" in out and "recent errors" in out and "missing" in out


def test_top_at_a_terminal_redraws_and_ends_cleanly_on_ctrl_c(start_server):
    srv = start_server(name="watched")  # one --token: its holder is the operator
    env = clean_env(COLUMNS="120", TERM="xterm")
    out = run_in_terminal([sys.executable, "-m", "remotorch", "top", srv.url, "--token", TOKEN, "--count", "3",
                           "--interval", "0.2"], env)
    assert ESC in out and "watched" in out and "tenants" in out and "Traceback" not in out
    proc = subprocess.Popen([sys.executable, "-X", "faulthandler", "-m", "remotorch", "top", srv.url, "--token", TOKEN,
                             "--interval", "0.2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=default_ctrl_c)
    stdout, stderr = Lines(proc.stdout), Lines(proc.stderr)
    stdout.wait_for(lambda line: f"watched ({srv.url})" in line)  # its first redraw: it runs
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:  # hung after Ctrl-C: its threads' stacks say where
        proc.send_signal(signal.SIGABRT)
        proc.wait(timeout=30)
        raise AssertionError(f"remotorch top did not end 60 s after Ctrl-C:\n{stderr.text()[-6000:]}") from None
    assert proc.returncode == 0 and "Traceback" not in stderr.text() and "watched" in stdout.text(), stderr.text()


def test_top_says_which_worker_it_cannot_ask(shared):
    done = subprocess.run([sys.executable, "-m", "remotorch", "top", shared.url, "--token", ALICE, "--count", "1"],
                          capture_output=True, text=True, timeout=120, env=clean_env())
    assert done.returncode == 0 and f"{shared.url}: AuthenticationError" in done.stdout
