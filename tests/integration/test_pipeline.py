"""Pipeline-parallel training on real workers: every schedule equals single-process training.

Two (or three) ``remotorch serve`` processes on loopback; the model's stages
are placed round robin on them; activations and gradients move worker to
worker. The reference is the same model trained here on the whole batch with
the same optimizer: the losses of every step and the parameters after the
last must agree to float tolerance.
"""

from __future__ import annotations

import copy

import pytest
import torch

import remotorch
from remotorch import errors, pipeline
from remotorch.pipeline import PipelineSplitError

from conftest import TOKEN


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(width, width)

    def forward(self, x):
        return x + torch.nn.functional.gelu(self.fc(x))


class Blocks(torch.nn.Module):
    """embed -> layers.0..n-1 (residual blocks) -> head; ``skip`` adds layers.0's output to the last block's."""

    def __init__(self, width: int = 16, n: int = 4, skip: bool = False, d_in: int = 8, d_out: int = 4) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(d_in, width)
        self.layers = torch.nn.ModuleList(Block(width) for _ in range(n))
        self.head = torch.nn.Linear(width, d_out)
        self.skip = skip

    def forward(self, x):
        h = self.embed(x)
        first = None
        for i, layer in enumerate(self.layers):
            h = layer(h)
            if i == 0:
                first = h
        if self.skip:
            h = h + first
        return self.head(h)


def mse(out, target):
    return torch.nn.functional.mse_loss(out, target)


@pytest.fixture(scope="module")
def two_workers(start_module_server):
    return [start_module_server(name=f"stage{i}") for i in range(2)]


@pytest.fixture
def pair(session_for, two_workers):
    return session_for(*two_workers)


def train_both(model, split_before, session, *, schedule, steps=3, microbatches=4, batch=8, loss_fn=mse,
               data=None, opt_class=torch.optim.AdamW, lr=1e-2):
    """Train a copy here and the model in a pipeline; returns (pipeline, local losses, pipeline losses)."""
    ref = copy.deepcopy(model)
    pipe = pipeline.Pipeline(model, split_before, session=session, schedule=schedule,
                             microbatches=microbatches, loss_fn=loss_fn)
    opt = pipe.optimizer(opt_class, lr=lr)
    ref_opt = opt_class(ref.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(1)
    local, remote = [], []
    for _ in range(steps):
        x, y = data(gen) if data else (torch.randn(batch, 8, generator=gen), torch.randn(batch, 4, generator=gen))
        loss = pipe.step(x, y)
        opt.step()
        opt.zero_grad()
        ref_loss = loss_fn(ref(**x) if isinstance(x, dict) else ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        remote.append(float(loss))
        local.append(float(ref_loss))
    pipe.pull(model)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=f"parameter {name} differs")
    return pipe, local, remote


@pytest.mark.parametrize("schedule,splits", [
    ("GPipe", ["layers.2"]),
    ("1F1B", ["layers.2"]),
    ("1F1B", ["layers.1", "layers.3"]),  # 3 stages on 2 workers: worker 0 runs stages 0 and 2
    ("Interleaved1F1B", ["layers.1", "layers.2", "layers.3"]),  # 2 chunks per worker
])
def test_every_schedule_trains_like_one_process(pair, seeded, schedule, splits):
    model = Blocks()
    pipe, local, remote = train_both(model, splits, pair, schedule=schedule)
    assert remote == pytest.approx(local, rel=1e-5)
    assert pipe.schedule.placement == tuple(i % 2 for i in range(len(splits) + 1))
    stats = pair.stats()
    assert stats["fallbacks"] == 0
    # every forward and backward of every stage and microbatch ran on a worker
    assert stats["remote_calls"] >= 3 * 2 * (len(splits) + 1) * 4


def test_a_skip_connection_across_stages(pair, seeded):
    """layers.0's output is used by stage 2 (the last block and the head): it goes 0 -> 2 directly."""
    model = Blocks(skip=True)
    pipe, local, remote = train_both(model, ["layers.1", "layers.3"], pair, schedule="1F1B")
    assert remote == pytest.approx(local, rel=1e-5)
    edges = {(e.src, e.dst) for e in pipe.layout.edges}
    assert (0, 2) in edges and (0, 1) in edges and (1, 2) in edges


def test_hf_gpt2_split_in_two(pair, seeded):
    import transformers  # part of the test extra: a missing one fails, not skips
    cfg = transformers.GPT2Config(n_layer=4, n_embd=32, n_head=2, vocab_size=100, n_positions=32,
                                  tie_word_embeddings=False, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg)

    def loss_fn(out, target):
        return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten())

    def data(gen):  # keyword inputs, as Hugging Face models take them
        ids = torch.randint(0, 100, (8, 16), generator=gen)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, torch.randint(0, 100, (8, 16),
                                                                                          generator=gen)

    # SGD: Adam turns the float noise of exactly-zero gradients (GPT-2's key bias) into full steps
    pipe, local, remote = train_both(model, ["transformer.h.2"], pair, schedule="1F1B", loss_fn=loss_fn,
                                     data=data, opt_class=torch.optim.SGD, lr=0.1)
    assert remote == pytest.approx(local, rel=1e-5)
    assert pair.stats()["fallbacks"] == 0


