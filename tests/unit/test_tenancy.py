"""A worker's tenants at work (worker/tenancy.py), rule by rule, without sockets: which tenant each
connection is, what it may do, whose sessions are whose, and what a reload ends.

The listener's part (the key id a hello named) is played by ``connected``; the
integration tests (tests/integration/test_tenants.py) run the same rules through
a real ``remotorch serve``.
"""

from __future__ import annotations

import logging

import pytest
import torch

from remotorch.errors import AuthenticationError, InvalidRequestError, QuotaExceededError, UnsupportedGraphError
from remotorch.transport.handshake import key_id
from remotorch.worker.leases import LeaseTable
from remotorch.worker.tenancy import Tenancy, check_namespaces
from remotorch.worker.tenants import Tenants, token_hash

from helpers import Clock

A, B = key_id(token_hash("alice-token")), key_id(token_hash("bob-token"))


def table(name: str, token: str, *extra: str) -> str:
    return "\n".join([f"[tenants.{name}]", f'token_sha256 = "{token_hash(token).hex()}"', *extra]) + "\n"


@pytest.fixture
def tokens(tmp_path):
    path = tmp_path / "tokens.toml"
    path.write_text(table("alice", "alice-token", "max_sessions = 2", "memory_quota = 1000",
                          'allow_ops = ["rmtest_lib"]')
                    + table("bob", "bob-token", "requests_per_second = 2", "operator = true"))
    return path


@pytest.fixture
def tenancy(tokens):
    return Tenancy(Tenants(str(tokens), "plain-token"), LeaseTable(30.0, clock=Clock()))


def test_each_connection_is_the_tenant_its_hello_named(tenancy):
    tenancy.connected(1, A)
    tenancy.connected(2, B)
    tenancy.connected(3, None)  # a hello without a key id: the plain --token
    assert [tenancy.name(c) for c in (1, 2, 3)] == ["alice", "bob", ""]
    assert tenancy.name(99) == ""  # never announced (an in-process service): the unnamed tenant
    tenancy.connected(4, key_id(token_hash("mallory-token")))
    assert tenancy.tenant(4) is None and tenancy.name(4) == "?"
    tenancy.disconnected(1)
    assert tenancy.name(1) == ""  # forgotten: as if never announced


def test_without_a_plain_token_an_unnamed_connection_is_no_tenant(tokens):
    tenancy = Tenancy(Tenants(str(tokens)), LeaseTable(30.0))
    assert tenancy.tenant(7) is None
    with pytest.raises(AuthenticationError):
        tenancy.admit(7, stream=True)


def test_a_rate_refuses_requests_but_never_liveness_and_names_the_tenant(tenancy):
    tenancy.connected(2, B)
    tenancy.admit(2, stream=False)
    tenancy.admit(2, stream=False)  # bob's burst: two
    with pytest.raises(QuotaExceededError, match=r"^tenant bob is over its rate of 2 requests per second$"):
        tenancy.admit(2, stream=False)
    tenancy.admit(2, stream=False, liveness=True)  # a heartbeat is never refused
    tenancy.connected(1, A)
    for _ in range(50):
        tenancy.admit(1, stream=False)  # alice has no rate


def test_a_connection_that_streams_is_a_session_counted_against_max_sessions(tenancy):
    for cid in (1, 2, 3):
        tenancy.connected(cid, A)
    tenancy.admit(1, stream=False)  # outside a stream (health): not a session
    assert tenancy.sessions(A) == []
    tenancy.admit(1, stream=True)
    tenancy.admit(1, stream=True)  # (counted once)
    tenancy.admit(2, stream=True)
    assert sorted(tenancy.sessions(A)) == [1, 2] and tenancy.sessions(A, but=2) == [1]
    with pytest.raises(QuotaExceededError, match=r"^tenant alice has 2 sessions on this worker, its limit"):
        tenancy.admit(3, stream=True)
    assert tenancy.session_counts() == {"alice": 2}
    tenancy.disconnected(2)
    tenancy.admit(3, stream=True)  # room again
    assert sorted(tenancy.sessions(A)) == [1, 3]


