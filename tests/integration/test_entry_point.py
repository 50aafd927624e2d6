"""``torch.compile(model, backend="remotorch")`` works through the installed entry point alone."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import remotorch
import remotorch.client.session

from conftest import TOKEN, clean_env

SCRIPT = textwrap.dedent("""
    import sys
    import torch

    assert "remotorch" not in sys.modules
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).eval()
    compiled = torch.compile(model, backend="remotorch")
    x = torch.randn(5, 16)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(compiled(x), model(x))
    assert "remotorch" in sys.modules  # dynamo loaded the backend through the entry point

    import remotorch  # only now, to look at what happened
    session = remotorch.default_session()
    stats = session.stats()
    assert stats["remote_calls"] == 3, stats
    assert stats["fallbacks"] == 0, stats
    assert stats["graphs_uploaded"] == 1, stats
    print("NAME", session.health()["name"])
    session.close()
    print("ENTRY-POINT-OK")
""")


def test_string_backend_without_importing_remotorch(server):
    env = clean_env(REMOTORCH_URL=server.url, REMOTORCH_TOKEN=TOKEN)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "ENTRY-POINT-OK" in proc.stdout
    assert "NAME test" in proc.stdout  # it ran on the fixture server, not on an embedded worker


def test_string_backend_with_options_in_process(session):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()).eval()
    compiled = torch.compile(model, backend="remotorch", options={"session": session, "fallback": "raise"})
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert torch.equal(compiled(x), model(x))
    assert session.stats()["remote_calls"] == 1

    torch._dynamo.reset()
    bad = torch.compile(model, backend="remotorch", options={"session": session, "colour": "blue"})
    with pytest.raises(Exception, match="colour"):
        bad(x)


def test_default_session_reads_the_environment(server, monkeypatch):
    monkeypatch.setenv("REMOTORCH_URL", server.url)
    monkeypatch.setenv("REMOTORCH_TOKEN", TOKEN)
    monkeypatch.setattr(remotorch.client.session, "_default", None)
    session = remotorch.default_session()
    try:
        assert session.url == server.url
        assert not session.embedded
        assert remotorch.default_session() is session
        torch.manual_seed(0)
        model = torch.nn.Linear(5, 2).eval()
        compiled = remotorch.compile(model, fallback="raise")  # no session: the default one
        x = torch.randn(4, 5)
        with torch.no_grad():
            assert torch.equal(compiled(x), model(x))
        assert session.stats()["remote_calls"] == 1
        assert session.health()["name"] == "test"
    finally:
        session.close()
    assert remotorch.default_session() is not session  # a closed default is replaced
    remotorch.default_session().close()
