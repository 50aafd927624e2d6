"""Unit tests of the worker's stores: parameter slots and optimizers, and handles (in-process; the
wire is covered in integration/test_training.py)."""

from __future__ import annotations

import pytest
import torch

from remotorch.errors import InvalidRequestError, MissingObjectsError
from remotorch.worker.handles import HandleStore, count_bytes
from remotorch.worker.training import SAME_BITS_FOREACH, Trainables, optimizer_class, plain_hyper

S = "session-a"


@pytest.fixture
def state():
    return Trainables(torch.device("cpu"))


def test_gradients_accumulate_like_autograd(state):
    state.bind(S, 1, torch.zeros(3), private=True)
    g = torch.ones(3)
    state.accumulate(S, 1, g, owned=False)
    p = state.slot(S, 1)
    assert torch.equal(p.grad, torch.ones(3))
    g.mul_(5)  # not owned: the first gradient was copied, so this does not leak in
    assert torch.equal(p.grad, torch.ones(3))
    state.accumulate(S, 1, torch.full((3,), 2.0), owned=True)
    assert torch.equal(p.grad, torch.full((3,), 3.0))
    with pytest.raises(InvalidRequestError, match="shape"):
        state.accumulate(S, 1, torch.ones(4), owned=True)
    state.accumulate(S, 1, torch.ones(3, dtype=torch.float64), owned=True)  # converted to the slot's dtype
    assert p.grad.dtype == torch.float32 and torch.equal(p.grad, torch.full((3,), 4.0))


def test_bind_copies_shared_content_and_overwrites_in_place(state):
    shared = torch.arange(4.0)
    state.bind(S, 1, shared, private=False)
    p = state.slot(S, 1)
    assert p.data_ptr() != shared.data_ptr()  # a content-addressed tensor is never mutated
    opt = torch.optim.SGD([p], lr=1.0)
    p.grad = torch.ones(4)
    opt.step()
    assert torch.equal(shared, torch.arange(4.0))
    state.bind(S, 1, torch.full((4,), 7.0), private=True)  # same shape: same Parameter object
    assert state.slot(S, 1) is p and torch.equal(p, torch.full((4,), 7.0))


def test_slot_used_by_an_optimizer_cannot_change_shape(state):
    state.bind(S, 1, torch.zeros(2), private=True)
    state.optim_create(S, 1, "SGD", [[1]], [{"lr": 0.1}])
    with pytest.raises(InvalidRequestError, match="changed shape"):
        state.bind(S, 1, torch.zeros(3), private=True)


def test_bytes_count_params_grads_state_and_handles_once(state):
    handles = HandleStore()

    def total(session=None):
        return count_bytes([*handles.tensors(session), *state.tensors(session)])

    state.bind(S, 1, torch.zeros(10), private=True)  # 40 bytes
    state.accumulate(S, 1, torch.ones(10), owned=True)  # +40
    h = torch.ones(5)
    handles.put(S, [100, 101], [h, h])  # the same tensor twice: +20 once
    assert total() == 100 and handles.nbytes(S) == 20  # each object once
    handles.track()  # (from now on kept as handles come and go)
    assert handles.nbytes(S) == 20 == handles.total_bytes
    state.optim_create(S, 7, "Adam", [[1]], [{"lr": 0.1}])
    state.optim_step(S, 7, [])
    assert total() == 100 + 80 + 4  # exp_avg, exp_avg_sq, step
    state.apply_pending(S, zero_grad=[7])
    handles.release(S, [100, 101, 999])  # an id it does not hold is ignored
    assert state.slot(S, 1).grad is None
    assert total() == 40 + 84 and state.bytes() == 40 + 84
    state.bind("session-b", 1, torch.zeros(2), private=True)
    assert state.bytes("session-b") == 8
    assert total(S) == 40 + 84
    state.drop_session(S)
    assert state.bytes() == 8
    assert state.bytes(S) == 0


def test_handles_are_per_session_and_ids_are_not_reused():
    handles = HandleStore()
    handles.put(S, [1], [torch.ones(1)])
    with pytest.raises(InvalidRequestError, match="already in use"):
        handles.put(S, [1], [torch.ones(1)])
    with pytest.raises(MissingObjectsError) as info:
        handles.get("session-b", 1)
    assert info.value.handles == [1] and info.value.tensors == [] and not info.value.recoverable


def test_missing_slots_and_optimizers_are_named_by_typed_ids(state):
    with pytest.raises(MissingObjectsError) as info:
        state.slot(S, 5)
    assert info.value.slots == [5] and not info.value.recoverable
    with pytest.raises(MissingObjectsError) as info:
        state.optim_step(S, 9, [])
    assert info.value.optims == [9]


def test_optimizer_names_resolve_only_to_torch_optim_classes():
    assert optimizer_class("AdamW") is torch.optim.AdamW
    for name in ("Optimizer", "lr_scheduler", "__class__", "_functional", "SGD.step", "", "x" * 100):
        with pytest.raises(InvalidRequestError):
            optimizer_class(name)
    assert plain_hyper({"betas": [0.8, 0.9], "lr": 0.1}) == {"betas": (0.8, 0.9), "lr": 0.1}
    for key in ("params", "_x", "a b", "__init__"):
        with pytest.raises(InvalidRequestError):
            plain_hyper({key: 1})


@pytest.mark.parametrize("name", sorted(SAME_BITS_FOREACH))
def test_a_cpu_worker_steps_with_foreach_and_gets_the_same_bits_as_torchs_default_loop(state, name):
    """The worker picks the multi-tensor step where the user left ``foreach`` unset; it must change no bit."""
    torch.manual_seed(0)
    shapes = [(64, 32), (32,), (300, 64), (1,)]
    values = [torch.randn(s) for s in shapes]
    grads = [[torch.randn(s) for s in shapes] for _ in range(5)]
    local = [torch.nn.Parameter(v.clone()) for v in values]
    hyper = dict(getattr(torch.optim, name)([torch.zeros(1, requires_grad=True)]).defaults, lr=1e-2)
    assert hyper["foreach"] is None
    opt_local = getattr(torch.optim, name)([{"params": local, **hyper}], lr=1e-2)  # torch's own default: the loop
    for sid, v in enumerate(values, 1):
        state.bind(S, sid, v.clone(), private=True)
    state.optim_create(S, 1, name, [list(range(1, len(values) + 1))], [hyper])
    assert state._optim(S, 1).param_groups[0]["foreach"] is True
    for step in grads:
        for p, g in zip(local, step):
            p.grad = g.clone()
        opt_local.step()
        for sid, g in enumerate(step, 1):
            state.accumulate(S, sid, g.clone(), owned=True)
        state.optim_step(S, 1, [{}])
        state.apply_pending(S, zero_grad=[1])
    for sid, p in enumerate(local, 1):
        assert torch.equal(state.slot(S, sid).detach(), p.detach()), f"{name}: parameter {sid} differs"


def test_a_foreach_the_user_chose_is_kept(state):
    state.bind(S, 1, torch.zeros(3), private=True)
    state.optim_create(S, 1, "AdamW", [[1]], [{"lr": 0.1, "foreach": False}])
    state.bind(S, 2, torch.zeros(3), private=True)
    state.optim_create(S, 2, "SGD", [[2]], [{"lr": 0.1, "foreach": None}])  # no faster: torch's default
    assert state._optim(S, 1).param_groups[0]["foreach"] is False
    assert state._optim(S, 2).param_groups[0]["foreach"] is None
