"""A worker on a CUDA device, through the real server: models, device placement, OOM.

Skipped on machines without CUDA (select them with ``-m gpu``). On a GPU
machine they run against a real ``remotorch serve --device cuda``.
"""

from __future__ import annotations

import pytest
import torch

import remotorch
from remotorch import models
from remotorch.errors import RemoteOutOfMemoryError

from helpers import NEEDS_CUDA, assert_data_parallel_trains_as_one_process

pytestmark = NEEDS_CUDA


@pytest.fixture(scope="module")
def cuda_server(start_module_server):
    return start_module_server(name="gpu", extra_args=("--device", "cuda"))


@pytest.fixture
def cuda_session(session_for, cuda_server):
    return session_for(cuda_server)


def test_health_names_the_cuda_device(cuda_session):
    info = cuda_session.health()
    assert info["device"].startswith("cuda")


@pytest.mark.parametrize("name, make, shape, tol", [
    ("mlp", models.mlp, (32, 784), 1e-4),
    ("cnn", models.SmallCNN, (8, 3, 32, 32), 2e-2),  # cuDNN may use TF32 for convolutions
    ("block", models.TransformerBlock, (4, 16, 64), 1e-3),
])
def test_cpu_client_runs_models_on_a_cuda_worker(cuda_session, name, make, shape, tol):
    """Inputs on the client's CPU, graphs on the worker's GPU, outputs back on the CPU."""
    torch.manual_seed(0)
    model = make().eval()
    x = torch.randn(*shape)
    compiled = remotorch.compile(model, session=cuda_session, fallback="raise")
    with torch.no_grad():
        expected = model(x)
        got = compiled(x)
    assert got.device.type == "cpu"
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
    assert cuda_session.stats()["remote_calls"] == 1


def test_cuda_client_gets_cuda_outputs_equal_to_local_cuda(cuda_session):
    """Same device and engine on both sides: outputs land on the client's device and match."""
    torch.manual_seed(0)
    model = models.mlp().cuda().eval()
    x = torch.randn(32, 784, device="cuda")
    compiled = remotorch.compile(model, session=cuda_session, fallback="raise")
    with torch.no_grad():
        expected = model(x)
        got = compiled(x)
        again = compiled(x)
    assert got.device == x.device
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(again, got, atol=0, rtol=0)
    stats = cuda_session.stats()
    assert stats["graphs_uploaded"] == 1 and stats["tensors_uploaded"] == 4


def test_dynamic_batch_on_cuda_uploads_one_graph(cuda_session):
    torch.manual_seed(0)
    model = models.mlp().eval()
    compiled = remotorch.compile(model, session=cuda_session, fallback="raise", dynamic=True)
    with torch.no_grad():
        for batch in (2, 5, 17, 64):
            x = torch.randn(batch, 784)
            torch.testing.assert_close(compiled(x), model(x), atol=1e-4, rtol=1e-4)
    assert cuda_session.stats()["graphs_uploaded"] == 1


def test_cuda_out_of_memory_is_an_error_reply_and_the_worker_goes_on(cuda_session):
    def huge(x):
        return x.expand(1 << 18, 1 << 18) + 1  # 2**36 float32 = 256 GiB: more than any one GPU

    compiled = remotorch.compile(huge, session=cuda_session, fallback="raise")
    with pytest.raises(RemoteOutOfMemoryError):
        compiled(torch.ones(1, 1))
    torch.manual_seed(0)
    model = models.mlp().eval()
    x = torch.randn(4, 784)
    with torch.no_grad():
        torch.testing.assert_close(remotorch.compile(model, session=cuda_session, fallback="raise")(x),
                                   model(x), atol=1e-4, rtol=1e-4)


def test_two_cuda_replicas_average_over_a_group_and_match_one_process(start_server, session_for):
    """Data parallelism on CUDA workers forms NCCL groups; two workers on one GPU, which NCCL refuses
    ("Duplicate GPU detected"), form a gloo group instead: 2 replicas train as one process on the
    whole batch does (1e-4)."""
    workers = [start_server(name=f"nccl{i}", extra_args=("--device", "cuda")) for i in range(2)]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
    dp, _ = assert_data_parallel_trains_as_one_process(session_for(workers), model, x, y)
    assert dp.replicas == 2


def test_a_restarted_cuda_worker_takes_weights_from_its_disk_cache(start_server, tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    x = torch.randn(4, 32)
    with torch.no_grad():
        want = model(x)
    for run in range(2):
        server = start_server(name=f"cached{run}", extra_args=("--device", "cuda", "--cache-dir", str(tmp_path)))
        torch._dynamo.reset()
        with remotorch.Session(server.url, token=server.token) as s:
            with torch.no_grad():
                got = remotorch.compile(model, session=s, fallback="raise")(x).clone()
            stats = s.stats()
        server.stop()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert (stats["tensors_recalled"] > 0 and stats["tensors_uploaded"] == 0) if run else stats["tensors_uploaded"] > 0
