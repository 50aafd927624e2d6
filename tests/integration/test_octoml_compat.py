"""octoml-profile scripts run on remotorch with one import line changed.

The two examples of octoml-profile's README run as scripts in fresh
processes, verbatim but for the import line (the graph-break example is a
fragment there: it gets its imports and the ``@accelerate`` its text says it
needs), against the embedded worker (defaults, as a user runs it) and against
a test server through ``REMOTORCH_URL``. Their printed reports are checked line
by line against octoml-profile's layout and against each other's numbers.
"""

from __future__ import annotations

import io
import re
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

from conftest import TOKEN, clean_env
from remotorch import errors
from remotorch.compat.octoml_profile import (BackendSubstitutedWarning, RemoteInferenceSession, accelerate,
                                             remote_profile, resolve_backends)

OLD_IMPORT = "from octoml_profile import"
NEW_IMPORT = "from remotorch.compat.octoml_profile import"

# octoml-profile README, "Getting Started" (verbatim)
GETTING_STARTED = '''\
import torch
import torch.nn.functional as F
from torch.nn import Linear, ReLU, Sequential
from octoml_profile import (accelerate,
                            remote_profile,
                            RemoteInferenceSession)

model = Sequential(Linear(100, 200), ReLU(), Linear(200, 10))

@accelerate
def predict(x: torch.Tensor):
    y = model(x)
    z = F.softmax(y, dim=-1)
    return z

# Alternatively you can also directly use `accelerate`
# on a model, e.g. `predict = accelerate(model)` which will leave the
# softmax out of remote execution

session = RemoteInferenceSession()
with remote_profile(session):
    for i in range(10):
        x = torch.randn(1, 100)
        predict(x)
'''

# octoml-profile README, "Uncompiled segments": the fragment (verbatim), after the lines it assumes
GRAPH_BREAKS = '''\
import torch
from octoml_profile import accelerate, remote_profile, RemoteInferenceSession

import torch.nn.functional as F
import time

@accelerate
def function_with_graph_breaks(x):
    time.sleep(1) # Uncompiled segment 0
    x = F.relu(x) # graph #1, segment 1
    torch._dynamo.graph_break() # Uncompiled segment 2
    time.sleep(0.1) # continue segment 2
    x = F.relu(x) # graph #2, segment 3
    time.sleep(1) # Uncompiled segment 4
    return x

sess = RemoteInferenceSession('r6i.large/onnxrt-cuda')
with remote_profile():
    for _ in range(2):
        function_with_graph_breaks(torch.tensor(1.))
'''

NUM = r"(\d+\.\d{3})"


def run_script(tmp_path, text: str, **env) -> subprocess.CompletedProcess:
    assert text.count(OLD_IMPORT) == 1
    path = tmp_path / "octoml_example.py"
    path.write_text(text.replace(OLD_IMPORT, NEW_IMPORT))
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=600,
                          env=clean_env(**env), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def table_lines(out: str) -> list[str]:
    lines = out.splitlines()
    return lines[lines.index("Profile 1/1:"):]


def check_frame(lines: list[str]) -> None:
    """Header, rule lines as wide as the header, totals block: octoml-profile's frame."""
    assert re.fullmatch(r" +Segment +Runs +Mean ms +Failures *", lines[1]), lines[1]
    width = len(lines[1].rstrip())
    assert lines[2] == "=" * len(lines[2]) and len(lines[2]) >= width
    rule = next(i for i, line in enumerate(lines) if line.startswith("---"))
    assert lines[rule] == "-" * len(lines[2])
    assert re.fullmatch(rf"Total uncompiled code run time: {NUM} ms", lines[rule + 1])
    assert lines[rule + 2] == "Total times (compiled + uncompiled) per backend, ms:"


