"""Training through remote graphs, on the real worker server over loopback.

Saved activations stay on the worker as handles, parameter gradients
accumulate there, and :class:`remotorch.optim.RemoteOptimizer` steps there.
Every remote run is compared with the same loop run purely locally; the
worker runs the same CPU kernels through the eager engine, so AdamW results
agree to float rounding.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import remotorch
from remotorch import models
from remotorch.codec import messages as m
from remotorch.codec.tensors import tensor_to_wire
from remotorch.errors import (ForeignParameterError, InvalidRequestError, MissingObjectsError,
                              WorkerError)
from remotorch.optim import RemoteOptimizer
from remotorch.training.client import training_client

TOL = dict(atol=1e-6, rtol=1e-5)
SLACK = 2048  # bytes of headers a steady-state step may add to inputs, labels and loss


def compile_remote(fn, session, **kwargs):
    return remotorch.compile(fn, session=session, fallback="raise", **kwargs)


def classifier_loss(model):
    def loss_fn(x, y):
        return F.cross_entropy(model(x), y)
    return loss_fn


def regression_loss(model):
    def loss_fn(x, y):
        return F.mse_loss(model(x), y)
    return loss_fn


def mlp_batch(n=32):
    return torch.randn(n, 784), torch.randint(0, 10, (n,))


def train_side_by_side(step, reference_loss, optimizers, batches, between=None, after_each=None) -> list:
    """For each batch: the remote step and the local reference, backward both; then ``between()``
    (e.g. clip and compare gradient norms); then every optimizer steps and zeroes its gradients;
    then ``after_each()`` (e.g. lr schedulers). Returns the (remote, reference) losses."""
    losses = []
    for x, y in batches:
        loss, ref_loss = step(x, y), reference_loss(x, y)
        loss.backward()
        ref_loss.backward()
        if between is not None:
            between()
        for o in optimizers:
            o.step()
            o.zero_grad()
        if after_each is not None:
            after_each()
        losses.append((loss, ref_loss))
    return losses


def block_batch(n=4):
    return torch.randn(n, 16, 64), torch.randn(n, 16, 64)


def remote_and_reference(model, loss_of, session, opt_cls=torch.optim.AdamW, groups=None, dynamic=None, **hyper):
    """What training ``model`` on ``session`` next to a local reference takes: the reference (a copy
    of ``model``), the remote step (``loss_of(model)`` compiled), a RemoteOptimizer for the model
    and an ``opt_cls`` for the reference, both with ``hyper`` (and ``groups(m)``: parameter groups,
    instead of all the parameters)."""
    params = groups or (lambda m: m.parameters())
    reference = copy.deepcopy(model)
    step = compile_remote(loss_of(model), session, dynamic=dynamic)
    return (reference, step, RemoteOptimizer(opt_cls, params(model), session=session, **hyper),
            opt_cls(params(reference), **hyper))


def train_pair(model, loss_of, batch, session, steps, opt_cls=torch.optim.AdamW, **hyper):
    """Train ``model`` remotely and a copy locally on the same batches; both, and the losses."""
    reference, step, opt, ref_opt = remote_and_reference(model, loss_of, session, opt_cls, **hyper)
    losses = train_side_by_side(step, loss_of(reference), (opt, ref_opt), (batch() for _ in range(steps)))
    return reference, opt, [(loss.item(), ref_loss.item()) for loss, ref_loss in losses]


def assert_same_parameters(model, reference, **tol):
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, msg=name, **(tol or TOL))


# ----------------------------------------------------------- AdamW, remote vs local
def test_adamw_mlp_20_steps_matches_local(session):
    torch.manual_seed(0)
    model = models.mlp()
    before = copy.deepcopy(model)
    reference, _, losses = train_pair(model, classifier_loss, mlp_batch, session, 20, lr=1e-3)
    for remote_loss, local_loss in losses:
        assert remote_loss == pytest.approx(local_loss, rel=1e-5)
    # the local copy is stale until pulled: the worker holds the trained parameters
    assert_same_parameters(model, before, atol=0, rtol=0)
    assert all(p.grad is None for p in model.parameters())
    assert session.pull(model) == 4
    assert_same_parameters(model, reference)
    assert not torch.equal(model[0].weight, before[0].weight)
    assert session.stats()["fallbacks"] == 0


def test_adamw_transformer_block_20_steps_matches_local(session):
    torch.manual_seed(1)
    model = models.TransformerBlock()
    reference, _, losses = train_pair(model, regression_loss, block_batch, session, 20,
                                      lr=1e-3, weight_decay=0.1)
    for remote_loss, local_loss in losses:
        assert remote_loss == pytest.approx(local_loss, rel=1e-5)
    session.pull(model)
    assert_same_parameters(model, reference, atol=1e-5, rtol=1e-4)
    assert model.state_dict().keys() == reference.state_dict().keys()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, reference.state_dict()[key], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("opt_cls, hyper", [
    (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True)),
    (torch.optim.Adam, dict(lr=1e-3, amsgrad=True)),
    (torch.optim.RMSprop, dict(lr=1e-3, centered=True)),
    (torch.optim.Adagrad, dict(lr=1e-2)),
])
def test_other_torch_optim_classes_match_local(session, opt_cls, hyper):
    torch.manual_seed(2)
    model = models.mlp()
    reference, _, _ = train_pair(model, classifier_loss, lambda: mlp_batch(8), session, 3, opt_cls, **hyper)
    session.pull(model)
    assert_same_parameters(model, reference)


def test_parameter_groups_with_their_own_hyperparameters(session):
    torch.manual_seed(21)
    model = models.mlp()

    def groups(m):
        return [{"params": m[0].parameters(), "lr": 0.05, "weight_decay": 0.01},
                {"params": m[2].parameters()}]
    reference, step, opt, ref_opt = remote_and_reference(model, classifier_loss, session, torch.optim.SGD, groups,
                                                         lr=0.2, momentum=0.5)
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref_opt.param_groups] == [0.05, 0.2]
    train_side_by_side(step, classifier_loss(reference), (opt, ref_opt), (mlp_batch(8) for _ in range(3)))
    session.pull(model)
    assert_same_parameters(model, reference)


def test_dynamic_shapes_training_saves_sizes_and_tensors(session):
    torch.manual_seed(24)
    model = models.TransformerBlock()
    reference, step, opt, ref_opt = remote_and_reference(model, regression_loss, session, dynamic=True, lr=1e-3)
    # one forward/backward pair serves every batch size
    train_side_by_side(step, regression_loss(reference), (opt, ref_opt), (block_batch(n) for n in (2, 3, 5)))
    assert session.stats()["graphs_uploaded"] == 2
    session.pull(model)
    assert_same_parameters(model, reference, atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------------- wire bytes
def test_steady_state_step_carries_only_inputs_labels_and_loss(session):
    torch.manual_seed(3)
    model = models.mlp()
    step = compile_remote(classifier_loss(model), session)
    opt = RemoteOptimizer(torch.optim.AdamW, model.parameters(), session=session, lr=1e-3)
    for i in range(5):
        x, y = mlp_batch()
        before = session.stats()
        loss = step(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        after = session.stats()
    payload = x.nbytes + y.nbytes + loss.nbytes
    wire = (after["bytes_sent"] - before["bytes_sent"]) + (after["bytes_received"] - before["bytes_received"])
    assert payload <= wire <= payload + SLACK
    assert after["tensors_uploaded"] == 4  # the parameters, once, when the optimizer was created
    assert after["graphs_uploaded"] == 2


# ---------------------------------------------------------------------- memory
def test_saved_activations_stay_on_the_worker_and_are_freed_after_backward(start_server, make_session):
    srv = start_server(name="activations")  # its own worker: nobody else changes its memory
    session = make_session(srv.url)
    torch.manual_seed(4)
    model = models.mlp()
    step = compile_remote(classifier_loss(model), session)
    x, y = mlp_batch()
    step(x, y).backward()  # compile both graphs, bind the parameters
    session.flush_releases()
    idle = session.health()["resident_bytes"]
    loss = step(x, y)
    client = training_client(session)
    assert client.handles.live > 0
    held = session.health()["resident_bytes"] - idle
    hidden = 32 * 256 * 4  # at least the hidden activation is kept for backward
    assert held >= hidden
    loss.backward()
    assert client.handles.live == 0
    session.flush_releases()
    # the gradients of the second backward were added to the first: nothing new is held
    assert session.health()["resident_bytes"] == idle


def test_worker_memory_is_flat_over_1000_steps(start_server, make_session):
    srv = start_server(name="flat")
    session = make_session(srv.url)
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    step = compile_remote(classifier_loss(model), session)
    opt = RemoteOptimizer(torch.optim.AdamW, model.parameters(), session=session, lr=1e-3)
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    memory = {}
    for i in range(1, 1001):
        step(x, y).backward()
        opt.step()
        opt.zero_grad()
        if i in (10, 1000):
            session.flush_releases()
            memory[i] = session.health()["resident_bytes"]
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert memory[10] == memory[1000]
    # parameters, exp_avg, exp_avg_sq, and AdamW's step counter (a 0-d float32) per parameter
    assert memory[1000] == 3 * params + 4 * len(list(model.parameters()))
    assert training_client(session).handles.live == 0


# ------------------------------------------------------------ schedulers, clipping
def test_lr_schedulers_drive_the_worker_optimizer(session):
    torch.manual_seed(6)
    model = models.mlp()
    reference, step, opt, ref_opt = remote_and_reference(model, classifier_loss, session, torch.optim.SGD,
                                                         lr=0.1, momentum=0.9)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (opt, ref_opt)]
    warm = [torch.optim.lr_scheduler.LambdaLR(o, lambda e: 1.0 / (1 + e)) for o in (opt, ref_opt)]
    train_side_by_side(step, classifier_loss(reference), (opt, ref_opt), (mlp_batch(8) for _ in range(6)),
                       after_each=lambda: [s.step() for s in scheds + warm])
    assert opt.param_groups[0]["lr"] == pytest.approx(ref_opt.param_groups[0]["lr"])
    assert opt.param_groups[0]["lr"] < 0.1 / 4
    session.pull(model)
    assert_same_parameters(model, reference)


def test_clip_grad_norm_on_the_worker(session):
    torch.manual_seed(7)
    model = models.mlp()
    reference, step, opt, ref_opt = remote_and_reference(model, classifier_loss, session, torch.optim.SGD, lr=0.5)

    def clip_both():
        norm = opt.clip_grad_norm_(0.05)
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        assert isinstance(norm, torch.Tensor)
        torch.testing.assert_close(norm, ref_norm)
        assert norm.item() > 0.05  # so the clipping did something

    train_side_by_side(step, classifier_loss(reference), (opt, ref_opt), (mlp_batch(8) for _ in range(2)),
                       between=clip_both)
    session.pull(model)
    assert_same_parameters(model, reference)


def test_torchs_own_clip_grad_norm_clips_gradients_that_live_on_the_worker(session):
    """A loop written for torch calls ``torch.nn.utils.clip_grad_norm_(model.parameters(), …)``; with a
    RemoteOptimizer the gradients are on the worker (``p.grad`` is None here), and it must still clip
    them there, exactly as torch does locally."""
    torch.manual_seed(7)
    model = models.mlp()
    reference, step, opt, ref_opt = remote_and_reference(model, classifier_loss, session, torch.optim.SGD, lr=0.5)
    norms = []

    def clip_both():
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        torch.testing.assert_close(norm, ref_norm)
        norms.append(norm.item())

    train_side_by_side(step, classifier_loss(reference), (opt, ref_opt), (mlp_batch(8) for _ in range(3)),
                       between=clip_both)
    assert len(norms) == 3 and min(norms) > 0.05  # so the clipping did something each step
    session.pull(model)
    assert_same_parameters(model, reference)
    # part of the optimizer's parameters, or a mix with local ones: torch's answer needs both sides
    with pytest.raises(ValueError, match="partly on a worker"):
        torch.nn.utils.clip_grad_norm_(list(model.parameters())[:1], 1.0)
    with pytest.raises(ValueError, match="partly on a worker"):
        torch.nn.utils.clip_grad_norm_([*model.parameters(), *reference.parameters()], 1.0)
    # parameters no RemoteOptimizer manages: torch's own function
    plain = nn.Linear(3, 1)
    plain(torch.ones(2, 3)).sum().backward()
    assert torch.nn.utils.clip_grad_norm_(plain.parameters(), 1e-3).item() > 1e-3
    assert torch.nn.utils.clip_grad_norm_.__wrapped__(plain.parameters(), 1e-3).item() <= 1e-3 + 1e-6


# --------------------------------------------------------- gradients and graph breaks
class BreakNet(nn.Module):
    """Two linear layers with data-dependent control flow (a graph break) between them."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(20, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if h.sum() > 0:  # graph break: gradients flow across it through the client
            h = h * 2
        return self.b(h)


