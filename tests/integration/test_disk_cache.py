"""A worker's disk cache, through real ``remotorch serve`` processes: restarts, damage, full disks, sharing.

Each test starts workers on a folder of its own (``--cache-dir``), stops them,
starts new ones on the same folder, and compares what a fresh session sends
and gets with what eager PyTorch computes.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import remotorch
from conftest import TOKEN, clean_env
from helpers import REPO, tiny_mlp

import transformers  # noqa: E402 (part of the test extra: a missing one fails here rather than skipping)


def small_gpt2() -> torch.nn.Module:
    """A GPT-2 of about 2 MB of weights (random, from a config: nothing is downloaded)."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=1000, n_embd=128, n_layer=2, n_head=4, n_positions=64,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config).eval()


IDS = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(1))


def first_call(server, model, x, **compile_options):
    """A fresh session's first call: (output, the session's counters, the worker's disk cache report)."""
    torch._dynamo.reset()  # a new process would capture afresh
    with remotorch.Session(server.url, token=TOKEN) as s:
        compiled = remotorch.compile(model, session=s, fallback="raise", **compile_options)
        with torch.no_grad():
            out = compiled(x)
        out = out.logits if hasattr(out, "logits") else out
        out = out.cpu()  # read here (a clone would be an eager call on the worker)
        return out, s.stats(), s.health()["disk_cache"]


def expected(model, x):
    with torch.no_grad():
        out = model(x)
    return out.logits if hasattr(out, "logits") else out


def test_a_restarted_worker_serves_a_known_model_without_its_weights(start_server, tmp_path):
    model = small_gpt2()
    want = expected(model, IDS)
    first = start_server(extra_args=("--cache-dir", str(tmp_path)))
    out, cold, report = first_call(first, model, IDS)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert cold["bytes_sent"] > 1 << 20 and report["writes"] >= cold["tensors_uploaded"] > 0
    first.stop()

    restarted = start_server(extra_args=("--cache-dir", str(tmp_path)))
    out, warm, report = first_call(restarted, model, IDS)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert warm["bytes_sent"] < 256 << 10, warm
    assert warm["tensors_uploaded"] == 0 and warm["graphs_uploaded"] == 0
    assert warm["tensors_recalled"] == cold["tensors_uploaded"] and warm["graphs_recalled"] >= 1
    assert report["writes"] == 0 and report["corrupt"] == 0


def test_damaged_entries_are_uploaded_again(start_server, tmp_path):
    model = tiny_mlp(64, 256, 256, 8)
    x = torch.randn(4, 64)
    want = expected(model, x)
    first = start_server(extra_args=("--cache-dir", str(tmp_path)))
    _, cold, _ = first_call(first, model, x)
    first.stop()
    entries = sorted((tmp_path / "tensors").rglob("*"), key=lambda p: p.stat().st_size if p.is_file() else 0)
    entries = [p for p in entries if p.is_file()]
    assert len(entries) == cold["tensors_uploaded"] == 6
    biggest, second = entries[-1], entries[-2]
    raw = bytearray(biggest.read_bytes())
    raw[len(raw) // 2] ^= 0x40  # one bit flipped in the middle of the data
    biggest.write_bytes(bytes(raw))
    second.write_bytes(second.read_bytes()[:-1000])  # truncated

    restarted = start_server(extra_args=("--cache-dir", str(tmp_path)))
    out, stats, report = first_call(restarted, model, x)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert stats["tensors_uploaded"] == 2 and stats["tensors_recalled"] == 4, stats
    assert report["corrupt"] == 2
    assert biggest.exists() and second.exists()  # written again, whole, from the new upload
    again = start_server(extra_args=("--cache-dir", str(tmp_path)))
    _, stats, report = first_call(again, model, x)
    assert stats["tensors_uploaded"] == 0 and report["corrupt"] == 0


def test_a_full_disk_or_an_unwritable_folder_still_serves(start_server, tmp_path):
    model = tiny_mlp(64, 256, 8)
    x = torch.randn(4, 64)
    want = expected(model, x)
    # a file size limit of 16 KiB on the worker: each weight's write fails as on a full disk
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 10, hard))
    try:
        limited = start_server(extra_args=("--cache-dir", str(tmp_path / "full")))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    for _ in range(2):  # and it goes on serving
        out, stats, report = first_call(limited, model, x)
        torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert report["write_errors"] >= 1 and "file size limit" in report["problem"], report
    assert "serves on" in limited.stderr_text()

    blocker = tmp_path / "a-file"
    blocker.write_text("a file where the cache folder's parent should be")
    unwritable = start_server(extra_args=("--cache-dir", str(blocker / "cache")))
    out, stats, report = first_call(unwritable, model, x)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert report == {} and stats["tensors_uploaded"] > 0
    assert "cannot be written" in unwritable.stderr_text()