def test_getting_started_example_runs_on_the_embedded_worker(tmp_path):
    proc = run_script(tmp_path, GETTING_STARTED)
    out = proc.stdout
    assert out.splitlines()[0] == "Runs discarded because compilation occurred: 1"
    lines = table_lines(out)
    check_frame(lines)
    first = re.fullmatch(rf"0  Uncompiled +9 +{NUM}", lines[3])
    assert first, lines[3]
    assert lines[4] == ""
    assert re.fullmatch(r"1  Graph #1", lines[5])
    row = re.fullmatch(rf" +local/onnxrt +90 +{NUM} +0", lines[6])  # 9 timed calls x 10 repeats
    assert row, lines[6]
    assert lines[7] == ""
    last = re.fullmatch(rf"2  Uncompiled +9 +{NUM}", lines[8])
    assert last, lines[8]
    uncompiled = float(re.search(NUM, lines[10]).group(1))
    assert uncompiled == pytest.approx(float(first.group(1)) + float(last.group(1)), abs=0.0015)
    total = re.fullmatch(rf" +local/onnxrt +{NUM}", lines[12])
    assert total, lines[12]
    assert float(total.group(1)) == pytest.approx(uncompiled + float(row.group(1)), abs=0.0025)
    assert len(lines) == 13, lines
    # quiet by default: the embedded worker's ONNX export logs no torchvision warnings
    assert "torchvision" not in proc.stderr, proc.stderr[-2000:]


def test_graph_break_example_runs_against_remotorch_url(tmp_path, server):
    proc = run_script(tmp_path, GRAPH_BREAKS, REMOTORCH_URL=server.url, REMOTORCH_TOKEN=TOKEN)
    out = proc.stdout
    assert out.splitlines()[0] == "Runs discarded because compilation occurred: 1"
    lines = table_lines(out)
    check_frame(lines)
    rows = [line for line in lines[3:] if line and not line.startswith(("-", "Total"))]
    backend = f"{server.name}/onnxrt"  # default backends: each worker's onnxrt
    expected = [r"0  Uncompiled", r"1  Graph #1", backend, r"2  Uncompiled", r"3  Graph #2", backend,
                r"4  Uncompiled", backend]
    assert len(rows) == len(expected), rows
    for got, want in zip(rows, expected):
        assert want in got, (got, want)
    means = [float(re.fullmatch(rf".*Uncompiled +1 +{NUM}", rows[i]).group(1)) for i in (0, 3, 6)]
    assert means[0] >= 1000 and means[1] >= 100 and means[2] >= 1000  # the sleeps, measured locally
    for i in (2, 5):
        assert re.fullmatch(rf" +{re.escape(backend)} +10 +{NUM} +0", rows[i]), rows[i]
    assert "torchvision" not in server.stderr_text()


# ---------------------------------------------------------------- backends as octoml-profile named them
CPU = dict(name="cpu0", device="cpu", engines=["eager", "inductor", "onnxrt"])
GPU = dict(name="gpu0", device="cuda:0", engines=["eager", "onnxrt", "tensorrt"])


def test_old_engine_names_map_to_a_worker_of_the_matching_device():
    assert resolve_backends(["g4dn.xlarge/onnxrt-cuda", "r6i.large/onnxrt-cpu"], [CPU, GPU]) == \
        ["gpu0/onnxrt", "cpu0/onnxrt"]
    assert resolve_backends("g5.xlarge/onnxrt-tensorrt", [CPU, GPU]) == ["gpu0/tensorrt"]
    assert resolve_backends("cpu0/onnxrt-cuda", [CPU, GPU]) == ["gpu0/onnxrt"]  # the device decides
    assert resolve_backends(["cpu0/eager", "gpu0/onnxrt", "x/onnxrt-cuda"], [CPU, GPU]) == \
        ["cpu0/eager", "gpu0/onnxrt"]  # duplicates collapse
    assert resolve_backends(None, [CPU, GPU]) == ["cpu0/onnxrt", "gpu0/onnxrt"]
    assert resolve_backends(None, [dict(name="w", device="cpu", engines=["eager"])]) == ["w/eager"]


