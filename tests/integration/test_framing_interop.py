"""A worker and a client on different framings: the compiled one (_cframing) and the pure-Python one.

The two speak the same bytes (tests/unit/test_framing.py checks it byte for
byte); here a real ``remotorch serve`` started with ``REMOTORCH_FRAMING=python``
serves a client on the compiled framing, and the other way round, over TCP:
a model's calls (small requests, and large ones whose frames are cut into
GMAC-tagged chunks), a 4 MiB echo, and a message that breaks the worker's
size limit, refused while the connection stays in step.
"""

from __future__ import annotations

import pytest
import torch

import remotorch
from remotorch import errors, models
from remotorch.transport import framing

from conftest import TOKEN

pytestmark = pytest.mark.skipif(framing._C is None, reason="_cframing not built: only one framing here")


@pytest.mark.parametrize("worker_framing", ["python", "compiled"])
def test_a_worker_and_a_client_on_different_framings(start_server, monkeypatch, worker_framing):
    env = {"REMOTORCH_FRAMING": "python"} if worker_framing == "python" else {}
    server = start_server(token=TOKEN, env=env, extra_args=("--max-message-bytes", str(8 << 20)))
    if worker_framing == "compiled":
        monkeypatch.setattr(framing, "_C", None)  # this client on the pure-Python framing
    torch.manual_seed(0)
    model = models.mlp().eval()
    with remotorch.Session(server.url, token=TOKEN) as session:
        assert session.health()["framing"] == worker_framing
        channel = session.connection.link._transport._channel
        assert channel.compiled == (worker_framing == "python")
        compiled = remotorch.compile(model, session=session, fallback="raise")
        with torch.no_grad():
            for n in (3, 700):  # 9 KB inline; 2.2 MB in 9 tagged chunks
                x = torch.randn(n, 784)
                assert torch.equal(compiled(x), model(x))
        assert session.stats()["remote_calls"] == 2
        big = torch.randn(1 << 20).numpy()
        assert bytes(memoryview(session.echo([big])[0])) == big.tobytes()
        with pytest.raises(errors.LimitExceededError):
            session.echo([torch.zeros(3 << 18).numpy()] * 4)  # 4 frames of 3 MiB: 12 MiB, over the worker's 8
        assert session.health()["name"] == "test"  # the same connection, still in step
        assert session.connection.link._transport._channel is channel
