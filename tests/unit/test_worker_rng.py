"""Each session's random state on the worker (worker/rng.py), its promises one by one, in this process.

A session draws one sequence whatever other sessions do between its random
graphs: the worker restores the session's own state around each run and keeps
the state the run leaves. A state the client sends starts the sequence anew;
what the client is told is exactly the bytes that changed since it last knew.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from remotorch.codec.rngstate import patched
from remotorch.errors import InvalidRequestError
from remotorch.worker.rng import Generators


def state_of(seed: int) -> bytes:
    return bytes(torch.Generator().manual_seed(seed).get_state().numpy())


def eager(seed: int, draws: int) -> list[torch.Tensor]:
    """``draws`` calls of ``torch.rand(5)`` from ``seed``, one after another, as one process would."""
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(5, generator=g) for _ in range(draws)]


def draw() -> torch.Tensor:
    return torch.rand(5)


@pytest.fixture
def gens():
    saved = torch.get_rng_state()
    yield Generators(torch.device("cpu"))
    torch.set_rng_state(saved)


def test_two_sessions_interleaved_each_draw_their_own_sequence(gens):
    a, b = eager(1, 3), eager(2, 3)
    got_a, got_b = [gens.run("a", state_of(1), draw)], [gens.run("b", state_of(2), draw)]
    for _ in range(2):  # each goes on from the state it left, the other's draws in between
        got_a.append(gens.run("a", b"", draw))
        torch.rand(100)  # the worker's own generator moves too (other work): nothing of a session's
        got_b.append(gens.run("b", b"", draw))
    for got, want in ((got_a, a), (got_b, b)):
        assert all(torch.equal(g, w) for g, w in zip(got, want)), (got, want)


def test_a_state_sent_again_starts_the_sequence_anew(gens):
    first = gens.run("a", state_of(3), draw)
    gens.run("a", b"", draw)
    assert torch.equal(gens.run("a", state_of(3), draw), first)


def test_a_session_that_never_sent_a_state_starts_from_the_workers_own_and_keeps_it(gens):
    torch.manual_seed(9)
    want = eager(9, 2)
    assert torch.equal(gens.run("a", b"", draw), want[0])
    g = torch.Generator().manual_seed(9)
    torch.rand(5, generator=g)  # what it was told is the change from the worker's own state
    assert patched(state_of(9), gens.changes("a")) == bytes(g.get_state().numpy())
    torch.manual_seed(123)  # the worker's generator moves on: the session's state is its own now
    assert torch.equal(gens.run("a", b"", draw), want[1])


def test_the_changes_told_are_those_since_the_client_last_knew(gens):
    assert gens.changes("nobody") == []
    sent = state_of(4)
    gens.run("a", sent, draw)
    changes = gens.changes("a")
    after_one = patched(sent, changes)
    g = torch.Generator().manual_seed(4)
    torch.rand(5, generator=g)
    assert after_one == bytes(g.get_state().numpy())  # the client's copy rebuilt exactly
    assert gens.changes("a") == []  # told once: nothing new since
    gens.run("a", b"", draw)
    torch.rand(5, generator=g)
    assert patched(after_one, gens.changes("a")) == bytes(g.get_state().numpy())


def test_a_graph_that_draws_nothing_changes_nothing_told(gens):
    sent = state_of(5)
    gens.run("a", sent, lambda: torch.ones(3))
    assert gens.changes("a") == []


def test_a_state_of_the_wrong_size_is_refused_and_the_session_keeps_its_own(gens):
    first = gens.run("a", state_of(6), draw)
    with pytest.raises(InvalidRequestError, match=r"a generator state is \d+ bytes, not 7"):
        gens.run("a", b"1234567", draw)
    assert torch.equal(gens.run("a", b"", draw), eager(6, 2)[1])
    assert torch.equal(first, eager(6, 1)[0])


def test_a_failed_run_keeps_what_it_drew_and_forget_ends_a_session(gens):
    def fails():
        torch.rand(5)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        gens.run("a", state_of(7), fails)
    assert torch.equal(gens.run("a", b"", draw), eager(7, 2)[1])  # as torch would: the draw happened
    gens.forget("a")
    gens.forget("a")  # (twice: nothing left to forget)
    assert gens.changes("a") == []
    torch.manual_seed(8)
    assert torch.equal(gens.run("a", b"", draw), eager(8, 1)[0])  # a new session: the worker's state again


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's generator calls over a CPU generator standing for device 0's (the CUDA path's logic
    on a machine without CUDA): the generator, and the devices each call named."""
    gen = torch.Generator()
    devices: list = []

    def set_state(state, device):
        devices.append(device)
        gen.set_state(state)

    def get_state(device):
        devices.append(device)
        return gen.get_state()

    monkeypatch.setattr(torch.cuda, "default_generators", (gen,))
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_state)
    monkeypatch.setattr(torch.cuda, "get_rng_state", get_state)
    return gen, devices


def cuda_seed(cpu_state: bytes) -> int:
    return int.from_bytes(hashlib.sha256(cpu_state).digest()[:8], "little") >> 1


def test_on_a_cuda_worker_each_session_draws_from_a_cuda_state_seeded_from_its_own(fake_cuda):
    gen, devices = fake_cuda
    saved = torch.get_rng_state()
    try:
        gens = Generators(torch.device("cuda", 0))

        def draw():
            return torch.rand(5, generator=gen)

        a, b = [], []
        a.append(gens.run("a", state_of(1), draw))
        b.append(gens.run("b", state_of(2), draw))
        a.append(gens.run("a", b"", draw))
        b.append(gens.run("b", b"", draw))
        assert all(torch.equal(g, w) for g, w in zip(a, eager(cuda_seed(state_of(1)), 2)))
        assert all(torch.equal(g, w) for g, w in zip(b, eager(cuda_seed(state_of(2)), 2)))
        assert devices and set(devices) == {torch.device("cuda", 0)}
        torch.manual_seed(9)  # a session that sent no state: seeded from the worker's own CPU state
        assert torch.equal(gens.run("c", b"", draw), eager(cuda_seed(state_of(9)), 1)[0])
        gen.manual_seed(77)
        before = gen.get_state()
        gens._cuda_seeded(state_of(3))  # seeding a state leaves the device's generator as it was
        assert torch.equal(gen.get_state(), before)
        seeded = Generators(torch.device("cuda"))._cuda_seeded(state_of(3))  # "cuda": the current device, 0
        assert torch.equal(seeded, torch.Generator().manual_seed(cuda_seed(state_of(3))).get_state())
    finally:
        torch.set_rng_state(saved)