def test_a_missing_device_substitutes_with_a_warning():
    with pytest.warns(BackendSubstitutedWarning, match="no cuda worker"):
        assert resolve_backends("g4dn.xlarge/onnxrt-cuda", [CPU]) == ["cpu0/onnxrt"]
    with pytest.warns(BackendSubstitutedWarning, match="tensorrt"):
        assert resolve_backends("g4dn.xlarge/onnxrt-tensorrt", [CPU]) == ["cpu0/onnxrt"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolve_backends("r6i.large/onnxrt-cpu", [CPU])  # a match needs no warning


def test_bad_backends_are_typed_errors():
    with pytest.raises(errors.UnknownBackendError, match="cpu0/tensorrt"):
        resolve_backends("cpu0/tensorrt", [CPU])
    with pytest.raises(errors.UnknownBackendError, match="no such backend: nope/eager"):
        resolve_backends(["nope/eager"], [CPU])
    eager_only = [dict(name="w", device="cpu", engines=["eager"])]
    with pytest.raises(errors.UnknownBackendError, match="offers onnxrt; they offer w/eager"):
        resolve_backends("x/onnxrt-cpu", eager_only)
    with pytest.raises(errors.UnknownBackendError, match="offers tensorrt or onnxrt"):
        resolve_backends("x/onnxrt-tensorrt", eager_only)
    for bad in ("onnxrt-cpu", "a/b/c", "/eager", 3):
        with pytest.raises(ValueError, match="WORKER/ENGINE"):
            resolve_backends([bad], [CPU])


# ---------------------------------------------------------------- the API in-process, against the test server
def _predict():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))

    @accelerate(local_backend="eager")
    def predict(x):
        return F.softmax(model(x), dim=-1)

    return predict


def test_session_with_backends_profiles_each_and_reports(server):
    predict = _predict()
    out = io.StringIO()
    with RemoteInferenceSession([f"{server.name}/eager", "r6i.large/onnxrt-cpu"], server.url,
                                access_token=TOKEN) as sess:
        assert sess.backends == [f"{server.name}/eager", f"{server.name}/onnxrt"]
        assert torch.is_grad_enabled()
        with remote_profile(sess, num_repeats=3, print_results_to=out) as handle:
            assert not torch.is_grad_enabled()  # octoml-profile ran the block under no_grad
            for _ in range(4):
                y = predict(torch.randn(2, 8))
            assert y.shape == (2, 4) and not y.requires_grad
        assert torch.is_grad_enabled()
        report = handle.report()
        assert report.timed_calls == 3 and report.compile_calls == 1
        assert set(report.totals) == set(sess.backends)
        listing = io.StringIO()
        sess.print_supported_backends(listing)
    text = out.getvalue()
    for backend in sess.backends:
        assert re.search(rf"^ +{re.escape(backend)} +9 +{NUM} +0$", text, re.M), text  # 3 calls x 3 repeats
        assert re.search(rf"^    {re.escape(backend)} +{NUM}$", text, re.M), text
    assert f"{server.name}/inductor" in listing.getvalue() and "onnxrt-tensorrt" in listing.getvalue()


def test_misuse_is_refused_and_leaves_the_session_usable(server):
    with RemoteInferenceSession("nope/eager", server.url, access_token=TOKEN) as sess:
        with pytest.raises(errors.UnknownBackendError):
            with remote_profile(sess):
                pass
        assert torch.is_grad_enabled()  # no_grad was not left entered
        assert sess.session.health()["name"] == server.name
        with pytest.raises(ValueError, match="`session` cannot be set at the same time as `backends`"):
            remote_profile(sess, backends=["x/eager"])
    with RemoteInferenceSession(f"{server.name}/eager", server.url, access_token=TOKEN) as sess:
        with remote_profile(sess, print_results_to=None):
            with pytest.raises(RuntimeError, match="Nested"):
                with remote_profile(sess):
                    pass
