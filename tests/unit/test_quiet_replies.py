"""Which replies the worker may hold back (``Service.last_quiet``): only those that carry nothing the
client may be waiting to read. The real service in this process, on an in-memory transport.

The serving loop holds a quiet reply while more of the peer's requests are here
(transport/holding.py, tests/unit/test_holding.py); a reply a read waits for
must never be quiet, or it would wait for the next reply (or the kernel's
200 ms cork ceiling), which no test could tell from a slow machine.
"""

from __future__ import annotations

import pytest
import torch

import remotorch
from remotorch import errors
from remotorch.codec import messages as m
from remotorch.transport.loopback import LoopbackTransport
from remotorch.worker.service import Service
from remotorch.worker.worker import Worker

from helpers import tiny_mlp


@pytest.fixture
def quiet():
    """A session on an in-process service, and the (request type, quiet) of every request it handled."""
    service = Service(Worker("cpu", name="inproc"))
    seen: list[tuple[str, bool]] = []

    def handle(cid, header, frames):
        reply = service.handle(cid, header, frames)
        seen.append((type(service.last_body).__name__, service.last_quiet))
        return reply

    s = remotorch.Session(transport=LoopbackTransport(handle, on_disconnect=service.disconnected))
    yield s, seen
    s.close()


def runs(seen: list, since: int) -> list[bool]:
    return [q for kind, q in seen[since:] if kind == "Run"]


@torch.no_grad()
def test_a_run_whose_value_comes_back_is_never_quiet_one_whose_value_stays_is(quiet):
    s, seen = quiet
    model = tiny_mlp(8, 8, 512).eval()  # an output of 8 KiB: kept on the worker while it is not read
    f = remotorch.compile(model, session=s, fallback="raise")
    x = torch.randn(4, 8)
    f(x)  # compiled, uploaded
    s.synchronize()
    mark = len(seen)
    kept = [f(x) for _ in range(3)]  # not read: their outputs stay on the worker
    s.synchronize()
    assert runs(seen, mark) == [True, True, True]
    for _ in range(2):  # read, late: from now on the run's reply brings the value back
        y = f(x)
        f(x)
        y.numpy()  # (a read of the value itself: an eager call on it, y.sum(), would be a run of its own)
    s.synchronize()
    mark = len(seen)
    y = f(x)
    y.numpy()
    assert runs(seen, mark) == [False]  # a read waits for it
    assert all(k.is_remote for k in kept)


def test_an_error_reply_is_never_quiet_and_an_ok_one_is(quiet):
    s, seen = quiet
    gid = "0123456789abcdef" * 4
    with pytest.raises(errors.MissingObjectsError):
        s.connection.link.request(m.Run(gid, "eager", []), expect=m.RunReply)
    assert seen[-1] == ("Run", False)
    s.connection.link.request(m.PutTensors([], []), expect=m.Ok)
    assert seen[-1] == ("PutTensors", True)
