"""Real models from ``transformers`` and ``diffusers``, built from tiny configs, for the conformance suite.

Each :class:`ModelSpec` builds one architecture with one or two layers and
widths of 16 to 64 (nothing is downloaded), seeded and with every dropout,
layer drop and drop path at zero, so that a run is deterministic and the same
code gives the same numbers under any backend. It also makes the model's
inputs: a batch of two whose first row is left-padded, labels for training,
and what ``generate`` takes where the model generates.

The list follows the models torch tests ``torch.compile`` against
(``benchmarks/dynamo/huggingface_models_list.txt`` in PyTorch), plus the
decoder families people run today, vision, audio, mixture-of-experts models
(their experts run ``transformers``' custom operator: the worker needs
``--allow-ops transformers``) and a diffusion UNet.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

VOCAB, BATCH, SEQ, PAD = 128, 2, 8, 0

#: families, in the order docs/models.md lists them
FAMILIES = ("encoder", "decoder", "encoder-decoder", "moe", "vision", "audio", "diffusion")


@dataclass(frozen=True)
class ModelSpec:
    """One architecture: how to build it and its inputs, and which modes apply to it."""

    name: str  # the class, e.g. "GPT2LMHeadModel"
    family: str
    build: Callable[[], torch.nn.Module]
    inputs: Callable[[], dict]  # forward's keyword arguments
    labels: Callable[[dict], dict] | None = None  # extra training arguments (labels=…); None: a synthetic loss
    generate: Callable[[dict], dict] | None = None  # generate()'s arguments, from the inputs
    allow_ops: tuple[str, ...] = ()  # custom-operator namespaces the worker must allow

    @property
    def modes(self) -> tuple[str, ...]:
        return ("forward", "generate", "train") if self.generate else ("forward", "train")


# --------------------------------------------------------------------------- helpers
def _quiet(config):
    """No dropout, layer drop or drop path anywhere (the config's float fields that name one)."""
    for key, value in list(vars(config).items()):
        if isinstance(value, float) and any(w in key for w in ("dropout", "pdrop", "drop_path", "layerdrop")):
            setattr(config, key, 0.0)
    return config


def _hf(model_class: str, config_class: str, **config) -> Callable[[], torch.nn.Module]:
    def build():
        import transformers

        cfg = _quiet(getattr(transformers, config_class)(**config))
        torch.manual_seed(0)
        model = getattr(transformers, model_class)(cfg)
        for m in model.modules():  # dropout modules made from other settings
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
        return model
    return build


def _ids(seq: int = SEQ, pad: int = 2) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (BATCH, seq), generator=g)
    mask = torch.ones_like(ids)
    ids[0, :pad], mask[0, :pad] = PAD, 0  # row 0 left-padded
    return {"input_ids": ids, "attention_mask": mask}


def _text_labels(inputs: dict) -> dict:
    return {"labels": inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)}


def _seq2seq_inputs() -> dict:
    inputs = _ids()
    g = torch.Generator().manual_seed(2)
    inputs["decoder_input_ids"] = torch.randint(3, VOCAB, (BATCH, 5), generator=g)
    return inputs


def _seq2seq_labels(inputs: dict) -> dict:
    return {"labels": inputs["decoder_input_ids"]}


def _generate_text(inputs: dict) -> dict:
    return {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}


def _generate_seq2seq(inputs: dict) -> dict:
    return {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}


def _class_labels(classes: int = 3) -> Callable[[dict], dict]:
    def labels(inputs: dict) -> dict:
        return {"labels": torch.arange(BATCH) % classes}
    return labels


def _pixels(size: int = 32, channels: int = 3) -> Callable[[], dict]:
    def inputs() -> dict:
        g = torch.Generator().manual_seed(3)
        return {"pixel_values": torch.randn(BATCH, channels, size, size, generator=g)}
    return inputs


IDS = dict(vocab_size=VOCAB, pad_token_id=PAD, bos_token_id=1, eos_token_id=2)
BERTISH = dict(IDS, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
               max_position_embeddings=64)
LLAMAISH = dict(IDS, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=64, max_position_embeddings=64)
BARTISH = dict(IDS, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
               decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
               decoder_start_token_id=2)
VIT = dict(image_size=32, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=1,
           num_attention_heads=2, intermediate_size=64, num_labels=3)


