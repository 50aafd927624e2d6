"""The models of the peer benchmark, built alike in every process.

Each model is built from a fixed seed, so every process that calls
:func:`build` holds bit-identical weights without any weights crossing a
socket; every system's outputs are then checked against the local model's.
"""

from __future__ import annotations

import threading

import torch
from torch import nn

SEED = 0
NAMES = ("mlp", "block", "gpt2")

# The HF GPT-2 configuration (randomly initialised; nothing is downloaded).
# 4 layers of width 256 and an 8192-token vocabulary: about 10 ms of forward
# on one core here, so compute dominates the call (the 1 MB of logits is what
# crosses the wire back).
GPT2_CONFIG = dict(n_layer=4, n_embd=256, n_head=4, n_positions=128, vocab_size=8192,
                   bos_token_id=0, eos_token_id=0)
GPT2_TOKENS = 32
BLOCK_SHAPE = (8, 32, 64)  # batch, tokens, width of the transformer block's input
# torch's default generator is process-wide: builds that run at once (torch RPC's
# server threads) would interleave their draws and get other weights
_BUILDING = threading.Lock()


class GPT2Logits(nn.Module):
    """GPT-2 language model returning only its logits (no KV cache): one tensor in, one out."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        self.gpt = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2_CONFIG))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.gpt(input_ids=input_ids, use_cache=False).logits


def build_module(name: str) -> nn.Module:
    """The named model in eval mode, its weights drawn from :data:`SEED` (one build at a time)."""
    with _BUILDING:
        return _build(name)


def _build(name: str) -> nn.Module:
    torch.manual_seed(SEED)
    if name == "mlp":  # the seed MLP: 784-256-10 (remotorch.devtools.models.mlp)
        model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))
    elif name == "block":
        from remotorch.devtools.models import TransformerBlock

        model = TransformerBlock(dim=BLOCK_SHAPE[2], heads=4)
    elif name == "gpt2":
        model = GPT2Logits()
    else:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(NAMES)}")
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def example_input(name: str) -> torch.Tensor:
    """The named model's input: MLP batch 32 x 784, block 8 x 32 x 64, GPT-2 1 x 32 token ids."""
    g = torch.Generator().manual_seed(SEED + 1)
    if name == "mlp":
        return torch.randn(32, 784, generator=g)
    if name == "block":
        return torch.randn(*BLOCK_SHAPE, generator=g)
    if name == "gpt2":
        return torch.randint(0, GPT2_CONFIG["vocab_size"], (1, GPT2_TOKENS), generator=g)
    raise ValueError(f"unknown model {name!r}; known: {', '.join(NAMES)}")


def describe(name: str) -> str:
    """One line saying what the named model is, for the report."""
    c = GPT2_CONFIG
    return {"mlp": "MLP 784-256-10, batch 32 x 784 float32",
            "block": f"transformer block (pre-norm, 4 heads, width {BLOCK_SHAPE[2]}), "
                     f"{BLOCK_SHAPE[0]} x {BLOCK_SHAPE[1]} x {BLOCK_SHAPE[2]} float32",
            "gpt2": f"HF GPT2LMHeadModel (n_layer={c['n_layer']}, n_embd={c['n_embd']}, n_head={c['n_head']}, "
                    f"vocab {c['vocab_size']}), batch 1 x {GPT2_TOKENS} tokens -> logits"}[name]
