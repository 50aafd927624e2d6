"""TLS around the transport: encrypted bytes, a checked worker certificate, the token still required."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import remotorch
from remotorch import errors

from conftest import TOKEN, clean_env
from tcp_tap import Tap
from tls_certs import self_signed

MARKER = b"remotorch-plaintext-marker-7f3a9c"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    return {"worker": self_signed(d, "worker"), "other": self_signed(d, "other")}


@pytest.fixture(scope="module")
def tls_server(start_module_server, certs):
    crt, key = certs["worker"]
    return start_module_server(name="tls", extra_args=("--tls-cert", crt, "--tls-key", key))


def marker_tensor() -> torch.Tensor:
    return torch.frombuffer(bytearray(MARKER * 64), dtype=torch.uint8)


def echo_through(url: str, ca: str | None) -> tuple[list, bytes]:
    """Echo a tensor holding the marker through a tap in front of ``url``; what came back, what crossed."""
    scheme, rest = url.split("://")
    host, port = rest.rsplit(":", 1)
    tap = Tap((host, int(port)))
    try:
        with remotorch.Session(f"{scheme}://127.0.0.1:{tap.port}", token=TOKEN, tls_ca=ca) as s:
            out = s.echo([marker_tensor().numpy()])
            assert s.health()["name"] in ("tls", "test")
        return out, tap.seen
    finally:
        tap.close()


def test_tls_session_runs_a_model_correctly(tls_server, certs):
    assert tls_server.url.startswith("tls://")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).eval()
    with remotorch.Session(tls_server.url, token=TOKEN, tls_ca=certs["worker"][0]) as s:
        compiled = remotorch.compile(model, session=s, fallback="raise")
        with torch.no_grad():
            for n in (3, 5):
                x = torch.randn(n, 16)
                assert torch.equal(compiled(x), model(x))
        assert s.stats()["remote_calls"] == 2


def test_tls_hides_the_bytes_plain_tcp_shows_them(tls_server, server, certs):
    out, seen = echo_through(tls_server.url, certs["worker"][0])
    assert bytes(out[0]) == MARKER * 64
    assert len(seen) > len(MARKER) * 64  # the tensor did cross the tap, encrypted
    assert MARKER not in seen
    # the control: the same exchange over plain TCP carries the marker in the clear
    out, seen = echo_through(server.url, None)
    assert bytes(out[0]) == MARKER * 64
    assert MARKER in seen


def test_tls_carries_large_frames_both_ways(tls_server, certs):
    """Frames over the inline size stream in pieces with their tag, through TLS too."""
    import numpy as np

    rng = np.random.default_rng(7)
    with remotorch.Session(tls_server.url, token=TOKEN, tls_ca=certs["worker"][0]) as s:
        for size in (20 << 10, 3 << 20):
            payload = rng.integers(0, 256, size, dtype=np.uint8)
            out = s.echo([payload, payload[: size // 3]])
            assert np.array_equal(np.asarray(out[0]), payload)
            assert np.array_equal(np.asarray(out[1]), payload[: size // 3])
        assert s.health()["name"] == "tls"


def test_untrusted_certificate_is_an_authentication_error(tls_server, certs):
    with remotorch.Session(tls_server.url, token=TOKEN, tls_ca=certs["other"][0]) as s:
        with pytest.raises(errors.AuthenticationError, match="certificate"):
            s.health()
    with remotorch.Session(tls_server.url, token=TOKEN) as s:  # system CAs do not know a self-signed cert
        with pytest.raises(errors.AuthenticationError):
            s.health()
    assert tls_server.alive()


def test_wrong_token_over_tls_is_refused(tls_server, certs):
    with remotorch.Session(tls_server.url, token="not-the-token", tls_ca=certs["worker"][0]) as s:
        with pytest.raises(errors.AuthenticationError):
            s.health()


def test_plain_client_to_tls_worker_and_back_fail_cleanly(tls_server, server, certs):
    plain_url = tls_server.url.replace("tls://", "tcp://")
    with remotorch.Session(plain_url, token=TOKEN, connect_timeout=5, timeout=5, retry_after=0) as s:
        with pytest.raises((errors.WorkerUnavailableError, errors.ProtocolError)):
            s.health()
    tls_url = server.url.replace("tcp://", "tls://")
    with remotorch.Session(tls_url, token=TOKEN, tls_ca=certs["worker"][0], connect_timeout=5,
                           timeout=5, retry_after=0) as s:
        with pytest.raises((errors.ProtocolError, errors.WorkerUnavailableError)):
            s.health()
    with remotorch.Session(tls_server.url, token=TOKEN, tls_ca=certs["worker"][0]) as s:
        assert s.health()["name"] == "tls"  # both workers keep serving
    assert server.alive() and tls_server.alive()


def test_health_command_over_tls(tls_server, certs):
    cmd = [sys.executable, "-m", "remotorch", "health", tls_server.url, "--token", TOKEN,
           "--tls-ca", certs["worker"][0]]
    done = subprocess.run(cmd, capture_output=True, text=True, env=clean_env(), timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "healthy: tls://" in done.stdout


def test_serve_refuses_a_missing_certificate(tmp_path):
    cmd = [sys.executable, "-m", "remotorch", "serve", "--port", "0", "--tls-cert", str(tmp_path / "none.crt")]
    done = subprocess.run(cmd, capture_output=True, text=True, env=clean_env(), timeout=120)
    assert done.returncode == 2
    assert "remotorch serve:" in done.stderr