def _encoder(name: str, config: str, **cfg) -> ModelSpec:
    return ModelSpec(name, "encoder", _hf(name, config, **cfg), _ids, _text_labels)


def _decoder(name: str, config: str, family: str = "decoder", allow_ops: tuple[str, ...] = (), **cfg) -> ModelSpec:
    return ModelSpec(name, family, _hf(name, config, **cfg), _ids, _text_labels, _generate_text, allow_ops)


def _seq2seq(name: str, config: str, **cfg) -> ModelSpec:
    return ModelSpec(name, "encoder-decoder", _hf(name, config, **cfg), _seq2seq_inputs, _seq2seq_labels,
                     _generate_seq2seq)


def _vision(name: str, config: str, **cfg) -> ModelSpec:
    return ModelSpec(name, "vision", _hf(name, config, **cfg), _pixels(), _class_labels())


# --------------------------------------------------------------------------- audio and diffusion
def _whisper_inputs() -> dict:
    g = torch.Generator().manual_seed(4)
    return {"input_features": torch.randn(BATCH, 16, 64, generator=g),
            "decoder_input_ids": torch.randint(3, VOCAB, (BATCH, 5), generator=g)}


def _whisper_generate(inputs: dict) -> dict:
    return {"input_features": inputs["input_features"]}


def _waveform() -> dict:
    g = torch.Generator().manual_seed(5)
    return {"input_values": torch.randn(BATCH, 800, generator=g)}


def _ctc_labels(inputs: dict) -> dict:
    g = torch.Generator().manual_seed(6)
    return {"labels": torch.randint(3, 30, (BATCH, 4), generator=g)}


WAV2VEC2 = dict(vocab_size=32, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                conv_dim=(16, 16), conv_stride=(5, 4), conv_kernel=(10, 8), num_conv_pos_embeddings=16,
                num_conv_pos_embedding_groups=2, pad_token_id=0, ctc_loss_reduction="mean")


def _unet() -> torch.nn.Module:
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    return UNet2DConditionModel(sample_size=16, in_channels=4, out_channels=4, layers_per_block=1,
                                block_out_channels=(32, 64), norm_num_groups=8, cross_attention_dim=32,
                                attention_head_dim=8,
                                down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))


def _unet_inputs() -> dict:
    g = torch.Generator().manual_seed(7)
    return {"sample": torch.randn(BATCH, 4, 16, 16, generator=g), "timestep": torch.tensor([10, 500]),
            "encoder_hidden_states": torch.randn(BATCH, 6, 32, generator=g)}


def _vae() -> torch.nn.Module:
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    return AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(16, 32),
                         layers_per_block=1, norm_num_groups=8,
                         down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
                         up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"))


