"""Every local write to a parameter reaches the worker: local optimizers of every implementation,
storage swaps, and writes through ``.data`` announced with ``remotorch.mark_changed``.

Each case trains the same model twice, once compiled with ``aot_eager`` and once on a real worker,
and compares losses and weights step by step. Before the optimizer hook, a fused AdamW stepped the
local weights without bumping their version counters, the worker kept the first weights, and the
loss stayed flat.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remotorch

from helpers import tiny_mlp

X = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
Y = torch.randn(32, 1, generator=torch.Generator().manual_seed(2))

OPTIMIZERS = [
    (torch.optim.AdamW, dict(fused=True)),
    (torch.optim.AdamW, dict(foreach=True)),
    (torch.optim.AdamW, dict(foreach=False)),
    (torch.optim.Adam, dict(fused=True)),
    (torch.optim.SGD, dict(fused=True, momentum=0.9)),
    (torch.optim.SGD, dict(foreach=False, momentum=0.9)),
]


def _train(compile_fn, optimizer_class, options, steps: int = 3):
    model = tiny_mlp(8, 16, 1)
    opt = optimizer_class(model.parameters(), lr=0.05, **options)
    f = compile_fn(model)
    losses = []
    for _ in range(steps):
        loss = nn.functional.mse_loss(f(X), Y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("optimizer_class,options", OPTIMIZERS,
                         ids=[f"{c.__name__}-{'-'.join(f'{k}={v}' for k, v in o.items())}" for c, o in OPTIMIZERS])
def test_local_optimizer_trains_as_torch_does(session, optimizer_class, options):
    want = _train(lambda m: torch.compile(m, backend="aot_eager"), optimizer_class, options)
    got = _train(lambda m: remotorch.compile(m, session=session, fallback="raise"), optimizer_class, options)
    assert len(set(got[0])) == len(got[0]), f"the loss did not move: {got[0]}"
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


def test_storage_swapped_through_data_is_seen(session):
    """``p.data = other`` moves no version counter; the data's address moves, and that is seen."""
    model = tiny_mlp(8, 4).eval()
    f = remotorch.compile(model, session=session, fallback="raise")
    with torch.no_grad():
        f(X)
        model[0].weight.data = torch.randn_like(model[0].weight)
        assert torch.equal(f(X), model(X))


def test_writes_through_data_need_mark_changed(session):
    """An EMA update in place through ``.data`` is invisible to torch's counters; ``mark_changed`` says it.

    Without it the worker keeps the old weights (documented in training/writes.py and the README):
    this test also pins that limit, so a change that starts seeing such writes shows up here.
    """
    ema, model = tiny_mlp(8, 4, seed=0).eval(), tiny_mlp(8, 4, seed=1)
    f = remotorch.compile(ema, session=session, fallback="raise")
    with torch.no_grad():
        f(X)
        for e, p in zip(ema.parameters(), model.parameters()):
            e.data.mul_(0.5).add_(p.data, alpha=0.5)
        stale = f(X)
        assert not torch.equal(stale, ema(X))  # the limit: not seen by itself
        remotorch.mark_changed(ema)
        assert torch.equal(f(X), ema(X))


def test_optimizer_on_the_worker_is_left_alone(session):
    """A RemoteOptimizer's step changes the worker's values: the hook must not mark the local
    (stale) copies as changed, or they would be uploaded over the trained ones."""
    model = tiny_mlp(8, 16, 1)
    reference = tiny_mlp(8, 16, 1)
    f = remotorch.compile(model, session=session, fallback="raise")
    opt = remotorch.optim.RemoteOptimizer(torch.optim.SGD, model.parameters(), lr=0.1, session=session)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(3):
        loss = nn.functional.mse_loss(f(X), Y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = nn.functional.mse_loss(reference(X), Y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(loss.item(), ref_loss.item())
    session.pull(model)
    torch.testing.assert_close(list(model.parameters()), list(reference.parameters()))
