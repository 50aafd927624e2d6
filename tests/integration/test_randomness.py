"""Seeded randomness as torch does it: remote random graphs draw from this process's generator.

Each case runs the same code eagerly and through a real worker, from the same
``torch.manual_seed``, and compares bit for bit: dropout masks, the values
local code draws afterwards, a ``get_rng_state``/``set_rng_state`` round
trip, two sessions and two workers, and training with dropout step by step.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import remotorch


class Drop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 32)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(torch.relu(self.lin(x))).sum(1)


def model() -> nn.Module:
    torch.manual_seed(0)
    return Drop()


X = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))


def draws(fn) -> tuple:
    """Two calls and a local draw after them, from seed 7 (values read in between, as a user would)."""
    torch.manual_seed(7)
    with torch.no_grad():
        first = fn(X).tolist()
        second = fn(X).tolist()
    return first, second, torch.rand(4).tolist()


def test_dropout_equals_eager_and_local_draws_after_it_are_eager_s(session):
    m = model()
    want = draws(m)
    assert want[0] != want[1]  # two calls draw two masks
    compiled = remotorch.compile(m, session=session, fallback="raise")
    assert draws(compiled) == want  # the first call (waited for: it compiles) and a warm one
    assert draws(compiled) == want  # and again, run after run


def test_the_same_seed_gives_the_same_values_in_another_session_and_on_another_worker(session, make_session,
                                                                                      start_server):
    m = model()
    here = draws(remotorch.compile(m, session=session, fallback="raise"))
    other_session = draws(remotorch.compile(m, session=make_session(), fallback="raise"))
    other_worker = draws(remotorch.compile(m, session=make_session(start_server(name="other").url),
                                           fallback="raise"))
    assert here == other_session == other_worker == draws(m)


def test_the_same_seed_gives_the_same_values_on_the_inductor_engine_run_after_run(session, make_session):
    """Inductor draws its own way (not eager's values), from the session's state: the same seed gives
    the same masks in every session, and two calls two masks."""
    m = model()
    assert "inductor" in session.health()["engines"]
    first = draws(remotorch.compile(m, session=session, engine="inductor", fallback="raise"))
    assert first[0] != first[1]
    torch._dynamo.reset()
    assert draws(remotorch.compile(m, session=make_session(), engine="inductor", fallback="raise")) == first


def test_get_and_set_rng_state_round_trip(session):
    compiled = remotorch.compile(model(), session=session, fallback="raise")
    with torch.no_grad():
        compiled(X).tolist()  # compiled: the calls below are sent without waiting
        state = torch.get_rng_state()
        a = compiled(X)
        torch.set_rng_state(state)  # before a's value was read: this state wins
        b = compiled(X)
        assert torch.equal(a, b)
        torch.manual_seed(3)
        c = compiled(X)
        torch.manual_seed(3)
        assert torch.equal(compiled(X), c)


def test_an_explicit_generators_draws_stay_here_and_advance_it_as_eager_does(session):
    """Dynamo leaves a draw from a generator passed in outside its graphs (a graph break): the graphs
    around it run on the worker, the draw here, from that generator, call after call as eager draws,
    and the default generator does not move (no remote random graph parked it)."""
    def noisy(x, g):
        return (x * 2 + torch.rand(x.shape, generator=g)).sin()

    compiled = remotorch.compile(noisy, session=session, fallback="raise")
    torch.manual_seed(0)
    before = torch.get_rng_state()
    mine, reference = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    got = [compiled(X, mine) for _ in range(3)]
    assert torch.equal(torch.get_rng_state(), before)  # (read nothing yet: a parked state would show)
    for g in got:
        assert torch.equal(g, noisy(X, reference))
    assert torch.equal(mine.get_state(), reference.get_state())
    stats = session.stats()
    assert stats["remote_calls"] == 6 and stats["graphs_uploaded"] == 2 and stats["fallbacks"] == 0, stats


def test_training_with_dropout_equals_eager_step_by_step(session):
    remote_model, local_model = model(), model()
    compiled = remotorch.compile(remote_model, session=session, fallback="raise")
    opt = remotorch.optim.RemoteOptimizer(torch.optim.SGD, remote_model.parameters(), lr=0.1, session=session)
    local_opt = torch.optim.SGD(local_model.parameters(), lr=0.1)

    def run(f, optimizer) -> list[float]:
        torch.manual_seed(11)
        losses = []
        for _ in range(4):
            loss = f(X).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    want = run(local_model, local_opt)
    assert run(compiled, opt) == pytest.approx(want, rel=1e-6)
    session.pull(remote_model)
    torch.testing.assert_close(dict(remote_model.named_parameters()), dict(local_model.named_parameters()))


def unread_then_local(compiled) -> tuple:
    """From seed 7: two calls whose values are not read, then a local draw at once, then the values."""
    torch.manual_seed(7)
    with torch.no_grad():
        first, second = compiled(X), compiled(X)
        here = torch.rand(4).tolist()
        return first.tolist(), second.tolist(), here


def test_blocking_mode_waits_for_every_reply_so_local_draws_after_a_random_graph_are_eager_s(server, session_for):
    """``blocking=True`` waits for each reply: the generator's state is back here when the call
    returns, so a local draw with nothing read equals eager's; no request is sent without waiting."""
    m = model()
    want = unread_then_local(m)
    s = session_for(server, blocking=True)
    compiled = remotorch.compile(m, session=s, fallback="raise")
    assert unread_then_local(compiled) == want
    assert unread_then_local(compiled) == want
    assert s.stats()["requests_queued"] == 0


def test_launch_blocking_in_the_environment_is_blocking_mode(server, session_for, monkeypatch):
    monkeypatch.setenv("REMOTORCH_LAUNCH_BLOCKING", "1")
    s = session_for(server)
    assert s.blocking
    m = model()
    compiled = remotorch.compile(m, session=s, fallback="raise")
    assert unread_then_local(compiled) == unread_then_local(m)
    assert s.stats()["requests_queued"] == 0


def test_a_local_draw_while_the_state_is_on_the_worker_is_not_eager_s_and_says_so_once(session, caplog,
                                                                                       monkeypatch):
    """Without blocking mode the same program draws from the parked generator (repeatable, not what
    eager draws) and a warning says so, once; the values the worker drew are eager's all the same."""
    from remotorch.client import rng

    monkeypatch.setattr(rng.GENERATORS, "_warned", False)  # (once a process: an earlier test may have)
    m = model()
    want = unread_then_local(m)
    compiled = remotorch.compile(m, session=session, fallback="raise")
    with torch.no_grad():
        compiled(X).tolist()  # compiled (waited for): from here on calls are sent without waiting
    with caplog.at_level("WARNING", logger="remotorch.client.rng"):
        got = unread_then_local(compiled)
        again = unread_then_local(compiled)
    warned = [r for r in caplog.records if "random numbers were drawn here" in r.getMessage()]
    assert len(warned) == 1, caplog.text
    assert got[:2] == want[:2] and again[:2] == want[:2]  # the worker drew eager's values
    assert got[2] != want[2]  # the local draw came from the parked state
    assert session.stats()["requests_queued"] > 0


def test_get_rng_state_before_a_read_is_where_the_worker_is(session):
    """Read before the worker's reply, ``get_rng_state()`` is the parked state (not eager's); setting
    it back means "go on from where the worker is", so the sequence goes on unbroken."""
    m = model()
    torch.manual_seed(7)
    with torch.no_grad():
        want = [m(X).tolist() for _ in range(3)]
        eager_state = torch.get_rng_state()
    compiled = remotorch.compile(m, session=session, fallback="raise")
    torch.manual_seed(7)
    with torch.no_grad():
        first = compiled(X)
        first.tolist()  # (compiled and read: the calls below are sent without waiting)
        second = compiled(X)
        parked = torch.get_rng_state()
        torch.set_rng_state(parked)
        third = compiled(X)
        got = [first.tolist(), second.tolist(), third.tolist()]
    assert not torch.equal(parked, eager_state)
    assert got == want
    assert torch.equal(torch.get_rng_state(), eager_state)  # after the read: eager's state, here


def test_blocking_mode_gives_the_same_bits(server, session_for):
    m = copy.deepcopy(model())
    default = draws(remotorch.compile(m, session=session_for(server), fallback="raise"))
    blocking = draws(remotorch.compile(m, session=session_for(server, blocking=True), fallback="raise"))
    assert default == blocking == draws(m)


CLIENT = """
import sys, torch, remotorch
with remotorch.Session(sys.argv[1], token=sys.argv[2]) as s:
    f = remotorch.compile(lambda x: torch.nn.functional.dropout(x, 0.5), session=s, fallback="raise")
    torch.manual_seed(99)
    with torch.no_grad():
        f(torch.ones(4096)).sum().item()
print("drew", flush=True)
"""


def test_another_processs_session_drawing_between_two_random_graphs_changes_nothing_here(server, session):
    """The worker runs each session's random graphs from that session's own state: another client
    process's session draws on the same worker between two of this session's, which goes on from
    where its own left (its state does not travel again)."""
    import subprocess
    import sys

    from conftest import TOKEN, clean_env

    m = model()
    want = draws(m)
    compiled = remotorch.compile(m, session=session, fallback="raise")
    torch.manual_seed(7)
    with torch.no_grad():
        first = compiled(X).tolist()  # read: the state is here, and the worker's session holds a copy
        done = subprocess.run([sys.executable, "-c", CLIENT, server.url, TOKEN], capture_output=True, text=True,
                              env=clean_env(), timeout=300)
        assert done.stdout.strip() == "drew", done.stderr[-3000:]
        sent = session.stats()["bytes_sent"]
        second = compiled(X).tolist()
        assert session.stats()["bytes_sent"] - sent < X.nbytes + 1024  # the input; the state (5 KB) stays
    assert (first, second, torch.rand(4).tolist()) == want
