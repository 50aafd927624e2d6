"""A brief run whose outputs are kept as planned goes the short way
(``worker/runs.py``, ``run_kept``): it must answer, keep and refuse exactly as the general way does.

Each case runs the same requests on two workers in this process, one with the
short way turned off, and compares every reply and every value kept.
"""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from remotorch.codec import messages as m
from remotorch.codec.frames import FrameReader, FrameWriter
from remotorch.codec.graph import encode_graph
from remotorch.worker import guard, quota
from remotorch.worker import runs as runs_module
from remotorch.worker import worker as worker_module
from remotorch.worker.quota import Limits
from remotorch.worker.runs import run_kept
from remotorch.worker.service import Service
from remotorch.worker.worker import Worker

ALL = 1, 2, 3, 4, 5  # handles 1..5: the values put below


def _service(short: bool, monkeypatch, limits: Limits | None = None) -> tuple[Service, list]:
    """A service whose worker takes the short way (or never does); what each run's short way did."""
    taken = []

    def counted(*args):
        try:
            ran = run_kept(*args) if short else None
        except Exception:
            taken.append("raised")  # (on its way: the run failed there)
            raise
        taken.append(ran is not None)
        return ran

    monkeypatch.setattr(worker_module, "run_kept", counted)
    monkeypatch.setattr(runs_module, "run_kept", counted)  # (a Runs message's calls, in serve_runs)
    return Service(Worker("cpu", name="short" if short else "general", limits=limits or Limits())), taken


class Peer:
    """One client session on a service, numbering its own requests."""

    def __init__(self, service: Service) -> None:
        self.service, self.seq = service, 0

    def ask(self, body, frames=()):
        self.seq += 1
        header, out = self.service.handle(1, m.encode(body, None, seq=self.seq), list(frames))
        return m.decode(header), out

    def graph(self, fn, *examples) -> str:
        payload = encode_graph(make_fx(fn)(*examples))
        reply, _ = self.ask(m.PutGraph(payload.graph_id, payload.doc, payload.consts), payload.const_frames)
        assert type(reply) is m.Ok, reply
        return payload.graph_id

    def put(self, *values: torch.Tensor) -> None:
        """``values`` kept as handles 1, 2…, each by running an identity on it."""
        for k, v in enumerate(values):
            gid, w = self.graph(lambda a: a.clone(), v), FrameWriter()
            reply, _ = self.ask(m.Run(gid, args=[w.value(v)], keep=[0], handle_base=k + 1), w.frames)
            assert type(reply) is m.RunReply, reply

    def held(self, ids) -> dict[int, torch.Tensor | str]:
        got = {}
        for hid in ids:
            reply, frames = self.ask(m.Fetch([m.HandleArg(hid)]))
            got[hid] = (FrameReader(frames).tensor(reply.values[0]) if type(reply) is m.FetchReply
                        else reply.kind)
        return got


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b))
    return a == b


def _replies(reply, frames):
    """A reply as comparable values (each output's tensor read from the frames)."""
    if type(reply) is m.ErrorReply:
        return ("error", reply.kind, reply.handles, reply.graphs)
    if type(reply) is m.RunReply:
        return ("ran", reply.at, reply.compiled, reply.rng,
                [FrameReader(frames).tensor(o.meta) if hasattr(o, "meta") else o for o in reply.outputs])
    return (type(reply).__name__,)


def _equal(x, y) -> bool:
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return len(x) == len(y) and all(_equal(a, b) for a, b in zip(x, y))
    return _same(x, y)


def _both(monkeypatch, case, limits: Limits | None = None) -> list[bool]:
    """``case(peer)`` on a worker with the short way and one without; their replies and kept values
    are equal; returns, for the first, which runs went the short way."""
    out, ways = [], None
    for short in (True, False):
        service, taken = _service(short, monkeypatch, limits)
        peer = Peer(service)
        replies = case(peer)
        out.append(([_replies(r, f) for r, f in replies], peer.held(range(1, 40))))
        if short:
            ways = taken
    (short_replies, short_held), (general_replies, general_held) = out
    assert _equal(short_replies, general_replies), (short_replies, general_replies)
    assert short_held.keys() == general_held.keys()
    for hid in short_held:
        assert _same(short_held[hid], general_held[hid]), hid
    return ways


