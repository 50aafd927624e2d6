"""Data parallelism and data x pipeline on real ``remotorch serve`` workers over loopback (gloo groups).

Every result is compared to one local process training the same model on
the whole batch with plain ``torch.optim``: replicas change how the work is
spread, never the numbers (1e-4).
"""

from __future__ import annotations

import copy
import os
import signal
import time

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import remotorch
from remotorch import errors, pipeline
from remotorch.codec import messages as m
from remotorch.parallel import DataParallel

import transformers  # noqa: E402 (part of the test extra: a missing one fails here rather than skipping)

TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def four(start_module_server):
    """Four workers, one intra-op thread each (two replicas x two stages at the most)."""
    return [start_module_server(name=f"dp{i}", extra_args=("--threads", "1")) for i in range(4)]


def mlp(width: int = 16, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 4))


def batch(n: int = 16, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


def reference_steps(model: nn.Module, x, y, steps: int, lr: float = 1e-2, loss_fn=F.mse_loss) -> list[float]:
    """One local process: ``steps`` of AdamW on the whole batch; the losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def train_remote(trainer, x, y, steps: int, lr: float = 1e-2, opt=None) -> list[float]:
    """``steps`` of a DataParallel or Pipeline with AdamW on the workers (or ``opt``); the losses."""
    opt = opt if opt is not None else trainer.optimizer(torch.optim.AdamW, lr=lr)
    losses = []
    for _ in range(steps):
        losses.append(float(trainer.step(x, y)))
        opt.step()
        opt.zero_grad()
    return losses


def slot_values(conn, client, params) -> list[torch.Tensor]:
    """A replica's parameters as its worker holds them (read straight from its slots)."""
    from remotorch.codec.frames import FrameReader

    reply, frames = conn.request(m.PullSlots([client.slots.lookup(p).sid for p in params]), expect=m.PullReply)
    reader = FrameReader(frames)
    return [reader.tensor(meta).clone() for meta in reply.values]


def test_two_replicas_train_exactly_as_one_process_on_the_whole_batch(four, session_for):
    model, x, y = mlp(), *batch()
    ref = copy.deepcopy(model)
    expected = reference_steps(ref, x, y, 3)
    s = session_for(four[:2])
    dp = DataParallel(model, session=s, loss_fn=F.mse_loss)
    assert dp.replicas == 2
    opt = dp.optimizer(torch.optim.AdamW, lr=1e-2)
    losses = train_remote(dp, x, y, 3, opt=opt)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), **TOL)
    # both replicas hold the reference's parameters (they were never fetched to the client until now)
    c0, c1 = s.connections()
    params = list(model.parameters())
    mirror = dp.pipe.replica_layouts[1].runners[0].client
    for got, want in zip(slot_values(c1, mirror, params), ref.parameters()):
        torch.testing.assert_close(got, want.detach(), **TOL)
    assert dp.pull() == len(params)
    for got, want in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(got, want, **TOL)
    # the weights went up once, to replica 0; replica 1 took them worker to worker
    assert c0.stats.tensors_uploaded >= len(params) and c1.stats.tensors_uploaded == 0
    state = opt.state_dict()
    assert set(state["state"]) == {n for n, _ in model.named_parameters()}
    assert int(state["state"]["0.weight"]["step"]) == 3


def test_a_model_trained_inside_with_session_holds_its_values_after_the_block(four):
    """As a user writes it: no pull, no state_dict; the block's end brings the trained values back."""
    model, x, y = mlp(seed=11), *batch(16, seed=12)
    ref = copy.deepcopy(model)
    reference_steps(ref, x, y, 2)
    with remotorch.Session([w.url for w in four[:2]], token=four[0].token) as s:
        dp = DataParallel(model, session=s, loss_fn=F.mse_loss)
        opt = dp.optimizer(torch.optim.AdamW, lr=1e-2)
        train_remote(dp, x, y, 2, opt=opt)
    for got, want in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(got, want, **TOL)
    assert int(opt.state_dict()["state"]["0.weight"]["step"]) == 2  # the optimizer's state came back too


def test_with_no_session_it_trains_on_the_default_worker_as_one_replica():
    model, x, y = mlp(seed=13), *batch(8, seed=14)
    ref = copy.deepcopy(model)
    expected = reference_steps(ref, x, y, 2)
    dp = DataParallel(model, loss_fn=F.mse_loss)  # session left out: the embedded default worker
    assert dp.replicas == len(remotorch.default_session().connections()) == 1
    torch.testing.assert_close(torch.tensor(train_remote(dp, x, y, 2)), torch.tensor(expected), **TOL)
    dp.pull()
    for got, want in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(got, want, **TOL)


def test_averaging_overlapped_with_backward_trains_the_same(four, session_for):
    """overlap_before=["2"]: each replica's model in two parts on its worker; the later part's gradients
    are averaged while the earlier part's backward runs, and nothing changes in the numbers."""
    model, x, y = mlp(), *batch(16, seed=8)
    ref = copy.deepcopy(model)
    expected = reference_steps(ref, x, y, 3)
    dp = DataParallel(model, session=session_for(four[:2]), loss_fn=F.mse_loss, overlap_before=["2"],
                      microbatches=2)
    assert dp.pipe.num_stages == 2 and dp.pipe.overlap
    torch.testing.assert_close(torch.tensor(train_remote(dp, x, y, 3)), torch.tensor(expected), **TOL)
    assert set(dp.pipe.last_timing) == {"step_s", "reduce_s"}
    dp.pull()
    for got, want in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(got, want, **TOL)


