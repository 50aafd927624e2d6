"""Workers on Modal: the App built offline, the container's path run here, the client's errors.

There is no Modal account on CI machines. What runs here:

* ``make_app`` builds the ``modal.App``, its image and its GPU function
  without contacting Modal;
* the container's entry (the app's own function, through Modal's ``.local()``)
  runs on this machine with a loopback "tunnel": a real ``remotorch serve``
  with a fresh self-signed certificate and the client's random token, reached
  over TLS with that certificate pinned, from a fresh process configured
  only by the ``REMOTORCH_*`` lines ``remotorch deploy modal`` prints;
* a ``volume=`` spec mounts a ``modal.Volume`` at ``/cache``, and two
  container runs in sequence on one cache folder (standing in for the
  Volume): the second, a fresh worker, starts warm;
* ``remotorch deploy modal`` without credentials says so and exits 1.

``test_live_modal_worker`` starts a real Modal container and runs only where
Modal credentials are configured.
"""

from __future__ import annotations

import contextlib
import json
import queue
import re
import subprocess
import sys
import threading
from importlib import metadata

import pytest
import torch

import remotorch
from conftest import TOKEN as SERVER_TOKEN, clean_env, closed_port
from remotorch import errors
from remotorch.deploy.container import _fingerprint, self_signed
from remotorch.deploy.modal import CACHE_MOUNT, MODAL_PRICES, ModalWorker, _build, credentials_configured, make_app

from helpers import REPO

TOKEN = "modal-test-token-" + "7" * 32


def test_make_app_builds_offline():
    import modal

    app = make_app(gpu="A100", timeout=1200, name="w")
    assert isinstance(app, modal.App) and app.name == "remotorch"
    spec = ModalWorker(gpu="H100:2", timeout=600, name="big", app_name="mine")
    app2, fn = _build(spec)
    assert app2.name == "mine" and isinstance(fn, modal.Function)
    assert fn._spec_.gpus == "H100:2"  # modal 1.6.4's private spec: the GPU reached the function
    assert spec.price == pytest.approx(2 * MODAL_PRICES["H100"])
    assert ModalWorker(gpu="T4", price_per_hour=0.1).price == 0.1
    assert ModalWorker(gpu=None).price == 0.0
    packages = spec.packages()
    assert f"torch=={torch.__version__.split('+')[0]}" in packages
    assert any(p.startswith("msgspec==") for p in packages) and "onnxruntime-gpu" in packages
    assert "onnxruntime" in ModalWorker(gpu=None).packages()
    # every dependency remotorch itself declares is in the image (the worker imports the whole package)
    names = {p.split("==")[0] for p in packages}
    from packaging.requirements import Requirement

    for requirement in [r for r in metadata.requires("remotorch") if "extra ==" not in r]:
        marker = Requirement(requirement).marker
        if marker is not None and not marker.evaluate():
            continue  # (not for the image's Python, which is this one's: tomli is for 3.10)
        assert re.split(r"[<>=!~\[ ;]", requirement)[0] in names, requirement
    for bad in (dict(timeout=5), dict(timeout=25 * 3600), dict(port=0), dict(volume="a/b"), dict(volume="")):
        with pytest.raises(ValueError):
            ModalWorker(**bad)


def test_volume_is_mounted_at_cache():
    import modal

    assert CACHE_MOUNT == "/cache"
    _, fn = _build(ModalWorker(gpu="T4", volume="rt-cache"))
    volumes = fn._spec_.volumes  # modal 1.6.4's private spec: {mount path: the Volume's async implementation}
    assert list(volumes) == ["/cache"]
    assert isinstance(volumes["/cache"], modal.volume._Volume) and volumes["/cache"].name == "rt-cache"
    assert not _build(ModalWorker(gpu="T4"))[1]._spec_.volumes
    assert make_app(gpu=None, volume="rt-cache").name == "remotorch"


class LoopbackTunnel:
    """What ``modal.forward(port, unencrypted=True)`` gives, for a port on this machine."""

    def __init__(self, port: int) -> None:
        self.tcp_socket = ("127.0.0.1", port)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