def test_a_lease_belongs_to_the_tenant_that_made_it(tenancy):
    leases = tenancy.leases
    tenancy.connected(1, A)
    tenancy.connected(2, B)
    tenancy.connected(3, A)
    tenancy.attach(1, "alice-session-0001")
    leases.attach(1, "alice-session-0001")
    tenancy.attached(1, "alice-session-0001")
    assert leases.lookup("alice-session-0001").kid == A
    with pytest.raises(InvalidRequestError, match="^no such session for this token$"):
        tenancy.attach(2, "alice-session-0001")  # bob cannot take alice's session
    tenancy.attach(3, "alice-session-0001")  # alice, on another connection, can
    assert tenancy.sessions(A) == [leases.lookup("alice-session-0001")]
    assert tenancy.session_counts() == {"alice": 1, "bob": 0}
    tenancy.attach(3, "alice-session-0002")  # a second lease of hers: within max_sessions
    leases.attach(3, "alice-session-0002")
    tenancy.attached(3, "alice-session-0002")
    tenancy.connected(4, A)
    with pytest.raises(QuotaExceededError, match="tenant alice has 2 sessions"):
        tenancy.attach(4, "alice-session-0003")


def test_attaching_ends_a_connections_own_session_and_a_revoked_one_may_not_attach(tenancy):
    tenancy.connected(1, A)
    tenancy.admit(1, stream=True)
    assert tenancy.sessions(A) == [1]
    tenancy.attach(1, "alice-session-0001")
    tenancy.leases.attach(1, "alice-session-0001")
    tenancy.attached(1, "alice-session-0001")
    assert tenancy.sessions(A) == [tenancy.leases.lookup("alice-session-0001")]  # one session, not two
    tenancy.connected(5, key_id(token_hash("mallory-token")))
    with pytest.raises(AuthenticationError, match="^this connection's token was revoked: its sessions ended$"):
        tenancy.attach(5, "mallory-session-01")
    tenancy.attached(5, "mallory-session-01")  # (no such lease, and no tenant: nothing to claim)
    tenancy.attached(5, "alice-session-0001")  # a connection of no tenant claims nothing
    assert tenancy.leases.lookup("alice-session-0001").kid == A
    tenancy.leases.release(1)  # its session ended (Detach): the connection serves none until it streams
    assert tenancy.sessions(A) == []


def test_a_reload_ends_the_revoked_tenants_sessions_and_refuses_their_connections(tenancy, tokens, caplog):
    for cid, kid in ((1, A), (2, A), (3, B), (4, None)):
        tenancy.connected(cid, kid)
    tenancy.attach(1, "alice-session-0001")
    tenancy.leases.attach(1, "alice-session-0001")
    tenancy.attached(1, "alice-session-0001")
    lease = tenancy.leases.lookup("alice-session-0001")
    tenancy.admit(2, stream=True)  # alice's second, a connection serving as its own
    tenancy.admit(3, stream=True)
    ended: list = []
    tokens.write_text(table("bob", "bob-token", "requests_per_second = 2", "operator = true"))
    with caplog.at_level(logging.WARNING, logger="remotorch.worker.tenancy"):
        assert tenancy.reload(ended.append) == ["alice"]
    assert ended == [lease, 2]
    assert "revoked ['alice']; 2 connection(s) refused from now on" in caplog.text
    assert tenancy.leases.lookup("alice-session-0001") is None
    for cid in (1, 2):
        assert tenancy.tenant(cid) is None
        with pytest.raises(AuthenticationError, match="^this connection's token was revoked: its sessions ended$"):
            tenancy.admit(cid, stream=False, liveness=True)
    assert tenancy.name(3) == "bob" and tenancy.name(4) == ""  # everyone else untouched
    assert tenancy.sessions(B) == [3]
    assert tenancy.reload(ended.append) == [] and ended == [lease, 2]  # nothing more to revoke


def test_a_reload_of_a_broken_file_changes_nothing(tenancy, tokens, caplog):
    tenancy.connected(1, A)
    tokens.write_text("[tenants.alice\n")
    with caplog.at_level(logging.ERROR, logger="remotorch.worker.tenancy"):
        assert tenancy.reload(lambda key: pytest.fail("nothing ends")) == []
    (record,) = caplog.records
    assert record.getMessage().startswith(f"tokens file not reloaded (everything stays as it was): {tokens}: not TOML")
    assert tenancy.name(1) == "alice"


def test_a_memory_quota_counts_every_session_of_the_tenant(tenancy):
    held = {1: 300, 2: 400, 3: 5000}
    for cid, kid in ((1, A), (2, A), (3, B)):
        tenancy.connected(cid, kid)
        tenancy.admit(cid, stream=True)
    assert tenancy.over_quota(1, 300, held.get) == ""  # 700 + 300: exactly the quota
    why = tenancy.over_quota(1, 301, held.get)
    assert why == ("tenant alice would hold 1001 bytes on the worker, over its memory quota of 1000 "
                   "(its 2 session(s) hold 700 now)")
    tenancy.connected(6, A)  # a connection whose first request is not counted yet counts too
    held[6] = 50
    assert "its 3 session(s) hold 750 now" in tenancy.over_quota(6, 251, held.get)
    assert tenancy.over_quota(3, 10 ** 9, held.get) == ""  # bob has no quota
    assert tenancy.over_quota(99, 10 ** 9, held.get) == ""  # nor the unnamed tenant


