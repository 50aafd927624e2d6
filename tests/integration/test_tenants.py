"""Named tenants on one worker (``remotorch serve --tokens FILE``): who they are, what each may do,
what one can see of another, and a token revoked by SIGHUP while everyone works.

Every worker here is a real ``remotorch serve`` with a tokens file; the clients are
ordinary sessions, and the attacks are raw requests on their connections.
"""

from __future__ import annotations

import os
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
from remotorch.codec.tensors import content_id, tensor_to_wire
from remotorch.transport import TcpTransport
from remotorch.worker.tenants import token_hash

import custom_ops_lib  # noqa: F401 (registers rmtest_lib here too, as the user's process would)

from conftest import TOKEN, wait_until

TESTS = os.path.dirname(os.path.abspath(custom_ops_lib.__file__))
ALICE, BOB = "rmt_alice-0123456789abcdef", "rmt_bob-0123456789abcdef"  # (also test_isolation's)


def table(name: str, token: str, **extra) -> str:
    lines = [f"[tenants.{name}]", f'token_sha256 = "{token_hash(token).hex()}"']
    for key, value in extra.items():
        text = ("true" if value else "false") if isinstance(value, bool) else repr(value).replace("'", '"')
        lines.append(f"{key} = {text}")
    return "\n".join(lines) + "\n"


@pytest.fixture
def tokens_file(tmp_path):
    path = tmp_path / "tokens.toml"
    path.write_text(table("alice", ALICE) + table("bob", BOB))
    return path


def serve_tenants(start_server, path, *extra):
    return start_server(token=None, name="shared", extra_args=("--tokens", str(path), *extra))


def mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).eval()


def test_token_new_prints_a_token_and_the_table_a_worker_admits_it_by(start_server, tmp_path):
    out = subprocess.run([sys.executable, "-m", "remotorch", "token", "new", "carol"], capture_output=True,
                         text=True, check=True).stdout
    token, rest = out.split("\n", 1)
    assert token.startswith("rmt_") and len(token) > 40 and token not in rest  # shown once, alone
    path = tmp_path / "tokens.toml"
    path.write_text(rest)
    assert token not in path.read_text() and token_hash(token).hex() in path.read_text()
    srv = serve_tenants(start_server, path)
    model, x = mlp(0), torch.randn(3, 16)
    with remotorch.Session(srv.url, token=token) as s, torch.no_grad():
        assert torch.equal(remotorch.compile(model, session=s, fallback="raise")(x), model(x))
    with pytest.raises(errors.AuthenticationError):
        with remotorch.Session(srv.url, token=token + "x", retry_after=0) as s:
            s.health()


