"""Weights that live on the worker: a model that never exists on the client.

A real ``remotorch serve --weights models=DIR --checkpoints ck=DIR`` reads
safetensors files that transformers' own ``save_pretrained`` wrote; the
client builds the model on meta and holds stand-ins. Everything is compared
with the same model loaded locally by transformers: logits, ``generate``,
three AdamW steps, checkpoints read back by transformers, a resumed run.
"""

from __future__ import annotations

import re

import pytest
import torch
import transformers
from torch import nn

import remotorch
from remotorch import errors
from remotorch.client.remote import remote_ref
from remotorch.optim import RemoteOptimizer

from conftest import TOKEN
from helpers import assert_still_serves

IDS = torch.randint(2, 100, (2, 10), generator=torch.Generator().manual_seed(0))


def gpt2_config(**more):
    return transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64, bos_token_id=0,
                                   eos_token_id=1, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **more)


def llama_config(**more):
    return transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=100, tie_word_embeddings=False, bos_token_id=0,
                                    eos_token_id=1, **more)


MODELS = {"gpt2": (transformers.GPT2LMHeadModel, gpt2_config),  # tied embeddings
          "llama": (transformers.LlamaForCausalLM, llama_config)}  # untied; rotary inv_freq (non-persistent)


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    """A weights root with each model as save_pretrained wrote it (one sharded), and a checkpoints root."""
    weights, checkpoints = tmp_path_factory.mktemp("weights"), tmp_path_factory.mktemp("checkpoints")
    for name, (cls, config) in MODELS.items():
        torch.manual_seed(1)
        cls(config()).save_pretrained(weights / name)
    torch.manual_seed(2)
    transformers.GPT2LMHeadModel(gpt2_config()).save_pretrained(weights / "sharded", max_shard_size="20KB")
    return weights, checkpoints


@pytest.fixture(scope="module")
def worker(roots, start_module_server):
    weights, checkpoints = roots
    return start_module_server(name="weights", extra_args=("--weights", f"models={weights}",
                                                           "--checkpoints", f"ck={checkpoints}"))


@pytest.fixture
def wsession(worker, session_for):
    return session_for(worker)


def local(roots, name: str, folder: str = "models"):
    weights, checkpoints = roots
    cls = MODELS.get(name, MODELS["gpt2"])[0]
    return cls.from_pretrained((weights if folder == "models" else checkpoints) / name)


def train(model, opt, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        loss = model(IDS, labels=IDS).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


# ------------------------------------------------------------------ the model as transformers has it
@pytest.mark.parametrize("name", sorted(MODELS))
def test_logits_and_generate_equal_transformers_and_nothing_of_the_weights_crosses(roots, wsession, name):
    cls = MODELS[name][0]
    before = wsession.stats()
    model = remotorch.from_pretrained(cls, f"models/{name}", session=wsession)
    loaded = wsession.stats()
    assert loaded["blocking_reads"] - before["blocking_reads"] == 2  # OpenWeights, LoadWeights
    assert loaded["bytes_sent"] - before["bytes_sent"] < 4096 and loaded["tensors_uploaded"] == 0
    want = local(roots, name)
    for (key, p), (_, q) in zip(model.named_parameters(), want.named_parameters()):
        assert remote_ref(p) is not None and isinstance(p, nn.Parameter), key  # a stand-in, not a copy
        assert (p.shape, p.dtype, p.requires_grad) == (q.shape, q.dtype, q.requires_grad), key
    if name == "gpt2":
        assert model.lm_head.weight is model.transformer.wte.weight  # tied: one value on the worker
    else:
        assert model.lm_head.weight is not model.model.embed_tokens.weight
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, want(IDS).logits)
        got = model.generate(IDS[:1], max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(got, want.generate(IDS[:1], max_new_tokens=6, do_sample=False, pad_token_id=0))
    assert wsession.stats()["tensors_uploaded"] == 0 or name == "llama"  # (llama: its inv_freq, computed here)
    assert wsession.stats()["fallbacks"] == 0


def test_non_persistent_buffers_are_computed_here_as_transformers_does(roots, wsession):
    model = remotorch.from_pretrained(transformers.LlamaForCausalLM, "models/llama", session=wsession)
    want = local(roots, "llama")
    mine = dict(model.named_buffers())
    theirs = dict(want.named_buffers())
    assert sorted(mine) == sorted(theirs) and mine
    for key, b in mine.items():
        assert remote_ref(b) is None, key  # not in any checkpoint: a real tensor here, uploaded by content id
        assert torch.equal(b, theirs[key]) and b.dtype == theirs[key].dtype, key


def test_a_sharded_checkpoint_loads_with_one_request_for_all_its_files(roots, wsession):
    index = remotorch.weights.load.open_weights(wsession, "models/sharded")
    assert len(index.files) > 2 and "model-00001" in index.files[0]
    model = remotorch.from_pretrained(transformers.GPT2LMHeadModel, "models/sharded", session=wsession)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, local(roots, "sharded")(IDS).logits)