# --------------------------------------------------------------------------- the zoo
def specs() -> list[ModelSpec]:
    """Every model of the suite (built lazily: nothing here imports transformers)."""
    moe = ("transformers",)
    return [
        # encoders
        _encoder("AlbertForMaskedLM", "AlbertConfig", **BERTISH, embedding_size=16),
        _encoder("BertForMaskedLM", "BertConfig", **BERTISH),
        _encoder("CamembertForMaskedLM", "CamembertConfig", **BERTISH),
        _encoder("ConvBertForMaskedLM", "ConvBertConfig", **BERTISH, embedding_size=32),
        _encoder("DebertaV2ForMaskedLM", "DebertaV2Config", **BERTISH),
        _encoder("DistilBertForMaskedLM", "DistilBertConfig", vocab_size=VOCAB, pad_token_id=PAD, dim=32,
                 n_layers=1, n_heads=2, hidden_dim=64, max_position_embeddings=64),
        _encoder("ElectraForMaskedLM", "ElectraConfig", **BERTISH, embedding_size=32),
        _encoder("FNetForMaskedLM", "FNetConfig", **{k: v for k, v in BERTISH.items() if k != "num_attention_heads"}),
        _encoder("LongformerForMaskedLM", "LongformerConfig", **BERTISH, attention_window=4),
        _encoder("MegatronBertForMaskedLM", "MegatronBertConfig", **BERTISH),
        _encoder("MobileBertForMaskedLM", "MobileBertConfig", **BERTISH, embedding_size=16,
                 intra_bottleneck_size=16, num_feedforward_networks=1),
        _encoder("RobertaForMaskedLM", "RobertaConfig", **BERTISH),
        _encoder("XLMRobertaForMaskedLM", "XLMRobertaConfig", **BERTISH),
        ModelSpec("LayoutLMForMaskedLM", "encoder", _hf("LayoutLMForMaskedLM", "LayoutLMConfig", **BERTISH),
                  lambda: dict(_ids(), bbox=torch.tensor([0, 0, 10, 10]).repeat(BATCH, SEQ, 1)), _text_labels),
        ModelSpec("XLNetLMHeadModel", "encoder", _hf("XLNetLMHeadModel", "XLNetConfig", **IDS, d_model=32,
                                                      n_layer=1, n_head=2, d_inner=64), _ids, _text_labels),
        # decoders
        _decoder("GPT2LMHeadModel", "GPT2Config", **IDS, n_embd=32, n_layer=1, n_head=2, n_positions=64),
        _decoder("GPTNeoForCausalLM", "GPTNeoConfig", **IDS, hidden_size=32, num_layers=1, num_heads=2,
                 attention_types=[[["global"], 1]], max_position_embeddings=64),
        _decoder("GPTJForCausalLM", "GPTJConfig", **IDS, n_embd=32, n_layer=1, n_head=2, rotary_dim=8,
                 n_positions=64),
        _decoder("GPTNeoXForCausalLM", "GPTNeoXConfig", **BERTISH),
        _decoder("OPTForCausalLM", "OPTConfig", **IDS, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                 ffn_dim=64, max_position_embeddings=64, word_embed_proj_dim=32),
        _decoder("XGLMForCausalLM", "XGLMConfig", **IDS, d_model=32, num_layers=1, attention_heads=2, ffn_dim=64,
                 max_position_embeddings=64),
        _decoder("BloomForCausalLM", "BloomConfig", **IDS, hidden_size=32, n_layer=1, n_head=2),
        _decoder("FalconForCausalLM", "FalconConfig", **IDS, hidden_size=32, num_hidden_layers=1,
                 num_attention_heads=2, new_decoder_architecture=True, num_kv_heads=2),
        _decoder("CodeGenForCausalLM", "CodeGenConfig", **IDS, n_embd=32, n_layer=1, n_head=2, rotary_dim=8,
                 n_positions=64),
        _decoder("LlamaForCausalLM", "LlamaConfig", **LLAMAISH),
        _decoder("MistralForCausalLM", "MistralConfig", **LLAMAISH, sliding_window=4),
        _decoder("Qwen2ForCausalLM", "Qwen2Config", **LLAMAISH),
        _decoder("Qwen3ForCausalLM", "Qwen3Config", **LLAMAISH, head_dim=8),
        _decoder("GemmaForCausalLM", "GemmaConfig", **LLAMAISH, head_dim=8),
        _decoder("Gemma2ForCausalLM", "Gemma2Config", **LLAMAISH, head_dim=8, sliding_window=4),
        _decoder("PhiForCausalLM", "PhiConfig", **LLAMAISH),
        _decoder("Phi3ForCausalLM", "Phi3Config", **LLAMAISH),
        _decoder("StableLmForCausalLM", "StableLmConfig", **LLAMAISH),
        _decoder("Starcoder2ForCausalLM", "Starcoder2Config", **LLAMAISH),
        _decoder("TrOCRForCausalLM", "TrOCRConfig", **IDS, d_model=32, decoder_layers=1, decoder_attention_heads=2,
                 decoder_ffn_dim=64, max_position_embeddings=64),
        _decoder("BartForCausalLM", "BartConfig", **BARTISH),
        _decoder("PegasusForCausalLM", "PegasusConfig", **BARTISH),
        # mixture of experts: the experts run transformers' custom operator
        _decoder("MixtralForCausalLM", "MixtralConfig", "moe", moe, **LLAMAISH, num_local_experts=4,
                 num_experts_per_tok=2),
        _decoder("Qwen2MoeForCausalLM", "Qwen2MoeConfig", "moe", moe, **LLAMAISH, num_experts=4,
                 num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32),
        _decoder("OlmoeForCausalLM", "OlmoeConfig", "moe", moe, **LLAMAISH, num_experts=4, num_experts_per_tok=2),
        # encoder-decoders
        _seq2seq("T5ForConditionalGeneration", "T5Config", **IDS, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                 num_heads=2, decoder_start_token_id=PAD),
        _seq2seq("MT5ForConditionalGeneration", "MT5Config", **IDS, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                 num_heads=2, decoder_start_token_id=PAD),
        _seq2seq("BartForConditionalGeneration", "BartConfig", **BARTISH),
        _seq2seq("MBartForConditionalGeneration", "MBartConfig", **BARTISH),
        _seq2seq("PLBartForConditionalGeneration", "PLBartConfig", **BARTISH),
        _seq2seq("PegasusForConditionalGeneration", "PegasusConfig", **BARTISH),
        _seq2seq("BlenderbotForConditionalGeneration", "BlenderbotConfig", **BARTISH),
        _seq2seq("BlenderbotSmallForConditionalGeneration", "BlenderbotSmallConfig", **BARTISH),
        _seq2seq("M2M100ForConditionalGeneration", "M2M100Config", **BARTISH),
        _seq2seq("MarianMTModel", "MarianConfig", **BARTISH),
        # vision
        _vision("ViTForImageClassification", "ViTConfig", **VIT),
        _vision("DeiTForImageClassification", "DeiTConfig", **VIT),
        _vision("BeitForImageClassification", "BeitConfig", **VIT, vocab_size=VOCAB),
        _vision("SwinForImageClassification", "SwinConfig", image_size=32, patch_size=4, embed_dim=16,
                depths=[1, 1], num_heads=[2, 2], window_size=4, num_labels=3),
        _vision("ConvNextForImageClassification", "ConvNextConfig", num_stages=2, hidden_sizes=[16, 32], depths=[1, 1],
                num_labels=3),
        _vision("ResNetForImageClassification", "ResNetConfig", embedding_size=16, hidden_sizes=[16, 32],
                depths=[1, 1], num_labels=3),
        # audio
        ModelSpec("WhisperForConditionalGeneration", "audio",
                  _hf("WhisperForConditionalGeneration", "WhisperConfig", **IDS, d_model=32, encoder_layers=1,
                      decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                      decoder_ffn_dim=64, num_mel_bins=16, max_source_positions=32, max_target_positions=64,
                      decoder_start_token_id=1, suppress_tokens=[], begin_suppress_tokens=[]),
                  _whisper_inputs, lambda inputs: {"labels": inputs["decoder_input_ids"]}, _whisper_generate),
        ModelSpec("Wav2Vec2ForCTC", "audio", _hf("Wav2Vec2ForCTC", "Wav2Vec2Config", **WAV2VEC2), _waveform,
                  _ctc_labels),
        ModelSpec("HubertForCTC", "audio", _hf("HubertForCTC", "HubertConfig", **WAV2VEC2), _waveform, _ctc_labels),
        # diffusion
        ModelSpec("UNet2DConditionModel", "diffusion", _unet, _unet_inputs),
        ModelSpec("AutoencoderKL", "diffusion", _vae, lambda: {"sample": _pixels(16)()["pixel_values"]}),
    ]


