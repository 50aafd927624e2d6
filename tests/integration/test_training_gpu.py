"""Training on a CUDA worker from a CPU client, through the real server.

Skipped on machines without CUDA (select them with ``-m gpu``). CUDA kernels
differ from the CPU ones, so remote and local training agree to a tolerance.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn import functional as F

import remotorch
from remotorch import models
from remotorch.optim import RemoteOptimizer
from remotorch.training.client import training_client

from conftest import TOKEN
from helpers import NEEDS_CUDA

pytestmark = NEEDS_CUDA


@pytest.fixture(scope="module")
def cuda_server(start_module_server):
    return start_module_server(name="gpu-train", extra_args=("--device", "cuda"))


def test_adamw_on_a_cuda_worker_matches_local_cpu_and_holds_memory_flat(cuda_server):
    with remotorch.Session(cuda_server.url, token=TOKEN) as session:
        torch.manual_seed(0)
        model = models.mlp()
        reference = copy.deepcopy(model)
        step = remotorch.compile(lambda x, y: F.cross_entropy(model(x), y), session=session, fallback="raise")
        opt = RemoteOptimizer(torch.optim.AdamW, model.parameters(), session=session, lr=1e-3)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
        memory = {}
        for i in range(1, 51):
            x, y = torch.randn(32, 784), torch.randint(0, 10, (32,))
            loss = step(x, y)
            assert loss.device.type == "cpu"  # outputs come back to the client's device
            loss.backward()
            norm = opt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
            ref_loss = F.cross_entropy(reference(x), y)
            ref_loss.backward()
            ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
            ref_opt.step()
            ref_opt.zero_grad()
            torch.testing.assert_close(norm, ref_norm, atol=1e-4, rtol=1e-4)
            if i in (10, 50):
                session.flush_releases()
                memory[i] = session.health()["resident_bytes"]
        assert memory[10] == memory[50]
        assert training_client(session).handles.live == 0
        session.pull(model)
        for p, q in zip(model.parameters(), reference.parameters()):
            assert p.device.type == "cpu"
            torch.testing.assert_close(p, q, atol=1e-4, rtol=1e-3)
