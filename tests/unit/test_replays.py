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
