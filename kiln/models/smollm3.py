"""SmolLM3 family: Hugging Face's SmolLM3 (3B) — Llama's layers, some of them without RoPE ("NoPE"):
- `no_rope_layers`: per layer, 1 where the layer rotates q and k, 0 where it does not; a config
  without the list takes every `no_rope_layer_interval`-th layer (4: layers 3, 7, 11, …) as NoPE;
- tied embeddings and grouped-query attention by default (transformers' SmolLM3Config: RoPE base
  2,000,000 when config.json leaves it out); YaRN for contexts past the pretraining one.

TVM's paged KV cache applies its RoPE to every layer, so the cache applies none and the model rotates
q and k of the RoPE layers itself (`rotate_qkv`, with YaRN's frequencies and attention factor computed
as transformers computes them); a NoPE layer's keys go into the cache as they come.

Refused, each in one line: rope scalings other than YaRN (none is published for SmolLM3; the cache's
llama3 kernel is not the model's), and a sliding window that binds (`layer_types` windowed layers,
which SmolLM3 derives for its NoPE layers under `use_sliding_window`): published SmolLM3 configs have
none, and the cache's windowed layers would need Gemma 3's prefill limits (models/gemma3.py).

llama.cpp converts SmolLM3 as a Llama (Q and K rows permuted) under the name "smollm3" and writes no
key for the NoPE layers: its loader runs every 4th layer without RoPE. Kiln reads such a GGUF so.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache

from kiln.errors import KilnError

from . import llama
from .config_reader import ConfigReader
from .decoder import MODEL_ROPES, Architecture, rope_inv_freq, rope_type, rotate_qkv
from .gguf import LLAMA_LAYER_TENSORS, GGUFMapping, GGUFTensors, Metadata
from .llama import (
    IGNORED_TENSORS,
    LlamaAttention,
    LlamaConfig,
    LlamaForCausalLM,
    fused_sources,
    llama_layers_config,
    undo_rope_permutation,
)

# transformers' SmolLM3Config defaults, for configs that leave fields out.
DEFAULTS = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=11008,
    num_hidden_layers=36,
    num_attention_heads=16,
    num_key_value_heads=4,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    rope_theta=2_000_000.0,
    tie_word_embeddings=True,
)
LAYER_KINDS = ("full_attention", "sliding_attention")
# llama.cpp's smollm3 loader: every 4th layer without RoPE (no GGUF key says otherwise).
LLAMA_CPP_NO_ROPE_INTERVAL = 4


@dataclass
class SmolLM3Config(LlamaConfig):
    rope_layers: tuple[bool, ...] = ()  # per layer: whether it rotates q and k


def rope_layers(read: ConfigReader, num_layers: int) -> tuple[bool, ...]:
    """transformers' SmolLM3Config: `no_rope_layers` (1: RoPE, 0: none; at least one per layer),
    else every `no_rope_layer_interval`-th layer without."""
    interval = read.get("no_rope_layer_interval", int, 4)
    flags = read.get("no_rope_layers", list, None)
    if flags is None:
        return tuple((i + 1) % interval != 0 for i in range(num_layers))
    if len(flags) < num_layers or any(isinstance(f, bool) or f not in (0, 1) for f in flags):
        raise KilnError(
            f"config.json no_rope_layers should hold 1 (RoPE) or 0 (no RoPE) for each of the {num_layers} layers",
            read.path,
        )
    return tuple(flags[i] == 1 for i in range(num_layers))


def refuse_binding_window(read: ConfigReader, rope: tuple[bool, ...], context: int) -> None:
    """transformers windows the layers `layer_types` calls "sliding_attention" (by default the NoPE
    layers, under `use_sliding_window` with a `sliding_window`)."""
    window = read.get("sliding_window", int, None)
    use_window = read.get("use_sliding_window", bool, False)
    kinds = read.get("layer_types", list, None)
    if kinds is None:
        kinds = [LAYER_KINDS[use_window and window is not None and not has_rope] for has_rope in rope]
    if len(kinds) != len(rope) or not set(kinds) <= set(LAYER_KINDS):
        raise KilnError(
            f"config.json layer_types should name {len(rope)} layers, each one of {', '.join(LAYER_KINDS)}", read.path
        )
    windowed = [i for i, kind in enumerate(kinds) if kind == "sliding_attention"]
    if windowed and window is not None and window < context:
        raise KilnError(
            f"config.json sliding_window {window} binds on layers {windowed} within the context window ({context}), "
            f"and Kiln's smollm3 has no sliding-window layers; build with --context-window-size {window} or less",
            read.path,
        )


def parse_config(hf_config: dict, path: Path, overrides: dict[str, int]) -> SmolLM3Config:
    read = ConfigReader({**DEFAULTS, **hf_config}, path)
    fields = read.decoder_fields(overrides)
    scaling = (fields["rope_scaling"] or {}).get("rope_type")
    if scaling not in (None, "yarn"):
        raise KilnError(
            f"config.json rope scaling '{scaling}' is not supported for smollm3 (supported: default, yarn)", path
        )
    rope = rope_layers(read, fields["num_hidden_layers"])
    refuse_binding_window(read, rope, fields["context_window_size"])
    attention_bias = read.get("attention_bias", bool, False)
    return llama_layers_config(
        read,
        {**fields, "tie_word_embeddings": read.get("tie_word_embeddings", bool, True)},
        SmolLM3Config,
        qkv_bias=attention_bias,
        o_proj_bias=attention_bias,
        mlp_bias=read.get("mlp_bias", bool, False),
        family_applies_rope=True,
        rope_layers=rope,
    )


def rope_frequencies(config: SmolLM3Config) -> tuple[np.ndarray, float]:
    """The RoPE layers' frequencies and cos/sin factor: YaRN's (`MODEL_ROPES`) or the default's."""
    frequencies = MODEL_ROPES.get(rope_type(config))
    return frequencies(config) if frequencies else (rope_inv_freq(config.rope_theta, config.head_dim), 1.0)


class SmolLM3Attention(LlamaAttention):
    def __init__(self, config: SmolLM3Config, dtype: str):
        super().__init__(config, dtype)
        self.inv_freq, self.attention_factor = rope_frequencies(config)

    def rope(self, qkv: nn.Tensor, kv_cache: PagedKVCache, layer_id: int) -> nn.Tensor:
        if not self.config.rope_layers[layer_id]:
            return qkv  # a NoPE layer: q and k as projected
        return rotate_qkv(qkv, kv_cache, self.config, self.inv_freq, self.attention_factor)


class SmolLM3ForCausalLM(LlamaForCausalLM):
    attention_class = SmolLM3Attention


def gguf_config(metadata: Metadata, tensors: GGUFTensors) -> dict:
    """llama.cpp's SmolLM3Model converter: Llama's hyperparameters; the NoPE layers as its loader runs them."""
    config = llama.gguf_config(metadata, tensors, "smollm3", ("SmolLM3ForCausalLM",))
    return {**config, "no_rope_layer_interval": LLAMA_CPP_NO_ROPE_INTERVAL}


ARCHITECTURE = Architecture(
    model_type="smollm3",
    parse_config=parse_config,
    build=SmolLM3ForCausalLM,
    fused_sources=fused_sources,
    ignored_tensors=IGNORED_TENSORS,
    gguf=GGUFMapping(
        architecture="smollm3",
        config=gguf_config,
        layer_tensors=LLAMA_LAYER_TENSORS,
        config_tensors=("rope_freqs.weight",),
        restore_layout=undo_rope_permutation,
    ),
)
