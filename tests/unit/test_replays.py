"""The worker's memory of what each session's stream ran (``remotorch.worker.replay.Replays``).

``ran`` only notes a request, so that its reply goes out first; every other
method, and the serving loop once the reply is written, settles it. These
tests read the memory without the serving loop: a request sent again must be
answered from it whether or not the loop settled it.
"""

from __future__ import annotations

from remotorch.codec import messages as m
from remotorch.worker.replay import Replays


def replays() -> Replays:
    return Replays(lambda exc: m.encode(m.ErrorReply("worker", str(exc))))


def reply(n: int) -> tuple:
    return m.encode(m.Ok()) + bytes(n), [bytearray(n)]


def test_a_request_noted_and_not_settled_is_answered_from_memory_when_sent_again():
    r = replays()
    first = reply(1)
    r.ran("s", 1, first)
    assert r.answered("s", 1) is first  # settled on the way: not run again
    assert r.answered("s", 2) is None  # a new one runs
    assert r.unacknowledged() == 1


def test_what_a_request_acknowledges_is_forgotten_once_it_is_settled():
    r = replays()
    for seq in (1, 2, 3):
        r.ran("s", seq, reply(seq), ack=seq - 1)
    r.settle()
    assert r.unacknowledged() == 1  # 1 and 2 were acknowledged by 2 and 3; 3 is kept
    assert r.held_bytes() == len(reply(3)[0]) + 3
    gone = r.answered("s", 1)  # ran, and its reply is no longer kept: an error, never a second run
    assert gone is not None and b"error" in gone[0] and b"ran already" in gone[0]


def test_settling_twice_keeps_a_reply_once_and_each_session_apart():
    r = replays()
    r.ran("a", 1, reply(4))
    r.settle()
    r.settle()
    r.ran("b", 1, reply(8))
    assert r.unacknowledged() == 1  # b's is noted, not yet settled
    r.acknowledge("a", 1)  # settles b's first, then forgets a's
    assert r.unacknowledged() == 1
    assert r.answered("b", 1) is not None and r.answered("a", 2) is None


def test_a_session_that_ends_before_its_last_request_is_settled_leaves_nothing_behind():
    r = replays()
    r.ran("s", 1, reply(16))
    r.forget("s")
    r.settle()
    assert r.unacknowledged() == 0 and r.held_bytes() == 0
    assert r.answered("s", 1) is None  # no memory of it: a new session numbers afresh


def test_the_memory_is_bounded_by_replies_and_by_bytes_per_session(monkeypatch):
    from remotorch.worker import replay

    monkeypatch.setattr(replay, "MAX_REPLIES", 3)
    r = replays()
    kept = {seq: reply(10) for seq in range(1, 6)}
    for seq, rep in kept.items():
        r.ran("s", seq, rep)
    r.ran("t", 1, reply(10))
    r.settle()
    assert r.unacknowledged() == 4  # s keeps its last three, t its one
    assert [r.answered("s", seq) is kept[seq] for seq in (3, 4, 5)] == [True] * 3
    assert b"could not be kept" in r.answered("s", 2)[0] and r.answered("s", 6) is None
    monkeypatch.setattr(replay, "MAX_REPLIES", 4096)
    size = len(reply(100)[0]) + 100
    monkeypatch.setattr(replay, "MAX_BYTES", 2 * size)
    r = replays()
    for seq in (1, 2, 3):
        r.ran("s", seq, reply(100))
    r.settle()
    assert r.unacknowledged() == 2 and r.held_bytes() == 2 * size  # exactly the bound: kept
    assert r.answered("s", 1)[1] == [] and b"ran already" in r.answered("s", 1)[0]


def test_a_reply_without_frames_counts_its_header_and_other_sessions_keep_theirs():
    r = replays()
    header = m.encode(m.Ok())
    r.ran("s", 1, (header, []))
    r.forget("t")  # another session ends: s's noted reply stays noted
    r.acknowledge("nobody", 7)  # (a session with no memory: nothing to forget)
    r.settle()
    assert r.held_bytes() == len(header) and r.answered("s", 1) == (header, [])
    r.acknowledge("s", 1)
    assert r.unacknowledged() == 0 and r.held_bytes() == 0


def test_a_request_that_acknowledges_nothing_forgets_nothing_and_an_ended_session_is_forgotten():
    r = replays()
    first, second = reply(1), reply(2)
    r.ran("s", 1, first)  # no ack given: it acknowledges nothing
    r.ran("s", 2, second)
    r.settle()
    assert r.answered("s", 1) is first and r.answered("s", 2) is second
    r.forget("s")  # the session ended: a client with its id starts afresh
    assert r.answered("s", 1) is None and r.unacknowledged() == 0
    header = m.encode(m.Ok())
    r.ran("t", 1, (header, None))  # a reply with no frames at all
    r.settle()
    assert r.held_bytes() == len(header)


def test_a_reply_no_longer_kept_is_an_error_saying_why():
    r = replays()
    r.ran("s", 1, reply(1))
    r.ran("s", 2, reply(1), ack=1)
    r.settle()
    error = m.decode(r.answered("s", 1)[0])
    assert error.message == ("request 1 was sent again after a dropped connection: it ran already, and its reply "
                             "could not be kept for so long (the client read no reply for too long)")
