"""Profile a Hugging Face transformers model (built from a small config, nothing downloaded).

A BERT encoder of 4 layers runs on eager, inductor and onnxrt on the
session's first worker; the table shows each engine's graph time, the
Python around it, and how far each engine's outputs are from eager PyTorch.

    python examples/profile_transformers.py --out prof/
"""

from __future__ import annotations

import torch
import transformers

import remotorch

from _common import backends_for, finish, parse_args, session_for


def build_model() -> torch.nn.Module:
    config = transformers.BertConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=4,
                                     num_attention_heads=4, intermediate_size=512,
                                     max_position_embeddings=128)
    torch.manual_seed(0)
    return transformers.BertModel(config).eval()


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], default_backends=["eager", "inductor", "onnxrt"])
    model = build_model()

    @remotorch.accelerate
    def encode(ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids).last_hidden_state
    ids = torch.randint(0, 1000, (8, 64), generator=torch.Generator().manual_seed(1))
    with session_for(args) as session, torch.no_grad():
        with remotorch.remote_profile(session, backends=backends_for(args, session),
                                      num_repeats=args.repeats) as prof:
            for _ in range(args.calls):
                out = encode(ids)
        torch.testing.assert_close(out, model(input_ids=ids).last_hidden_state)
        finish(prof.report(), args)


if __name__ == "__main__":
    main()
