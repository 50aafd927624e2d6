"""An eager call's run is prepared once per layout, and later calls take it: same results, same errors.

The first call of an operator on a layout goes the long way (``RemoteGraph``
→ the runner → ``launch`` → the connection), then ``remotorch.client.prepared``
keeps what that way decided; each later call only names its handles and
queues its ``Run``. Against a real ``remotorch serve`` on loopback, compared
with eager torch bit for bit.
"""

from __future__ import annotations

import sys
import threading

import pytest
import torch

import remotorch
from remotorch import errors
from remotorch.capture.graph import RemoteGraph
from remotorch.client.remote import RemoteTensor
from remotorch.codec import messages as m


def _line() -> int:
    return sys._getframe(1).f_lineno


def kept(session, value):
    f = remotorch.compile(lambda a: a.clone(), session=session, fallback="raise")
    with torch.no_grad():
        out = f(value)
    assert type(out) is RemoteTensor and out.is_remote
    return out


@pytest.fixture
def s(make_session):
    return make_session(keep_min_bytes=0)


@pytest.fixture
def long_ways(monkeypatch):
    """How many calls went the long way (through a captured graph's call), counted from now."""
    count = [0]
    call = RemoteGraph.__call__

    def counted(self, *args):
        count[0] += 1
        return call(self, *args)

    monkeypatch.setattr(RemoteGraph, "__call__", counted)
    return count


def chain(y, n: int):
    for _ in range(n):
        y = y * 1.5
        y = y + 0.25
        y = torch.tanh(y)
        y = y[:, 1:].sum(1, keepdim=True) + y  # (a view, a reduction and a broadcast)
    return y


def test_only_the_first_call_of_each_layout_goes_the_long_way(s, long_ways):
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    y = kept(s, x)
    long_ways[0] = 0
    before = s.stats()["eager_ops"]
    with torch.no_grad():
        got = chain(y, 30)
    assert remote(got)
    # mul, add, tanh, sum, add of a broadcast (the view y[:, 1:] sends nothing): five layouts
    assert long_ways[0] == 5
    assert s.stats()["eager_ops"] - before == 30 * 5
    assert torch.equal(got, chain(x, 30))


def remote(t) -> bool:
    return type(t) is RemoteTensor and t.is_remote


def test_a_prepared_call_that_fails_on_the_worker_raises_at_its_read_naming_its_line(s):
    good, bad = kept(s, torch.eye(8) * 4), kept(s, -torch.eye(8))
    first = torch.linalg.cholesky(good)  # the long way: prepared after it
    factor = torch.linalg.cholesky(bad); line = _line()  # noqa: E702 (prepared: sent without waiting)
    with pytest.raises(errors.RemoteError) as info:
        factor.sum().item()
    assert f"{__file__}:{line}" in str(info.value) and "cholesky" in str(info.value)
    assert torch.equal(first, torch.eye(8) * 2)  # the session goes on
    assert torch.equal(torch.linalg.cholesky(good), torch.eye(8) * 2)


def test_a_failing_operator_call_names_the_line_through_torchs_own_python_wrappers(s):
    a, ones, zeros = (kept(s, v) for v in (torch.arange(6), torch.ones(6, dtype=torch.int64),
                                           torch.zeros(6, dtype=torch.int64)))
    first = a // ones  # the long way (Tensor.__floordiv__ is a Python function of torch's)
    q = a // zeros; line = _line()  # noqa: E702 (integer division by zero: on the worker, at the read)
    with pytest.raises(errors.RemoteError) as info:
        q.tolist()
    assert f"{__file__}:{line}" in str(info.value)
    assert torch.equal(first, torch.arange(6))


def test_values_a_chain_of_prepared_calls_drops_are_released_on_the_worker(s):
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    y = kept(s, x)
    conn = y._rt_ref.conn
    dropped = []
    with torch.no_grad():
        z = y * 2
        for _ in range(60):
            z = z * 2  # each call names the last value, which is dropped right after
            dropped.append(z.__dict__["_rt_ref"].handle)
        total = z.sum().item()
    assert total == pytest.approx((x * 2 ** 61).sum().item())
    assert torch.equal(conn.fetch(m.HandleArg(dropped[-1])), x * 2 ** 61)  # (z: still held)
    for hid in dropped[:40]:  # released, riding on later calls and requests, in order
        with pytest.raises(errors.MissingObjectsError):
            conn.fetch(m.HandleArg(hid))


