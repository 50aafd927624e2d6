"""The ``remotorch`` command line: health checks and the refusal to serve openly without a token."""

from __future__ import annotations

import subprocess
import sys

from conftest import TOKEN, clean_env, closed_port


def remotorch_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "remotorch", *args], capture_output=True, text=True,
                          env=clean_env(), timeout=timeout)


def test_health_of_a_running_worker(server):
    proc = remotorch_cli("health", server.url, "--token", TOKEN)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "healthy" in proc.stdout
    assert "test" in proc.stdout  # the worker's name
    assert "eager" in proc.stdout


def test_health_with_a_wrong_token_fails(server):
    proc = remotorch_cli("health", server.url, "--token", "not-the-token")
    assert proc.returncode != 0
    assert "unhealthy" in proc.stdout
    assert server.alive()


def test_health_of_a_closed_port_fails():
    proc = remotorch_cli("health", f"tcp://127.0.0.1:{closed_port()}", "--token", TOKEN, "--timeout", "2")
    assert proc.returncode != 0
    assert "unhealthy" in proc.stdout


def test_serve_on_all_interfaces_without_a_token_is_refused():
    proc = remotorch_cli("serve", "--host", "0.0.0.0", "--port", "0", timeout=60)
    assert proc.returncode != 0
    assert "token" in proc.stderr.lower()
    assert "serving on" not in proc.stdout


def test_serve_refuses_a_hold_engine_without_a_valid_time():
    proc = remotorch_cli("serve", "--port", "0", "--engines", "eager,hold:-1", timeout=60)
    assert proc.returncode == 2
    assert "hold:-1" in proc.stderr and "seconds" in proc.stderr
    assert "serving on" not in proc.stdout