def test_training_across_a_graph_break_matches_local(session):
    torch.manual_seed(8)
    model = BreakNet()
    reference, _, _ = train_pair(model, regression_loss, lambda: (torch.randn(8, 20), torch.randn(8, 4)),
                                 session, 5, torch.optim.Adam, lr=1e-2)
    assert session.stats()["graphs_uploaded"] >= 4  # two forward/backward pairs at least
    session.pull(model)
    assert_same_parameters(model, reference)


def mlp_bound_to_the_worker(session, seed):
    """A seeded MLP, its local copy, the MLP compiled on ``session``, and a RemoteOptimizer (never stepped)
    that binds its parameters to the worker: gradients accumulate there. Keep the optimizer alive."""
    torch.manual_seed(seed)
    model = models.mlp()
    reference = copy.deepcopy(model)
    opt = RemoteOptimizer(torch.optim.SGD, model.parameters(), session=session, lr=0.1)
    return model, reference, compile_remote(model, session), opt


def test_gradients_accumulate_with_pytorch_semantics_and_input_grads_come_back(session):
    model, reference, compiled, _opt = mlp_bound_to_the_worker(session, 9)
    xs = [torch.randn(4, 784, requires_grad=True) for _ in range(2)]
    ref_xs = [x.detach().clone().requires_grad_() for x in xs]
    for x, rx in zip(xs, ref_xs):  # two backward passes, no zero_grad: gradients add up
        compiled(x).pow(2).sum().backward()
        reference(rx).pow(2).sum().backward()
        torch.testing.assert_close(x.grad, rx.grad)  # the input's gradient travels back
    session.pull(model, grads=True)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_autograd_grad_returns_gradients_even_with_an_optimizer_on_the_worker(session):
    model, reference, compiled, _opt = mlp_bound_to_the_worker(session, 28)
    x = torch.randn(4, 784)
    grads = torch.autograd.grad(compiled(x).pow(2).sum(), list(model.parameters()))
    ref_grads = torch.autograd.grad(reference(x).pow(2).sum(), list(reference.parameters()))
    for g, rg in zip(grads, ref_grads):
        torch.testing.assert_close(g, rg)
    # backward(inputs=...) accumulates only those: on the worker, as backward() would
    compiled(x).pow(2).sum().backward(inputs=[model[0].weight])
    reference(x).pow(2).sum().backward(inputs=[reference[0].weight])
    assert model[0].weight.grad is None  # it stayed on the worker
    session.pull(model, grads=True)
    torch.testing.assert_close(model[0].weight.grad, reference[0].weight.grad)
    assert all(p.grad is None for p in list(model.parameters())[1:])


