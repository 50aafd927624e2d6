"""Eager torch calls on values kept on a worker run there, queued on the stream; only a read waits.

Against a real ``remotorch serve`` on loopback: a value kept on the worker
stands here as a ``RemoteTensor``; an eager call on it, outside any compiled
region, is sent to that worker without waiting (``remotorch.client.eager``),
its result a placeholder whose sizes, dtype and strides came from fake
tensors here. Every result is compared with eager torch's, bit for bit.
Round trips and bytes behind a real delay are in ``test_eager_wan.py``.
"""

from __future__ import annotations

import copy
import io
import json
import sys

import pytest
import torch
import torch.nn.functional as F

import remotorch
from remotorch import errors
from remotorch.client.remote import RemoteTensor

from helpers import tiny_mlp


def _line() -> int:
    """The caller's line number."""
    return sys._getframe(1).f_lineno


def kept(session, *values, worker=None):
    """``values`` as values kept on the session's worker: outputs of a compiled identity."""
    f = remotorch.compile(lambda *a: tuple(v.clone() for v in a), session=session, fallback="raise", worker=worker)
    with torch.no_grad():
        out = f(*values)
    assert all(type(o) is RemoteTensor and o.is_remote for o in out)
    return out if len(out) > 1 else out[0]


def remote(t) -> bool:
    return type(t) is RemoteTensor and t.is_remote


@pytest.fixture
def s(make_session):
    """A session that keeps every output on the worker, small ones too (keep_min_bytes=0)."""
    return make_session(keep_min_bytes=0)


CALLS = {
    "chain": lambda y, x: (y * 0.5 + 1).softmax(-1)[:, :7].sum(1),
    "where": lambda y, x: torch.where(y > 0, y, -y),
    "matmul": lambda y, x: y @ y.T,
    "gelu": lambda y, x: F.gelu(y),
    "cat": lambda y, x: torch.cat([y, y], 0),
    "to": lambda y, x: y.to(torch.float64),
    "argmax": lambda y, x: y.argmax(-1),
    "max": lambda y, x: torch.max(y, dim=1),
    "mixed": lambda y, x: torch.stack([y, x]) * x,  # a local tensor travels as an input
    "transposed": lambda y, x: y.t().contiguous() + 1,
    "comparison": lambda y, x: y == x,
    "clone": lambda y, x: y.clone(),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_a_call_on_a_kept_value_runs_on_the_worker_and_equals_torch(s, name):
    call = CALLS[name]
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    y = kept(s, x)
    want = call(x.clone(), x)
    before = s.stats()
    got = call(y, x)
    assert s.stats()["eager_ops"] > before["eager_ops"]
    assert s.stats()["values_fetched"] == before["values_fetched"]  # nothing read yet
    for g, w in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
        assert remote(g)
        assert (g.shape, g.dtype, g.stride()) == (w.shape, w.dtype, w.stride())
        assert torch.equal(g, w)  # (a read)
    assert isinstance(want, torch.Tensor) or type(got) is type(want)  # (torch.return_types.max...)
    assert y.is_remote  # the value itself never came back


def test_writes_and_views_keep_torch_semantics(s):
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1))
    y, w = kept(s, x), x.clone()
    col, wcol = y[:, 2], w[:, 2]  # a view made before the writes
    read, wread = y[:, 3], w[:, 3]
    assert read.tolist() == wread.tolist()  # a view read before the writes (fetched alone)
    version = y._version
    assert y.mul_(2).add_(1) is y  # in place: the same object back
    w.mul_(2).add_(1)
    assert y._version > version  # as torch counts writes
    y[:10].zero_(), w[:10].zero_()
    y[:, 0] = 5.0
    w[:, 0] = 5.0
    torch.add(y, 1, out=y), torch.add(w, 1, out=w)
    assert remote(y) and remote(col) and remote(read)
    assert torch.equal(col, wcol) and torch.equal(read, wread)  # views see the writes
    assert torch.equal(y, w)


def test_a_shape_mismatch_raises_at_once_with_torchs_message(s):
    y = kept(s, torch.randn(4, 5))
    with pytest.raises(RuntimeError) as want:
        torch.randn(4, 5) + torch.ones(3)
    before = s.stats()
    with pytest.raises(RuntimeError) as got:
        y + torch.ones(3)
    assert str(got.value) == str(want.value)
    assert s.stats()["messages_sent"] == before["messages_sent"]  # refused here, before anything left


