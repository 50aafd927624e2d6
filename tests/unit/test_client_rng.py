"""Where this process's generator state lives (client/rng.py), rule by rule, against the worker's own
per-session states (worker/rng.py) in this process: no sockets, no graphs.

A "call" here is what a link does around a random graph: ask which state to
send, say it was sent, let the worker draw, then read its reply at once or
later. Whatever the order, the values drawn (remotely, and here after a read)
must be eager's: one sequence from ``torch.manual_seed``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import pytest
import torch

from remotorch.client.rng import Generators
from remotorch.worker.rng import Generators as WorkerGenerators


@dataclass
class Launched:
    done: bool = False


@dataclass(eq=False)
class Link:
    """One worker session: its generator states there, and the replies not read yet."""

    gens: Generators
    worker: WorkerGenerators = field(default_factory=lambda: WorkerGenerators(torch.device("cpu")))
    unread: list = field(default_factory=list)  # (epoch, changes, Launched)
    sent_states: list = field(default_factory=list)  # what each random graph carried (None: nothing)

    def call(self, draws: int = 3, read: bool = True) -> torch.Tensor:
        state = self.gens.state_for(self)
        self.sent_states.append(state)
        epoch = self.gens.sent(self, state)
        here = torch.get_rng_state()  # the worker is another process: its generator is not ours
        try:
            out = self.worker.run(self, state or b"", lambda: torch.rand(draws))
            changes = self.worker.changes(self)
        finally:
            torch.set_rng_state(here)
        launched = Launched()
        if read:
            launched.done = True
            self.gens.answered(self, epoch, changes)
        else:
            self.unread.append((epoch, changes, launched))
            self.gens.launched(self, launched)
        return out

    def bring_back_generator(self) -> None:
        """A read on this link: every reply comes in, in order."""
        for epoch, changes, launched in self.unread:
            launched.done = True
            self.gens.answered(self, epoch, changes)
        self.unread.clear()


def eager(seed: int, *draws: int) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    return [torch.rand(n) for n in draws]


def same(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.fixture
def gens():
    saved = torch.get_rng_state()
    yield Generators()
    torch.set_rng_state(saved)


def test_calls_read_at_once_draw_eagers_sequence_and_the_state_travels_once(gens):
    want = eager(1, 3, 3, 3, 4)
    link = Link(gens)
    torch.manual_seed(1)
    got = [link.call(), link.call(), link.call()]
    assert same(got + [torch.rand(4)], want)
    assert link.sent_states[0] is not None and link.sent_states[1:] == [None, None]  # the worker holds it


def test_while_the_state_is_on_the_worker_the_generator_is_parked_until_a_read(gens):
    want = eager(2, 3, 3, 4)
    link = Link(gens)
    torch.manual_seed(2)
    got = [link.call(read=False), link.call(read=False)]
    assert gens._parked() and link.sent_states[1] is None
    assert gens.awaited(link) is link.unread[-1][2]  # a read waits for the last random graph too
    gens.bring_back(link)
    assert not gens._parked() and gens.awaited(link) is None
    assert same(got + [torch.rand(4)], want)


def test_a_reseed_while_parked_wins_and_travels_with_the_next_graph(gens, caplog):
    link = Link(gens)
    torch.manual_seed(3)
    link.call(read=False)
    with caplog.at_level(logging.WARNING, logger="remotorch.client.rng"):
        torch.manual_seed(4)
        got = [link.call(), torch.rand(4)]
    assert caplog.text == ""  # a reseed is what the program meant
    assert link.sent_states[-1] == bytes(torch.Generator().manual_seed(4).get_state().numpy())
    assert same(got, eager(4, 3, 4))


def test_set_rng_state_of_the_parked_state_means_where_the_worker_is(gens):
    want = eager(5, 3, 3, 3)
    link = Link(gens)
    torch.manual_seed(5)
    got = [link.call(read=False)]
    parked = torch.get_rng_state()
    got.append(link.call(read=False))
    torch.set_rng_state(parked)
    got.append(link.call())
    assert link.sent_states[1:] == [None, None]
    assert same(got, want)


def test_a_draw_while_parked_is_not_eagers_and_says_so_once(gens, caplog):
    link = Link(gens)
    torch.manual_seed(6)
    with caplog.at_level(logging.WARNING, logger="remotorch.client.rng"):
        link.call(read=False)
        drawn = torch.rand(4)
        link.call(read=False)
        torch.rand(4)
        link.call()
    warned = [r.getMessage() for r in caplog.records]
    assert warned == ["random numbers were drawn here while a remote random graph's generator state was on its "
                      "worker (before any read there): they are not those a local run would draw. Read a value "
                      "(or call session.synchronize()) first, or set REMOTORCH_LAUNCH_BLOCKING=1"]
    assert not torch.equal(drawn, eager(6, 3, 4)[1])
    assert gens._owner is None  # the state drawn here went with the next graph


def test_the_state_follows_the_calls_from_worker_to_worker(gens):
    want = eager(7, 3, 3, 3, 3, 4)
    a, b = Link(gens), Link(gens)
    torch.manual_seed(7)
    got = [a.call(read=False), b.call(read=False), b.call(read=False), a.call()]
    assert a.unread == [] and b.unread == []  # each move brought the state back first (a read there)
    assert [s is None for s in a.sent_states + b.sent_states] == [False, False, False, True]
    got.append(torch.rand(4))
    assert same(got, want)


def test_a_worker_whose_copy_equals_the_state_here_gets_no_state_again(gens):
    want = eager(8, 3, 3) + eager(8, 3, 3, 3, 3)
    a, b = Link(gens), Link(gens)
    torch.manual_seed(8)
    got = [a.call(), b.call()]  # b's copy: two draws past the seed
    torch.manual_seed(8)
    got += [a.call()]  # reseeded: a's copy is stale, the state goes
    assert a.sent_states[-1] is not None
    got += [a.call()]
    assert a.sent_states[-1] is None
    got += [b.call()]  # two draws past the seed again: b's copy is the state here, by value
    assert b.sent_states[-1] is None
    got += [a.call()]  # a's copy is one draw behind now
    assert a.sent_states[-1] is not None
    assert same(got, want)


def test_a_reply_to_an_older_graph_does_not_bring_the_state_back(gens):
    link = Link(gens)
    torch.manual_seed(9)
    link.call(read=False)
    link.call(read=False)
    (epoch, changes, _), _ = link.unread
    gens.answered(link, epoch, changes)  # the first reply alone: the state is still on the worker
    assert gens._parked() and gens._owner is link
    link.bring_back_generator()
    assert not gens._parked()


def test_a_lost_worker_gives_back_the_state_from_before_its_graphs(gens):
    link = Link(gens)
    torch.manual_seed(10)
    before = torch.get_rng_state()
    link.call(read=False)
    link.call(read=False)
    gens.forget(link)  # its session is gone, with the state
    assert torch.equal(torch.get_rng_state(), before) and gens._owner is None
    link.unread.clear()
    assert link.call() is not None and link.sent_states[-1] is not None  # it starts anew from here


def test_a_fork_gives_each_worker_its_own_stream_and_leaves_the_generator_here(gens):
    a, b = Link(gens), Link(gens)

    def run(seed: int) -> tuple[list, torch.Tensor]:
        torch.manual_seed(seed)
        gens.fork([a, b])
        drawn = [a.call(read=False), b.call(read=False), a.call(read=False), b.call(read=False)]
        assert not gens._parked()  # streams of their own: this process's generator stays here
        return drawn, torch.rand(4)

    first, here = run(11)
    assert not torch.equal(first[0], first[1])  # two streams
    assert [s is None for s in a.sent_states] == [False, True]  # the first state, then on from it
    torch.manual_seed(11)
    base = int(torch.empty((), dtype=torch.int64).random_().item())
    assert torch.equal(here, torch.rand(4))  # the fork drew one number here, and nothing else
    assert a.sent_states[0] == bytes(torch.Generator().manual_seed(base).get_state().numpy())
    assert b.sent_states[0] == bytes(torch.Generator().manual_seed(base + 1).get_state().numpy())
    again, _ = run(11)
    assert same(again, first)  # the same seed: the same streams
    gens.forget(a)
    assert a.call() is not None and a.sent_states[-1] is not None  # forgotten: its stream ended


def test_only_the_worker_that_holds_the_state_is_waited_for(gens):
    a, b = Link(gens), Link(gens)
    torch.manual_seed(12)
    a.call(read=False)
    assert gens.awaited(a) is a.unread[-1][2] and gens.awaited(b) is None
    a.unread[-1][2].done = True  # its reply is read already: nothing to wait for
    assert gens.awaited(a) is None


def test_a_forgotten_worker_gets_the_state_again_and_a_reseed_while_parked_survives_it(gens):
    a = Link(gens)
    gens.forget(Link(gens))  # a link never used: nothing to forget
    torch.manual_seed(13)
    a.call()  # read: the worker's copy is the state here
    gens.forget(a)  # a new session there: it holds nothing
    a.call()
    assert a.sent_states[-1] is not None
    a.call(read=False)
    torch.manual_seed(99)  # the program reseeded while parked: that state wins
    want = torch.get_rng_state()
    gens.forget(a)
    assert torch.equal(torch.get_rng_state(), want)


def test_a_fork_first_brings_the_state_back_from_every_worker_that_holds_it(gens):
    a, b = Link(gens), Link(gens)
    torch.manual_seed(14)
    a.call(read=False)  # the state lives on a
    gens.fork([a, b])
    torch.manual_seed(14)
    torch.rand(3)
    base = int(torch.empty((), dtype=torch.int64).random_().item())  # drawn after a's graph, here
    a.call(read=False)
    assert a.sent_states[-1] == bytes(torch.Generator().manual_seed(base).get_state().numpy())


def test_a_fork_goes_on_from_here_when_a_worker_cannot_give_the_state_back(gens):
    class Lost(Link):
        def bring_back_generator(self) -> None:  # its worker is gone: no reply comes
            pass

    lost, other = Lost(gens), Link(gens)
    torch.manual_seed(15)
    lost.call(read=False)
    gens.fork([lost, other])
    assert gens._owner is None and gens._last is None
    other.call()
    assert other.sent_states[-1] is not None


def test_a_state_set_back_before_a_reply_came_draws_again_what_it_drew(gens):
    link = Link(gens)
    torch.manual_seed(16)
    link.call()
    saved = torch.get_rng_state()  # the worker's copy is this state too, until its next graph
    first = link.call(read=False)
    torch.set_rng_state(saved)  # set back before that graph's reply came: this state must travel
    again = link.call()
    assert link.sent_states[-1] == bytes(saved.numpy())
    assert torch.equal(first, again)


def test_a_call_goes_on_from_here_when_the_worker_holding_the_state_cannot_give_it_back(gens):
    class Lost(Link):
        def bring_back_generator(self) -> None:  # its worker is gone: no reply comes
            pass

    lost, other = Lost(gens), Link(gens)
    torch.manual_seed(17)
    lost.call(read=False)
    assert gens.state_for(other) is not None and gens._owner is None  # the state lives here again


def test_a_reply_while_a_later_graph_is_in_flight_does_not_make_the_workers_copy_current(gens):
    want = eager(18, 3, 3, 3, 3)
    link = Link(gens)
    torch.manual_seed(18)
    got = [link.call(), link.call(read=False), link.call(read=False)]
    (epoch, changes, launched), _ = link.unread
    launched.done = True
    gens.answered(link, epoch, changes)  # the first reply: its copy is two draws in; a third is on its way
    torch.manual_seed(18)
    torch.rand(3)
    torch.rand(3)  # the program sets the state two draws in: the worker's copy was that, a graph ago
    again = link.call()
    assert link.sent_states[-1] is not None  # it must travel: the worker has moved on
    assert same(got + [again], want[:3] + [want[2]])
