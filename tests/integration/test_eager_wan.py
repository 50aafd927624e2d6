"""Eager calls on kept values behind a real delay: they are queued, and only a read waits.

Every session here reaches the shared worker through a user-space relay that
holds each chunk 5 ms in each direction (``remotorch.devtools.netem``). The
tests count what is deterministic, never time: the values the code read
(``stats()["reads"]``, each waiting once at most) and the bytes.
"""

from __future__ import annotations

import pytest
import torch

import remotorch
from remotorch.devtools.netem import DelayProxy
from remotorch.optim import RemoteOptimizer

from helpers import tiny_gpt2
from helpers import token_batch as batch

DELAY_MS = 5
MiB = 1 << 20


@pytest.fixture(scope="module")
def relay(server):
    with DelayProxy(server.url, delay_ms=DELAY_MS) as proxy:
        yield proxy


@pytest.fixture
def wan(relay, session_for):
    return session_for(relay.url)


def delta(session, before: dict) -> dict:
    now = session.stats()
    return {k: now[k] - before[k] for k in ("reads", "blocking_reads", "bytes_sent", "bytes_received", "values_fetched",
                                             "eager_ops")}


def kept(session, x: torch.Tensor) -> torch.Tensor:
    f = remotorch.compile(lambda a: a.clone(), session=session, fallback="raise")
    with torch.no_grad():
        y = f(x)
    session.synchronize()
    return y


def test_ten_queued_training_steps_then_one_logging_read_wait_once(wan):
    model = tiny_gpt2()
    f = remotorch.compile(model, session=wan, fallback="raise")
    opt = RemoteOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-3, session=wan)

    def step(i: int) -> torch.Tensor:
        loss = f(batch(i), labels=batch(i)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    for i in range(2):  # cold: uploads, compiles
        step(i).item()
    torch.stack([step(i) for i in range(2)]).mean().item()  # the logging calls' graphs made once
    wan.synchronize()
    before = wan.stats()
    losses = [step(i) for i in range(10)]
    mean = torch.stack(losses).mean().item()
    d = delta(wan, before)
    assert d["reads"] == 1 and d["blocking_reads"] <= 1, d  # exactly one round trip at most: the .item()
    assert d["eager_ops"] == 2 and d["values_fetched"] == 0, d
    assert mean == pytest.approx(sum(loss.item() for loss in losses) / 10, rel=1e-6)


def test_a_chain_of_200_calls_then_a_scalar_read_waits_once_and_receives_little(wan):
    x = torch.randn(256, 1024, generator=torch.Generator().manual_seed(0))  # 1 MiB
    y = kept(wan, x)

    def chain(t):
        for _ in range(100):
            t = t * 1.0001
            t = t + 0.5
        return t.sum()

    chain(y).item()  # every call's graph made and uploaded once
    before = wan.stats()
    got = chain(y).item()
    d = delta(wan, before)
    assert d["reads"] == 1 and d["blocking_reads"] <= 1, d
    assert d["eager_ops"] == 201, d
    assert d["bytes_received"] < 16 << 10, d
    assert got == chain(x).item()


def test_writes_and_views_then_one_column_read_wait_once_for_the_column(wan):
    x = torch.randn(256, 1024, generator=torch.Generator().manual_seed(1))  # 1 MiB
    y, w = kept(wan, x), x.clone()
    for t in (y, w):  # once: the calls' graphs made and uploaded
        t.mul_(2).add_(1)
        t[:10].zero_()
        t[:, 3].tolist()
    wan.synchronize()
    before = wan.stats()
    for t in (y, w):
        t.mul_(2).add_(1)
        t[:10].zero_()
        t[20:30].mul_(3)
    column = y[:, 3].tolist()
    d = delta(wan, before)
    assert d["reads"] == 1 and d["blocking_reads"] <= 1, d
    assert d["values_fetched"] == 1, d
    # the column's 1 KiB and the replies' headers: not the value's 1 MiB
    assert d["bytes_received"] < y[:, 3].nbytes + 2048, d
    assert column == w[:, 3].tolist()
    assert y.is_remote
