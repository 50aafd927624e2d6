"""What a worker refuses to open or write for a client, over the real transport: each refused name is a
typed error, and the worker keeps serving. The worker's own checks, in process: tests/unit/test_weight_files.py."""

from __future__ import annotations

import os

import pytest
import torch
import transformers

import remotorch
from remotorch import errors
from remotorch.weights.load import open_weights

from helpers import assert_still_serves


@pytest.fixture(scope="module")
def worker(tmp_path_factory, start_module_server):
    base = tmp_path_factory.mktemp("roots")
    weights, checkpoints, outside = base / "weights", base / "checkpoints", base / "outside"
    for folder in (weights, checkpoints, outside):
        folder.mkdir()
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    model.save_pretrained(weights / "tiny")
    model.save_pretrained(outside / "secret")
    config.save_pretrained(weights / "pickled")  # a folder as older transformers wrote it: a pickle, no safetensors
    torch.save(model.state_dict(), weights / "pickled" / "pytorch_model.bin")
    (weights / "escape").symlink_to(outside / "secret")  # a link out of the root
    (weights / "inside").symlink_to(weights / "tiny")  # a link that stays inside: allowed
    hub = base / "hub"
    hub_repo(hub, "org/tiny", {"1" * 40: 1, "2" * 40: 2}, {"main": "2" * 40, "v1": "1" * 40}, config)
    return start_module_server(name="roots", extra_args=("--weights", f"models={weights}",
                                                         "--weights", f"hub={hub}",
                                                         "--checkpoints", f"ck={checkpoints}"))


def hub_repo(hub, repo: str, commits: dict[str, int], refs: dict[str, str], config) -> None:
    """A Hugging Face hub cache as huggingface_hub lays it out: each commit's snapshot files are relative
    links to content-named blobs; refs name commits. Commit c holds a model made with seed commits[c]."""
    import hashlib

    folder = hub / ("models--" + repo.replace("/", "--"))
    (folder / "blobs").mkdir(parents=True)
    (folder / "refs").mkdir()
    for commit, seed in commits.items():
        torch.manual_seed(seed)
        saved = hub / f"saved-{seed}"
        transformers.GPT2LMHeadModel(config).save_pretrained(saved)
        snapshot = folder / "snapshots" / commit
        snapshot.mkdir(parents=True)
        for file in saved.iterdir():
            data = file.read_bytes()
            blob = folder / "blobs" / hashlib.sha256(data).hexdigest()
            blob.write_bytes(data)
            (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    for ref, commit in refs.items():
        (folder / "refs" / ref).write_text(commit)


REFUSED = {
    "dot-dot": "models/../outside/secret",
    "percent-escape": "models/%2e%2e/outside/secret",
    "absolute": "/etc/passwd",
    "unknown-root": "elsewhere/tiny",
    "backslash": "models\\tiny",
    "nul": "models/tiny\0",
    "symlink-out": "models/escape",
    "pickle-folder": "models/pickled",
    "pickle-file": "models/pickled/pytorch_model.bin",
}


@pytest.mark.parametrize("form", sorted(REFUSED))
def test_each_refused_name_is_typed_and_the_worker_keeps_serving(worker, session_for, form):
    s = session_for(worker)
    with pytest.raises(errors.PathRefusedError):
        remotorch.from_pretrained(transformers.GPT2LMHeadModel, REFUSED[form], session=s)
    assert open_weights(s, "models/inside").keys  # the same session goes on
    assert_still_serves(s, name="roots", server=worker)


def test_a_write_into_a_read_only_root_is_refused(worker, session_for):
    s = session_for(worker)
    model = remotorch.from_pretrained(transformers.GPT2LMHeadModel, "models/tiny", session=s)
    with pytest.raises(errors.PathRefusedError, match="read-only"):
        remotorch.save(model, "models/copy", session=s)
    assert remotorch.save(model, "ck/copy", session=s)[0] == "model.safetensors"
    with pytest.raises(errors.PathRefusedError):
        remotorch.save(model, "ck/../escape", session=s)
    assert_still_serves(s, name="roots", server=worker)


def test_a_worker_with_no_roots_refuses_every_load_and_save(server, session):
    with pytest.raises(errors.PathRefusedError, match="named no folders"):
        open_weights(session, "models/tiny")
    with pytest.raises(errors.PathRefusedError, match="named no folders"):
        remotorch.save(torch.nn.Linear(2, 2), "ck/x", session=session)
    assert session.health()["weight_roots"] == {}
    assert_still_serves(session, server=server)


def test_health_names_the_roots_but_never_their_folders(worker, session_for):
    info = session_for(worker).health()
    assert info["weight_roots"] == {"ck": "write", "hub": "read", "models": "read"}
    assert not any(os.sep in str(v) for v in info["weight_roots"].values())


@pytest.mark.parametrize("revision,seed", [(None, 2), ("v1", 1), ("1" * 40, 1), ("main", 2)])
def test_a_hub_cache_repository_loads_at_a_revision_offline(worker, session_for, tmp_path, revision, seed):
    s = session_for(worker)
    model = remotorch.from_pretrained(transformers.GPT2LMHeadModel, "hub/org/tiny", session=s, revision=revision)
    hub = next(p for p in worker_roots(worker) if p.name == "hub")
    want = transformers.GPT2LMHeadModel.from_pretrained(hub / f"saved-{seed}")
    ids = torch.randint(0, 50, (1, 8))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want(ids).logits)
    with pytest.raises(errors.CheckpointError, match="no revision 'v9'"):
        remotorch.from_pretrained(transformers.GPT2LMHeadModel, "hub/org/tiny", session=s, revision="v9")


def worker_roots(worker) -> list:
    """The folders a test worker was started with (from its command line)."""
    from pathlib import Path

    args = list(worker.proc.args)
    return [Path(args[i + 1].split("=", 1)[1]) for i, a in enumerate(args) if a in ("--weights", "--checkpoints")]