def test_a_call_that_fails_on_the_worker_raises_at_the_read_naming_its_line(s):
    a = kept(s, -torch.eye(8))  # not positive-definite
    factor = torch.linalg.cholesky(a); line = _line()  # noqa: E702 (sent without waiting: no error yet)
    total = factor.sum()  # depends on it: fails too, and names the first failure
    with pytest.raises(errors.RemoteError) as info:
        total.item()
    assert f"{__file__}:{line}" in str(info.value) and "cholesky" in str(info.value)
    b = kept(s, torch.eye(8) * 4)  # the session goes on
    assert torch.equal(torch.linalg.cholesky(b), torch.eye(8) * 2)


READS = {
    "item": lambda t: t.sum().item(),
    "tolist": lambda t: t.tolist(),
    "bool": lambda t: bool(t.sum() > 0),
    "if": lambda t: "pos" if t.max() > 0 else "neg",
    "numpy": lambda t: t.numpy().tolist(),
    "print": lambda t: print(t, file=io.StringIO()),
    "cpu": lambda t: t.cpu(),
    "to cpu": lambda t: t.to("cpu"),
    "torch.save": lambda t: torch.save(t, io.BytesIO()),
    "torch.equal": lambda t: torch.equal(t, t),
}


@pytest.mark.parametrize("name", sorted(READS))
def test_a_read_waits_for_the_value(s, name):
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(2))
    y = kept(s, x) * 3  # a value an eager call made
    before = s.stats()
    got = READS[name](y)
    after = s.stats()
    assert after["blocking_reads"] > before["blocking_reads"] or after["values_fetched"] > before["values_fetched"]
    want = READS[name](x * 3)
    if isinstance(got, torch.Tensor):
        assert not remote(got) and torch.equal(got, want)
    elif name != "print":
        assert got == want


def test_a_size_that_depends_on_the_data_comes_back_alone(s):
    """``x[x > 0]``, ``nonzero``, ``unique``: run on the worker, which answers the size (one round trip
    each, a few bytes); the other choice, fetching the argument, would move it whole (1 MiB here)."""
    x = torch.randn(256, 1024, generator=torch.Generator().manual_seed(3))
    y = kept(s, x)
    before = s.stats()
    picked, where, values = y[y > 1], (y > 2).nonzero(), torch.unique((y * 2).round())
    after = s.stats()
    assert after["bytes_received"] - before["bytes_received"] < 8 << 10
    assert remote(picked) and remote(where) and remote(values)
    assert picked.shape == x[x > 1].shape and where.shape == (x > 2).nonzero().shape
    assert torch.equal(picked, x[x > 1]) and torch.equal(where, (x > 2).nonzero())
    assert torch.equal(values, torch.unique((x * 2).round()))


def test_random_calls_draw_what_eager_draws(s):
    x = torch.randn(512, generator=torch.Generator().manual_seed(4))
    y = kept(s, x)

    def draws(t):
        return [F.dropout(t, 0.5, training=True), torch.rand_like(t), torch.bernoulli(t.sigmoid()),
                torch.multinomial(t.softmax(0), 5)]

    torch.manual_seed(7)
    want = draws(x) + [torch.randn(3)]
    torch.manual_seed(7)
    got = draws(y)
    assert all(remote(g) for g in got)
    for g, w in zip(got, want):
        assert torch.equal(g, w)  # (a read: the generator's state comes back with it)
    assert torch.equal(torch.randn(3), want[-1])  # drawn here after the worker's draws, as eager draws it


def test_eager_remote_off_reads_the_value_and_runs_the_call_here(make_session):
    s = make_session(keep_min_bytes=0, eager_remote=False)
    x = torch.randn(64, 64)
    y = kept(s, x)
    before = s.stats()
    got = y * 2
    assert not remote(got) and not y.is_remote  # read once, then an ordinary tensor
    assert s.stats()["values_fetched"] == before["values_fetched"] + 1
    assert s.stats()["eager_ops"] == 0
    assert torch.equal(got, x * 2)