def test_auto_classes_and_torch_compile_on_top(roots, wsession):
    model = remotorch.from_pretrained(transformers.AutoModelForCausalLM, "models/gpt2", session=wsession)
    assert type(model) is transformers.GPT2LMHeadModel
    compiled = torch.compile(model, backend="remotorch", options={"session": wsession, "fallback": "raise"})
    again = remotorch.compile(model, session=wsession, fallback="raise")
    want = local(roots, "gpt2")
    with torch.no_grad():
        assert torch.equal(compiled(IDS).logits, want(IDS).logits)
        assert torch.equal(again(IDS).logits, want(IDS).logits)
    assert wsession.stats()["fallbacks"] == 0


def test_dtype_follows_transformers(roots, wsession):
    half = remotorch.from_pretrained(transformers.GPT2LMHeadModel, "models/gpt2", session=wsession,
                                     torch_dtype=torch.bfloat16)
    want = transformers.GPT2LMHeadModel.from_pretrained(roots[0] / "gpt2", dtype=torch.bfloat16)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        assert torch.equal(half(IDS).logits, want(IDS).logits)


# ------------------------------------------------------------------ training, saving, resuming
@pytest.mark.parametrize("name", sorted(MODELS))
def test_three_adamw_steps_equal_local_and_the_checkpoint_loads_in_transformers(roots, wsession, name):
    cls = MODELS[name][0]
    want_model = local(roots, name).train()
    want = train(want_model, torch.optim.AdamW(want_model.parameters(), lr=1e-2), 3)
    model = remotorch.from_pretrained(cls, f"models/{name}", session=wsession).train()
    opt = RemoteOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-2)
    assert train(model, opt, 3) == want
    before = wsession.stats()
    files = remotorch.save(model, f"ck/{name}-3", session=wsession)
    assert files == ["model.safetensors", "config.json", "generation_config.json"]
    after = wsession.stats()
    assert after["values_fetched"] == before["values_fetched"] == 0
    assert after["bytes_received"] - before["bytes_received"] < 1024  # no tensor bytes come back
    same_state(cls.from_pretrained(roots[1] / f"{name}-3"), want_model)  # bit-equal, read by transformers


def test_a_resumed_run_equals_an_uninterrupted_one_and_moves_no_tensor_to_the_client(roots, worker, session_for):
    want_model = local(roots, "gpt2").train()
    want = train(want_model, torch.optim.AdamW(want_model.parameters(), lr=1e-2, weight_decay=0.1), 6)
    first = session_for(worker)
    model = remotorch.from_pretrained(transformers.GPT2LMHeadModel, "models/gpt2", session=first).train()
    opt = RemoteOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-2, weight_decay=0.1)
    assert train(model, opt, 3) == want[:3]
    remotorch.save(model, "ck/resume")
    remotorch.save(opt, "ck/resume/optimizer.safetensors")
    assert first.stats()["values_fetched"] == 0
    first.close()
    second = session_for(worker)  # a new session: the worker forgot the first's values
    model = remotorch.from_pretrained(transformers.GPT2LMHeadModel, "ck/resume", session=second).train()
    opt = RemoteOptimizer(torch.optim.AdamW, model.parameters(), lr=1.0)  # the checkpoint's lr wins
    remotorch.load_state_dict(opt, "ck/resume/optimizer.safetensors")
    assert opt.param_groups[0]["lr"] == 1e-2 and opt.param_groups[0]["weight_decay"] == 0.1
    assert train(model, opt, 3) == want[3:]
    assert second.stats()["values_fetched"] == 0


