"""Gemma 2 family: Gemma 2 2B, 9B and 27B.

Gemma 2 is Gemma 3's text model (models/gemma3.py, whose modules build it) without the RMSNorms
over query and key heads and with one RoPE base for every layer, plus an attention-logit soft-cap:
each score s becomes cap · tanh(s / cap) before the softmax. TVM's attention kernels have no
soft-cap, so Kiln writes it into them (kiln/models/kv_cache/attention_softcap.py); MLC-LLM leaves it out.
Local layers (a window of `sliding_window` tokens) alternate with global ones, local first, and
take gemma3.py's way through TVM's windowed prefill.
"""

from __future__ import annotations

from pathlib import Path

from kiln.errors import KilnError

from .config_reader import ConfigReader
from .decoder import Architecture
from .gemma3 import (
    GEMMA_LAYER_TENSORS,
    LAYER_KINDS,
    Gemma3Config,
    Gemma3ForCausalLM,
    gemma_config,
    norm_weight_minus_one,
    swa_layers,
)
from .gguf import GGUFMapping, GGUFTensors, Metadata, decoder_hparams
from .llama import fused_sources

# transformers' Gemma2Config defaults, for configs that leave fields out.
DEFAULTS = dict(
    vocab_size=256000,
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=26,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    max_position_embeddings=8192,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    query_pre_attn_scalar=256,
    sliding_window=4096,
    attn_logit_softcapping=50.0,
    final_logit_softcapping=30.0,
    tie_word_embeddings=True,
)
GLOBAL_EVERY = 2  # the layer pattern of configs without `layer_types`
SIZE_27B_LAYERS = 46  # Gemma 2 27B scales queries by hidden / heads, not head_dim (llama.cpp's loader)
# llama.cpp's defaults where a GGUF leaves them out.
GGUF_WINDOW, GGUF_ATTENTION_SOFTCAP, GGUF_FINAL_SOFTCAP = 4096, 50.0, 30.0


def parse_config(hf_config: dict, path: Path, overrides: dict[str, int]) -> Gemma3Config:
    """A field set to null keeps null (transformers then applies no soft-cap); one left out takes
    transformers' default."""
    read = ConfigReader({**DEFAULTS, **hf_config}, path)
    theta, scaling = read.rope()
    if scaling is not None:
        raise KilnError(f"config.json RoPE scaling {scaling['rope_type']!r} is not supported for Gemma 2", path)
    ropes = {kind: (theta, 1.0) for kind in LAYER_KINDS}
    return gemma_config(read, overrides, ropes, GLOBAL_EVERY, query_key_norm=False)


def gguf_config(metadata: Metadata, tensors: GGUFTensors) -> dict:
    """llama.cpp's Gemma2Model converter writes the window and both soft-caps and no RoPE base (its
    loader then takes 10k for every layer)."""
    config = decoder_hparams(metadata, tensors, "gemma2", ["Gemma2ForCausalLM"])
    del config["hidden_act"]
    local_base = metadata.get("gemma2.rope.freq_base_swa", config["rope_theta"], float)
    if local_base != config["rope_theta"]:
        raise KilnError(
            f"GGUF metadata gemma2.rope.freq_base_swa {local_base} differs from gemma2.rope.freq_base "
            f"{config['rope_theta']}: Kiln's Gemma 2 has one RoPE base",
            metadata.path,
        )
    layers = config["num_hidden_layers"]
    windowed = swa_layers(metadata, layers, GLOBAL_EVERY)
    return {
        **config,
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": metadata.get("gemma2.attention.sliding_window", GGUF_WINDOW, int),
        "layer_types": ["sliding_attention" if flag else "full_attention" for flag in windowed],
        "query_pre_attn_scalar": config["hidden_size"] // config["num_attention_heads"]
        if layers == SIZE_27B_LAYERS
        else config["head_dim"],
        "attn_logit_softcapping": metadata.get("gemma2.attn_logit_softcapping", GGUF_ATTENTION_SOFTCAP, float),
        "final_logit_softcapping": metadata.get("gemma2.final_logit_softcapping", GGUF_FINAL_SOFTCAP, float),
    }


ARCHITECTURE = Architecture(
    model_type="gemma2",
    parse_config=parse_config,
    build=Gemma3ForCausalLM,
    fused_sources=fused_sources,
    gguf=GGUFMapping(
        architecture="gemma2",
        config=gguf_config,
        layer_tensors=GEMMA_LAYER_TENSORS,
        restore_values=norm_weight_minus_one,
    ),
)
