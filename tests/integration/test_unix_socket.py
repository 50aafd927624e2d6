"""Workers on this host over a Unix socket: ``remotorch serve --unix PATH``, ``unix://PATH`` URLs.

Same framing, handshake and token as TCP; the socket file is private to
its user, replaced when stale, refused when a live worker holds it, and
removed when the worker stops. The embedded default worker listens on one.
"""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys

import pytest
import torch

import remotorch
from remotorch import errors, models
from remotorch.client.embedded import EmbeddedWorker
from remotorch.transport.client import parse_url

from conftest import TOKEN, clean_env, spawn_server, wait_until


@pytest.fixture
def sock_path(tmp_path):
    return str(tmp_path / "w.sock")


def test_unix_worker_runs_graphs_and_keeps_weights_resident(sock_path):
    server = spawn_server(extra_args=("--unix", sock_path))
    try:
        assert server.url == f"unix://{sock_path}"
        mode = os.stat(sock_path).st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
        torch.manual_seed(0)
        model = models.mlp().eval()
        with remotorch.Session(server.url, token=TOKEN) as session:
            assert session.health()["name"] == "test"
            compiled = remotorch.compile(model, session=session, fallback="raise")
            with torch.no_grad():
                for n in (3, 5):
                    x = torch.randn(n, 784)
                    assert torch.equal(compiled(x), model(x))
            stats = session.stats()
            assert stats["remote_calls"] == 2 and stats["fallbacks"] == 0
            assert stats["tensors_uploaded"] == 4  # two weights, two biases: once
            big = torch.randn(1 << 20)  # 4 MiB: the streamed, chunk-tagged path
            echoed = session.echo([big.numpy()])[0]
            assert bytes(memoryview(echoed)) == big.numpy().tobytes()
    finally:
        server.stop()


def test_unix_worker_refuses_a_wrong_token(sock_path):
    server = spawn_server(extra_args=("--unix", sock_path))
    try:
        with remotorch.Session(server.url, token="not-the-token") as session:
            with pytest.raises(errors.AuthenticationError):
                session.health()
        with remotorch.Session(server.url, token=TOKEN) as session:
            assert session.health()["protocol"] == remotorch.codec.messages.PROTOCOL_VERSION
    finally:
        server.stop()


def test_cli_health_over_a_unix_socket(sock_path):
    server = spawn_server(extra_args=("--unix", sock_path))
    try:
        ok = subprocess.run([sys.executable, "-m", "remotorch", "health", server.url, "--token", TOKEN],
                            capture_output=True, text=True, env=clean_env(), timeout=120)
        assert ok.returncode == 0, ok.stderr
        assert "test" in ok.stdout
    finally:
        server.stop()
    down = subprocess.run([sys.executable, "-m", "remotorch", "health", server.url, "--token", TOKEN],
                          capture_output=True, text=True, env=clean_env(), timeout=120)
    assert down.returncode == 1


def test_socket_file_removed_on_sigterm_and_stale_one_replaced(sock_path):
    server = spawn_server(extra_args=("--unix", sock_path))
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=60) == 0
    assert not os.path.exists(sock_path)
    server.stop()
    # a socket file nobody listens on (left by a killed worker) is replaced
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(sock_path)
    stale.close()
    assert os.path.exists(sock_path)
    again = spawn_server(extra_args=("--unix", sock_path))
    try:
        with remotorch.Session(again.url, token=TOKEN) as session:
            assert session.health()["name"] == "test"
    finally:
        again.stop()


def test_a_live_workers_socket_is_not_taken_over(sock_path):
    server = spawn_server(extra_args=("--unix", sock_path))
    try:
        second = subprocess.run([sys.executable, "-m", "remotorch", "serve", "--unix", sock_path,
                                 "--token", TOKEN], capture_output=True, text=True, env=clean_env(),
                                stdin=subprocess.DEVNULL, timeout=120)
        assert second.returncode == 2
        assert "already listening" in second.stderr
        with remotorch.Session(server.url, token=TOKEN) as session:
            assert session.health()["name"] == "test"  # the first one still serves
    finally:
        server.stop()


@pytest.mark.parametrize("args, message", [
    (("--unix", "relative.sock"), "absolute path"),
    (("--unix", "/tmp/x.sock", "--tls-cert", "/nonexistent.pem"), "only on this host"),
])
def test_serve_refuses_bad_unix_options(args, message):
    done = subprocess.run([sys.executable, "-m", "remotorch", "serve", *args], capture_output=True,
                          text=True, env=clean_env(), stdin=subprocess.DEVNULL, timeout=120)
    assert done.returncode == 2
    assert message in done.stderr


def test_serve_refuses_a_path_that_is_not_a_socket(tmp_path):
    path = tmp_path / "plain-file"
    path.write_text("keep me")
    done = subprocess.run([sys.executable, "-m", "remotorch", "serve", "--unix", str(path)],
                          capture_output=True, text=True, env=clean_env(), stdin=subprocess.DEVNULL,
                          timeout=120)
    assert done.returncode == 2 and "not a socket" in done.stderr
    assert path.read_text() == "keep me"


@pytest.mark.parametrize("url", ["unix://relative.sock", "unix:", "http://x:1"])
def test_bad_addresses_are_value_errors(url):
    with pytest.raises(ValueError):
        parse_url(url)


def test_unreachable_unix_worker_falls_back_or_raises(tmp_path):
    url = f"unix://{tmp_path / 'nobody.sock'}"
    torch.manual_seed(0)
    model = models.mlp().eval()
    x = torch.randn(2, 784)
    with remotorch.Session(url, token=TOKEN) as session:
        strict = remotorch.compile(model, session=session, fallback="raise")
        with torch.no_grad(), pytest.raises(errors.WorkerUnavailableError):
            strict(x)
    with remotorch.Session(url, token=TOKEN) as session:
        lenient = remotorch.compile(model, session=session, fallback="local")
        with torch.no_grad(), pytest.warns(errors.RemoteFallbackWarning):
            assert torch.equal(lenient(x), model(x))
        assert session.stats()["fallbacks"] == 1


def test_embedded_worker_over_tcp_when_asked(monkeypatch):
    monkeypatch.setenv("REMOTORCH_EMBEDDED_TRANSPORT", "tcp")
    monkeypatch.delenv("REMOTORCH_URL", raising=False)
    with remotorch.Session(device="cpu") as session:
        assert session.health()["name"] == "local"  # the session reached it
        worker = session.embedded_worker
        assert worker.transport == "tcp" and worker.url.startswith("tcp://127.0.0.1:")
        assert session.connection.url == worker.url
        assert session.echo([b"over tcp"])[0].tobytes() == b"over tcp"
    assert not worker.alive()


def test_embedded_worker_socket_directory_is_private_and_removed():
    worker = EmbeddedWorker("cpu", transport="unix")
    directory = os.path.dirname(worker.url[len("unix://"):])
    try:
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        with remotorch.Session(worker.url, token=worker.token) as session:
            assert session.health()["name"] == "local"
    finally:
        worker.stop()
    assert wait_until(lambda: not os.path.exists(directory))
    with pytest.raises(ValueError):
        EmbeddedWorker("cpu", transport="carrier-pigeon")
