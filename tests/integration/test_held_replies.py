"""Replies nobody waits for leave the worker together.

The worker here runs its graphs on the ``hold:0.4`` engine (each run answers
0.4 s late), so that requests queued behind a run are all at the worker when
it ends, on any machine; the runs queued behind it on ``hold:0.002``, so that
their replies, were they not held, would leave far apart. The relay between counts the reads it took each
direction's bytes in; the tests count those and the replies, and judge
nothing by the machine's speed. That a reply a read waits for is never held is
the service's decision (``Service.last_quiet``, tests/unit/test_quiet_replies.py):
a held one leaves at the kernel's 200 ms cork ceiling at the latest, which no
test here could tell from a slow machine.
"""

from __future__ import annotations

import pytest
import torch

import remotorch
from remotorch.devtools.netem import DelayProxy

from helpers import tiny_mlp

HOLD_S = 0.4
SHORT_S = 0.002  # the queued runs' hold: far apart for the relay, all eight within HOLD_MAX_S


@pytest.fixture(scope="module")
def holding(start_module_server):
    srv = start_module_server(name="holding", extra_args=("--engines", f"eager,hold:{HOLD_S:g},hold:{SHORT_S:g}"))
    with DelayProxy(srv.url, delay_ms=2) as proxy:
        yield proxy


def _compiled(session, engine: str, seed: int):
    torch.manual_seed(seed)
    model = tiny_mlp(8, 8, 512)  # an output of 8 KiB: kept on the worker while it is not read
    return remotorch.compile(model.eval(), session=session, engine=engine, fallback="raise")


X = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def test_replies_to_queued_requests_come_back_in_one_write(holding, session_for):
    s = session_for(holding.url)
    slow, quick = _compiled(s, f"hold:{HOLD_S:g}", 0), _compiled(s, f"hold:{SHORT_S:g}", 1)
    slow(X), quick(X)  # compiled and uploaded (their outputs are never read: they stay on the worker)
    s.synchronize()
    before = s.stats()["requests_queued"]
    holding.reset_log()
    kept = [slow(X)] + [quick(X) for _ in range(8)]  # the eight are at the worker before the first ends
    s.synchronize()
    assert s.stats()["requests_queued"] - before == len(kept) == 9
    (exchange,) = holding.exchanges()
    # nine replies, not sent SHORT_S apart: one write (two if a loaded machine made them take HOLD_MAX_S)
    assert exchange.reads_down <= 2, exchange