def test_clip_grad_norm_and_an_ema_of_worker_weights(roots, wsession):
    want_model = local(roots, "gpt2").train()
    want_opt = torch.optim.AdamW(want_model.parameters(), lr=1e-2)
    model = remotorch.from_pretrained(transformers.GPT2LMHeadModel, "models/gpt2", session=wsession).train()
    opt = RemoteOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-2)
    for m_, o in ((want_model, want_opt), (model, opt)):
        m_(IDS, labels=IDS).loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(m_.parameters(), 0.5)
        o.step()
        o.zero_grad()
        if m_ is want_model:
            want_norm = norm
    assert torch.equal(norm, want_norm)
    remotorch.save(model, "ck/clipped")
    same_state(local(roots, "clipped", "ck"), want_model)


def test_eager_calls_on_loaded_weights_run_on_the_worker(roots, wsession):
    """Code between the compiled parts works on the weights where they live: a norm to log, an EMA
    of the parameters, an initialisation written into one; only what Python reads comes back."""
    want = local(roots, "gpt2")
    model = remotorch.from_pretrained(transformers.GPT2LMHeadModel, "models/gpt2", session=wsession)
    before = wsession.stats()
    with torch.no_grad():
        ema = {k: p.detach().clone() for k, p in model.named_parameters()}  # on the worker, as the weights
        want_ema = {k: p.detach().clone() for k, p in want.named_parameters()}
        for (k, p), (_, q) in zip(model.named_parameters(), want.named_parameters()):
            ema[k].mul_(0.9).add_(p * p, alpha=0.1)
            want_ema[k].mul_(0.9).add_(q * q, alpha=0.1)
        norm = torch.stack([e.float().norm() for e in ema.values()]).sum()
        want_norm = torch.stack([e.float().norm() for e in want_ema.values()]).sum()
        model.lm_head.weight[:3].zero_()  # (tied: the embedding's rows too, as in torch)
        want.lm_head.weight[:3].zero_()
    assert norm.item() == want_norm.item()
    after = wsession.stats()
    assert after["eager_ops"] - before["eager_ops"] > 3 * len(ema)
    assert after["values_fetched"] == before["values_fetched"]  # the weights never came here
    assert after["bytes_received"] - before["bytes_received"] < 64 << 10, after["bytes_received"]
    assert [k for k, e in ema.items() if remote_ref(e) is None and e.nbytes >= wsession.keep_min_bytes] == []
    for k, e in ema.items():
        assert torch.equal(e, want_ema[k]), k
    same_state(model, want)


def test_state_dict_and_pull_bring_values_home_only_when_asked(roots, wsession):
    model = remotorch.from_pretrained(transformers.GPT2LMHeadModel, "models/gpt2", session=wsession)
    sd = model.state_dict()
    assert wsession.stats()["values_fetched"] == 0 and all(remote_ref(t) is not None for t in sd.values())
    want = local(roots, "gpt2").state_dict()
    assert torch.equal(sd["transformer.wte.weight"], want["transformer.wte.weight"])  # a read: fetched
    assert wsession.stats()["values_fetched"] >= 1
    wsession.pull(model)
    assert all(remote_ref(t) is None for t in model.state_dict().values())
    same_state(model, local(roots, "gpt2"))


def test_closing_the_session_leaves_loaded_weights_on_the_worker(roots, worker, session_for):
    s = session_for(worker)
    model = remotorch.from_pretrained(transformers.GPT2LMHeadModel, "models/gpt2", session=s)
    received = s.stats()["bytes_received"]
    s.close()
    assert s.stats()["values_fetched"] == 0
    assert s.stats()["bytes_received"] - received < 256  # the detach's answer; no weights fetched at close
    with pytest.raises(errors.RemoteError):
        model.transformer.wte.weight.sum().item()


# ------------------------------------------------------------------ any module, strictly
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)
        self.register_buffer("scale", torch.full((4,), 2.0))
        self.register_buffer("table", torch.arange(4.0), persistent=False)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))) * self.scale + self.table


