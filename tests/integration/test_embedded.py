"""The default worker: with no URL anywhere, a session starts its own loopback worker process."""

from __future__ import annotations

import os

import pytest
import torch

import remotorch
from remotorch import models

from helpers import Probe


def test_session_without_url_runs_on_an_embedded_worker(monkeypatch):
    monkeypatch.delenv("REMOTORCH_URL", raising=False)
    monkeypatch.delenv("REMOTORCH_TOKEN", raising=False)
    session = remotorch.Session()
    try:
        assert session.embedded
        torch.manual_seed(0)
        Probe(session, models.mlp(), torch.randn(4, 784))()
        assert session.stats()["remote_calls"] == 1
        assert session.health()["name"] == "local"
        worker = session.embedded_worker
        assert worker is not None and worker.alive()
        assert worker.url.startswith("unix:///") and worker.transport == "unix"
        pid = worker.pid
        os.kill(pid, 0)  # the process exists
    finally:
        session.close()
    assert not worker.alive()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert session.embedded_worker is None
