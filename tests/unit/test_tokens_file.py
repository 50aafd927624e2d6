"""The tokens file: what it admits, what it refuses and why, and a tenant's request budget."""

from __future__ import annotations

import socket
import threading

import pytest

from remotorch.transport import handshake
from remotorch.transport.framing import AuthFailed
from remotorch.worker.tenants import Tenant, Tenants, TokensFileError, parse_tokens, token_hash

HASH = token_hash("alice-token").hex()


def test_a_full_table_parses_to_its_limits():
    t = parse_tokens(f'''
[tenants.alice]
token_sha256 = "{HASH}"
memory_quota = "2G"
max_sessions = 4
requests_per_second = 50
allow_ops = ["transformers"]
[tenants.bob]
token_sha256 = "{token_hash("bob-token").hex()}"
memory_quota = 1048576
''')
    alice, bob = t["alice"], t["bob"]
    assert (alice.memory_quota, alice.max_sessions, alice.requests_per_second, alice.allow_ops) == (
        2 << 30, 4, 50.0, frozenset({"transformers"}))
    assert (bob.memory_quota, bob.max_sessions, bob.requests_per_second, bob.allow_ops) == (1 << 20, None, None, None)
    assert alice.token_sha256 == token_hash("alice-token") and alice.key_id != bob.key_id


@pytest.mark.parametrize("text, says", [
    ("[tenants.alice\n", "not TOML"),
    ('[tenants.alice]\ntoken = "alice-token"\n', "unknown key(s) ['token']"),
    ('[tenants.alice]\ntoken_sha256 = "abc"\n', "token_sha256 must be 64 hex digits"),
    (f'[tenants."al ice"]\ntoken_sha256 = "{HASH}"\n', "a name is 1 to 64 characters"),
    (f'[tenants.alice]\ntoken_sha256 = "{HASH}"\nmemory_quota = "lots"\n', "memory_quota: not a size"),
    ("tenants = 5\n", "tokens.toml: 'tenants' must be tables: [tenants.NAME]"),
    ("[tenants]\nalice = 5\n", "tokens.toml: [tenants.alice]: must be a table"),
    ('[tenants.alice]\ntoken_sha256 = "abc"\n', "tokens.toml: [tenants.alice]: token_sha256 must be 64 hex digits "
                                              "(remotorch token new alice prints a token and its table)"),
    (f'[tenants.alice]\ntoken_sha256 = "{HASH}"\nmax_sessions = true\n', "max_sessions must be"),
    (f'[tenants.alice]\ntoken_sha256 = "{HASH}"\nrequests_per_second = true\n', "requests_per_second must be"),
    (f'[tenants.alice]\ntoken_sha256 = "{HASH}"\nrequests_per_second = 0\n', "requests_per_second must be"),
    (f'[tenants.alice]\ntoken_sha256 = "{HASH}"\nallow_ops = [""]\n', "allow_ops must be a list"),
    (f'[tenants.alice]\ntoken_sha256 = "{HASH}"\noperator = "yes"\n',
     "[tenants.alice]: operator must be true or false"),
    (f'[tenants.alice]\ntoken_sha256 = "{HASH}"\nmemory_quota = 1.5\n',
     "[tenants.alice]: memory_quota: a size such as 2G, or a number of bytes"),
    (f'[tenants.alice]\ntoken_sha256 = "{HASH}"\nmemory_quota = -1\n',
     "[tenants.alice]: memory_quota: a size such as 2G, or a number of bytes"),
    (f'[tenants.alice]\ntoken_sha256 = "{HASH}"\nmax_sessions = 0\n', "max_sessions must be"),
    (f'[tenants.alice]\ntoken_sha256 = "{HASH}"\nrequests_per_second = -1\n', "requests_per_second must be"),
    (f'[tenants.alice]\ntoken_sha256 = "{HASH}"\nallow_ops = "transformers"\n', "allow_ops must be a list"),
    (f'[tenants.alice]\ntoken_sha256 = "{HASH}"\n[tenants.bob]\ntoken_sha256 = "{HASH}"\n',
     "the same token as [tenants.alice]"),
    (f'[people.alice]\ntoken_sha256 = "{HASH}"\n', "unknown top-level key(s) ['people']"),
])
def test_a_file_that_cannot_be_used_is_refused_naming_the_tenant_and_the_key(text, says):
    with pytest.raises(TokensFileError) as info:
        parse_tokens(text, "tokens.toml")
    assert says in str(info.value) and str(info.value).startswith("tokens.toml")


