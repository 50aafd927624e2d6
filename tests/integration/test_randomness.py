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


def test_an_explicit_generator_is_honoured(session):
    def noisy(x, g):
        return x + torch.rand(x.shape, generator=g)

    compiled = remotorch.compile(noisy, session=session, fallback="raise")
    got = compiled(X, torch.Generator().manual_seed(5))
    assert torch.equal(got, noisy(X, torch.Generator().manual_seed(5)))


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


def test_blocking_mode_gives_the_same_bits(server, session_for):
    m = copy.deepcopy(model())
    default = draws(remotorch.compile(m, session=session_for(server), fallback="raise"))
    blocking = draws(remotorch.compile(m, session=session_for(server, blocking=True), fallback="raise"))
    assert default == blocking == draws(m)
