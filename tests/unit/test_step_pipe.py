"""The queue's estimate of the optimizer steps a link holds (``remotorch.client.depth.StepPipe``)."""

from __future__ import annotations

from remotorch.client.depth import MAX_PIPE, StepPipe


def steps_every(pipe: StepPipe, seconds: float, n: int, start: float = 100.0) -> float:
    t = start
    for _ in range(n):
        pipe.stepped(t)
        t += seconds
    return t


def test_the_link_holds_no_step_until_its_round_trip_and_the_pace_are_known():
    pipe = StepPipe()
    assert pipe.steps() == 0
    steps_every(pipe, 0.004, 10)
    assert pipe.steps() == 0  # no round trip measured yet
    fresh = StepPipe()
    fresh.answered(0.020)
    fresh.stepped(1.0)
    fresh.stepped(1.004)
    assert fresh.steps() == 0  # one gap is not a pace


def test_steps_on_the_wire_are_the_round_trip_over_the_pace():
    pipe = StepPipe()
    steps_every(pipe, 0.004, 10)
    pipe.answered(0.021)
    assert pipe.steps() == 5  # 21 ms / 4 ms, rounded down
    pipe.answered(0.0005)  # loopback: less than a step
    assert pipe.steps() == 0


def test_a_read_now_and_then_does_not_move_the_pace():
    pipe = StepPipe()
    t = 0.0
    for block in range(3):  # ten steps 2 ms apart, then a read that waits one 40 ms round trip
        t = steps_every(pipe, 0.002, 10, start=t) + 0.040
    pipe.answered(0.040)
    assert pipe.steps() == 20


def test_the_last_round_trip_counts_and_the_estimate_is_capped():
    pipe = StepPipe()
    steps_every(pipe, 0.001, 5)
    pipe.answered(0.080)
    pipe.answered(0.010)  # the link got faster
    assert pipe.steps() == 10
    pipe.answered(10.0)
    assert pipe.steps() == MAX_PIPE


def test_time_spent_waiting_for_room_in_the_queue_is_not_the_pace():
    # the bound throttles the loop to one step per 40 ms round trip; the program itself takes 2 ms
    pipe = StepPipe()
    waited = 0.0
    for i in range(10):
        pipe.stepped(i * 0.040, waited)
        waited += 0.038
    pipe.answered(0.040)
    assert pipe.steps() == 20


def test_the_pace_needs_three_gaps_and_is_their_median():
    pipe = StepPipe()
    pipe.answered(0.024)
    for t in (0.0, 0.001, 0.003):  # two gaps: 1 and 2 ms
        pipe.stepped(t)
    assert pipe.steps() == 0
    pipe.stepped(0.006)  # three: 1, 2 and 3 ms, the median 2
    assert pipe.steps() == 12
    for t in (0.010, 0.015, 0.021):  # six: 1..6 ms, the median the upper middle one, 4
        pipe.stepped(t)
    assert pipe.steps() == 6


def test_the_pace_is_that_of_the_last_31_steps():
    pipe = StepPipe()
    pipe.answered(0.1)
    t = steps_every(pipe, 0.05, 17)  # 16 gaps of 50 ms, then 16 of 10 ms: the last 31 hold 15 slow ones
    steps_every(pipe, 0.01, 16, start=t - 0.05 + 0.01)
    assert pipe.steps() == 10


def test_steps_sent_at_once_fill_the_pipe_and_waited_defaults_to_none():
    pipe = StepPipe()
    pipe.answered(0.001)
    for _ in range(4):
        pipe.stepped(5.0)  # no time between them
    assert pipe.steps() == MAX_PIPE
    explicit, implicit = StepPipe(), StepPipe()
    for p in (explicit, implicit):
        p.answered(0.02)
    for i in range(5):
        explicit.stepped(i * 0.004, waited=0.0)
        implicit.stepped(i * 0.004) if i % 2 else implicit.stepped(i * 0.004, 0.0)
    assert explicit.steps() == implicit.steps() == 5