def test_a_large_value_a_chain_drops_is_released_by_the_very_next_call(s):
    """Small values dropped are released 16 at a time; a value of 1 MiB or more rides on the next call,
    so the worker frees it as soon as torch would here (and reuses its memory while it is in cache)."""
    waiting = {}
    for numel in (256, 1 << 18):  # 1 KiB and 1 MiB of float32
        x = torch.randn(numel, generator=torch.Generator().manual_seed(2))
        y = kept(s, x)
        conn = y._rt_ref.conn
        with torch.no_grad():
            z, want = y * 1.5, x * 1.5
            (z * 1.5).sum().item()  # every layout prepared; what was released so far has gone
            most = 0
            for _ in range(40):
                z, want = z * 1.5, want * 1.5
                most = max(most, conn.handles.releasing)
            assert torch.equal(z, want)
        waiting[numel] = most
    # the value the last call dropped (it rides on the next), and at first the small sum read before
    assert waiting[1 << 18] <= 2, waiting
    assert waiting[256] >= 15, waiting


# run in a fresh interpreter: the suite's own process carries garbage of earlier tests' (dynamo's caches
# let go of compiled graphs through weak references) that the collector may find in any window
_GARBAGE = """
import collections, gc, json, sys
import torch, remotorch

def chain(y, n):
    for _ in range(n):
        y = y * 1.5
        y = y + 0.25
        y = torch.tanh(y)
        y = y[:, 1:].sum(1, keepdim=True) + y
    return y

def ours(o):  # an object of remotorch's, or a function of remotorch's or of torch's pytree (tree_map)
    if type(o).__module__.startswith("remotorch."):
        return True
    func = getattr(o, "__func__", o)
    if not callable(o) or not hasattr(func, "__code__"):
        return False
    module = getattr(func, "__module__", None) or ""
    return module.startswith("remotorch.") or module == "torch.utils._pytree"

with remotorch.Session(sys.argv[1], token=sys.argv[2], keep_min_bytes=0) as s, torch.no_grad():
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(3))
    y = remotorch.compile(lambda a: a.clone(), session=s, fallback="raise")(x)
    chain(y, 2).sum().item()  # every layout prepared
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    got = chain(y, 50)  # 250 calls, prepared
    same = torch.equal(got, chain(x, 50))
    del got
    gc.collect()
    cyclic = collections.Counter(type(o).__qualname__ for o in gc.garbage if ours(o))
    gc.set_debug(0)
    gc.garbage.clear()
    print(json.dumps({"same": same, "calls": s.stats()["eager_ops"], "cyclic": cyclic}))
"""


def test_eager_calls_leave_no_garbage_for_the_collector(server):
    """Each call's records are freed as soon as its reply is read: none is in a reference cycle that
    only Python's collector frees (with thousands of calls in flight, such garbage promoted to the
    oldest generation made full collections of the user's whole heap, about 45% of the client's
    time per call)."""
    import json
    import subprocess

    from conftest import TOKEN, clean_env

    out = subprocess.run([sys.executable, "-c", _GARBAGE, server.url, TOKEN], env=clean_env(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["same"] and got["calls"] >= 250, got
    assert not got["cyclic"], got["cyclic"]


def test_prepared_calls_from_several_threads_at_once_equal_torch(s):
    xs = [torch.randn(4, 16, generator=torch.Generator().manual_seed(10 + i)) for i in range(4)]
    ys = [kept(s, x) for x in xs]
    with torch.no_grad():
        chain(ys[0], 1)  # every layout prepared once
    got: dict[int, torch.Tensor] = {}
    failures = []

    def run(i: int) -> None:
        try:
            with torch.no_grad():
                got[i] = chain(ys[i], 25)
        except BaseException as exc:  # noqa: BLE001 (reported below)
            failures.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    try:
        for t in threads:
            t.start()
    finally:
        for t in threads:
            t.join(timeout=300)
    assert not failures and len(got) == 4
    for i, x in enumerate(xs):
        assert torch.equal(got[i], chain(x, 25))
