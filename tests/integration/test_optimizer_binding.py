"""A RemoteOptimizer made without ``session=`` follows the session its parameters are used with.

The natural order of a training script is: compile the model on a session,
make the optimizer, then loop. The optimizer must not bind to the default
session (which would start an embedded worker nobody asked for, and then
refuse the parameters with ForeignParameterError at the first forward).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn import functional as F

import remotorch
import remotorch.client.session
from remotorch import models
from remotorch.optim import RemoteOptimizer

from conftest import TOKEN

TOL = dict(atol=1e-6, rtol=1e-5)


@pytest.fixture
def no_default_session(monkeypatch):
    """Fails the test if anything asks for the process-wide default session."""
    monkeypatch.setattr(remotorch.client.session, "_default", None)

    def refuse():
        raise AssertionError("the default session was asked for")

    monkeypatch.setattr(remotorch.client.session, "default_session", refuse)
    monkeypatch.setattr(remotorch.training.optim, "default_session", refuse)


@pytest.mark.parametrize("opt_cls,hyper", [(torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
                                           (torch.optim.AdamW, dict(lr=1e-2))])
def test_optimizer_without_session_binds_to_the_first_forward(server, no_default_session, opt_cls, hyper):
    torch.manual_seed(0)
    model = models.mlp()
    reference = copy.deepcopy(model)
    with remotorch.Session(server.url, token=TOKEN) as s:
        step = remotorch.compile(lambda x, y: F.cross_entropy(model(x), y), session=s, fallback="raise")
        opt = RemoteOptimizer(opt_cls, model.parameters(), **hyper)  # no session=: none is known yet
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        ref_opt = opt_cls(reference.parameters(), **hyper)
        ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
        assert not opt.bound
        for i in range(4):
            opt.zero_grad()  # before the first forward: nothing remote to clear, nothing started
            ref_opt.zero_grad()
            x, y = torch.randn(16, 784), torch.randint(0, 10, (16,))
            loss = step(x, y)
            assert opt.bound  # the forward bound it, before its backward
            loss.backward()
            assert all(p.grad is None for p in model.parameters())  # gradients stayed on the worker
            opt.step()
            sched.step()
            ref_loss = F.cross_entropy(reference(x), y)
            ref_loss.backward()
            ref_opt.step()
            ref_sched.step()
            torch.testing.assert_close(loss, ref_loss, **TOL)
        s.pull(model)
        stats = s.stats()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, **TOL)
    assert stats["fallbacks"] == 0
    assert remotorch.client.session._default is None  # no embedded worker was started


def test_state_loaded_before_binding_reaches_the_worker(server, no_default_session):
    """A checkpoint loaded into an optimizer that has no worker yet is sent when it gets one."""
    torch.manual_seed(1)
    model = models.mlp()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 784), torch.randint(0, 10, (8,))
    warm = torch.optim.AdamW(reference.parameters(), lr=1e-2)  # a local run to take a checkpoint from
    F.cross_entropy(reference(x), y).backward()
    warm.step()
    warm.zero_grad()
    with torch.no_grad():
        for p, q in zip(model.parameters(), reference.parameters()):
            p.copy_(q)
    with remotorch.Session(server.url, token=TOKEN) as s:
        step = remotorch.compile(lambda a, b: F.cross_entropy(model(a), b), session=s, fallback="raise")
        opt = RemoteOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-2)
        opt.load_state_dict(warm.state_dict())
        assert not opt.bound and opt.state_dict()["state"][0]["step"] == 1
        step(x, y).backward()
        opt.step()
        F.cross_entropy(reference(x), y).backward()
        warm.step()
        assert opt.state_dict()["state"][0]["step"] == 2  # the worker's state continued the checkpoint
        s.pull(model)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, **TOL)


def test_one_optimizer_over_parameters_of_two_sessions_is_refused(server, make_session, no_default_session):
    from remotorch.errors import ForeignParameterError

    a, b = models.mlp(), models.mlp()
    s1, s2 = make_session(), make_session()
    f1 = remotorch.compile(lambda x, y: F.cross_entropy(a(x), y), session=s1, fallback="raise")
    f2 = remotorch.compile(lambda x, y: F.cross_entropy(b(x), y), session=s2, fallback="raise")
    opt = RemoteOptimizer(torch.optim.SGD, [*a.parameters(), *b.parameters()], lr=0.1)
    x, y = torch.randn(4, 784), torch.randint(0, 10, (4,))
    f1(x, y).backward()
    assert opt.bound
    with pytest.raises(ForeignParameterError):
        f2(x, y)
