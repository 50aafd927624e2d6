"""Busy-polling: ``serve --spin-us`` and ``Session(spin_us=)`` / ``REMOTORCH_SPIN_US``.

Spinning changes when each end sleeps, never what it answers: results stay
exact, other sessions stay served, a call longer than the window still
returns, and an idle worker stops spinning once its window has passed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

import remotorch
from remotorch import models

from conftest import TOKEN, clean_env, spawn_server


def _cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.fixture(scope="module")
def spinning_server():
    server = spawn_server(extra_args=("--spin-us", "3000"))
    yield server
    server.stop()


def test_spinning_ends_give_exact_results(spinning_server):
    torch.manual_seed(0)
    model = models.mlp().eval()
    with remotorch.Session(spinning_server.url, token=TOKEN, spin_us=3000) as session:
        compiled = remotorch.compile(model, session=session, fallback="raise")
        with torch.no_grad():
            for n in (1, 7, 32):
                x = torch.randn(n, 784)
                assert torch.equal(compiled(x), model(x))
        assert session.stats()["remote_calls"] == 3


def test_a_call_longer_than_the_spin_window_still_returns(spinning_server):
    # the client spins 20 µs, the worker needs far longer for a 512×512 matmul chain
    def chain(a):
        for _ in range(20):
            a = torch.tanh(a @ a)
        return a
    a = torch.randn(512, 512) / 30
    with remotorch.Session(spinning_server.url, token=TOKEN, spin_us=20) as session:
        compiled = remotorch.compile(chain, session=session, fallback="raise")
        with torch.no_grad():
            torch.testing.assert_close(compiled(a), chain(a))


def test_a_spinning_worker_serves_other_sessions(spinning_server):
    torch.manual_seed(1)
    model = models.mlp().eval()
    errors: list[str] = []

    def client(i: int) -> None:
        try:
            with remotorch.Session(spinning_server.url, token=TOKEN, spin_us=1000 * (i % 2)) as session:
                compiled = remotorch.compile(model, session=session, fallback="raise")
                with torch.no_grad():
                    for _ in range(20):
                        x = torch.randn(4, 784)
                        if not torch.equal(compiled(x), model(x)):
                            errors.append(f"client {i}: wrong result")
                            return
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(f"client {i}: {type(exc).__name__}: {exc}")

    with remotorch.Session(spinning_server.url, token=TOKEN) as warm, torch.no_grad():
        remotorch.compile(model, session=warm, fallback="raise")(torch.randn(4, 784))  # compile first
    threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads)
    assert errors == []


def test_an_idle_worker_stops_spinning(spinning_server):
    with remotorch.Session(spinning_server.url, token=TOKEN) as session:
        for _ in range(50):
            session.echo([b"x" * 64])
    time.sleep(0.5)  # far past the 3 ms window
    before = _cpu_seconds(spinning_server.proc.pid)
    time.sleep(2.0)
    used = _cpu_seconds(spinning_server.proc.pid) - before
    assert used < 0.5, f"an idle worker used {used:.2f} s of CPU in 2 s"


def test_bad_spin_settings_are_refused(monkeypatch):
    done = subprocess.run([sys.executable, "-m", "remotorch", "serve", "--spin-us", "-5"],
                          capture_output=True, text=True, env=clean_env(), stdin=subprocess.DEVNULL,
                          timeout=120)
    assert done.returncode == 2 and "--spin-us" in done.stderr
    with pytest.raises(ValueError, match="spin_us"):
        remotorch.Session("tcp://127.0.0.1:1", spin_us=-1)
    monkeypatch.setenv("REMOTORCH_SPIN_US", "fast")
    with pytest.raises(ValueError, match="REMOTORCH_SPIN_US"):
        remotorch.Session("tcp://127.0.0.1:1")


def test_embedded_worker_spins_when_the_session_does(monkeypatch):
    monkeypatch.delenv("REMOTORCH_URL", raising=False)
    monkeypatch.setenv("REMOTORCH_SPIN_US", "500")
    session = remotorch.Session()
    try:
        assert session.echo([b"ping"])[0].tobytes() == b"ping"
        args = session.embedded_worker.args
        assert args[args.index("--spin-us") + 1] == "500"
    finally:
        session.close()
