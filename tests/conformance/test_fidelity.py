"""Ordinary user code gives what aot_eager gives: the four ways it broke, as a user writes them.

1. A result read after the ``with Session()`` block that made it (closing a
   session brings home what Python still holds: values, trained parameters,
   optimizer state; ``close(fetch=False)`` drops them instead).
2. Training where the model computes its own loss (``labels=``).
3. Activation checkpointing (dropout's random numbers replayed exactly).
4. Symbolic-size arithmetic (``sym_sum``, ``sym_max``…) with ``dynamic=True``.

Every case runs against a real ``remotorch serve`` with ``fallback="raise"``
and is compared with the same code under ``torch.compile(backend="aot_eager")``.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap

import pytest
import torch

import remotorch
from remotorch.client.remote import RemoteTensor
from remotorch.errors import RemoteError, UnsupportedGraphError, WorkerUnavailableError
from remotorch.optim import RemoteOptimizer

from conftest import TOKEN, clean_env
from helpers import train_steps

# the zoo's aot_eager references start computing in a second process while these tests run
pytestmark = pytest.mark.usefixtures("zoo_references")


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(10, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def aot_eager(fn, **kwargs):
    return torch.compile(fn, backend="aot_eager", **kwargs)


def assert_same_parameters(got, want) -> None:
    """Trained parameters (two iterables in the same order) agree within training's tolerance."""
    got, want = list(got), list(want)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------- 1. values outlive their session
def test_the_readme_pattern_a_result_read_after_the_with_block(server):
    model, x = mlp(), torch.randn(32, 10)
    with remotorch.Session(server.url, token=TOKEN) as session:
        y = remotorch.compile(model, session=session, fallback="raise")(x)
        assert type(y) is RemoteTensor and y.is_remote  # it stayed on the worker
        column, transposed = y[:, 3], y.t()  # views of it, still remote
    assert not y.is_remote
    expected = aot_eager(model)(x)
    torch.testing.assert_close(y.sum(), expected.sum())
    torch.testing.assert_close(column, expected[:, 3])
    torch.testing.assert_close(transposed, expected.t())
    assert session.stats()["values_fetched"] >= 1


def test_closing_fetches_every_live_value_in_one_request(server, monkeypatch):
    from remotorch.client.connection import Connection

    model, kept = mlp(), []
    batches = [torch.randn(32, 10) for _ in range(20)]
    calls = []
    real = Connection.fetch_many
    monkeypatch.setattr(Connection, "fetch_many", lambda self, args: calls.append(len(args)) or real(self, args))
    with remotorch.Session(server.url, token=TOKEN) as session:
        compiled = remotorch.compile(model, session=session, fallback="raise")
        for x in batches:
            kept.append(compiled(x))  # outputs kept in a list, read much later
        assert all(y.is_remote for y in kept)
        del kept[5]  # a value nobody holds any more is not fetched
    assert calls == [19]
    for x, y in zip(batches[:5] + batches[6:], kept):
        torch.testing.assert_close(y, model(x))


def test_launched_calls_are_settled_and_fetched_at_close(server):
    model, xs = mlp(), [torch.randn(32, 10) for _ in range(4)]
    with remotorch.Session(server.url, token=TOKEN) as session:  # calls are sent without waiting
        compiled = remotorch.compile(model, session=session, fallback="raise")
        with torch.no_grad():
            outs = [compiled(x) for x in xs]
    with torch.no_grad():
        for x, y in zip(xs, outs):
            torch.testing.assert_close(y, model(x))


def test_close_with_fetch_false_drops_the_values_and_says_so(server):
    model, x = mlp(), torch.randn(32, 10)
    session = remotorch.Session(server.url, token=TOKEN)
    y = remotorch.compile(model, session=session, fallback="raise")(x)
    session.close(fetch=False)
    with pytest.raises(WorkerUnavailableError, match="fetch=False"):
        y.sum()
    with remotorch.Session(server.url, token=TOKEN, fetch_on_close=False) as other:
        z = remotorch.compile(model, session=other, fallback="raise")(x)
    with pytest.raises(WorkerUnavailableError, match="dropped"):
        print(z)


def test_a_value_whose_worker_died_still_raises_a_typed_error(start_server):
    srv = start_server()
    model, x = mlp(), torch.randn(32, 10)
    with remotorch.Session(srv.url, token=TOKEN, timeout=10) as session:
        y = remotorch.compile(model, session=session, fallback="raise")(x)
        srv.stop()  # the worker dies with the value; leaving the block must not hang or raise
    with pytest.raises(RemoteError):
        y.sum()