def test_a_reload_returns_the_revoked_key_ids_and_keeps_unchanged_tenants(tmp_path):
    path = tmp_path / "tokens.toml"
    bob = f'[tenants.bob]\ntoken_sha256 = "{token_hash("bob-token").hex()}"\nrequests_per_second = 2\n'
    path.write_text(f'[tenants.alice]\ntoken_sha256 = "{HASH}"\n' + bob)
    tenants = Tenants(str(path))
    kept = tenants.get(handshake.key_id(token_hash("bob-token")))
    assert tenants.names() == ["alice", "bob"] and tenants.legacy_token is None
    path.write_text(bob)
    assert tenants.reload() == [handshake.key_id(token_hash("alice-token"))]
    assert tenants.get(handshake.key_id(token_hash("bob-token"))) is kept  # its request budget goes on
    path.write_text(bob.replace("requests_per_second = 2", "requests_per_second = 3"))
    assert tenants.reload() == []
    changed = tenants.get(handshake.key_id(token_hash("bob-token")))
    assert changed is not kept and changed.requests_per_second == 3.0  # changed limits: a new tenant object
    kept = changed
    path.write_text("[tenants.bob\n")
    with pytest.raises(TokensFileError):
        tenants.reload()
    assert tenants.names() == ["bob"]  # a broken file changes nothing


def test_token_is_the_unnamed_tenant_and_may_not_also_be_in_the_file(tmp_path):
    path = tmp_path / "tokens.toml"
    path.write_text(f'[tenants.alice]\ntoken_sha256 = "{HASH}"\n')
    tenants = Tenants(str(path), "plain-token")
    assert tenants.names() == ["", "alice"] and tenants.legacy_token == b"plain-token"
    assert tenants.get(None).name == ""
    with pytest.raises(TokensFileError, match="^--token is also a tenant's token in the tokens file$"):
        Tenants(str(path), "alice-token")


def test_a_tenants_budget_is_a_burst_of_one_second_then_its_rate():
    t = Tenant("alice", token_hash("x"), requests_per_second=4)
    assert [t.admit(now=10.0) for _ in range(6)] == [True] * 4 + [False] * 2
    assert t.admit(now=10.25) and not t.admit(now=10.25)  # a quarter second refills one
    assert Tenant("bob", token_hash("y")).admit()  # no rate: always


def _handshake(server_side, token: bytes):
    a, b = socket.socketpair()
    out = {}

    def serve():
        try:
            out["server"] = server_side(b)
        except Exception as exc:  # noqa: BLE001 (reported below)
            out["server"] = exc

    t = threading.Thread(target=serve)
    t.start()
    try:
        out["client"] = handshake.client_handshake(a, token, 7)
    except Exception as exc:  # noqa: BLE001
        out["client"] = exc
    t.join()
    a.close()
    b.close()
    return out["client"], out["server"]


def test_a_keyed_hello_picks_its_tenant_and_an_unknown_key_is_answered_as_a_wrong_token(tmp_path):
    path = tmp_path / "tokens.toml"
    path.write_text(f'[tenants.alice]\ntoken_sha256 = "{HASH}"\n')
    tenants = Tenants(str(path))
    client, server = _handshake(lambda s: handshake.accept_handshake(s, tenants.legacy_token, 7, None,
                                                                      tenants.secret), b"alice-token")
    assert isinstance(client, bytes) and server[0] == client
    assert server[2] == handshake.key_id(token_hash("alice-token"))
    client, server = _handshake(lambda s: handshake.accept_handshake(s, tenants.legacy_token, 7, None,
                                                                      tenants.secret), b"mallory-token")
    assert isinstance(client, AuthFailed) and "does not share this token" in str(client)


def test_the_smallest_limits_are_admitted():
    (t,) = parse_tokens(f'[tenants.alice]\ntoken_sha256 = "{HASH}"\nmemory_quota = 0\nmax_sessions = 1\n'
                        'requests_per_second = 0.5\n').values()
    assert (t.memory_quota, t.max_sessions, t.requests_per_second) == (0, 1, 0.5)


def test_without_a_file_the_token_or_the_empty_one_is_the_only_tenant(tmp_path):
    plain = Tenants(None, "plain-token")
    assert plain.names() == [""] and plain.get(None).token_sha256 == token_hash("plain-token")
    empty = Tenants()  # a loopback worker without a token: the empty token
    assert empty.legacy_token == b"" and empty.get(None).token_sha256 == token_hash("")
    assert empty.secret(handshake.key_id(token_hash(""))) == token_hash("")
    with pytest.raises(TokensFileError, match="^cannot read the tokens file: "):
        Tenants(str(tmp_path / "missing.toml"))


def test_a_file_only_worker_has_no_unnamed_tenant_whatever_the_file_holds(tmp_path):
    path = tmp_path / "tokens.toml"
    path.write_text(f'[tenants.nobody]\ntoken_sha256 = "{token_hash("").hex()}"\n'
                    f'[tenants.XXXX]\ntoken_sha256 = "{HASH}"\n')
    tenants = Tenants(str(path))
    assert tenants.get(None) is None and tenants.legacy_token is None  # a hello without a key id: no one
    both = Tenants(str(path), "plain-token")  # a tenant's name never clashes with the unnamed one
    assert both.names() == ["", "XXXX", "nobody"]


def test_an_empty_file_admits_no_one_and_a_digest_may_be_upper_case():
    assert parse_tokens("") == {}
    (t,) = parse_tokens(f'[tenants.alice]\ntoken_sha256 = "{HASH.upper()}"\n').values()
    assert t.token_sha256 == token_hash("alice-token")
    with pytest.raises(TokensFileError, match="^tokens file: not TOML"):  # the source's default name
        parse_tokens("[tenants.alice\n")