def test_two_replicas_by_two_stages_with_1f1b_equal_one_process(four, session_for):
    model, x, y = mlp(width=32, seed=3), *batch(16, seed=4)
    ref = copy.deepcopy(model)
    expected = reference_steps(ref, x, y, 3)
    s = session_for(four)
    pipe = pipeline.Pipeline(model, ["2"], loss_fn=F.mse_loss, session=s, schedule="1F1B", microbatches=2,
                             replicas=2)
    losses = train_remote(pipe, x, y, 3)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), **TOL)
    assert [layout.urls for layout in pipe.replica_layouts] == [[w.url for w in four[:2]], [w.url for w in four[2:]]]
    assert len(pipe.columns) == 2 and all(col.group.world == 2 for col in pipe.columns)
    pipe.pull()
    for got, want in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(got, want, **TOL)


def steady_step_bytes(four, session_for, width: int) -> tuple[int, int]:
    model, (x, y) = mlp(width), batch()
    s = session_for(four[:2])
    dp = DataParallel(model, session=s, loss_fn=F.mse_loss)
    opt = dp.optimizer(torch.optim.AdamW, lr=1e-3)
    train_remote(dp, x, y, 2, opt=opt)  # warm: traced, uploaded, optimizers made
    s.synchronize()  # (the step's optimizer steps are answered after its loss is read: count them all)
    before = s.stats()
    train_remote(dp, x, y, 1, opt=opt)
    s.synchronize()
    after = s.stats()
    return (after["bytes_sent"] - before["bytes_sent"]), (after["bytes_received"] - before["bytes_received"])


def test_client_bytes_per_steady_step_do_not_grow_with_the_model(four, session_for):
    small_sent, small_recv = steady_step_bytes(four, session_for, 64)
    big_sent, big_recv = steady_step_bytes(four, session_for, 256)
    params_256 = sum(p.numel() * 4 for p in mlp(256).parameters())  # 0.3 MB: would show if it travelled
    assert big_sent <= small_sent * 1.1 + 512, (small_sent, big_sent)
    assert big_recv <= small_recv * 1.1 + 512, (small_recv, big_recv)
    assert big_sent + big_recv < params_256 / 10


def test_a_gpt2_trains_data_parallel_as_one_process(four, session_for):
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=32,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(5)
    model = transformers.GPT2LMHeadModel(config)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(6))

    def loss_fn(logits, labels):
        return F.cross_entropy(logits.logits[:, :-1].reshape(-1, 64), labels[:, 1:].reshape(-1))

    expected = reference_steps(ref, ids, ids, 2, lr=1e-3, loss_fn=loss_fn)
    s = session_for(four[:2])
    dp = DataParallel(model, session=s, loss_fn=loss_fn)
    got = train_remote(dp, ids, ids, 2, lr=1e-3)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), **TOL)
    dp.pull()
    # Adam moves every element by about lr per step whatever its gradient's size, so an element whose
    # gradient is ~0 (summed in another order across replicas) may differ by up to lr x steps: 2e-3
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=2e-3, msg=lambda msg, name=name: f"{name}: {msg}")
    close = sum(int(torch.isclose(p, q, **TOL).sum()) for p, q in zip(model.parameters(), ref.parameters()))
    assert close >= 0.999 * sum(p.numel() for p in model.parameters())  # and nearly all agree to 1e-4


def test_bad_input_gets_clear_errors_and_the_workers_keep_serving(four, session_for):
    model, (x, y) = mlp(), batch(15)
    s = session_for(four[:2])
    dp = DataParallel(model, session=s, loss_fn=F.mse_loss)
    with pytest.raises(ValueError, match=r"batch of 15 does not split into 2 replicas x 1 equal microbatches"):
        dp.step(x, y)
    with pytest.raises(ValueError, match="names a worker twice"):
        DataParallel(mlp(), session=s, loss_fn=F.mse_loss, workers=[0, 0]).step(*batch())
    x, y = batch(16)
    dp.step(x, y)
    c0, c1 = s.connections()
    group = dp.pipe.columns[0].group
    # a group this session never formed, on a worker of the group
    with pytest.raises(errors.InvalidRequestError, match="not a group of this session"):
        c1.request(m.ReduceGrads(group.id + 1000, [1]), expect=m.Ok)
    # another session on the same worker cannot use this session's group
    other = session_for(four[1])
    with pytest.raises(errors.InvalidRequestError, match="not a group of this session"):
        other.connections()[0].request(m.ReduceGrads(group.id, [1]), expect=m.Ok)
    # replicas of different models: the layouts are compared before anything moves
    sids = [dp.pipe.columns[0].sids(r) for r in range(2)]
    shapes = [[list(p.shape) for p in model.parameters()], [[3, 3] for _ in model.parameters()]]
    dtypes = ["float32"] * len(sids[0])
    with pytest.raises(errors.InvalidRequestError, match="replicas hold different models"):
        group.ask([m.BroadcastSlots(group.id, sids[rank], shapes[rank], dtypes, 0) for rank in range(2)])
    assert all(conn.request(m.Health(), expect=m.HealthReply)[0].name for conn in (c0, c1))


