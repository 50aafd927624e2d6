"""Hugging Face ``transformers`` models from tiny configs (nothing downloaded), remote vs eager."""

from __future__ import annotations

import pytest
import torch

import remotorch

import transformers  # noqa: E402 (part of the test extra: a missing one fails here rather than skipping)


def compile_remote(fn, session, **kwargs):
    return remotorch.compile(fn, session=session, fallback="raise", **kwargs)


def assert_ran_on_the_worker(session) -> None:
    """The model's graphs ran remotely: weights went up, graphs ran there, nothing fell back."""
    stats = session.stats()
    assert stats["fallbacks"] == 0, stats
    assert stats["remote_calls"] >= 1 and stats["graphs_uploaded"] >= 1, stats
    assert stats["tensors_uploaded"] >= 1, stats  # the weights


def _ids(vocab: int = 100, batch: int = 2, seq: int = 12) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(7))


def tiny_bert():
    torch.manual_seed(8)
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64,
                                     max_position_embeddings=64)
    return transformers.BertModel(config).eval()


def tiny_gpt2():
    torch.manual_seed(9)
    config = transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2Model(config).eval()


@pytest.mark.parametrize("build", [tiny_bert, tiny_gpt2], ids=["bert", "gpt2"])
def test_hf_tiny_model(session, build):
    model = build()
    compiled = compile_remote(model, session)
    ids = _ids()
    with torch.no_grad():
        expected = model(input_ids=ids).last_hidden_state
        out = compiled(input_ids=ids).last_hidden_state
    assert torch.equal(out, expected)
    assert_ran_on_the_worker(session)


def test_hf_bert_tiny_with_padding_mask(session):
    model = tiny_bert()
    compiled = compile_remote(model, session)
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0  # the second sequence is padded
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask)
        out = compiled(input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(out.last_hidden_state, expected.last_hidden_state, rtol=0, atol=0)
    torch.testing.assert_close(out.pooler_output, expected.pooler_output, rtol=0, atol=0)
    assert_ran_on_the_worker(session)
