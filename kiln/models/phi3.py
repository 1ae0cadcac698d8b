"""Phi-3 family: Phi-3-mini (4k, 128k), Phi-3.5-mini, Phi-4-mini — Llama's layers without biases;
what differs is in the checkpoint and its config:

- The projections are already fused (`qkv_proj`, `gate_up_proj` with the gate first), in Kiln's
  own layout: the weights map one to one.
- RoPE is LongRoPE (`rope_scaling` type "longrope", "su" in the first configs): each frequency is
  divided by a per-dimension factor and cos/sin scaled by sqrt(1 + ln(max/original) / ln(original)).
  Phi-3 uses the short factors up to `original_max_position_embeddings` and the long ones beyond;
  Kiln applies the short ones in the model (kiln/models/decoder.py `apply_rope`), so it refuses a longer
  context window.
- `sliding_window` (2047 in Phi-3-mini-4k) binds once the context window is longer: then the KV
  cache keeps the last window of tokens (kiln/models/decoder.py `ConfigReader.sliding_window`).
- `partial_rotary_factor` (Phi-4-mini: 0.75) rotates the first part of each head only.

The default context window is the original one under LongRoPE, at most 4096.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kiln.errors import KilnError

from .config_reader import ConfigReader
from .decoder import Architecture
from .gguf import GGUFMapping, GGUFTensors, Metadata, decoder_hparams
from .llama import LlamaConfig, LlamaForCausalLM


def longrope_named(hf_config: dict) -> dict:
    """The first Phi-3 configs call LongRoPE "su"; transformers reads it as "longrope"."""
    scaling = hf_config.get("rope_scaling")
    if not isinstance(scaling, dict) or scaling.get("rope_type", scaling.get("type")) != "su":
        return hf_config
    return {**hf_config, "rope_scaling": {**scaling, "rope_type": "longrope"}}


def parse_config(hf_config: dict, path: Path, overrides: dict[str, int]) -> LlamaConfig:
    read = ConfigReader(longrope_named(hf_config), path)
    read.expect("hidden_act", ("silu",), "silu")
    _, scaling = read.rope()
    if scaling and scaling["rope_type"] != "longrope":
        raise KilnError(
            f"config.json rope scaling '{scaling['rope_type']}' is not Phi-3's; Kiln's phi3 supports longrope", path
        )
    longest = read.get("max_position_embeddings", int, 4096)
    original = read.get(
        "original_max_position_embeddings", int, (scaling or {}).get("original_max_position_embeddings", longest)
    )
    fields = read.sliding_window(
        read.decoder_fields(overrides, max_context=min(4096, original) if scaling else 4096, partial_rotary=True)
    )
    context = fields["context_window_size"]
    if scaling and context > original:
        raise KilnError(
            f"a context window of {context} is longer than config.json's "
            f"original_max_position_embeddings ({original}): beyond it Phi-3 switches to the "
            f"long RoPE factors, which Kiln does not apply; build with --context-window-size {original} "
            "or less",
            path,
        )

    # transformers 5 keeps partial_rotary_factor in rope_parameters, earlier versions at the top level
    rope_parameters = hf_config.get("rope_parameters") or {}
    partial = read.get("partial_rotary_factor", float, rope_parameters.get("partial_rotary_factor", 1.0))
    rotary_dim = int(fields["head_dim"] * partial)
    if partial > 1 or rotary_dim % 2:
        raise KilnError(
            f"config.json partial_rotary_factor {partial} should rotate an even number (at most "
            f"all) of the {fields['head_dim']} head dimensions",
            path,
        )
    if scaling:
        if len(scaling.get("short_factor") or ()) != rotary_dim // 2:
            raise KilnError(
                f"config.json rope scaling short_factor should hold {rotary_dim // 2} factors "
                "(one per rotated pair of head dimensions)",
                path,
            )
        # `factor`, when given, is transformers' name for max / original positions.
        scaling = {
            **scaling,
            "original_max_position_embeddings": original,
            "max_position_embeddings": original * scaling["factor"] if "factor" in scaling else longest,
        }
    return LlamaConfig(
        **{**fields, "rope_scaling": scaling},
        rotary_dim=rotary_dim,
        intermediate_size=read.get("intermediate_size", int),
        rms_norm_eps=read.get("rms_norm_eps", float, 1e-5),
        extra=read.unused(),
    )


def gguf_config(metadata: Metadata, tensors: GGUFTensors) -> dict:
    """llama.cpp's Phi3MiniModel converter keeps the original context as rope metadata, LongRoPE's
    factors as two tensors with the attention factor beside them, and 0 for no sliding window."""
    config = decoder_hparams(metadata, tensors, "phi3", ["Phi3ForCausalLM"], partial_rotary=True)
    config["original_max_position_embeddings"] = metadata.get(
        "phi3.rope.scaling.original_context_length", config["max_position_embeddings"]
    )
    config["sliding_window"] = metadata.get("phi3.attention.sliding_window") or None
    if "rope_factors_short.weight" in tensors.names:
        config["rope_scaling"] = {
            "rope_type": "longrope",
            "short_factor": tensors.read("rope_factors_short.weight").astype(np.float64).tolist(),
            "long_factor": tensors.read("rope_factors_long.weight").astype(np.float64).tolist(),
            "attention_factor": metadata.get("phi3.rope.scaling.attn_factor"),
        }
    return config


ARCHITECTURE = Architecture(
    model_type="phi3",
    parse_config=parse_config,
    build=LlamaForCausalLM,
    fused_sources=lambda config: {},  # the checkpoint's projections are fused already
    gguf=GGUFMapping(
        architecture="phi3",
        config=gguf_config,
        layer_tensors={
            "attn_norm": "input_layernorm",
            "attn_qkv": "self_attn.qkv_proj",
            "attn_output": "self_attn.o_proj",
            "ffn_norm": "post_attention_layernorm",
            "ffn_up": "mlp.gate_up_proj",
            "ffn_down": "mlp.down_proj",
        },
        config_tensors=("rope_factors_long.weight", "rope_factors_short.weight"),
    ),
)
