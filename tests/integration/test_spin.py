"""Busy-polling: ``serve --spin-us`` and ``Session(spin_us=)`` / ``REMOTORCH_SPIN_US``.

Spinning changes when each end sleeps, never what it answers: results stay
exact, other sessions stay served, a call longer than the window still
returns. Each end does spin (its CPU time shows the window spent polling),
and an idle worker stops spinning once its window has passed.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

import remotorch
from remotorch import models

from conftest import TOKEN, clean_env


def _cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _asleep(pid: int, timeout: float = 60.0) -> bool:
    """Wait until process ``pid`` no longer spins: a tenth of a second in which it used at most 2 clock
    ticks of CPU (a spinning one uses all ten). False if it still spins after ``timeout`` seconds."""
    tick = 1 / os.sysconf("SC_CLK_TCK")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        before = _cpu_seconds(pid)
        time.sleep(0.1)
        if _cpu_seconds(pid) - before <= 2 * tick + 1e-9:
            return True
    return False


@pytest.fixture(scope="module")
def spinning_server(start_module_server):
    return start_module_server(extra_args=("--spin-us", "3000"))


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


WINDOW = 0.25  # seconds: a spin window long enough to show in CPU time
HOLD = 0.6  # a call the worker holds for longer than the window


@pytest.fixture(scope="module")
def wide_spinner(start_module_server):
    return start_module_server(name="wide", extra_args=("--spin-us", f"{WINDOW * 1e6:g}",
                                                        "--engines", f"eager,hold:{HOLD:g}"))


def test_a_worker_spins_for_its_window_after_each_request_and_then_sleeps(wide_spinner):
    pid = wide_spinner.proc.pid
    with remotorch.Session(wide_spinner.url, token=TOKEN) as session:
        session.echo([b"x"])
        assert _asleep(pid)
        before = _cpu_seconds(pid)
        for _ in range(4):
            session.echo([b"x" * 64])  # a few microseconds of work, then a window of busy-polling
            assert _asleep(pid), "the worker spun on past its window"
        spun = _cpu_seconds(pid) - before
    # a worker that sleeps at once needs milliseconds; one that spins, up to 4 windows (less on a busy host)
    assert spun >= WINDOW, f"4 requests cost the worker only {spun:.2f} s of CPU: it did not spin"
    assert _asleep(pid)  # past the window that followed the session's last message
    before = _cpu_seconds(pid)
    time.sleep(2.0)
    used = _cpu_seconds(pid) - before
    assert used < 0.3, f"an idle worker used {used:.2f} s of CPU in 2 s"


def test_a_client_spins_for_its_window_while_its_call_runs_then_waits_asleep(wide_spinner):
    """A call held longer than the client's window still returns; the window was spent busy-polling."""
    x = torch.randn(16)
    cpu = {}
    for spin_us in (WINDOW * 1e6, 0):
        with remotorch.Session(wide_spinner.url, token=TOKEN, spin_us=spin_us) as session:
            compiled = remotorch.compile(lambda a: a * 3, session=session, engine=f"hold:{HOLD:g}",
                                         fallback="raise")
            assert torch.equal(compiled(x), x * 3)  # compiled, uploaded
            spent = []
            for _ in range(2):  # the lesser of two: one call may also pay for what the host did to us
                assert _asleep(wide_spinner.proc.pid)  # the worker's own window after the last reply is over
                gc.disable()  # late in a long run one full collection alone can cost ~100 ms of this thread
                try:
                    start, started_at = time.thread_time(), time.monotonic()
                    assert torch.equal(compiled(x), x * 3)
                    assert time.monotonic() - started_at >= HOLD
                    spent.append(time.thread_time() - start)
                finally:
                    gc.enable()
            cpu[spin_us] = min(spent)
        torch._dynamo.reset()
    # polling through the window costs up to WINDOW of this thread's CPU time (less on a busy host);
    # without a window the thread sleeps through the call: a millisecond or so, up to a few tens on a
    # host that reclaims idle memory (every page the call touches after the sleep faults back in)
    assert cpu[WINDOW * 1e6] >= WINDOW / 5, cpu
    assert cpu[0] < WINDOW / 3 and cpu[0] < cpu[WINDOW * 1e6] / 4, cpu  # (a loaded host: up to ~65 ms seen)


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


def test_auto_spin_polls_until_two_waits_in_a_row_outlast_its_window():
    from remotorch.transport.base import AUTO_SPIN_S, Spin

    spin = Spin(None)
    if spin.window == 0.0:
        pytest.skip("this process may run on one CPU only: auto never spins here")
    assert spin.window == AUTO_SPIN_S and spin.budget() == AUTO_SPIN_S
    spin.waited(AUTO_SPIN_S * 5)  # one long wait (a pause before a burst): still polls for the next
    assert spin.budget() == AUTO_SPIN_S
    spin.waited(AUTO_SPIN_S / 4)  # back to back again
    spin.waited(AUTO_SPIN_S * 5)
    assert spin.budget() == AUTO_SPIN_S
    spin.waited(AUTO_SPIN_S * 5)  # two in a row: the other end is slow or idle, sleep from now on
    assert spin.budget() == 0.0
    spin.waited(AUTO_SPIN_S * 5)
    assert spin.budget() == 0.0
    spin.waited(AUTO_SPIN_S / 4)  # replies come back to back again: poll again
    assert spin.budget() == AUTO_SPIN_S
    fixed = Spin(0.002)
    fixed.waited(1.0)  # a fixed window polls whatever the waits were
    assert fixed.budget() == 0.002
    assert Spin(0).budget() == 0.0


def test_spin_is_auto_by_default_and_zero_turns_it_off(monkeypatch):
    monkeypatch.delenv("REMOTORCH_SPIN_US", raising=False)
    assert remotorch.Session("tcp://127.0.0.1:1")._spin_s is None
    monkeypatch.setenv("REMOTORCH_SPIN_US", "auto")
    assert remotorch.Session("tcp://127.0.0.1:1")._spin_s is None
    monkeypatch.setenv("REMOTORCH_SPIN_US", "0")
    assert remotorch.Session("tcp://127.0.0.1:1")._spin_s == 0.0
    assert remotorch.Session("tcp://127.0.0.1:1", spin_us="auto")._spin_s is None


def test_an_auto_spinning_worker_is_fast_in_bursts_exact_and_idle_when_left_alone(server):
    # the shared test worker runs with the default, --spin-us auto
    pid = server.proc.pid
    torch.manual_seed(2)
    model = models.mlp().eval()
    with remotorch.Session(server.url, token=TOKEN) as session:
        compiled = remotorch.compile(model, session=session, fallback="raise")
        with torch.no_grad():
            for _ in range(50):  # a burst: both ends poll between the calls
                x = torch.randn(8, 784)
                assert torch.equal(compiled(x), model(x))
    assert _asleep(pid), "an idle auto-spinning worker went on spinning"
    before = _cpu_seconds(pid)
    time.sleep(2.0)
    used = _cpu_seconds(pid) - before
    assert used < 0.3, f"an idle auto-spinning worker used {used:.2f} s of CPU in 2 s"