def test_retain_graph_allows_a_second_backward(session):
    model, reference, compiled, _opt = mlp_bound_to_the_worker(session, 10)
    x = torch.randn(4, 784)
    loss = compiled(x).pow(2).sum()
    ref_loss = reference(x).pow(2).sum()
    for _ in range(2):
        loss.backward(retain_graph=True)
        ref_loss.backward(retain_graph=True)
    assert training_client(session).handles.live > 0  # still saved: the graph is retained
    session.pull(model, grads=True)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    del loss
    assert training_client(session).handles.live == 0


def test_parameters_used_by_local_code_get_their_gradients_and_new_values(session):
    torch.manual_seed(11)
    model = models.mlp()
    scale = nn.Parameter(torch.tensor(0.5))
    reference, ref_scale = copy.deepcopy(model), nn.Parameter(torch.tensor(0.5))
    compiled = compile_remote(model, session)
    opt = RemoteOptimizer(torch.optim.SGD, [*model.parameters(), scale], session=session, lr=0.1)
    ref_opt = torch.optim.SGD([*reference.parameters(), ref_scale], lr=0.1)
    train_side_by_side(lambda x, y: F.cross_entropy(compiled(x), y) * scale,  # scale is used only here, locally
                       lambda x, y: F.cross_entropy(reference(x), y) * ref_scale, (opt, ref_opt),
                       (mlp_batch(8) for _ in range(3)),
                       # brought back after each step: local code uses it
                       after_each=lambda: torch.testing.assert_close(scale, ref_scale))
    session.pull(model)
    assert_same_parameters(model, reference)


