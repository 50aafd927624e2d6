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
