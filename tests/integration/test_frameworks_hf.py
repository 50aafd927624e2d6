"""Hugging Face ``Trainer`` with its defaults on a model compiled with ``backend="remotorch"``.

``Trainer`` picks the fused AdamW by default (``optim="adamw_torch_fused"``), whose steps do not bump
the parameters' version counters: before remotorch's optimizer hook, this run trained nothing (the
worker kept the first weights). It must train exactly as ``aot_eager`` does: the same losses, the
same weights.
"""

from __future__ import annotations

import torch

# part of the test extra: a missing one fails here rather than skipping the file
import accelerate  # noqa: F401 (Trainer needs it)
import transformers  # noqa: F401


def _train(backend: str, session, out_dir) -> tuple[list[float], dict]:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, 128, (12, 16), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(str(out_dir / backend), per_device_train_batch_size=4, max_steps=3, logging_steps=1,
                             report_to=[], save_strategy="no", remove_unused_columns=False, use_cpu=True,
                             disable_tqdm=True, seed=0)
    if backend == "remotorch":
        import remotorch
        compiled = remotorch.compile(model, session=session, fallback="raise")
    else:
        compiled = torch.compile(model, backend=backend)
    trainer = Trainer(model=compiled, args=args, train_dataset=data)
    trainer.create_optimizer()
    assert trainer.optimizer.defaults.get("fused") is True  # the case this test is about: the default
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_trainer_defaults_train_as_aot_eager(session, tmp_path):
    want_losses, want = _train("aot_eager", None, tmp_path)
    got_losses, got = _train("remotorch", session, tmp_path)
    assert len(got_losses) == 3 and len(set(got_losses)) > 1, got_losses
    torch.testing.assert_close(got_losses, want_losses)
    torch.testing.assert_close(got, want)
    stats = session.stats()
    assert stats["fallbacks"] == 0
    # it ran on the worker: each of the 3 steps a forward and a backward graph at least, and the fused
    # AdamW's steps on the worker-side optimizer (the weights came back for the comparison above)
    assert stats["remote_calls"] >= 6 and stats["graphs_uploaded"] >= 2, stats