def test_without_a_remote_optimizer_gradients_come_back_for_a_local_one(session):
    torch.manual_seed(22)
    model = models.mlp()
    reference = copy.deepcopy(model)
    step = compile_remote(classifier_loss(model), session)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, reference)]

    def gradients_came_back():
        assert all(p.grad is not None for p in model.parameters())

    # a local optimizer: gradients come back, updated weights go up again
    train_side_by_side(step, classifier_loss(reference), opts, (mlp_batch(8) for _ in range(3)),
                       between=gradients_came_back)
    assert_same_parameters(model, reference)
    # a RemoteOptimizer created after a backward takes the local gradients along
    x, y = mlp_batch(8)
    step(x, y).backward()
    classifier_loss(reference)(x, y).backward()
    opt = RemoteOptimizer(torch.optim.SGD, model.parameters(), session=session, lr=0.1)
    opt.step()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    assert all(p.grad is None for p in model.parameters())
    session.pull(model)
    assert_same_parameters(model, reference)


@torch.library.custom_op("rmtrain::double", mutates_args=())
def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_double.register_fake
def _double_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def test_a_graph_that_runs_locally_sees_the_trained_parameters(session):
    torch.manual_seed(23)
    model = models.mlp()
    reference, opt, _ = train_pair(model, classifier_loss, lambda: mlp_batch(8), session, 3, lr=1e-2)
    evaluate = remotorch.compile(lambda x: _double(model(x)), session=session, fallback="local")
    x = torch.randn(4, 784)
    with torch.no_grad(), pytest.warns(remotorch.errors.RemoteFallbackWarning, match="double"):
        out = evaluate(x)  # an op the worker does not allow: the graph runs here
    with torch.no_grad():
        torch.testing.assert_close(out, reference(x) * 2, **TOL)
    assert session.stats()["fallbacks"] == 1