def test_kept_outputs_of_held_arguments_go_the_short_way_and_equal_the_general_way(monkeypatch):
    def case(peer):
        peer.put(torch.arange(12.0).reshape(4, 3))
        mul = peer.graph(lambda a, b: (a * b, a - b), torch.ones(4, 3), torch.ones(4, 3))
        short = mul[:m.SHORT_GRAPH_ID]
        return [peer.ask(m.Run(mul, args=[m.HandleArg(1), m.HandleArg(1)], keep=[0, 1], handle_base=10)),
                peer.ask(m.Run(short, args=[m.HandleArg(10), m.HandleArg(11)], keep=[0, 1], handle_base=12,
                               brief=True)),
                peer.ask(m.Run(short, args=[m.HandleArg(12), m.HandleArg(13)], keep=[0, 1], handle_base=14,
                               brief=True))]

    assert _both(monkeypatch, case) == [True, True]


def test_a_view_argument_goes_the_short_way(monkeypatch):
    def case(peer):
        peer.put(torch.arange(12.0).reshape(4, 3))
        add = peer.graph(lambda a: a + 2, torch.ones(2, 3))
        rows = m.ViewArg(1, [2, 3], [3, 1], 3)  # rows 1 and 2
        return [peer.ask(m.Run(add, args=[rows], keep=[0], handle_base=10, brief=True)),
                peer.ask(m.Run(add, args=[rows], keep=[0], handle_base=11, brief=True)),
                peer.ask(m.Run(add, args=[m.ViewArg(1, [2, 3], [3, 1], 9)], keep=[0], handle_base=12,
                               brief=True))]  # past the end of its storage: refused

    assert _both(monkeypatch, case)[-2:] == [True, "raised"]


@pytest.mark.parametrize("name", ["transposed", "a size-1 dimension", "not a tensor", "not all kept",
                                  "kept out of order"])
def test_outputs_not_kept_as_planned_are_disposed_of_as_the_general_way_does(monkeypatch, name):
    fns = {"transposed": (lambda a: a.t(), [0]), "a size-1 dimension": (lambda a: a[:1] * 2, [0]),
           "not a tensor": (lambda a: (a * 2, a.shape[0]), [0]), "not all kept": (lambda a: (a * 2, a + 1), [1]),
           "kept out of order": (lambda a: (a * 2, a + 1), [1, 0])}
    fn, keep = fns[name]

    def case(peer):
        peer.put(torch.arange(12.0).reshape(4, 3))
        gid = peer.graph(fn, torch.ones(4, 3))
        replies = [peer.ask(m.Run(gid, args=[m.HandleArg(1)], keep=keep, handle_base=10, brief=True))]
        replies.append(peer.ask(m.Run(gid, args=[m.HandleArg(1)], keep=keep, handle_base=20, brief=True)))
        return replies

    _both(monkeypatch, case)


def test_outputs_over_the_session_quota_travel_back_as_the_general_way_sends_them(monkeypatch):
    def case(peer):
        peer.put(torch.arange(12.0).reshape(4, 3))
        big = peer.graph(lambda a: a.repeat(64, 1), torch.ones(4, 3))
        return [peer.ask(m.Run(big, args=[m.HandleArg(1)], keep=[0], handle_base=10 + k, brief=True))
                for k in range(3)]

    ways = _both(monkeypatch, case, Limits(memory_quota=4096))
    assert ways[-1] is True  # (it went the short way, and found the quota full: the general disposal)


def test_missing_handles_and_graphs_fail_as_the_general_way_says(monkeypatch):
    def case(peer):
        peer.put(torch.arange(12.0).reshape(4, 3))
        neg = peer.graph(lambda a: -a, torch.ones(4, 3))
        return [peer.ask(m.Run(neg, args=[m.HandleArg(1)], keep=[0], handle_base=10, brief=True)),
                peer.ask(m.Run(neg, args=[m.HandleArg(9)], keep=[0], handle_base=11, brief=True)),  # never made
                peer.ask(m.Run("0" * m.SHORT_GRAPH_ID, args=[m.HandleArg(1)], keep=[0], handle_base=12,
                               brief=True)),  # a graph it never had
                peer.ask(m.Run(neg, args=[m.HandleArg(1)], keep=[0], handle_base=10, brief=True)),  # id in use
                peer.ask(m.Run(neg, args=[m.ScalarArg(1.0)], keep=[0], handle_base=13, brief=True))]  # a scalar

    _both(monkeypatch, case)


