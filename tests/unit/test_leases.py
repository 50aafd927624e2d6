"""The lease table and the store's cache on their own (no sockets): a fake clock makes time exact."""

from __future__ import annotations

import pytest

from helpers import Clock
from remotorch.worker.leases import SESSION_ID, LeaseTable
from remotorch.worker.store import SharedStore


@pytest.fixture
def clock():
    return Clock()


def test_unattached_connections_are_their_own_key(clock):
    table = LeaseTable(10, clock)
    assert table.key(7) == 7
    table.disconnect(7)
    assert table.expired() == ([], [])


def test_a_detached_session_lives_for_its_lease(clock):
    table = LeaseTable(10, clock)
    resumed, displaced = table.attach(1, "a" * 32)
    assert (resumed, displaced) == (False, [])
    key = table.key(1)
    table.disconnect(1)
    clock.now += 9.9
    assert table.expired() == ([], [])
    resumed, _ = table.attach(2, "a" * 32)  # reconnected in time: the same session
    assert resumed and table.key(2) is key
    table.disconnect(2)
    clock.now += 10.1
    gone, close = table.expired()
    assert gone == [key] and close == []
    resumed, _ = table.attach(3, "a" * 32)  # too late: a new, empty session under a new key
    assert not resumed and table.key(3) is not key


def test_a_silent_connected_session_expires_and_its_connection_is_closed(clock):
    table = LeaseTable(10, clock)
    table.attach(1, "b" * 32)
    clock.now += 6
    table.begin(1)  # a heartbeat
    table.end(1, clock.now)
    clock.now += 6
    assert table.expired() == ([], [])
    clock.now += 5
    gone, close = table.expired()
    assert len(gone) == 1 and close == [1]
    assert table.key(1) == 1  # the connection is no longer attached


def test_nothing_expires_while_a_request_runs_and_a_long_one_restarts_the_clocks(clock):
    table = LeaseTable(10, clock)
    table.attach(1, "c" * 32)
    table.attach(2, "d" * 32)
    started = clock.now
    table.begin(2)
    clock.now += 30  # session 2 runs a long graph; session 1's heartbeats wait behind it
    assert table.expired() == ([], [])
    table.end(2, started)
    clock.now += 1
    assert table.expired() == ([], [])  # session 1 gets a fresh lease from the end of the stall
    clock.now += 10
    gone, close = table.expired()
    assert sorted(close) == [1, 2]


def test_reattaching_moves_the_session_and_displaces_the_old_connection(clock):
    table = LeaseTable(10, clock)
    table.attach(1, "e" * 32)
    resumed, displaced = table.attach(2, "e" * 32)
    assert resumed and displaced == [1]
    assert table.key(1) == 1 and table.key(2) is not None
    with pytest.raises(ValueError):
        table.attach(2, "f" * 32)  # one connection, one session


def test_release_ends_a_session_now(clock):
    table = LeaseTable(10, clock)
    table.attach(1, "g" * 32)
    key = table.key(1)
    assert table.release(1) is key
    assert table.release(1) is None
    assert len(table) == 0


def test_session_id_syntax():
    assert SESSION_ID.fullmatch("A" * 16) and SESSION_ID.fullmatch("x_-" * 20)
    for bad in ("a" * 15, "a" * 129, "a" * 20 + " ", "a" * 20 + "/", "ü" * 20):
        assert not SESSION_ID.fullmatch(bad)


def test_store_cache_keeps_orphans_up_to_its_bound_oldest_evicted_first():
    store = SharedStore(keep_bytes=250)
    for i, key in enumerate("abc"):
        store.put(f"s{i}", key, object(), 100)
    store.drop_session("s0")
    store.drop_session("s1")
    assert store.orphan_bytes == 200 and store.total_bytes == 100
    store.drop_session("s2")  # 300 cached > 250: "a", the oldest orphan, goes
    assert store.orphan_bytes == 200
    assert not store.adopt("s9", "a")
    assert store.adopt("s9", "b")  # back in use, held by s9
    assert store.orphan_bytes == 100 and store.total_bytes == 100
    assert store.get("s9", "b") is not None
    assert store.evict(50) == 100 and store.orphan_bytes == 0
    with pytest.raises(KeyError):
        store.get("s0", "b")  # adopted by s9 only


def test_store_without_cache_frees_at_once():
    store = SharedStore()
    store.put("s", "a", object(), 10)
    assert store.drop_session("s") == ["a"]
    assert store.orphan_bytes == 0 and not store.adopt("t", "a")