# ----------------------------------------------------------- pull and local changes
def test_worker_parameters_are_the_truth_until_a_local_change(session):
    torch.manual_seed(12)
    model = models.mlp()
    reference, opt, _ = train_pair(model, classifier_loss, lambda: mlp_batch(8), session, 3, lr=1e-2)
    compiled = compile_remote(model, session)
    x = torch.randn(4, 784)
    uploaded = session.stats()["tensors_uploaded"]
    client = training_client(session)
    with torch.no_grad():  # inference after training: the trained weights, no stale upload, no handles
        torch.testing.assert_close(compiled(x), reference(x), **TOL)
    assert session.stats()["tensors_uploaded"] == uploaded
    assert client.handles.live == 0

    with torch.no_grad():  # a local in-place change is noticed and wins
        model[0].weight.mul_(0.5)  # the local copy is the untrained one: so is the result
        reference[0].weight.copy_(model[0].weight)  # the other parameters stay the trained ones
        torch.testing.assert_close(compiled(x), reference(x), **TOL)
    assert session.stats()["tensors_uploaded"] == uploaded + 1


def test_pull_brings_parameters_and_gradients_for_a_checkpoint(session):
    torch.manual_seed(13)
    model = models.TransformerBlock()
    reference, opt, _ = train_pair(model, regression_loss, block_batch, session, 2, lr=1e-3)
    x, y = block_batch()
    compile_remote(regression_loss(model), session)(x, y).backward()
    regression_loss(reference)(x, y).backward()
    assert session.pull(model, grads=True) == len(list(model.parameters()))
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4, msg=name)
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)
    restored = models.TransformerBlock()
    restored.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(restored(x), reference(x), atol=1e-5, rtol=1e-4)