def test_a_run_that_fails_on_the_worker_fails_as_the_general_way_says(monkeypatch):
    def case(peer):
        peer.put(-torch.eye(3))  # not positive-definite
        chol = peer.graph(lambda a: torch.linalg.cholesky(a), torch.eye(3))
        return [peer.ask(m.Run(chol, args=[m.HandleArg(1)], keep=[0], handle_base=10, brief=True)),
                peer.ask(m.Run(chol, args=[m.HandleArg(1)], keep=[0], handle_base=11, brief=True))]

    assert _both(monkeypatch, case)[-1] == "raised"  # (the second: compiled, so it went the short way)


def test_a_runs_message_answers_and_keeps_as_the_general_way_does(monkeypatch):
    """Eager calls queued together (``Runs``): the short way answers those kept as planned with their
    milliseconds alone, and a failing one, one over a missing handle and one not kept as planned
    exactly as the general way does; the calls after a failure still run."""

    def case(peer):
        peer.put(torch.arange(12.0).reshape(4, 3), -torch.eye(3))
        neg = peer.graph(lambda a: -a, torch.ones(4, 3))
        t = peer.graph(lambda a: a.t(), torch.ones(4, 3))
        chol = peer.graph(lambda a: torch.linalg.cholesky(a), torch.eye(3))
        runs = [m.Run(neg, args=[m.HandleArg(1)], keep=[0], handle_base=10, brief=True),
                m.Run(neg, args=[m.HandleArg(10)], keep=[0], handle_base=11, brief=True),
                m.Run(chol, args=[m.HandleArg(2)], keep=[0], handle_base=12, brief=True),  # fails
                m.Run(neg, args=[m.HandleArg(12)], keep=[0], handle_base=13, brief=True),  # needs it
                m.Run(t, args=[m.HandleArg(11)], keep=[0], handle_base=14, brief=True),  # not row-major
                m.Run(neg, args=[m.HandleArg(11)], keep=[0], handle_base=15, brief=True)]
        chores = [None, None, m.Pending(handles=[10]), None, None, None]
        reply, frames = peer.ask(m.Runs(runs, [0] * len(runs), chores))
        assert type(reply) is m.RunsReply, reply
        said = {i: _replies(r, frames) for i, r in reply.said.items()}
        return [(m.Ok(), []), *[(r, frames) for r in reply.said.values()]], said

    got = []

    def recorded(peer):
        replies, said = case(peer)
        got.append(said)
        return replies

    ways = _both(monkeypatch, recorded)
    # the first call of a graph says it compiled; then the failure, the call behind it, the transposed one
    assert got[0].keys() == got[1].keys() == {0, 2, 3, 4}, got
    assert got[0][2][1] == "worker" and got[0][3][1:3] == ("missing", [12])
    assert ways[-6:] == [True, True, "raised", "raised", True, True]


def test_out_of_memory_on_the_short_way_evicts_and_runs_once_more(monkeypatch):
    """As the general way's guard: a run that ran out of memory evicts what no session holds and runs
    once more; out of memory again, it is a typed RemoteOutOfMemoryError; anything else a WorkerError."""
    from remotorch import errors

    evicted = []
    monkeypatch.setattr(quota, "release_cached", lambda stores, device: evicted.append(1) or 1)
    failures = [MemoryError("no room"), None]

    def fn(a, b):
        exc = failures.pop(0) if failures else None
        if exc is not None:
            raise exc
        return a + b

    values = [torch.ones(3), torch.ones(3)]
    out, ms = guard.guarded_call("eager", fn, values, timeout=None, stores=(), device=torch.device("cpu"))
    assert torch.equal(out, torch.full((3,), 2.0)) and evicted == [1] and ms >= 0
    assert len(values) == 2  # (left as it was: each attempt takes a copy)

    failures[:] = [MemoryError("no room"), MemoryError("still none")]
    with pytest.raises(errors.RemoteOutOfMemoryError):
        guard.guarded_call("eager", fn, values, timeout=None, stores=(), device=torch.device("cpu"))
    failures[:] = [ValueError("bad")]
    with pytest.raises(errors.WorkerError, match="ValueError: bad"):
        guard.guarded_call("eager", fn, values, timeout=None, stores=(), device=torch.device("cpu"))
    with torch.enable_grad():
        failures[:] = [ValueError("bad")]
        with pytest.raises(errors.WorkerError):
            guard.guarded_call("eager", fn, values, timeout=None, stores=(), device=torch.device("cpu"))
        assert torch.is_grad_enabled()