def test_the_trace_shows_eager_calls(s, tmp_path):
    y = kept(s, torch.randn(32, 32))
    path = tmp_path / "eager.json"
    with remotorch.trace(path):
        (y * 2 + 1).sum().item()
    names = {e["name"] for e in json.loads(path.read_text())["traceEvents"]}
    assert {"eager aten.mul.Tensor", "eager aten.add.Tensor", "eager aten.sum.default"} <= names, names


def test_eager_calls_traced_in_several_threads_at_once_leave_compiled_calls_working(s):
    """Each new kind of eager call is traced (FX), and FX's "tracing now" flag is one global each trace
    saves and restores: traces in threads at once must not leave it set, or every compiled call after
    them raises ("using FX to symbolically trace a dynamo-optimized function")."""
    import threading

    import torch.fx._symbolic_trace as fx_trace

    values = kept(s, *[torch.randn(4, n) for n in range(3, 11)])
    errors_seen: list = []

    def work(offset: int) -> None:
        try:
            for i, v in enumerate(values):  # a new layout, a new trace, in each thread
                (v[:, : (i + offset) % v.shape[1] + 1] * (i + 2)).sum().item()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            errors_seen.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors_seen, errors_seen
    assert fx_trace._is_fx_tracing_flag is False
    assert not torch._C._dispatch_tls_is_dispatch_key_included(torch._C.DispatchKey.PreDispatch)
    assert torch._ops._len_torch_dispatch_stack_pre_dispatch() == 0  # (no tracer's mode left behind)
    f = remotorch.compile(lambda a: a * 3, session=s, fallback="raise")
    x = torch.randn(5)
    with torch.no_grad():
        assert torch.equal(torch.as_tensor(f(x).numpy()), x * 3)


def test_a_call_on_values_of_two_workers_moves_one_to_the_other(server, start_server, session_for):
    """The call runs where most of its bytes are; the other value moves worker to worker."""
    other = start_server(name="eager-second")
    s = session_for([server, other], keep_min_bytes=0)
    big, small = torch.randn(256, 256), torch.randn(256)
    a, b = kept(s, big, worker=0), kept(s, small, worker=1)
    before = s.stats()
    c = a + b
    s.synchronize()
    after = s.stats()
    assert remote(c) and c.__dict__["_rt_ref"].conn is a.__dict__["_rt_ref"].conn
    assert after["values_moved"] == before["values_moved"] + 1
    assert after["bytes_received"] - before["bytes_received"] < 16 << 10  # b went worker to worker
    assert torch.equal(c, big + small)


def test_an_output_an_eager_call_uses_stays_on_the_worker(s):
    """The read policy counts an eager call on a graph's output as a use on the worker, not a read:
    a loop that reads only a sum of each output never brings the outputs back."""
    f = remotorch.compile(lambda a: torch.tanh(a) * 3, session=s, fallback="raise")
    x = torch.randn(256, 256)
    with torch.no_grad():
        for _ in range(6):
            before = s.stats()
            out = f(x)
            total = out.sum().item()
            assert s.stats()["bytes_received"] - before["bytes_received"] < out.nbytes // 8
    assert remote(out)
    assert total == (torch.tanh(x) * 3).sum().item()


# ------------------------------------------------------------------ training
def test_a_loss_computed_eagerly_outside_the_model_trains_equal_to_local(s):
    model = tiny_mlp(16, 32, 10)
    reference = copy.deepcopy(model)
    compiled = remotorch.compile(model, session=s, fallback="raise")
    local = torch.compile(reference, backend="aot_eager")  # the same graphs, run here
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(4):
        x, labels = torch.randn(8, 16, generator=g), torch.randint(0, 10, (8,), generator=g)
        for net, optim, out in ((compiled, opt, losses), (local, ref_opt, None)):
            optim.zero_grad()
            loss = F.cross_entropy(net(x), labels)  # eager, outside the compiled model
            loss.backward()
            optim.step()
            if out is not None:
                out.append(loss)
    assert sum(remote(loss) for loss in losses[1:]) >= 2  # computed on the worker (the first call waits)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)