@contextlib.contextmanager
def run_container(folder, **options):
    """The app's function run here (``.local()``) until the block ends: a TLS worker; yields (reply, CA file).

    ``options`` go to the function (``cache_dir=``, ``commit=``…). The app is
    built without a Volume: ``.local()`` has no Volume mounts, and a folder
    here stands in for the Volume.
    """
    _, fn = _build(ModalWorker(gpu="A100", timeout=600, name="modal-test", price_per_hour=2.5))
    replies: queue.Queue = queue.Queue()
    stop = threading.Event()
    port = closed_port()
    result: list = []
    thread = threading.Thread(target=lambda: result.append(fn.local(
        TOKEN, replies, port=port, name="modal-test", price_per_hour=2.5, bind="127.0.0.1",
        tunnel=LoopbackTunnel, stop=stop, **options)), daemon=True)
    thread.start()
    info = replies.get(timeout=120)
    ca = folder / "worker.pem"
    ca.write_text(info["cert"])
    try:
        yield info, str(ca)
    finally:
        stop.set()
        thread.join(60)
    assert not thread.is_alive() and result == [0]
    with pytest.raises(errors.WorkerUnavailableError):  # the worker stopped with the container's function
        remotorch.Session(info["url"], token=TOKEN, tls_ca=str(ca), connect_timeout=2).health()


@pytest.fixture
def container_worker(tmp_path):
    """The app's function run here (``.local()``): a TLS worker; yields (address reply, CA file)."""
    with run_container(tmp_path) as running:
        yield running


def test_container_entry_serves_tls_with_the_certificate_pinned(container_worker, tmp_path):
    info, ca = container_worker
    assert info["url"].startswith("tls://127.0.0.1:") and info["name"] == "modal-test"
    assert "PRIVATE KEY" not in info["cert"]  # the key stays in the container
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).eval()
    x = torch.randn(5, 16)
    with remotorch.Session(info["url"], token=TOKEN, tls_ca=ca) as session:
        health = session.health()
        assert health["name"] == "modal-test" and health["price_per_hour"] == 2.5
        compiled = remotorch.compile(model, session=session, fallback="raise")
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x))
        assert session.stats()["remote_calls"] == 1
    other, _ = self_signed("127.0.0.1")  # a certificate for the same host, from another key
    (tmp_path / "other.pem").write_bytes(other)
    with remotorch.Session(info["url"], token=TOKEN, tls_ca=str(tmp_path / "other.pem")) as s:
        with pytest.raises(errors.AuthenticationError, match="not trusted"):
            s.health()
    with remotorch.Session(info["url"], token="wrong-" + TOKEN, tls_ca=ca) as s:
        with pytest.raises(errors.AuthenticationError):
            s.health()
    with remotorch.Session(info["url"].replace("tls://", "tcp://"), token=TOKEN, connect_timeout=3,
                           timeout=3) as s:
        with pytest.raises(errors.RemoteError):  # plain TCP to a TLS port does not get through
            s.health()


def test_second_run_on_the_same_volume_starts_warm(tmp_path, monkeypatch):
    """Two container runs in sequence on one cache folder: the second, a fresh worker, recalls what the
    first uploaded, and the folder is committed once its worker stopped."""
    cache = tmp_path / "volume"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 8)).eval()
    x = torch.randn(4, 256)
    with torch.no_grad():
        expected = model(x)
    runs, commits = [], []
    for run in range(2):
        folder = tmp_path / f"run{run}"
        folder.mkdir()
        with run_container(folder, cache_dir=str(cache), commit=lambda: commits.append(_fingerprint(cache)),
                           commit_every=3600) as (info, ca):
            with remotorch.Session(info["url"], token=TOKEN, tls_ca=ca) as session:
                torch._dynamo.reset()
                compiled = torch.compile(model, backend="remotorch", options={"session": session, "fallback": "raise"})
                with torch.no_grad():
                    torch.testing.assert_close(compiled(x), expected)
                stats = session.stats()
                assert stats["remote_calls"] == 1, stats
                runs.append(stats)
        assert commits and commits[-1] == _fingerprint(cache)  # committed after the worker stopped
    first, second = runs
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert first["bytes_sent"] > weights and first["tensors_uploaded"] > 0, first
    assert second["tensors_recalled"] > 0 and second["tensors_uploaded"] == 0, second
    assert second["bytes_sent"] < first["bytes_sent"] / 10, (first, second)
    # a container without a cache folder runs its worker with --no-cache, whatever the environment says
    monkeypatch.setenv("REMOTORCH_CACHE_DIR", str(cache))
    before = _fingerprint(cache)
    with run_container(tmp_path) as (info, ca), remotorch.Session(info["url"], token=TOKEN, tls_ca=ca) as session:
        compiled = remotorch.compile(model, session=session, fallback="raise")
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), expected)
        assert session.stats()["tensors_recalled"] == 0 and session.stats()["tensors_uploaded"] > 0, session.stats()
    assert _fingerprint(cache) == before