def test_a_tokens_file_that_cannot_be_used_stops_serve_with_the_reason(tmp_path):
    path = tmp_path / "tokens.toml"
    path.write_text('[tenants.alice]\ntoken_sha256 = "abc"\n')
    done = subprocess.run([sys.executable, "-m", "remotorch", "serve", "--port", "0", "--tokens", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "[tenants.alice]: token_sha256 must be 64 hex digits" in done.stderr


def test_max_sessions_counts_a_tenants_sessions_only(start_server, tmp_path):
    path = tmp_path / "tokens.toml"
    path.write_text(table("alice", ALICE, max_sessions=2) + table("bob", BOB))
    srv = serve_tenants(start_server, path)
    first, second = (remotorch.Session(srv.url, token=ALICE) for _ in range(2))
    try:
        first.health(), second.health()
        with pytest.raises(errors.QuotaExceededError, match="tenant alice has 2 sessions"):
            with remotorch.Session(srv.url, token=ALICE, retry_after=0) as third:
                third.health()
        bobs = [remotorch.Session(srv.url, token=BOB) for _ in range(3)]  # bob's are his own
        for b in bobs:
            b.health()
            b.close()
        second.close()  # ends at once (Detach): alice may open another
        with remotorch.Session(srv.url, token=ALICE) as again:
            assert again.health()["name"] == "shared"
    finally:
        first.close()
        second.close()


def test_a_tenant_over_its_memory_quota_gets_a_typed_error_and_its_neighbour_serves(start_server, tmp_path):
    path = tmp_path / "tokens.toml"
    path.write_text(table("alice", ALICE, memory_quota="1M") + table("bob", BOB))
    srv = serve_tenants(start_server, path)
    half = [torch.randn(160_000) for _ in range(2)]  # 640 KB each: one fits alice's 1 MiB, two do not
    with remotorch.Session(srv.url, token=ALICE) as a1, remotorch.Session(srv.url, token=ALICE) as a2, \
            remotorch.Session(srv.url, token=BOB) as bob:
        def put(session, t):
            meta, buf = tensor_to_wire(t, 0)
            session.connection.request(m.PutTensors([content_id(meta, buf)], [meta]), [buf])

        put(a1, half[0])
        with pytest.raises(errors.QuotaExceededError, match="tenant alice would hold .* over its memory quota"):
            put(a2, half[1])  # the quota is the tenant's, across its sessions
        for t in (*half, torch.randn(400_000)):  # bob has no quota of his own
            put(bob, t)
        model, x = mlp(2), torch.randn(2, 16)
        with torch.no_grad():
            assert torch.equal(remotorch.compile(model, session=bob, fallback="raise")(x), model(x))
        a1.close()
        put(a2, half[1])  # room again once alice's other session ended


def test_a_tenants_allow_ops_narrow_the_workers_also_for_a_graph_another_tenant_sent(start_server, tmp_path):
    path = tmp_path / "tokens.toml"
    path.write_text(table("alice", ALICE, allow_ops=[]) + table("bob", BOB))
    srv = start_server(token=None, name="ops", extra_args=("--tokens", str(path), "--allow-ops", "rmtest_lib",
                                                           "--import", "custom_ops_lib"),
                       env={"PYTHONPATH": os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")]))})

    def f(x, y):
        return torch.ops.rmtest_lib.scaled_add(x, y, 2.0) + 1

    x, y = torch.randn(4), torch.randn(4)
    with remotorch.Session(srv.url, token=BOB) as bob:  # bob first: the worker decodes the graph for him
        torch._dynamo.reset()
        assert torch.equal(remotorch.compile(f, session=bob, fallback="raise")(x, y), f(x, y))
    with remotorch.Session(srv.url, token=ALICE) as alice:  # the same bytes from alice: refused, typed
        torch._dynamo.reset()
        with pytest.raises(errors.UnsupportedGraphError, match="namespace 'rmtest_lib'"):
            remotorch.compile(f, session=alice, fallback="raise")(x, y)
        torch._dynamo.reset()
        model, z = mlp(3), torch.randn(2, 16)
        with torch.no_grad():  # and alice goes on serving
            assert torch.equal(remotorch.compile(model, session=alice, fallback="raise")(z), model(z))
    torch._dynamo.reset()


def test_a_tenants_request_rate_is_a_burst_then_its_rate_with_a_typed_error(start_server, tmp_path):
    """A fresh budget admits a burst of one second's worth at once, then refuses (typed, naming the
    rate) beyond what the rate refilled meanwhile; it refills; another tenant is not capped."""
    path = tmp_path / "tokens.toml"
    path.write_text(table("alice", ALICE, requests_per_second=5) + table("bob", BOB))
    srv = serve_tenants(start_server, path)
    alice = TcpTransport(srv.url, ALICE, protocol=m.PROTOCOL_VERSION)  # nothing of alice's before: a full budget

    def health() -> bool:
        reply = m.decode(alice.request(m.encode(m.Health()))[0])
        if isinstance(reply, m.ErrorReply):
            assert reply.kind == errors.QuotaExceededError.kind and "5 requests per second" in reply.message
            return False
        return True

    try:
        with remotorch.Session(srv.url, token=BOB) as bob:
            started = time.monotonic()
            admitted = [health() for _ in range(30)]  # far faster than 5 a second
            refilled = 5 * (time.monotonic() - started)
            assert admitted[:5] == [True] * 5, admitted  # the burst
            assert 5 <= sum(admitted) <= 5 + refilled + 1, (admitted, refilled)  # then the rate
            assert wait_until(health, timeout=30, interval=0.05)  # the budget refills: admitted again
            for _ in range(30):
                assert bob.health()["name"] == "shared"  # bob is not capped
    finally:
        alice.close()


def test_a_reload_with_a_broken_file_changes_nothing(start_server, tokens_file):
    srv = serve_tenants(start_server, tokens_file)
    with remotorch.Session(srv.url, token=ALICE) as alice:
        alice.health()
        tokens_file.write_text("[tenants.alice\n")
        os.kill(srv.proc.pid, signal.SIGHUP)
        assert wait_until(lambda: "tokens file not reloaded" in srv.stderr_text(), timeout=60)
        assert alice.health()["name"] == "shared"
    with remotorch.Session(srv.url, token=BOB) as bob:
        assert bob.health()["name"] == "shared"


def test_a_token_added_by_a_reload_is_admitted(start_server, tokens_file):
    carol = "rmt_carol-0123456789abcdef"
    srv = serve_tenants(start_server, tokens_file)
    with pytest.raises(errors.AuthenticationError):
        with remotorch.Session(srv.url, token=carol, retry_after=0) as s:
            s.health()
    tokens_file.write_text(table("alice", ALICE) + table("bob", BOB) + table("carol", carol))
    os.kill(srv.proc.pid, signal.SIGHUP)

    def admitted() -> bool:
        try:
            with remotorch.Session(srv.url, token=carol, retry_after=0) as s:
                return s.health()["name"] == "shared"
        except errors.AuthenticationError:
            return False

    assert wait_until(admitted, timeout=60, interval=0.1)
    with remotorch.Session(srv.url, token=ALICE) as alice:  # and the others are still admitted
        assert alice.health()["name"] == "shared"


def test_limits_changed_by_a_reload_apply_to_the_tenants_next_requests(start_server, tmp_path):
    path = tmp_path / "tokens.toml"
    path.write_text(table("alice", ALICE, max_sessions=1) + table("bob", BOB))
    srv = serve_tenants(start_server, path)

    def second_session() -> bool:
        try:
            with remotorch.Session(srv.url, token=ALICE, retry_after=0) as s:
                s.health()
                return True
        except errors.QuotaExceededError:
            return False

    with remotorch.Session(srv.url, token=ALICE) as first:
        first.health()
        assert not second_session()
        path.write_text(table("alice", ALICE, max_sessions=2) + table("bob", BOB))
        os.kill(srv.proc.pid, signal.SIGHUP)
        assert wait_until(second_session, timeout=60, interval=0.1)  # the new limit: two
        path.write_text(table("alice", ALICE, max_sessions=1) + table("bob", BOB))
        os.kill(srv.proc.pid, signal.SIGHUP)
        assert wait_until(lambda: not second_session(), timeout=60, interval=0.1)  # and back to one
        assert first.health()["name"] == "shared"  # a session made before a reload goes on


def test_a_token_revoked_under_load_ends_its_sessions_and_no_one_else_notices(start_server, tokens_file):
    """8 clients of 2 tenants call models in a loop; alice's token leaves the file and SIGHUP reloads it.
    Alice's clients get AuthenticationError; bob's see no error and no wrong result."""
    srv = serve_tenants(start_server, tokens_file)
    stop, started = threading.Event(), threading.Barrier(9)
    results: dict[int, dict] = {}

    def client(i: int, s: remotorch.Session, compiled, x, want) -> None:
        out = results[i] = dict(calls=0, wrong=0, errors=[], after=0)
        with s:
            with torch.no_grad():
                started.wait()
                while not stop.is_set():
                    try:
                        got = torch.from_numpy(compiled(x).numpy().copy())  # read (a clone: an eager call)
                    except errors.RemoteError as exc:
                        out["errors"].append(exc)
                        if len(out["errors"]) >= 3:
                            return
                        continue
                    out["calls"] += 1
                    out["wrong"] += not torch.equal(got, want)
                    if revoked.is_set():
                        out["after"] += 1

    revoked = threading.Event()
    torch._dynamo.reset()
    threads = []
    for i in range(8):  # sessions and compiled models made here, the calls in the threads
        s = remotorch.Session(srv.url, token=ALICE if i % 2 else BOB, retry_after=0)
        model, x = mlp(10 + i), torch.randn(4, 16)
        compiled = remotorch.compile(model, session=s, fallback="raise")
        with torch.no_grad():
            want = model(x)
            assert torch.equal(compiled(x), want)
        threads.append(threading.Thread(target=client, args=(i, s, compiled, x, want)))
    for t in threads:
        t.start()
    try:
        started.wait(timeout=120)
        assert wait_until(lambda: all(results[i]["calls"] >= 5 for i in range(8)), timeout=120), results
        tokens_file.write_text(table("bob", BOB))
        os.kill(srv.proc.pid, signal.SIGHUP)
        assert wait_until(lambda: "tokens reloaded: revoked ['alice']" in srv.stderr_text(), timeout=60)
        revoked.set()
        assert wait_until(lambda: all(results[i]["errors"] for i in range(1, 8, 2))  # alice's heard of it,
                          and all(results[i]["after"] >= 5 for i in range(0, 8, 2)), timeout=120), results
    finally:  # (bob's go on above; and no client thread outlives the test, whatever failed)
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    alice = [results[i] for i in range(8) if i % 2]
    bob = [results[i] for i in range(8) if not i % 2]
    for r in alice:
        assert r["errors"] and all(isinstance(e, errors.AuthenticationError) for e in r["errors"]), r
        assert r["wrong"] == 0
    for r in bob:
        assert r["errors"] == [] and r["wrong"] == 0 and r["after"] > 0, r
    with pytest.raises(errors.AuthenticationError):  # and the token opens nothing new
        with remotorch.Session(srv.url, token=ALICE, retry_after=0) as s:
            s.health()
    torch._dynamo.reset()


def test_token_beside_a_tokens_file_is_one_unnamed_tenant_the_operator(start_server, tokens_file):
    """``--token`` with ``--tokens``: the plain token is one more tenant, unnamed, without quotas, and
    the operator's (it may ask for the worker's activity, which a named tenant may not)."""
    srv = start_server(token=TOKEN, name="both", extra_args=("--tokens", str(tokens_file)))
    model, x = mlp(4), torch.randn(3, 16)
    with remotorch.Session(srv.url, token=TOKEN) as s, torch.no_grad():
        assert torch.equal(remotorch.compile(model, session=s, fallback="raise")(x), model(x))
        assert isinstance(s.connection.request(m.Stats(), expect=m.StatsReply)[0], m.StatsReply)
    with remotorch.Session(srv.url, token=ALICE) as alice:
        assert alice.health()["name"] == "both"
        with pytest.raises(errors.AuthenticationError, match="only an operator's token"):
            alice.connection.request(m.Stats(), expect=m.StatsReply)
    with pytest.raises(errors.AuthenticationError):
        with remotorch.Session(srv.url, token=TOKEN + "x", retry_after=0) as s:
            s.health()