# Run by benchmarks/conformance.py (docs/models.md) but not by the test suite, which keeps 42
# architectures of every family within its time: close relatives of models the suite has
# (RoBERTa's and BERT's derivatives, more Llama-style decoders, BART's family).
EXTENDED = frozenset({
    "CamembertForMaskedLM", "XLMRobertaForMaskedLM", "MegatronBertForMaskedLM", "XGLMForCausalLM",
    "CodeGenForCausalLM", "Qwen2ForCausalLM", "GemmaForCausalLM", "PhiForCausalLM", "StableLmForCausalLM",
    "Starcoder2ForCausalLM", "TrOCRForCausalLM", "BartForCausalLM", "PegasusForCausalLM",
    "MT5ForConditionalGeneration", "MBartForConditionalGeneration", "PLBartForConditionalGeneration",
    "BlenderbotForConditionalGeneration", "BlenderbotSmallForConditionalGeneration", "MarianMTModel",
})


def suite() -> list[ModelSpec]:
    """The models the test suite runs (every family; the rest of the zoo runs in the benchmark)."""
    return [s for s in specs() if s.name not in EXTENDED]


def by_name(name: str) -> ModelSpec:
    for spec in specs():
        if spec.name == name:
            return spec
    raise KeyError(f"no model {name!r} in the conformance zoo")
