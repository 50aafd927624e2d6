"""Pipeline stages and data-parallel replicas that read their own part of the weights from their own disk.

Each worker gets its own copy of the checkpoint folder (as each machine would have its own disk). The
model is built on meta here; ``weights=`` makes each worker read its stages' tensors. Training equals the
same model loaded and trained locally by transformers; each worker read exactly its stages' parameter
bytes; nothing of the weights went through the client.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers

import remotorch
from remotorch import pipeline
from remotorch.pipeline import PipelineSplitError

CONFIG = dict(n_layer=4, n_embd=32, n_head=2, vocab_size=100, n_positions=32, tie_word_embeddings=False,
              attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)


def loss_fn(out, target):
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten())


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """One copy of the checkpoints per worker (its own disk): untied and tied GPT-2."""
    first = tmp_path_factory.mktemp("disk0")
    torch.manual_seed(5)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(**CONFIG)).save_pretrained(first / "gpt2")
    torch.manual_seed(5)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**CONFIG, "tie_word_embeddings": True})) \
        .save_pretrained(first / "tied")
    second = tmp_path_factory.mktemp("disk1")
    shutil.copytree(first, second, dirs_exist_ok=True)
    return [first, second]


@pytest.fixture(scope="module")
def workers(folders, start_module_server):
    return [start_module_server(name=f"disk{i}", extra_args=("--weights", f"models={folder}"))
            for i, folder in enumerate(folders)]


def empty_model(**more) -> transformers.GPT2LMHeadModel:
    with remotorch.init_empty_weights():
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**CONFIG, **more}))


def data(gen):
    ids = torch.randint(0, 100, (8, 16), generator=gen)
    return {"input_ids": ids}, torch.randint(0, 100, (8, 16), generator=gen)


def train_against_local(folder, trainer, opt, steps: int = 3) -> tuple[list, list, torch.nn.Module]:
    ref = transformers.GPT2LMHeadModel.from_pretrained(folder / "gpt2").train()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    local, remote = [], []
    for _ in range(steps):
        x, y = data(gen)
        remote.append(float(trainer.step(x, y)))
        opt.step()
        opt.zero_grad()
        loss = loss_fn(ref(**x), y)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        local.append(float(loss.detach()))
    return local, remote, ref


def read_by(session) -> list[int]:
    return [w["weights_read"] for w in session.workers()]


def test_each_stage_worker_reads_only_its_own_stages_weights(folders, workers, session_for):
    s = session_for(*workers)
    model = empty_model()
    before = read_by(s)
    pipe = pipeline.Pipeline(model, ["transformer.h.2"], session=s, schedule="1F1B", microbatches=4,
                             loss_fn=loss_fn, weights="models/gpt2")
    opt = pipe.optimizer(torch.optim.SGD, lr=0.1)
    local, remote, ref = train_against_local(folders[0], pipe, opt)
    assert remote == pytest.approx(local, rel=1e-5)
    read = [b - a for a, b in zip(before, read_by(s))]
    stage_bytes = [sum(p.numel() * p.element_size() for p in r.params) for r in pipe.layout.runners]
    assert read == stage_bytes and all(read), (read, stage_bytes)  # each read its stage's parameters, once
    assert sum(read) == sum(p.numel() * 4 for p in ref.parameters())
    assert sorted(pipe.weights_read.values()) == sorted(stage_bytes)
    stats = s.stats()
    assert stats["tensors_uploaded"] == 0 and stats["values_fetched"] == 0 and stats["fallbacks"] == 0
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):  # a read of each: fetched now
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=f"parameter {name} differs")


def test_embeddings_tied_across_stages_are_refused_before_anything_is_read(workers, session_for):
    s = session_for(*workers)
    before = read_by(s)
    pipe = pipeline.Pipeline(empty_model(tie_word_embeddings=True), ["transformer.h.2"], session=s,
                             loss_fn=loss_fn, weights="models/tied")
    with pytest.raises(PipelineSplitError, match="tied weights"):
        pipe.step(*data(torch.Generator().manual_seed(1)))
    assert read_by(s) == before


def test_data_parallel_replicas_each_read_the_whole_model_from_their_own_disk(folders, workers, session_for):
    s = session_for(*workers)
    before = read_by(s)
    dp = remotorch.parallel.DataParallel(empty_model(), session=s, loss_fn=loss_fn, weights="models/gpt2")
    opt = dp.optimizer(torch.optim.SGD, lr=0.1)
    local, remote, ref = train_against_local(folders[0], dp, opt)
    assert remote == pytest.approx(local, rel=1e-5)
    total = sum(p.numel() * 4 for p in ref.parameters())
    assert [b - a for a, b in zip(before, read_by(s))] == [total, total]
    assert s.stats()["tensors_uploaded"] == 0 and s.stats()["values_moved"] == 0  # no broadcast between them
    dp.pull()
    for (name, p), q in zip(dp.model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=f"parameter {name} differs")


def test_stages_on_a_ray_cluster_read_their_weights(folders, ray_local):
    from remotorch.cluster import RayCluster

    with RayCluster(num_workers=2, num_cpus_per_worker=0.5, serve_args=["--weights", f"models={folders[0]}"]) as c:
        pipe = pipeline.Pipeline(empty_model(), ["transformer.h.2"], session=c.session, schedule="GPipe",
                                 microbatches=2, loss_fn=loss_fn, weights="models/gpt2")
        opt = pipe.optimizer(torch.optim.SGD, lr=0.1)
        local, remote, ref = train_against_local(folders[0], pipe, opt, steps=2)
        assert remote == pytest.approx(local, rel=1e-5)
        stage_bytes = [sum(p.numel() * p.element_size() for p in r.params) for r in pipe.layout.runners]
        assert sorted(pipe.weights_read.values()) == sorted(stage_bytes) and len(pipe.weights_read) == 2
        assert sum(stage_bytes) == sum(p.numel() * 4 for p in ref.parameters())
        assert c.session.stats()["tensors_uploaded"] == 0
