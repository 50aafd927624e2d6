"""Faults with real processes: a worker killed, frozen or stopped mid-call; a client killed or frozen.

The worker side keeps a session for its lease after the connection drops
(``--lease``), and frees it when the lease runs out; the client side turns a
dead or silent worker into ``WorkerUnavailableError`` within its timeout, or
into its local fallback.
"""

from __future__ import annotations

import copy
import os
import select
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import remotorch
from remotorch import errors
from remotorch.codec import messages as m
from remotorch.transport import TcpTransport

from conftest import TOKEN, clean_env, wait_until
from helpers import Probe, tiny_mlp

LEASE = 2.0  # heartbeats every LEASE / 3: a loaded host has over a second of slack
HOLD = 60.0  # the hold engine keeps a call in flight this long, on any machine
HOLDING = "hold engine: holding a graph run"  # what the worker logs as each hold begins

CLIENT = r"""
import sys, time, torch, remotorch
from remotorch.codec import messages as m
from remotorch.codec.tensors import content_id, tensor_to_wire
s = remotorch.Session(sys.argv[1], token=sys.argv[2])
t = torch.randn(1 << 19)
meta, buf = tensor_to_wire(t, 0)
s.connection.request(m.PutTensors([content_id(meta, buf)], [meta]), [buf])
print("ready", flush=True)
sent = s.stats()["messages_sent"]
while s.stats()["messages_sent"] < sent + 7:  # heartbeats every lease / 3: two leases and more
    time.sleep(0.05)
print("idle for two leases", flush=True)
time.sleep(600)
"""
CLIENT_BYTES = (1 << 19) * 4


@pytest.fixture(scope="module")
def leased(start_module_server):
    return start_module_server(name="leased", extra_args=("--lease", str(LEASE)))


@pytest.fixture
def observer(leased):
    s = remotorch.Session(leased.url, token=TOKEN)
    assert wait_until(lambda: s.health()["resident_bytes"] == 0), "residents left over from another test"
    yield s
    s.close()


def work(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ x) * 2


def holding(srv, count: int = 1) -> bool:
    """Wait until the worker has begun holding ``count`` graph runs (its log says so)."""
    return wait_until(lambda: srv.stderr_text().count(HOLDING) >= count, timeout=60)


