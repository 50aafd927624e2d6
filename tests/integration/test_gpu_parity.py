"""A CPU client and a CUDA worker give what local ``aot_eager`` gives on that GPU, bit for bit.

* The worker picks the attention kernel torch picks on its device (``AttentionChoice``), and the
  graphs the client traces for it (the fused kernel's operator, the min-cut partition) compute what
  ``torch.compile(backend="aot_eager")`` computes on the same GPU: GPT-2's logits and three AdamW
  steps, to the bit.
* A worker recording CUDA graphs (``--cuda-graphs``) computes what one that does not computes, to
  the bit, and replays (its stats say so).

Skipped on machines without CUDA (select them with ``-m gpu``).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import remotorch
from remotorch.codec import messages as m
from remotorch.codec.attention import BACKENDS
from remotorch.optim import RemoteOptimizer

from helpers import NEEDS_CUDA

pytestmark = NEEDS_CUDA


@pytest.fixture(scope="module")
def cuda_server(start_module_server):
    return start_module_server(name="gpu-parity", extra_args=("--device", "cuda"))


@pytest.fixture(scope="module")
def graphs_server(start_module_server):
    return start_module_server(name="gpu-graphs", extra_args=("--device", "cuda", "--cuda-graphs"))


def gpt2(seed: int = 0) -> torch.nn.Module:
    import transformers

    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000, n_positions=128,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def _signature(q, k, v, mask=None, dropout_p=0.0, is_causal=False) -> m.AttentionCall:
    def sig(t):
        return m.TensorSig(str(t.dtype).removeprefix("torch."), tuple(t.shape), tuple(t.stride()), t.requires_grad)
    return m.AttentionCall(sig(q), sig(k), sig(v), None if mask is None else sig(mask), dropout_p, is_causal)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("form", ["causal", "mask", "dropout", "no grad"])
def test_the_worker_picks_the_kernel_torch_picks_on_its_device(session_for, cuda_server, dtype, form):
    s = session_for(cuda_server)
    grad = form != "no grad"
    q, k, v = (torch.randn(8, 12, 512, 64, dtype=dtype, device="cuda", requires_grad=grad) for _ in range(3))
    mask = torch.ones(512, 512, dtype=torch.bool, device="cuda").tril() if form == "mask" else None
    kwargs = dict(mask=mask, dropout_p=0.1 if form == "dropout" else 0.0, is_causal=form in ("causal", "no grad"))
    local = torch._fused_sdp_choice(q, k, v, kwargs["mask"], kwargs["dropout_p"], kwargs["is_causal"])
    assert s.attention_backends(None, [_signature(q, k, v, **kwargs)]) == [BACKENDS[int(local)]]


def _train(compiled, model, optimizer, ids, steps: int = 3) -> list[torch.Tensor]:
    losses = []
    for _ in range(steps):
        loss = compiled(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().cpu())
    return losses


def test_gpt2_logits_and_three_training_steps_equal_local_aot_eager_bit_for_bit(session_for, cuda_server):
    s = session_for(cuda_server)
    ids = torch.randint(1, 1000, (4, 128), generator=torch.Generator().manual_seed(1))
    model = gpt2().eval()
    local = copy.deepcopy(model).cuda()
    with torch.no_grad():
        want = torch.compile(local, backend="aot_eager")(ids.cuda()).logits.cpu()
        got = remotorch.compile(model, session=s, fallback="raise")(ids).logits
    assert torch.equal(got, want)
    torch._dynamo.reset()
    model.train()
    local.train()
    want = _train(torch.compile(local, backend="aot_eager"), local, torch.optim.AdamW(local.parameters(), lr=1e-3),
                  ids.cuda())
    got = _train(remotorch.compile(model, session=s, fallback="raise"), model,
                 RemoteOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-3, session=s), ids)
    assert all(torch.equal(a, b) for a, b in zip(got, want)), (got, want)
    s.synchronize()
    for (name, p), q in zip(model.named_parameters(), local.parameters()):
        assert torch.equal(p.detach(), q.detach().cpu()), name


def _counts(session) -> dict:
    reply, _ = session.connection_for(None).request(m.Stats(), expect=m.StatsReply)
    return dict(reply.cuda_graphs)


def test_cuda_graphs_give_the_uncaptured_runs_bits_and_replay(session_for, cuda_server, graphs_server):
    plain, graphs = session_for(cuda_server), session_for(graphs_server)
    ids = torch.randint(1, 1000, (4, 128), generator=torch.Generator().manual_seed(2))
    runs = {}
    for name, s in (("plain", plain), ("graphs", graphs)):
        torch._dynamo.reset()
        model = gpt2().eval()
        compiled = remotorch.compile(model, session=s, fallback="raise")
        with torch.no_grad():
            logits = [compiled(ids).logits for _ in range(4)]
        model.train()
        torch._dynamo.reset()
        compiled = remotorch.compile(model, session=s, fallback="raise")
        losses = _train(compiled, model, RemoteOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-3, session=s),
                        ids, steps=4)
        s.synchronize()
        runs[name] = (logits, losses, [p.detach().clone() for p in model.parameters()])
    for a, b in zip(runs["plain"], runs["graphs"]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    counts = _counts(graphs)
    assert counts.get("recorded", 0) >= 3 and counts.get("replays", 0) >= 6, counts  # inference, forward, backward


def test_attention_dropout_on_a_cuda_worker_repeats_for_the_same_seed(session_for, cuda_server):
    s = session_for(cuda_server)
    q, k, v = (torch.randn(2, 4, 64, 64, requires_grad=True) for _ in range(3))
    compiled = remotorch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.3),
                                 session=s, fallback="raise")
    outs = []
    for _ in range(2):
        torch.manual_seed(7)
        out = compiled(q, k, v)
        out.sum().backward()
        outs.append((out.detach().clone(), q.grad.clone()))
        q.grad = k.grad = v.grad = None
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