def test_two_workers_share_one_folder(start_server, tmp_path):
    a = start_server(name="a", extra_args=("--cache-dir", str(tmp_path)))
    b = start_server(name="b", extra_args=("--cache-dir", str(tmp_path)))
    models = [tiny_mlp(32, 512, 512, 4, seed=s) for s in (1, 2)]
    x = torch.randn(3, 32)
    import threading

    def upload(server, model) -> None:  # the weights by content id, both workers writing at once
        with remotorch.Session(server.url, token=TOKEN) as s:
            s.connection.refs([t.detach() for t in model.parameters()])
    threads = [threading.Thread(target=upload, args=pair) for pair in zip((a, b), models)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len([p for p in (tmp_path / "tensors").rglob("*") if p.is_file()]) == 12
    # each worker now serves the model the other uploaded, from the folder
    for server, model in ((a, models[1]), (b, models[0])):
        out, stats, report = first_call(server, model, x)
        torch.testing.assert_close(out, expected(model, x), rtol=0, atol=0)
        assert stats["tensors_uploaded"] == 0 and stats["tensors_recalled"] == 6
        assert report["corrupt"] == 0
    assert not list((tmp_path / "tmp").iterdir())  # no half-written file left behind


def test_knowing_an_id_is_not_enough(start_server, tmp_path):
    """A session that names a cached id with a wrong proof is told nothing and must upload."""
    model = tiny_mlp(16, 64, 4)
    server = start_server(extra_args=("--cache-dir", str(tmp_path)))
    first_call(server, model, torch.randn(2, 16))
    known = [p.name for p in (tmp_path / "tensors").rglob("*") if p.is_file()]
    assert known
    from remotorch.codec import messages as m

    with remotorch.Session(server.url, token=TOKEN) as s:
        link = s.connection.link
        nonce = link.request(m.Challenge(), expect=m.ChallengeReply)[0].nonce
        assert len(nonce) == 16
        claims = [(tid, 64 * 16 * 4, b"\x00" * 16) for tid in known]
        reply = link.request(m.Have([], claims), expect=m.HaveReply)[0]
        assert reply.tensors == [] and reply.graphs == []
        with pytest.raises(remotorch.errors.InvalidRequestError, match="not a content id"):
            link.request(m.Have([], [("../../etc/passwd", 1, b"\x00" * 16)]), expect=m.HaveReply)
        assert s.health()["disk_cache"]["dir"] == str(tmp_path)  # the same session, served on


def inductor_counts(server, settled: int) -> dict:
    """The worker's inductor cache counters once ``settled`` lookups happened (the background
    warm-up may finish after the test's own compile)."""
    deadline = time.monotonic() + 120
    with remotorch.Session(server.url, token=TOKEN) as s:
        while True:
            report = s.health()["disk_cache"]
            if report["inductor_hits"] + report["inductor_misses"] >= settled or time.monotonic() > deadline:
                return report
            time.sleep(0.5)


def test_inductor_does_not_compile_again_on_a_restarted_worker(start_server, tmp_path):
    """Each worker warms inductor up in the background (``--warm-engines``) and compiles the model's
    graph: two compiles the first time, two cache hits and no compile after the restart."""
    model = tiny_mlp(32, 64, 4)
    x = torch.randn(2, 32)
    args = ("--cache-dir", str(tmp_path), "--engines", "inductor", "--warm-engines", "inductor")
    first = start_server(extra_args=args)
    out, _, _ = first_call(first, model, x, engine="inductor")
    torch.testing.assert_close(out, expected(model, x), rtol=1e-5, atol=1e-5)
    report = inductor_counts(first, 2)
    assert report["inductor_misses"] == 2 and report["inductor_hits"] == 0, report
    assert any((tmp_path / "inductor").rglob("*")), "inductor wrote its cache elsewhere"
    first.stop()
    restarted = start_server(extra_args=args)
    out, _, _ = first_call(restarted, model, x, engine="inductor")
    torch.testing.assert_close(out, expected(model, x), rtol=1e-5, atol=1e-5)
    report = inductor_counts(restarted, 2)
    assert report["inductor_misses"] == 0 and report["inductor_hits"] == 2, str(report)


def test_an_onnx_model_is_exported_once(start_server, tmp_path):
    model = tiny_mlp(16, 32, 4)
    x = torch.randn(2, 16)
    args = ("--cache-dir", str(tmp_path), "--engines", "onnxrt")
    first = start_server(extra_args=args)
    out, cold, report = first_call(first, model, x, engine="onnxrt")
    torch.testing.assert_close(out, expected(model, x), rtol=1e-4, atol=1e-5)
    onnx_entries = [p for p in (tmp_path / "artifacts" / "onnxrt").rglob("*") if p.is_file()]
    assert len(onnx_entries) == 1
    first.stop()
    restarted = start_server(extra_args=args)
    out, warm, report = first_call(restarted, model, x, engine="onnxrt")
    torch.testing.assert_close(out, expected(model, x), rtol=1e-4, atol=1e-5)
    # every read was a hit: the weights, the graph and the ONNX model; nothing new was written
    assert report["writes"] == 0 and report["misses"] == 0
    assert report["hits"] == warm["tensors_recalled"] + warm["graphs_recalled"] + 1


def test_the_embedded_worker_keeps_a_per_user_cache_across_processes(tmp_path):
    script = textwrap.dedent("""
        import torch, remotorch, json
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 8))
        x = torch.ones(2, 64)
        y = torch.compile(model, backend="remotorch")(x)
        assert torch.allclose(y, model(x))
        print(json.dumps(remotorch.default_session().stats()))
    """)
    env = clean_env(XDG_CACHE_HOME=str(tmp_path / "xdg"), HOME=str(tmp_path / "home"))
    runs = []
    import json

    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                              timeout=300, cwd=REPO)
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert runs[0]["tensors_uploaded"] == 4 and runs[0]["tensors_recalled"] == 0
    assert runs[1]["tensors_uploaded"] == 0 and runs[1]["tensors_recalled"] == 4
    assert runs[1]["bytes_sent"] < runs[0]["bytes_sent"] / 10
    assert any((tmp_path / "xdg" / "remotorch" / "tensors").rglob("*"))
    env_off = dict(env, REMOTORCH_CACHE_DIR="off")
    done = subprocess.run([sys.executable, "-c", script], env=env_off, capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert done.returncode == 0 and json.loads(done.stdout.strip().splitlines()[-1])["tensors_recalled"] == 0


def test_cache_command_lists_measures_and_clears(start_server, tmp_path):
    server = start_server(extra_args=("--cache-dir", str(tmp_path)))
    first_call(server, tiny_mlp(16, 64, 4), torch.randn(2, 16))

    def cache(*args):
        done = subprocess.run([sys.executable, "-m", "remotorch", "cache", *args, "--cache-dir", str(tmp_path)],
                              env=clean_env(), capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout
    listed = cache("ls")
    assert listed.count("tensors") == 4 and listed.count("graphs") == 1
    assert "MiB" in cache("du") and str(tmp_path) in cache("du")
    assert "cleared" in cache("clear")
    assert cache("ls").strip() == ""
    assert not any(p.is_file() for p in tmp_path.rglob("*") if "tmp" not in p.parts)