def test_cache_commits_once_quiet_and_at_the_end(tmp_path):
    """The container commits the Volume after a change has settled, never for ``tmp/`` alone, and
    logs a failed commit instead of stopping (the next change retries)."""
    import time

    from remotorch.deploy.container import _Committer

    (tmp_path / "tmp").mkdir()
    calls: list = []
    committer = _Committer(str(tmp_path), lambda: calls.append(_fingerprint(tmp_path)), every=0.05)
    (tmp_path / "tensors").mkdir()
    (tmp_path / "tensors" / "ab").write_bytes(b"x" * 10)
    time.sleep(0.06)
    committer.tick()
    assert calls == []  # changed since the last check: not settled yet
    time.sleep(0.06)
    committer.tick()
    assert calls == [(1, 10, (tmp_path / "tensors" / "ab").stat().st_mtime_ns)]
    (tmp_path / "tmp" / "half-written").write_bytes(b"y" * 5)
    committer.final()
    assert len(calls) == 1

    def fail():
        raise RuntimeError("no Volume here")

    committer.commit = fail
    (tmp_path / "tensors" / "cd").write_bytes(b"z")
    committer.final()  # logged, not raised
    committer.commit = lambda: calls.append(_fingerprint(tmp_path))
    committer.final()
    assert len(calls) == 2 and calls[-1][:2] == (2, 11)


def test_printed_connect_lines_configure_a_fresh_process(container_worker, tmp_path):
    info, ca = container_worker
    script = tmp_path / "user.py"
    script.write_text(
        "import torch\n"
        "model = torch.nn.Linear(8, 3).eval()\n"
        "compiled = torch.compile(model, backend='remotorch', options={'fallback': 'raise'})\n"
        "x = torch.randn(2, 8)\n"
        "with torch.no_grad():\n"
        "    torch.testing.assert_close(compiled(x), model(x))\n"
        "import remotorch\n"
        "print(remotorch.default_session().health()['name'], remotorch.default_session().stats()['remote_calls'])\n")
    env = clean_env(REMOTORCH_URL=info["url"], REMOTORCH_TOKEN=TOKEN, REMOTORCH_TLS_CA=ca)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["modal-test", "1"]


def test_deploy_without_credentials_says_what_to_do(tmp_path):
    env = clean_env(HOME=str(tmp_path))
    for key in ("MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET", "MODAL_PROFILE", "MODAL_CONFIG_PATH"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, "-m", "remotorch", "deploy", "modal", "--gpu", "T4"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 1
    assert "modal setup" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    bad = subprocess.run([sys.executable, "-m", "remotorch", "deploy", "modal", "--timeout", "5"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 2 and "timeout must be" in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "remotorch", "deploy", "modal", "--volume", "no/slashes"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 2 and "volume must be" in bad.stderr


def test_gpt2_eval_example_writes_its_files_locally(server, tmp_path):
    """The example of the remote-GPU, local-files pattern, run as a user runs it (against REMOTORCH_URL)."""
    example = REPO / "examples" / "gpt2_eval.py"
    out = tmp_path / "my results"
    proc = subprocess.run([sys.executable, str(example), "--out", str(out), "--problems", "12", "--batch", "4"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env=clean_env(REMOTORCH_URL=server.url, REMOTORCH_TOKEN=SERVER_TOKEN))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["results.csv", "summary.json", "timing.png"]
    rows = (out / "results.csv").read_text().splitlines()
    assert rows[0] == "problem,loss,perplexity,predicted,expected,correct,batch_ms" and len(rows) == 13
    summary = json.loads((out / "summary.json").read_text())
    assert summary["problems"] == 12 and summary["remote_calls"] == 3
    assert summary["tensors_uploaded"] > 0
    # only losses and predictions came back: 3 replies of 4 floats and 4 ints plus headers, no logits
    assert summary["bytes_received"] < 3000, summary
    assert "worker: test on cpu" in proc.stdout


@pytest.mark.skipif(not credentials_configured(), reason="no Modal credentials configured (modal setup)")
def test_live_modal_worker():
    from remotorch.deploy.modal import worker

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).eval()
    x = torch.randn(4, 64)
    with contextlib.ExitStack() as stack:
        session = stack.enter_context(worker(gpu="T4", timeout=900, name="ci-modal"))
        health = session.health()
        assert health["name"] == "ci-modal" and health["device"].startswith("cuda")
        compiled = remotorch.compile(model, session=session, fallback="raise")
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x), atol=1e-4, rtol=1e-4)