def test_no_grad_inference_creates_no_handles(session):
    torch.manual_seed(14)
    model = models.mlp()
    compiled = compile_remote(model, session)
    with torch.no_grad():
        out = compiled(torch.randn(4, 784))
    assert out.shape == (4, 10)
    assert training_client(session).handles.live == 0
    assert len(training_client(session).slots) == 0  # nothing trains: weights stay content-addressed


def test_optimizer_state_dict_round_trips_through_a_checkpoint(make_session):
    first, second = make_session(), make_session()
    torch.manual_seed(25)
    model = models.mlp()
    reference, opt, _ = train_pair(model, classifier_loss, lambda: mlp_batch(8), first, 3, lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)  # rebuilt below from the reference's state
    sd = opt.state_dict()
    assert set(sd["state"]) == set(range(4))
    first.pull(model)
    checkpoint = {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(sd)}
    first.close()

    # resume in another session (another worker connection) from the checkpoint
    resumed = models.mlp()
    resumed.load_state_dict(checkpoint["model"])
    torch._dynamo.reset()
    step = compile_remote(classifier_loss(resumed), second)
    opt2 = RemoteOptimizer(torch.optim.AdamW, resumed.parameters(), session=second, lr=0.5)
    opt2.load_state_dict(checkpoint["opt"])
    assert opt2.param_groups[0]["lr"] == 1e-2
    ref_opt.load_state_dict(checkpoint["opt"])
    train_side_by_side(step, classifier_loss(reference), (opt2, ref_opt), (mlp_batch(8) for _ in range(2)))
    second.pull(resumed)
    assert_same_parameters(resumed, reference)
    torch.testing.assert_close(opt2.state_dict()["state"][0]["exp_avg"], ref_opt.state_dict()["state"][0]["exp_avg"])


# ------------------------------------------------------------------ mixed precision
def test_autocast_bfloat16_training_matches_local(session):
    torch.manual_seed(15)
    model = models.mlp()
    reference, step, opt, ref_opt = remote_and_reference(model, classifier_loss, session, lr=1e-3)
    fp32_losses = []

    def in_bf16(loss_fn):
        def autocast_loss(x, y):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return loss_fn(x, y)
        return autocast_loss

    def reference_in_bf16(x, y):
        with torch.no_grad():
            fp32_losses.append(classifier_loss(reference)(x, y))
        return in_bf16(classifier_loss(reference))(x, y)

    losses = train_side_by_side(in_bf16(step), reference_in_bf16, (opt, ref_opt), (mlp_batch(16) for _ in range(3)))
    assert len(losses) == len(fp32_losses) == 3
    for (loss, ref_loss), fp32_loss in zip(losses, fp32_losses):
        assert loss.dtype == ref_loss.dtype == torch.float32
        # the worker ran the bf16 kernels local autocast runs: the same loss to the bit, which
        # the fp32 loss is not (they differ by 1e-4 to 3e-4, inside any tolerance wide enough for bf16)
        assert torch.equal(loss, ref_loss)
        assert not torch.equal(ref_loss, fp32_loss)
    session.pull(model)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert_same_parameters(model, reference)