def in_thread(fn, *args):
    """Run fn(*args) in a thread; returns a dict that gets 'value' or 'error' and 'at' (finish time)."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc
        box["at"] = time.monotonic()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    box["thread"] = t
    return box


def start_client(url: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", CLIENT, url, TOKEN], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=clean_env())
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
    return proc


def said(proc: subprocess.Popen, line: str, timeout: float = 60.0) -> bool:
    """Whether the child prints ``line`` next, within ``timeout`` seconds."""
    if not select.select([proc.stdout], [], [], timeout)[0]:
        return False
    return proc.stdout.readline().strip() == line


def heartbeats(session, count: int, timeout: float = LEASE * 20) -> bool:
    """Wait until ``session`` has sent ``count`` more messages (idle: heartbeats, every LEASE / 3)."""
    sent = session.stats()["messages_sent"]
    return wait_until(lambda: session.stats()["messages_sent"] >= sent + count, timeout=timeout)


# ----------------------------------------------------------------- worker faults
@pytest.mark.parametrize("fallback", ["raise", "local"])
def test_worker_killed_mid_call(start_server, fallback):
    srv = start_server(name="victim", extra_args=("--engines", f"eager,hold:{HOLD:g}"))
    session = remotorch.Session(srv.url, token=TOKEN, timeout=HOLD * 2, retry_after=0)
    try:
        compiled = remotorch.compile(work, session=session, engine=f"hold:{HOLD:g}", fallback=fallback)
        x = torch.randn(64, 64) / 8
        box = in_thread(compiled, x)
        assert holding(srv)  # the call is running on the worker now
        assert "at" not in box
        srv.proc.kill()
        killed = time.monotonic()
        box["thread"].join(60)
        assert box["at"] - killed < 10, "the client noticed the dead worker only at its timeout"
        if fallback == "raise":
            assert isinstance(box.get("error"), errors.WorkerUnavailableError), box
        else:
            assert torch.allclose(box["value"], work(x), atol=1e-6), box.get("error")
            assert session.stats()["fallbacks"] == 1
    finally:
        session.close()


def test_frozen_worker_gives_unavailable_within_the_timeout(start_server):
    srv = start_server(name="frozen")
    session = remotorch.Session(srv.url, token=TOKEN, timeout=1.5, retry_after=0)
    try:
        probe = Probe(session, tiny_mlp(4, 3, seed=2), torch.randn(2, 4))
        probe()
        os.kill(srv.proc.pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(errors.WorkerUnavailableError, match="did not answer"), torch.no_grad():
                probe.compiled(probe.x).numpy()  # a warm call is sent without waiting: its read waits
            assert time.monotonic() - start < 5
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        probe()  # reconnects
        stats = session.stats()
        assert (stats["graphs_uploaded"], stats["tensors_uploaded"]) == (1, 2)  # the lease kept its uploads
    finally:
        session.close()


def test_sigterm_finishes_the_call_in_flight_and_exits_cleanly(start_server):
    hold = 3.0
    srv = start_server(name="terminated", extra_args=("--engines", f"eager,hold:{hold:g}"))
    # outputs inline: the answer itself must carry the result (a value kept on a worker
    # that then exits could not be read afterwards, by design)
    session = remotorch.Session(srv.url, token=TOKEN, timeout=120, retry_after=0, keep_outputs=False)
    idle = remotorch.Session(srv.url, token=TOKEN, timeout=30, retry_after=0)
    try:
        assert idle.health()["name"] == "terminated"
        compiled = remotorch.compile(work, session=session, engine=f"hold:{hold:g}", fallback="raise")
        x = torch.randn(64, 64) / 8
        box = in_thread(compiled, x)
        assert holding(srv)  # the call is in flight: run, and held for a while yet
        assert "at" not in box
        terminated = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(timeout=60) == 0
        box["thread"].join(60)
        assert torch.allclose(box["value"], work(x), atol=1e-6), box.get("error")  # finished, answered
        assert box["at"] > terminated  # the answer came after the SIGTERM
        assert "Traceback" not in srv.stderr_text()
        with pytest.raises(errors.WorkerUnavailableError):
            idle.health()
    finally:
        session.close()
        idle.close()


# ---------------------------------------------------------- sessions and leases
def test_killed_client_is_freed_after_the_lease(leased, observer):
    client = start_client(leased.url)
    try:
        assert observer.health()["resident_bytes"] == CLIENT_BYTES
        assert observer.health()["connections"] == 2
        client.kill()
        client.wait()
        killed = time.monotonic()
        assert wait_until(lambda: observer.health()["connections"] == 1, timeout=60)  # its connection closed
        assert observer.health()["resident_bytes"] == CLIENT_BYTES  # and the lease holds it a while
        assert wait_until(lambda: observer.health()["resident_bytes"] == 0, timeout=LEASE * 10)
        assert time.monotonic() - killed >= LEASE * 0.9
    finally:
        client.kill()


def test_frozen_client_without_heartbeats_is_expired(leased, observer):
    client = start_client(leased.url)
    try:
        assert said(client, "idle for two leases")  # alive and idle: its heartbeats keep the lease
        assert observer.health()["resident_bytes"] == CLIENT_BYTES
        client.send_signal(signal.SIGSTOP)  # the connection stays open, the heartbeats stop
        assert wait_until(lambda: observer.health()["resident_bytes"] == 0, timeout=LEASE * 10)
    finally:
        client.kill()


def test_reconnect_within_the_lease_keeps_the_uploads(leased, observer):
    session = remotorch.Session(leased.url, token=TOKEN)
    try:
        probe = Probe(session, tiny_mlp(32, 64, 8, seed=3), torch.randn(5, 32))
        probe()
        uploaded = session.stats()["tensors_uploaded"]
        session.connection.drop()  # the connection drops
        probe()  # a new connection, the same session
        assert session.stats()["tensors_uploaded"] == uploaded
        assert session.stats()["graphs_uploaded"] == 1
        assert heartbeats(session, 7)  # idle for two leases: heartbeats keep it
        probe()
        assert session.stats()["tensors_uploaded"] == uploaded
    finally:
        session.close()
    assert wait_until(lambda: observer.health()["resident_bytes"] == 0, timeout=5)  # close frees at once


def test_a_session_past_its_lease_starts_empty_and_re_uploads(leased, observer):
    session = remotorch.Session(leased.url, token=TOKEN)
    try:
        compiled = remotorch.compile(torch.nn.Linear(8, 8).eval(), session=session, fallback="raise")
        x = torch.randn(2, 8)
        with torch.no_grad():
            first = compiled(x)
            session.connection.stop_heartbeats()  # this client stops its heartbeats (the thread ends)
            time.sleep(0.2)
            session.connection.drop()
            assert wait_until(lambda: observer.health()["resident_bytes"] == 0, timeout=LEASE * 10)
            assert torch.equal(compiled(x), first)  # Attach says "new": everything goes up again
        assert session.stats()["tensors_uploaded"] == 4
        assert session.stats()["graphs_uploaded"] == 2
    finally:
        session.close()


def test_unattached_connections_are_freed_when_they_close(leased, observer):
    transport = TcpTransport(leased.url, TOKEN, protocol=m.PROTOCOL_VERSION)
    t = torch.randn(1000)
    meta, buf = remotorch.codec.tensors.tensor_to_wire(t, 0)
    tid = remotorch.codec.tensors.content_id(meta, buf)
    header, _ = transport.request(m.encode(m.PutTensors([tid], [meta])), [buf])
    assert isinstance(m.decode(header), m.Ok)
    assert observer.health()["resident_bytes"] == t.nbytes
    transport.close()
    assert wait_until(lambda: observer.health()["resident_bytes"] == 0, timeout=5)


def test_restarted_worker_gets_everything_again_transparently(start_server):
    srv = start_server(name="first")
    port = srv.port
    session = remotorch.Session(srv.url, token=TOKEN, retry_after=0)
    try:
        probe = Probe(session, tiny_mlp(16, 16, 3, act=torch.nn.Tanh, seed=9), torch.randn(4, 16))
        probe()
        srv.stop()
        with pytest.raises(errors.WorkerUnavailableError), torch.no_grad():
            probe.compiled(probe.x).numpy()  # a warm call is sent without waiting: its read says
        srv2 = start_server(name="second", extra_args=("--port", str(port)))
        for _ in range(3):
            probe()
        stats = session.stats()
        assert (stats["graphs_uploaded"], stats["tensors_uploaded"]) == (2, 8)  # all of it, once more
        assert session.health()["name"] == "second"
        assert srv2.alive()
    finally:
        session.close()


def test_closing_a_session_of_a_frozen_worker_does_not_hang(start_server):
    srv = start_server(name="frozen-close")
    session = remotorch.Session(srv.url, token=TOKEN, timeout=120)
    assert session.health()["name"] == "frozen-close"
    os.kill(srv.proc.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        session.close()  # its Detach gets no answer: close gives up after a short wait
        assert time.monotonic() - start < 10
    finally:
        os.kill(srv.proc.pid, signal.SIGCONT)


def test_training_state_survives_a_dropped_connection(leased):
    """Saved activations stay on the worker while the lease holds: backward after a reconnect works."""
    session = remotorch.Session(leased.url, token=TOKEN)
    try:
        torch.manual_seed(21)
        model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        reference = copy.deepcopy(model)
        x = torch.randn(5, 12)
        loss = remotorch.compile(model, session=session, fallback="raise")(x).sum()
        session.connection.drop()  # the connection drops between forward and backward
        loss.backward()
        reference(x).sum().backward()
        for p, r in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-6)
    finally:
        session.close()


def test_requests_in_flight_to_a_worker_that_lost_the_session_each_fail_named(leased, observer):
    """The link drops with three calls in flight (their replies held in a relay) after the worker let
    the session's lease run out: the reconnect finds the session gone, and every call in flight
    fails with WorkerUnavailableError naming what was lost, raised at the next read, once. (Reads of the
    outputs themselves: an eager call on one, ``y.sum()``, would be one more request lost.)"""
    from remotorch.devtools.netem import DelayProxy

    with DelayProxy(leased.url) as relay:
        session = remotorch.Session(relay.url, token=TOKEN, retry_after=0)
        try:
            compiled = remotorch.compile(work, session=session, fallback="raise")
            x = torch.randn(8, 8)
            with torch.no_grad():
                compiled(x).numpy()  # compiled, uploaded; the next calls are sent without waiting
                session.connection.stop_heartbeats()
                relay.set_delay(0, down_ms=3600e3)  # the worker's replies stay in the relay
                ys = [compiled(x) for _ in range(3)]
                # the worker ran them (their outputs are held there, their replies in the relay), then the
                # lease ran out and it freed them
                assert wait_until(lambda: observer.health()["resident_bytes"] > 0, timeout=60)
                assert wait_until(lambda: observer.health()["resident_bytes"] == 0, timeout=LEASE * 20)
                relay.set_delay(0)  # before the cut: the reconnect's handshake must not wait in the relay
                assert relay.cut() > 0  # the three replies (held with the delay they came with), lost with the link
                with pytest.raises(errors.WorkerUnavailableError,
                                   match=r"no longer holds this session .*; lost with it: "
                                         r"graph [0-9a-f]{12} \(\S*test_faults\.py:\d+\) x3$"):
                    ys[0].numpy()
                for y in ys[1:]:  # one failure: each read of what it lost says so
                    with pytest.raises(errors.WorkerUnavailableError, match="no longer holds this session"):
                        y.numpy()
                session.synchronize()  # raised once: nothing more to raise
                assert torch.allclose(compiled(x), work(x), atol=1e-6)  # and the session goes on, anew
        finally:
            session.close()