def test_trained_parameters_buffers_and_optimizer_state_outlive_the_session(server):
    def cnn():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                   torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 4))

    x = torch.randn(4, 3, 8, 8)
    reference = cnn()
    compiled_ref, local_opt = aot_eager(reference), torch.optim.AdamW(reference.parameters(), lr=1e-2)
    train_steps(lambda: compiled_ref(x).square().mean(), local_opt)

    model = cnn()
    with remotorch.Session(server.url, token=TOKEN) as session:
        compiled = remotorch.compile(model, session=session, fallback="raise")
        opt = RemoteOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-2, session=session)
        train_steps(lambda: compiled(x).square().mean(), opt)
    # after the block: the model holds what the worker trained, BatchNorm's running stats too
    for (name, got), want in zip(model.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=name)
    state, want_state = opt.state_dict()["state"], local_opt.state_dict()["state"]
    assert state.keys() == want_state.keys()
    for i in state:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(state[i][key], want_state[i][key], rtol=1e-4, atol=1e-6)

    # training goes on in a new session, from that state, as if nothing had closed
    train_steps(lambda: compiled_ref(x).square().mean(), local_opt)
    with remotorch.Session(server.url, token=TOKEN) as again:
        compiled = remotorch.compile(model, session=again, fallback="raise")
        train_steps(lambda: compiled(x).square().mean(), opt)
    assert_same_parameters(model.parameters(), reference.parameters())


def test_the_default_session_fetches_nothing_at_interpreter_exit(tmp_path):
    script = tmp_path / "user.py"
    script.write_text(textwrap.dedent("""
        import logging, sys, torch, remotorch
        logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)
        model = torch.nn.Linear(10, 4096)
        y = remotorch.compile(model, fallback="raise")(torch.randn(64, 10))  # the default session
        assert y.is_remote
        if sys.argv[1] == "close":
            remotorch.default_session().close()
            assert not y.is_remote
        print("done")
    """))
    for how, fetched in (("exit", False), ("close", True)):
        run = subprocess.run([sys.executable, str(script), how], env=clean_env(), capture_output=True, text=True,
                             timeout=300)
        assert run.returncode == 0 and run.stdout.strip() == "done", run.stderr[-3000:]
        assert ("before the session ends" in run.stderr) is fetched, run.stderr[-3000:]


def test_moe_logits_read_after_the_block(zoo_worker):
    from remotorch.devtools import zoo

    spec = zoo.by_name("MixtralForCausalLM")
    model, inputs = spec.build().eval(), spec.inputs()
    with remotorch.Session(zoo_worker.url, token=TOKEN) as session, torch.no_grad():
        logits = remotorch.compile(model, session=session, fallback="raise")(**inputs).logits
        assert logits.is_remote
    with torch.no_grad():
        torch.testing.assert_close(logits, aot_eager(model)(**inputs).logits, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------- 2. the model computes its own loss
@pytest.mark.parametrize("name", ["BertForMaskedLM", "GPT2LMHeadModel"])
def test_training_with_labels_equals_aot_eager(server, name):
    from remotorch.devtools import zoo

    spec = zoo.by_name(name)
    ids = spec.inputs()["input_ids"]
    reference, model = spec.build().train(), spec.build().train()
    compiled_ref, local_opt = aot_eager(reference), torch.optim.AdamW(reference.parameters(), lr=1e-3)
    want = torch.stack(train_steps(lambda: compiled_ref(ids, labels=ids).loss, local_opt))
    with remotorch.Session(server.url, token=TOKEN) as session:
        compiled = remotorch.compile(model, session=session, fallback="raise")
        opt = RemoteOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-3, session=session)
        losses = train_steps(lambda: compiled(ids, labels=ids).loss, opt)
        assert session.stats()["fallbacks"] == 0
    torch.testing.assert_close(torch.stack(losses), want, rtol=1e-5, atol=1e-6)
    assert_same_parameters(model.parameters(), reference.parameters())


# ----------------------------------------------------------------- 3. activation checkpointing
def test_gpt2_with_gradient_checkpointing_trains_as_aot_eager(server):
    from remotorch.devtools import zoo

    spec = zoo.by_name("GPT2LMHeadModel")
    ids = spec.inputs()["input_ids"]
    results = []
    for backend in ("aot_eager", "remotorch"):
        model = spec.build()
        model.gradient_checkpointing_enable()
        model.train()
        with remotorch.Session(server.url, token=TOKEN) as session:
            if backend == "aot_eager":
                compiled, opt = aot_eager(model), torch.optim.AdamW(model.parameters(), lr=1e-3)
            else:
                compiled = remotorch.compile(model, session=session, fallback="raise")
                opt = RemoteOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-3, session=session)
            losses = train_steps(lambda: compiled(ids, labels=ids).loss, opt)
        results.append((torch.stack(losses), [p.detach().clone() for p in model.parameters()]))
    (want_losses, want_params), (losses, params) = results
    torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=1e-6)
    assert_same_parameters(params, want_params)


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def inner(self, x):
        return self.b(torch.nn.functional.gelu(self.a(x))).tanh()


def _selective():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    return {"use_reentrant": False, "context_fn": lambda: create_selective_checkpoint_contexts(policy)}