# ---------------------------------------------------------------------- errors
def test_backward_twice_raises_like_pytorch_and_the_worker_keeps_serving(session):
    torch.manual_seed(16)
    model = models.mlp()
    compiled = compile_remote(model, session)
    x = torch.randn(4, 784)
    loss = compiled(x).sum()
    loss.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()
    ref_loss = copy.deepcopy(model)(x).sum()
    ref_loss.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        ref_loss.backward()
    compiled(x).sum().backward()  # still serving
    assert session.health()["name"] == "test"


def test_non_differentiable_output_raises_like_pytorch(session):
    torch.manual_seed(17)
    model = models.mlp()
    compiled = compile_remote(lambda x: model(x).argmax(dim=1).float().sum(), session)
    out = compiled(torch.randn(4, 784))
    with pytest.raises(RuntimeError, match="does not require grad"):
        out.backward()
    compile_remote(model, session)(torch.randn(4, 784)).sum().backward()
    assert session.health()["name"] == "test"


def test_optimizer_given_parameters_of_another_session(make_session):
    owner, other = make_session(), make_session()
    torch.manual_seed(18)
    model = models.mlp()
    compile_remote(classifier_loss(model), owner)(*mlp_batch(4)).backward()
    with pytest.raises(ForeignParameterError, match="another session"):
        RemoteOptimizer(torch.optim.SGD, model.parameters(), session=other, lr=0.1)
    torch._dynamo.reset()
    with pytest.raises(ForeignParameterError):  # a graph of another session cannot use them either
        compile_remote(classifier_loss(model), other)(*mlp_batch(4))
    # both sessions keep working
    opt = RemoteOptimizer(torch.optim.SGD, model.parameters(), session=owner, lr=0.1)
    opt.step()
    assert other.health()["name"] == owner.health()["name"] == "test"
    # once the owner is closed, the parameters (pulled first) may move on
    owner.pull(model)
    owner.close()
    RemoteOptimizer(torch.optim.SGD, model.parameters(), session=other, lr=0.1)


def test_bad_training_requests_are_typed_errors(session):
    with pytest.raises(InvalidRequestError, match="not an optimizer class"):
        session.connection.request(m.OptimCreate(1, "Optimizer", [[]], [{}]))
    for name in ("__class__", "lr_scheduler", "SGD.step", "os", "Optimizer "):  # only classes, by name
        with pytest.raises(InvalidRequestError, match="not an optimizer class"):
            session.connection.request(m.OptimCreate(1, name, [[]], [{}]))
    meta, buf = tensor_to_wire(torch.ones(2), 0)
    session.connection.request(m.BindSlots([9001], [m.TensorArg(meta)]), [buf])
    with pytest.raises(InvalidRequestError, match="not allowed"):
        session.connection.request(m.OptimCreate(9002, "SGD", [[9001]], [{"__init__": 1.0}]))
    with pytest.raises(InvalidRequestError, match="refused its arguments"):
        session.connection.request(m.OptimCreate(9003, "SGD", [[9001]], [{"lr": -0.1}]))
    with pytest.raises(InvalidRequestError, match="refused its arguments"):
        session.connection.request(m.OptimCreate(9005, "SGD", [[9001]], [{"lr": 0.1, "momentum": -1.0}]))
    session.connection.request(m.OptimCreate(9006, "SGD", [[9001]], [{"lr": 0.1, "momentum": 0.9}]))
    with pytest.raises(InvalidRequestError, match="does not fit"):
        session.connection.request(m.OptimSetState(9006, [(5, "momentum_buffer", m.ScalarArg(1.0))]))
    with pytest.raises(InvalidRequestError, match="does not fit"):
        session.connection.request(m.OptimSetState(9006, [(0, "__dict__", m.ScalarArg(1.0))]))
    with pytest.raises(MissingObjectsError):
        session.connection.request(m.OptimStep(9099))
    with pytest.raises(MissingObjectsError):
        session.connection.request(m.PullSlots([12345]))
    with pytest.raises(MissingObjectsError):
        session.connection.request(m.OptimCreate(9004, "SGD", [[12345]], [{"lr": 0.1}]))
    with pytest.raises(TypeError, match="not an optimizer class"):
        RemoteOptimizer(torch.nn.Linear, [nn.Parameter(torch.ones(1))], session=session)
    with pytest.raises(WorkerError, match="closure"):  # LBFGS needs a closure for each evaluation
        p = nn.Parameter(torch.ones(2))
        opt = RemoteOptimizer(torch.optim.LBFGS, [p], session=session, lr=0.1)
        p.grad = torch.ones(2)
        opt.step()
    assert session.health()["name"] == "test"