def test_operators_and_custom_operators_by_tenant(tenancy):
    tenancy.connected(1, A)
    tenancy.connected(2, B)
    tenancy.attach(1, "alice-session-0001")
    tenancy.leases.attach(1, "alice-session-0001")
    tenancy.attached(1, "alice-session-0001")
    lease = tenancy.leases.lookup("alice-session-0001")
    assert [tenancy.operator(k) for k in (lease, 2, 99)] == [False, True, True]  # 99: the plain token's
    worker = frozenset({"rmtest_lib", "transformers"})
    assert tenancy.allowed_ops(lease, worker) == {"rmtest_lib"}  # narrowed to alice's own
    assert tenancy.allowed_ops(2, worker) == worker and tenancy.allowed_ops(99, worker) == worker


def test_a_graph_calling_an_operator_outside_the_allowed_namespaces_is_refused():
    from torch.fx.experimental.proxy_tensor import make_fx

    import custom_ops_lib  # noqa: F401 (registers rmtest_lib)

    def custom(x, y):
        return torch.ops.rmtest_lib.scaled_add(x, y, 2.0).relu()

    gm = make_fx(custom)(torch.randn(3), torch.randn(3))
    check_namespaces(gm, frozenset({"rmtest_lib"}))
    with pytest.raises(UnsupportedGraphError, match=r"^operation rmtest_lib::scaled_add cannot run remotely: "
                                                    r"the worker does not allow custom operators of namespace "
                                                    r"'rmtest_lib'"):
        check_namespaces(gm, frozenset())
    plain = make_fx(lambda x: x.unbind(0)[0].relu() + 1)(torch.randn(2, 3))  # aten and getitem: always
    check_namespaces(plain, frozenset())
    plain.add_submodule("lin", torch.nn.Linear(2, 2))  # a module without a graph, then a subgraph with one
    plain.add_submodule("sub", gm)
    with pytest.raises(UnsupportedGraphError, match="rmtest_lib"):
        check_namespaces(plain, frozenset())


def test_a_lease_no_tenant_claimed_and_a_plain_connection_without_token_are_nobodys(tokens):
    tenancy = Tenancy(Tenants(str(tokens), "plain-token"), LeaseTable(30.0))
    tenancy.leases.attach(1, "orphan-session-001")  # (attached without the tenancy's check)
    orphan = tenancy.leases.lookup("orphan-session-001")
    worker = frozenset({"rmtest_lib"})
    assert not tenancy.operator(orphan) and tenancy.allowed_ops(orphan, worker) == worker
    assert tenancy.over_quota(orphan, 10 ** 9, lambda key: 0) == ""
    named_only = Tenancy(Tenants(str(tokens)), LeaseTable(30.0))  # no --token: no unnamed tenant
    named_only.connected(2, None)
    for key in (2, 99):
        assert not named_only.operator(key) and named_only.allowed_ops(key, worker) == worker
        assert named_only.over_quota(key, 10 ** 9, lambda k: 0) == ""


def test_a_tenant_revoked_while_nobody_was_connected_as_it_is_named_and_others_stay(tokens, caplog):
    tenancy = Tenancy(Tenants(str(tokens)), LeaseTable(30.0))  # named tenants only
    tenancy.connected(3, B)
    tenancy.disconnected(42)  # (a connection never announced: nothing to forget)
    tokens.write_text(table("bob", "bob-token", "requests_per_second = 2", "operator = true"))
    with caplog.at_level(logging.WARNING, logger="remotorch.worker.tenancy"):
        assert tenancy.reload(lambda key: pytest.fail("no session of alice's")) == ["alice"]
    assert caplog.records[-1].getMessage() == "tokens reloaded: revoked ['alice']; 0 connection(s) refused from now on"
    assert tenancy.name(3) == "bob"  # bob's connection is untouched
    tenancy.admit(3, stream=True)


def test_a_connection_that_served_as_its_own_session_may_attach_at_its_tenants_limit(tenancy):
    for cid in (1, 2):
        tenancy.connected(cid, A)
        tenancy.admit(cid, stream=True)  # alice's two sessions: her limit
    tenancy.attach(1, "alice-session-0001")  # 1 becomes a lease: still two sessions, not three
    tenancy.leases.attach(1, "alice-session-0001")
    tenancy.attached(1, "alice-session-0001")
    assert len(tenancy.sessions(A)) == 2