@pytest.mark.parametrize("how", ["non-reentrant", "reentrant", "selective"])
def test_torch_utils_checkpoint_equals_aot_eager(server, how):
    kwargs = {"non-reentrant": {"use_reentrant": False}, "reentrant": {"use_reentrant": True},
              "selective": None}[how] or _selective()
    x = torch.randn(8, 16, requires_grad=True)

    def step(block, inputs):
        return torch.utils.checkpoint.checkpoint(block.inner, inputs, **kwargs).square().sum()

    grads = []
    for backend in ("aot_eager", "remotorch"):
        block, inputs = Block(), x.detach().clone().requires_grad_()
        with remotorch.Session(server.url, token=TOKEN) as session:
            fn = aot_eager(step) if backend == "aot_eager" else remotorch.compile(step, session=session,
                                                                                fallback="raise")
            loss = fn(block, inputs)
            loss.backward()
        grads.append([loss.detach(), inputs.grad, *(p.grad for p in block.parameters())])
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_checkpointed_dropout_replays_the_forwards_random_numbers(server):
    """The backward recomputes dropout on the worker: with the mask the forward drew, or w.grad is wrong."""
    w = torch.nn.Parameter(torch.rand(64) + 0.5)
    x = torch.randn(32, 64)

    def step(inputs):
        return torch.utils.checkpoint.checkpoint(
            lambda t: torch.nn.functional.dropout(t, 0.5, training=True) * w, inputs, use_reentrant=False)

    with remotorch.Session(server.url, token=TOKEN) as session:
        y = remotorch.compile(step, session=session, fallback="raise")(x)
        y.sum().backward()
        assert session.stats()["fallbacks"] == 0
    kept = y.detach() / w.detach()  # dropout(x): zero, or x / (1 - p)
    assert 0.3 < (kept == 0).float().mean().item() < 0.7  # really dropped, at about p
    torch.testing.assert_close(w.grad, kept.sum(0))  # d(sum(dropout(x) * w))/dw with the same mask


# ----------------------------------------------------------------- 4. symbolic sizes
def test_symbolic_size_arithmetic_runs_remotely_and_trains(server):
    def f(a, b, c):
        x = torch.cat([a, b, c])  # its size is a sym_sum of three
        width = max(a.shape[0], b.shape[0])  # sym_max
        return (x.sin() * width).sum(0), torch.arange(x.shape[0] + a.shape[1])

    with remotorch.Session(server.url, token=TOKEN) as session:
        remote = remotorch.compile(f, session=session, fallback="raise", dynamic=True)
        reference = aot_eager(f, dynamic=True)
        for n in (3, 5, 8):
            ins = [torch.randn(k, 4, requires_grad=True) for k in (n, n + 1, 2 * n)]
            refs = [t.detach().clone().requires_grad_() for t in ins]
            got, want = remote(*ins), reference(*refs)
            got[0].sum().backward()
            want[0].sum().backward()
            torch.testing.assert_close(got[0], want[0])
            assert torch.equal(got[1], want[1])
            for t, r in zip(ins, refs):
                torch.testing.assert_close(t.grad, r.grad)
        assert session.stats()["fallbacks"] == 0


def test_llama_batched_generate_with_a_left_padded_mask(server):
    from remotorch.devtools import zoo

    spec = zoo.by_name("LlamaForCausalLM")
    model = spec.build().eval()
    prompts = []
    for rows, length, pad in ((2, 6, 2), (3, 9, 3), (4, 7, 1)):
        g = torch.Generator().manual_seed(rows)
        ids = torch.randint(3, 128, (rows, length), generator=g)
        mask = torch.ones_like(ids)
        ids[0, :pad], mask[0, :pad] = 0, 0
        prompts.append((ids, mask))
    eager = [model.generate(input_ids=i, attention_mask=m, max_new_tokens=5, do_sample=False) for i, m in prompts]
    reference = copy.deepcopy(model)
    reference.forward = aot_eager(reference.forward, dynamic=True)
    with remotorch.Session(server.url, token=TOKEN) as session:
        model.forward = remotorch.compile(model.forward, session=session, fallback="raise", dynamic=True)
        outs = [model.generate(input_ids=i, attention_mask=m, max_new_tokens=5, do_sample=False) for i, m in prompts]
        assert session.stats()["fallbacks"] == 0
    for (i, m), out, want in zip(prompts, outs, eager):
        assert torch.equal(out, want)
        assert torch.equal(out, reference.generate(input_ids=i, attention_mask=m, max_new_tokens=5, do_sample=False))


def test_a_builtin_call_that_does_not_fit_is_refused_and_the_worker_keeps_serving(session):
    import msgspec

    from remotorch.codec import messages as m
    from remotorch.codec.graph import graph_id

    doc = msgspec.msgpack.encode({"format": 1, "nodes": [
        {"op": "placeholder", "kind": "tensor", "dtype": "float32", "shape": [2]},
        {"op": "call", "target": "torch:sym_sum", "args": [[{"$n": "v0"}, 1]], "kwargs": {}},  # a tensor operand
        {"op": "output", "args": [{"$n": "v1"}]}]})
    with pytest.raises(UnsupportedGraphError, match="sym_sum takes scalars"):
        session.connection.request(m.PutGraph(graph_id(doc, [], []), doc, []))
    model, x = mlp(), torch.randn(4, 10)
    torch.testing.assert_close(remotorch.compile(model, session=session, fallback="raise")(x), model(x))