def lose_worker_state(session) -> None:
    """The worker ends the session (as when its lease runs out) and the connection drops.

    A dropped connection alone keeps the session for its lease (the client
    re-attaches); ending it on the worker is what loses the state.
    """
    session.synchronize()  # nothing in flight: the detach goes on the connection by itself
    session.connection.transport.request(m.encode(m.Detach()))
    session.connection.drop()


def test_backward_after_the_worker_lost_the_activations_is_a_typed_error(session):
    torch.manual_seed(19)
    model = models.mlp()
    loss = compile_remote(model, session)(torch.randn(4, 784)).sum()
    lose_worker_state(session)
    with pytest.raises(MissingObjectsError, match="handle"):
        loss.backward()
    assert session.health()["name"] == "test"


def test_batch_norm_training_updates_buffers_without_growing_worker_memory(start_server, make_session):
    srv = start_server(name="batchnorm")
    session = make_session(srv.url)
    torch.manual_seed(20)
    model = models.SmallCNN()
    reference, _, _ = train_pair(model, classifier_loss,
                                 lambda: (torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))),
                                 session, 3, torch.optim.SGD, lr=0.05)
    session.flush_releases()
    early = session.health()["resident_bytes"]
    # the running statistics came back (they are local state) and changed every step
    for (name, b), rb in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(b, rb, msg=name, **TOL)
    step = compile_remote(classifier_loss(model), session)
    opt = RemoteOptimizer(torch.optim.SGD, model.parameters(), session=session, lr=0.05)
    for _ in range(10):
        step(torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))).backward()
        opt.step()
        opt.zero_grad()
    session.flush_releases()
    # superseded buffer values were released: only the second optimizer's (empty) state is new
    assert session.health()["resident_bytes"] == early


def test_profiling_a_training_forward_runs_plain_calls(session):
    """A profile stands where a session would: its graphs do not keep state on a worker."""
    torch.manual_seed(26)
    model = models.mlp()  # parameters require grad and no no_grad: aot_autograd makes a training forward
    fast = remotorch.accelerate(model, local_backend="eager")
    x = torch.randn(4, 784)
    with remotorch.remote_profile(session, backends=["test/eager"], num_repeats=2) as prof:
        out = fast(x)
    torch.testing.assert_close(out, model(x))
    assert training_client(session).handles.live == 0
    (call,) = prof.records  # the forward ran on the worker, as a profile run: not locally
    assert not (call.fell_back or call.failed) and call.graphs
    for graph in call.graphs:
        run = graph.runs["test/eager"]
        assert run.error is None and len(run.times_ms) == 2


def test_trained_parameters_lost_with_the_connection_are_a_typed_error_not_a_stale_upload(session):
    torch.manual_seed(27)
    model = models.mlp()
    reference, opt, _ = train_pair(model, classifier_loss, lambda: mlp_batch(8), session, 2, lr=1e-2)
    step = compile_remote(classifier_loss(model), session)
    lose_worker_state(session)  # the worker frees the trained parameters with the session
    with pytest.raises(MissingObjectsError, match="slot"):
        step(*mlp_batch(8)).item()  # a warm step is sent without waiting: its read raises
    with pytest.raises(MissingObjectsError, match="optimizer"):
        opt.step()  # an optimizer step makes no value: its failure is raised at the next read or sync
        session.synchronize()
    assert session.health()["name"] == "test"
