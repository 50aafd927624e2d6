"""The bytes a session holds on a worker, kept as values come and go (a memory quota asks before every
output a run keeps): always what counting every object once gives, and asked without counting them."""

from __future__ import annotations

import random
from itertools import chain

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from remotorch.codec import messages as m
from remotorch.codec.frames import FrameWriter
from remotorch.codec.graph import encode_graph
from remotorch.worker.handles import HandleStore, count_bytes
from remotorch.worker.quota import Limits
from remotorch.worker.service import Service
from remotorch.worker.store import SharedStore
from remotorch.worker.tenants import Tenants
from remotorch.worker.worker import Worker


def _brute_state(w: Worker, session=None) -> int:
    return count_bytes(chain(w.handles.tensors(session), w.trainables.tensors(session)))


def test_kept_bytes_equal_a_count_of_every_object_once_through_random_changes():
    rng = random.Random(5)
    w = Worker("cpu", name="bytes")
    sessions = ["a", "b"]
    pool = [torch.zeros(rng.randint(1, 40)) for _ in range(12)]  # objects a handle may name again
    w.trainables.bind("a", 1, pool[0], private=True)  # a parameter, also kept by handle below
    w.trainables.accumulate("a", 1, torch.ones_like(pool[0]), owned=True)
    held = {s: set() for s in sessions}
    next_id = 1
    for step in range(600):
        if step == 150:  # counted by sums only from here (a worker with a quota tracks from the start)
            assert not w.handles.tracking
            w.handles.track()
        s = rng.choice(sessions)
        op = rng.random()
        if op < 0.5:  # keep one to three tensors, some of them objects held already (here or elsewhere)
            k = rng.randint(1, 3)
            ts = [rng.choice(pool) if rng.random() < 0.5 else torch.zeros(rng.randint(1, 40)) for _ in range(k)]
            if rng.random() < 0.2:
                ts = [ts[0]] * k  # the same object under several handles
            if rng.random() < 0.1:
                ts[0] = w.trainables.slot("a", 1)  # a parameter saved as a handle (a training forward does)
            ids = list(range(next_id, next_id + k))
            next_id += k
            w.handles.put(s, ids, ts)
            held[s].update(ids)
        elif op < 0.9 and held[s]:
            gone = rng.sample(sorted(held[s]), rng.randint(1, min(3, len(held[s]))))
            w.handles.release(s, gone + [10 ** 9])  # (an id not held is ignored)
            held[s].difference_update(gone)
        elif op < 0.95:
            with pytest.raises(Exception):  # an id in use is refused, and nothing is counted for it
                if held[s]:
                    w.handles.put(s, [min(held[s])], [torch.zeros(3)])
                else:
                    raise ValueError
        else:
            w.handles.drop_session(s)
            held[s].clear()
        for who in (*sessions, None):
            assert w.state_bytes(who) == _brute_state(w, who), (step, who)
        if w.handles.tracking:
            assert w.handles.total_bytes == count_bytes(w.handles.tensors())


def test_a_worker_keeps_the_sums_only_where_a_quota_a_limit_or_tenants_ask_for_them():
    assert not Worker("cpu", name="plain").handles.tracking  # (storing a handle stays a dict operation)
    assert Worker("cpu", name="quota", limits=Limits(memory_quota=1 << 30)).handles.tracking
    assert Worker("cpu", name="limit", limits=Limits(memory_limit=1 << 30)).handles.tracking
    service = Service(Worker("cpu", name="tenants"))
    w = service.worker
    w.handles.put("a", [1, 2], [torch.zeros(4), torch.zeros(2)])
    assert not w.handles.tracking
    service.use_tenants(Tenants(None, "a-token"))  # (a tokens file's: the handles held already count too)
    assert w.handles.tracking and w.handles.nbytes("a") == 24 == w.state_bytes("a")


def test_a_sessions_uploads_are_counted_as_they_come_and_go():
    rng = random.Random(7)
    store = SharedStore(keep_bytes=100)
    keys = [f"k{i}" for i in range(10)]
    size = {k: rng.randint(1, 60) for k in keys}
    for step in range(500):
        s = rng.choice(["a", "b", "c"])
        op = rng.random()
        k = rng.choice(keys)
        if op < 0.45:
            store.put(s, k, object(), size[k])
        elif op < 0.6:
            store.adopt(s, k)
        elif op < 0.9:
            store.release(s, [k, "never"])
        else:
            store.drop_session(s)
        for who in ("a", "b", "c"):
            expected = sum(size[x] for x in store.session_keys(who))
            assert store.session_bytes(who) == expected, (step, who)


def test_a_quota_does_not_count_every_value_kept_before_each_eager_call(monkeypatch):
    """With a memory quota, each output an eager call keeps is checked against what the session holds;
    a session keeping 1000 other values must not have each of them counted per call."""
    service = Service(Worker("cpu", name="quota", limits=Limits(memory_quota=1 << 34)))
    seq = iter(range(1, 10 ** 6))

    def ask(body, frames=()):
        header, _ = service.handle(1, m.encode(body, None, seq=next(seq)), list(frames))
        return m.decode(header)
    x = torch.randn(64)
    payload = encode_graph(make_fx(lambda v: v * 1.5)(x))
    assert type(ask(m.PutGraph(payload.graph_id, payload.doc, payload.consts), payload.const_frames)) is m.Ok
    w = FrameWriter()
    assert type(ask(m.Run(payload.graph_id, args=[w.value(x)], keep=[0], handle_base=1, brief=True),
                    w.frames)) is m.RunReply
    session = next(iter(service.worker.handles._sessions))
    service.worker.handles.put(session, list(range(10 ** 6, 10 ** 6 + 1000)), [torch.randn(4) for _ in range(1000)])
    counted = []
    every_value = HandleStore.tensors

    def counting(self, session=None):  # what a count of every value held walks
        counted.append(session)
        return every_value(self, session)
    monkeypatch.setattr(HandleStore, "tensors", counting)
    gid = payload.graph_id[:m.SHORT_GRAPH_ID]
    runs = [m.Run(gid, args=[m.HandleArg(1 + j)], keep=[0], handle_base=2 + j, brief=True) for j in range(16)]
    reply = ask(m.Runs(runs, [0] * 16, [None] + [m.Pending(handles=[1 + j]) for j in range(15)]))
    assert type(reply) is m.RunsReply and not reply.said, reply  # every output kept, within the quota
    assert counted == []  # no call walked the 1000 values (the sums kept say what the session holds)
    expected = x
    for _ in range(17):  # the first run, then the sixteen
        expected = expected * 1.5
    assert torch.equal(service.worker.handles.get(session, 17), expected)
    assert service.worker.state_bytes(session) == _brute_state(service.worker, session)