def test_a_member_that_does_not_join_in_time_is_named(four, session_for):
    """Rank 1 is never asked: rank 0's join fails at the deadline with a GroupError naming rank 1."""
    conn = session_for(four[2]).connections()[0]
    store = conn.request(m.OpenStore(5.0), expect=m.StoreReply)[0].address
    assert store.startswith("127.0.0.1:")  # the worker's --group-host (loopback by default)
    started = time.monotonic()
    with pytest.raises(errors.GroupError, match=r"rank \[1\] did not join within 2s") as raised:
        conn.request(m.JoinGroup(77, store, "lonely/", 0, 2, 2.0), expect=m.Ok)
    assert 2.0 <= time.monotonic() - started < 30.0
    assert raised.value.remote_traceback is None or "Traceback" not in str(raised.value.message)
    # a store elsewhere than the worker's group host is refused before anything binds or dials
    with pytest.raises(errors.InvalidRequestError, match="not on this worker's group host"):
        conn.request(m.JoinGroup(78, "10.1.2.3:29500", "far/", 0, 2, 2.0), expect=m.Ok)
    assert conn.request(m.Health(), expect=m.HealthReply)[0].name == "dp2"


def test_a_replica_killed_mid_step_is_a_typed_error_then_training_resumes_from_a_checkpoint(
        start_server, session_for, monkeypatch):
    workers = [start_server(name=f"victim{i}", extra_args=("--threads", "1")) for i in range(2)]
    spare = start_server(name="spare", extra_args=("--threads", "1"))
    model, (x, y) = mlp(width=64), batch(64)
    ref = copy.deepcopy(model)
    expected = reference_steps(ref, x, y, 3)
    s = session_for([w.url for w in workers], retry_after=0.0)  # URLs: this test kills one on purpose
    dp = DataParallel(model, session=s, loss_fn=F.mse_loss, group_timeout=10.0)
    opt = dp.optimizer(torch.optim.AdamW, lr=1e-2)
    train_remote(dp, x, y, 1, opt=opt)
    checkpoint = dp.state_dict()
    # replica 1's worker dies mid-step: killed as the step sends it its first request
    stream, killed = s.connections()[1].link.stream, []

    def kill_first(send):
        def sent_then_killed(*args):
            if not killed:
                killed.append(time.monotonic())
                os.kill(workers[1].proc.pid, signal.SIGKILL)
            return send(*args)
        return sent_then_killed

    monkeypatch.setattr(stream, "_post", kill_first(stream._post))
    monkeypatch.setattr(stream, "_exchange", kill_first(stream._exchange))
    with pytest.raises((errors.WorkerUnavailableError, errors.GroupError)):
        dp.step(x, y)
    assert killed
    monkeypatch.undo()
    assert time.monotonic() - killed[0] < 10.0 + 30.0  # within the collective timeout, with room for the machine
    assert s.connections()[0].request(m.Health(), expect=m.HealthReply)[0].name == "victim0"  # still serves
    s.close()  # brings back what replica 0 holds; the dead replica has nothing to give
    # the user replaces the worker and resumes from the checkpoint: a new group, a new generation
    s2 = session_for([workers[0], spare])
    dp2 = DataParallel(model, session=s2, loss_fn=F.mse_loss, group_timeout=10.0)
    opt2 = dp2.optimizer(torch.optim.AdamW, lr=1e-2)
    dp2.load_state_dict(checkpoint)
    losses = train_remote(dp2, x, y, 2, opt=opt2)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected[1:]), **TOL)
    assert dp2.pipe.columns[0].group.prefix != dp.pipe.columns[0].group.prefix


def dropout_mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.5), nn.Linear(32, 4))


def test_dropout_across_replicas_is_the_same_run_after_run_from_the_same_seed(four, session_for):
    """Each step draws one seed from this process's generator and gives each replica a stream of its
    own from it (whatever order the replicas' requests go in): the same seed gives the same losses
    and weights, bit for bit, run after run; another seed other masks."""
    x, y = batch(16, seed=5)

    def run(seed: int) -> tuple[list[float], list[torch.Tensor]]:
        s = session_for(four[:2])
        model = dropout_mlp()
        dp = DataParallel(model, session=s, loss_fn=F.mse_loss)
        opt = dp.optimizer(torch.optim.SGD, lr=0.1)
        torch.manual_seed(seed)
        losses = train_remote(dp, x, y, 3, opt=opt)
        dp.pull()
        s.close()
        return losses, [p.detach().clone() for p in model.parameters()]

    losses, weights = run(7)
    again, again_weights = run(7)
    assert again == losses and all(torch.equal(a, b) for a, b in zip(again_weights, weights))
    assert run(8)[0] != losses