def test_hf_llama_split_in_two(pair, seeded):
    """Rotary tables are computed once in stage 0 and sent with the hidden states to stage 1."""
    import transformers  # part of the test extra: a missing one fails, not skips
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=100, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg)

    def loss_fn(out, target):
        return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten())

    def data(gen):
        return torch.randint(0, 100, (4, 16), generator=gen), torch.randint(0, 100, (4, 16), generator=gen)

    pipe, local, remote = train_both(model, ["model.layers.2"], pair, schedule="1F1B", loss_fn=loss_fn,
                                     data=data, microbatches=2, steps=2, opt_class=torch.optim.SGD, lr=0.1)
    assert remote == pytest.approx(local, rel=1e-5)
    assert len(pipe.layout.edges) >= 2  # more than the hidden states crosses the cut


def _steady_bytes(session, width: int) -> tuple[int, int]:
    """Client bytes of one steady step (the third), and the activation bytes the workers moved in it."""
    torch.manual_seed(0)
    model = Blocks(width=width)
    pipe = pipeline.Pipeline(model, ["layers.2"], session=session, schedule="1F1B", microbatches=4, loss_fn=mse)
    opt = pipe.optimizer(torch.optim.SGD, lr=0.01)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    for _ in range(2):
        pipe.step(x, y)
        opt.step()
        opt.zero_grad()
    before = session.stats()
    pipe.step(x, y)
    opt.step()
    opt.zero_grad()
    after = session.stats()
    client = (after["bytes_sent"] - before["bytes_sent"]) + (after["bytes_received"] - before["bytes_received"])
    moved = after["values_moved"] - before["values_moved"]
    assert moved == 2 * 4  # one activation forward and one gradient back per microbatch
    activation_bytes = moved * (8 // 4) * width * 4
    return client, activation_bytes


def test_client_bytes_per_step_do_not_grow_with_hidden_size(two_workers):
    sessions = [remotorch.Session([w.url for w in two_workers], token=TOKEN) for _ in range(2)]
    try:
        small, _ = _steady_bytes(sessions[0], 16)
        big, moved = _steady_bytes(sessions[1], 1024)
    finally:
        for s in sessions:
            s.close()
    assert big <= small * 1.1 + 512, (small, big)  # ids may be a digit longer; nothing scales with width
    assert moved > 4 * big, (moved, big)  # the activations did move, and not through the client


def test_lr_scheduler_and_checkpoint_round_trip(pair, seeded):
    model = Blocks()
    ref = copy.deepcopy(model)
    pipe = pipeline.Pipeline(model, ["layers.2"], session=pair, schedule="GPipe", microbatches=2, loss_fn=mse)
    opt = pipe.optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    for _ in range(3):
        pipe.step(x, y)
        opt.step()
        opt.zero_grad()
        sched.step()
        mse(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 3)
    state = pipe.state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(state["model"][name], p, rtol=1e-5, atol=1e-6)
        assert "momentum_buffer" in state["optimizer"]["state"][name]
    ref_state = ref_opt.state_dict()["state"]
    for i, (name, _) in enumerate(ref.named_parameters()):
        torch.testing.assert_close(state["optimizer"]["state"][name]["momentum_buffer"],
                                   ref_state[i]["momentum_buffer"], rtol=1e-5, atol=1e-6)


def test_a_killed_stage_worker_raises_and_training_resumes_from_a_checkpoint(start_server, seeded):
    servers = [start_server(name="resume0"), start_server(name="resume1")]
    model = Blocks()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    with remotorch.Session([s.url for s in servers], token=TOKEN) as s:
        pipe = pipeline.Pipeline(model, ["layers.2"], session=s, schedule="1F1B", microbatches=4, loss_fn=mse)
        opt = pipe.optimizer(torch.optim.AdamW, lr=1e-2)
        pipe.step(x, y)
        opt.step()
        opt.zero_grad()
        checkpoint = pipe.state_dict()
        servers[1].stop()
        with pytest.raises(errors.RemoteError) as info:
            pipe.step(x, y)
        assert isinstance(info.value, (errors.WorkerUnavailableError, errors.TransportError,
                                       errors.WorkerError)), info.value
    for _ in range(2):
        mse(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    fresh = Blocks()  # a new process would build the model anew and load the checkpoint
    replacement = start_server(name="resume2")
    with remotorch.Session([servers[0].url, replacement.url], token=TOKEN) as s:
        pipe = pipeline.Pipeline(fresh, ["layers.2"], session=s, schedule="1F1B", microbatches=4, loss_fn=mse)
        opt = pipe.optimizer(torch.optim.AdamW, lr=1e-2)
        pipe.load_state_dict(checkpoint)
        pipe.step(x, y)
        opt.step()
        opt.zero_grad()
        pipe.pull()
    for (name, p), q in zip(fresh.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=f"parameter {name} differs")


def test_split_errors_are_clear(pair):
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    with pytest.raises(PipelineSplitError, match="layers.9"):
        pipeline.Pipeline(Blocks(), ["layers.9"], session=pair, loss_fn=mse).step(x, y)
    with pytest.raises(ValueError, match="equal microbatches"):
        pipeline.Pipeline(Blocks(), ["layers.2"], session=pair, loss_fn=mse, microbatches=3).step(x, y)

    model = Blocks(width=16, d_in=16, d_out=16)
    model.head.weight = model.layers[0].fc.weight  # one parameter in stage 0 and stage 1
    with pytest.raises(PipelineSplitError, match="tied"):
        pipeline.Pipeline(model, ["layers.2"], session=pair, loss_fn=mse).step(torch.randn(8, 16),
                                                                               torch.randn(8, 16))
    assert pair.connections()[0].info(refresh=True)["name"] == "stage0"  # the workers keep serving


def test_all_stages_on_one_worker(session, seeded):
    """A session of one worker: every stage there, activations handed over as handles without moving."""
    model = Blocks()
    pipe, local, remote = train_both(model, ["layers.1", "layers.3"], session, schedule="1F1B")
    assert remote == pytest.approx(local, rel=1e-5)
    assert pipe.schedule.placement == (0, 0, 0)
    assert session.stats()["values_moved"] == 0


@pytest.fixture(scope="module")
def ray_workers(ray_local):
    from remotorch.cluster import RayCluster
    with RayCluster(num_workers=2, num_cpus_per_worker=0.5) as cluster:
        yield cluster


@pytest.mark.parametrize("schedule,splits", [
    ("GPipe", ["layers.2"]),
    ("1F1B", ["layers.1", "layers.3"]),
    ("Interleaved1F1B", ["layers.1", "layers.2", "layers.3"]),
])
def test_every_schedule_on_a_ray_cluster(ray_workers, seeded, schedule, splits):
    """Workers placed by Ray (each inside an actor); stages move activations between them directly."""
    s = ray_workers.session
    before = s.stats()["values_moved"]
    _, local, remote = train_both(Blocks(), splits, s, schedule=schedule)
    assert remote == pytest.approx(local, rel=1e-5)
    assert s.stats()["values_moved"] - before == 3 * 2 * 4 * len(splits)  # every edge, both ways, each step
    assert [w["name"] for w in s.workers()] == ["ray-0", "ray-1"]