def test_an_ema_of_kept_values_stays_on_the_worker_and_equals_local(s):
    torch.manual_seed(6)
    params = [torch.randn(64, 64), torch.randn(64)]
    live = list(kept(s, *params))
    ema = [p.detach().clone() for p in live]  # (eager clones: kept too)
    want_live, want_ema = [p.clone() for p in params], [p.clone() for p in params]
    g = torch.Generator().manual_seed(6)
    before = s.stats()
    with torch.no_grad():
        for _ in range(5):
            for p, e, wp, we in zip(live, ema, want_live, want_ema):
                step = torch.randn(p.shape, generator=g) * 0.01
                p.add_(step), wp.add_(step)  # the "training" moves them
                e.mul_(0.9).add_(p, alpha=0.1), we.mul_(0.9).add_(wp, alpha=0.1)
    after = s.stats()
    assert all(remote(e) for e in ema) and after["values_fetched"] == before["values_fetched"]
    assert after["bytes_received"] - before["bytes_received"] < 4 << 10
    for e, w in zip(ema, want_ema):
        assert torch.equal(e, w)


def test_sampling_generate_on_a_compiled_model_moves_no_logits_back(session):
    """HF ``generate(do_sample=True)``: the logits stay on the worker, and the sampling (temperature,
    top-k, softmax, multinomial) runs there too, as eager calls; what comes back is the chosen tokens,
    the stop check, and the random generator's state (§17.5), never a row of logits."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=8000, bos_token_id=0, eos_token_id=1)).eval()
    ids = torch.randint(2, 8000, (1, 8), generator=torch.Generator().manual_seed(0))
    options = dict(do_sample=True, top_k=50, temperature=0.8, pad_token_id=0)
    with torch.no_grad():
        torch.manual_seed(1)
        want = model.generate(ids, max_new_tokens=12, **options)
        model.forward = remotorch.compile(model.forward, session=session, fallback="raise", dynamic=True)
        model.generate(ids, max_new_tokens=3, **options)  # compiled, uploaded
        torch.manual_seed(1)
        before = session.stats()
        got = model.generate(ids, max_new_tokens=12, **options)
        after = session.stats()
    assert torch.equal(got, want)  # the same draws as eager
    assert after["values_fetched"] == before["values_fetched"]
    assert after["eager_ops"] - before["eager_ops"] >= 12 * 4  # the sampling ran on the worker
    logits_row = 8000 * 4
    assert (after["bytes_received"] - before["bytes_received"]) / 12 < logits_row / 3


def test_a_write_into_a_small_value_whose_reply_is_still_coming_is_not_undone_by_the_reply(session):
    """An output under 1 KiB is kept on the worker and also comes back in its call's reply (echo); a
    write queued before that reply is read makes the reply's copy stale: the read fetches the value."""
    f = remotorch.compile(lambda a: a * 2, session=session, fallback="raise")
    x = torch.arange(16.0)
    with torch.no_grad():
        f(x)  # the first call waits for its reply (compiles); the next is sent without waiting
        y = f(x)
        assert remote(y)
        y.add_(1)
        y[:4] = 0.0
    want = x * 2 + 1
    want[:4] = 0.0
    assert y.tolist() == want.tolist()


def test_a_parameter_made_of_a_kept_value_is_initialised_and_updated_on_the_worker(s):
    """``nn.Parameter(kept)`` stays a kept value; ``nn.init``, ``p.data`` tricks and an EMA of it are
    eager calls queued to the worker (``nn.init.normal_`` calls with keyword arguments only); equal
    to the same code run here."""
    w = torch.randn(32, 32, generator=torch.Generator().manual_seed(9))
    p, q = torch.nn.Parameter(kept(s, w)), torch.nn.Parameter(w.clone())
    assert remote(p) and p.requires_grad
    before = s.stats()
    results = []
    for param in (p, q):
        torch.manual_seed(11)
        with torch.no_grad():
            torch.nn.init.normal_(param, std=0.02)
            ema = param.detach().clone()
            for _ in range(3):
                param.data.mul_(0.5)
                ema.mul_(0.9).add_(param, alpha=0.1)
        results.append((param, ema))
    assert s.stats()["values_fetched"] == before["values_fetched"]
    assert remote(p) and remote(results[0][1])
    assert torch.equal(results[0][1], results[1][1]) and torch.equal(p, q)