@pytest.fixture(scope="module")
def net_file(roots):
    torch.manual_seed(3)
    net = Net()
    net.scale.fill_(3.0)
    from safetensors.torch import save_file

    save_file(net.state_dict(), str(roots[0] / "net.safetensors"))
    bad = {**net.state_dict(), "extra": torch.zeros(2)}
    save_file(bad, str(roots[0] / "net-extra.safetensors"))
    save_file({k: v for k, v in net.state_dict().items() if k != "b.bias"}, str(roots[0] / "net-less.safetensors"))
    save_file({**net.state_dict(), "b.weight": torch.zeros(5, 16)}, str(roots[0] / "net-shape.safetensors"))
    return net


def test_load_state_dict_fills_a_module_built_empty(wsession, net_file):
    with remotorch.init_empty_weights():
        net = Net()
    assert net.a.weight.device.type == "meta" and net.table.device.type == "cpu"
    assert remotorch.load_state_dict(net, "models/net.safetensors", session=wsession) == ([], [])
    x = torch.randn(3, 8)
    compiled = remotorch.compile(net, session=wsession, fallback="raise")
    with torch.no_grad():
        assert torch.equal(compiled(x), net_file(x))


@pytest.mark.parametrize("file,words", [("net-extra", "the files have 1 key(s) the model lacks: extra"),
                                        ("net-less", "the files lack 1 key(s) the model has: b.bias"),
                                        ("net-shape", "b.weight: [5, 16] in the files, [4, 16] in the model")])
def test_mismatched_keys_and_shapes_are_named_before_any_data_is_read(wsession, net_file, file, words):
    with remotorch.init_empty_weights():
        net = Net()
    sent = wsession.stats()["messages_sent"]
    with pytest.raises(errors.CheckpointError, match=re.escape(words)):
        remotorch.load_state_dict(net, f"models/{file}.safetensors", session=wsession)
    assert wsession.stats()["messages_sent"] - sent <= 2  # (attach and) OpenWeights: no LoadWeights
    if file == "net-extra":  # strict=False loads what matches and says what did not
        assert remotorch.load_state_dict(net, f"models/{file}.safetensors", session=wsession,
                                         strict=False) == ([], ["extra"])
    assert_still_serves(wsession, name="weights")


def test_a_session_over_its_quota_is_refused_before_anything_is_read(roots, start_server, session_for):
    weights, _ = roots
    srv = start_server(name="small", extra_args=("--weights", f"models={weights}", "--memory-quota", "64K"))
    s = session_for(srv)
    with pytest.raises(errors.QuotaExceededError):
        remotorch.from_pretrained(transformers.GPT2LMHeadModel, "models/gpt2", session=s)
    with remotorch.init_empty_weights():
        net = Net()
    remotorch.load_state_dict(net, "models/net.safetensors", session=s)  # small: fits
    assert_still_serves(s, name="small", server=srv)


def test_a_fresh_process_with_no_session_uses_the_embedded_worker_and_its_roots(roots):
    """As a user would start: REMOTORCH_WEIGHTS names the folder, no session is given, nothing else set."""
    import subprocess
    import sys

    from conftest import clean_env

    code = ("import torch, transformers, remotorch\n"
            "m = remotorch.from_pretrained(transformers.GPT2LMHeadModel, 'models/gpt2')\n"
            "ids = torch.arange(2, 12).reshape(1, 10)\n"
            "with torch.no_grad():\n"
            "    total = m(ids).logits.sum().item()\n"
            "from remotorch.client.remote import remote_ref\n"
            "print(total, all(remote_ref(p) is not None for p in m.parameters()))\n")
    out = subprocess.run([sys.executable, "-c", code], env=clean_env(REMOTORCH_WEIGHTS=f"models={roots[0]}"),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    total, stand_ins = out.stdout.split()
    with torch.no_grad():
        want = local(roots, "gpt2")(torch.arange(2, 12).reshape(1, 10)).logits.sum().item()
    # (the embedded worker runs its kernels on half the cores, as it shares the machine: sums may round apart)
    assert float(total) == pytest.approx(want, rel=1e-5) and stand_ins == "True"
