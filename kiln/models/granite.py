"""Granite family (dense): IBM Granite 3.x language models — Llama's layers with four scalars:
- `embedding_multiplier`: the token embeddings are multiplied by it (12 in Granite 3.x);
- `residual_multiplier`: each sublayer's output (attention, feed-forward) is multiplied by it
  before it is added to the residual stream (0.22);
- `attention_multiplier`: the attention scores' scale before the softmax, in place of
  1/sqrt(head_dim) (1/head_dim in Granite 3.x); TVM's paged KV cache takes it as `sm_scale`;
- `logits_scaling`: the logits are divided by it (8 in Granite 3.x 2B), tied output head or not.

A field left out takes transformers' GraniteConfig default (each scalar 1.0, so no attention
scale but 1). Biases (`attention_bias` on q, k, v and o; `mlp_bias`) as Llama's. The scalars are
applied at run time, not folded into weights: the tied embedding table is also the output head, and
the q4 tests hold the build to transformers on the same quantized source weights.

llama.cpp converts Granite as a Llama under the name "granite" (Q and K rows permuted, as Llama's)
with the scalars as `granite.embedding_scale`, `granite.residual_scale`, `granite.attention.scale`
and `granite.logit_scale`. Its converter leaves out a scalar the config leaves out, and its loader
then takes 1, but 1/sqrt(head_dim) for the attention scale: Kiln reads such a GGUF as llama.cpp runs it.
A GGUF that turns RoPE off (`granite.rope.scaling.finetuned` false, which llama.cpp's loader
honours) is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tvm.relax.frontend import nn
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache

from kiln.errors import KilnError

from . import llama
from .config_reader import ConfigReader
from .decoder import Architecture
from .gguf import LLAMA_LAYER_TENSORS, GGUFMapping, GGUFTensors, Metadata
from .llama import (
    IGNORED_TENSORS,
    LlamaAttention,
    LlamaConfig,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    fused_sources,
    llama_layers_config,
    undo_rope_permutation,
)

# transformers' GraniteConfig defaults, for configs that leave fields out.
DEFAULTS = dict(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    embedding_multiplier=1.0,
    residual_multiplier=1.0,
    attention_multiplier=1.0,
    logits_scaling=1.0,
)


SCALARS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")


@dataclass
class GraniteConfig(LlamaConfig):
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    logits_scaling: float = 1.0


def parse_config(hf_config: dict, path: Path, overrides: dict[str, int]) -> GraniteConfig:
    read = ConfigReader({**DEFAULTS, **hf_config}, path)
    attention_bias = read.get("attention_bias", bool, False)
    return llama_layers_config(
        read,
        read.decoder_fields(overrides),
        GraniteConfig,
        qkv_bias=attention_bias,
        o_proj_bias=attention_bias,
        mlp_bias=read.get("mlp_bias", bool, False),
        **{scalar: read.get(scalar, float) for scalar in SCALARS},
    )


class GraniteAttention(LlamaAttention):
    def __init__(self, config: GraniteConfig, dtype: str):
        super().__init__(config, dtype)
        self.sm_scale = config.attention_multiplier


class GraniteDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: GraniteConfig, dtype: str, attention: type[LlamaAttention]):
        super().__init__(config, dtype, attention)
        self.residual_multiplier = config.residual_multiplier

    def forward(self, x: nn.Tensor, kv_cache: PagedKVCache, layer_id: int) -> nn.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), kv_cache, layer_id) * self.residual_multiplier
        return x + self.mlp(self.post_attention_layernorm(x)) * self.residual_multiplier


class GraniteForCausalLM(LlamaForCausalLM):
    attention_class = GraniteAttention
    layer_class = GraniteDecoderLayer

    def embed_tokens(self, token_ids: nn.Tensor) -> nn.Tensor:
        return super().embed_tokens(token_ids) * self.config.embedding_multiplier

    def logits(self, hidden: nn.Tensor) -> nn.Tensor:
        return super().logits(hidden) / self.config.logits_scaling


def gguf_config(metadata: Metadata, tensors: GGUFTensors) -> dict:
    """llama.cpp's GraniteModel converter: Llama's hyperparameters and the four scalars under llama.cpp's
    names, each written only when set and not 0 (its loader reads 0 as unset)."""
    config = llama.gguf_config(metadata, tensors, "granite", ("GraniteForCausalLM",))
    if not metadata.get("granite.rope.scaling.finetuned", True, bool):
        raise KilnError(
            "GGUF metadata granite.rope.scaling.finetuned is false: a Granite without RoPE is not supported",
            metadata.path,
        )
    return {
        **config,
        "embedding_multiplier": metadata.get("granite.embedding_scale", 0.0, float) or 1.0,
        "residual_multiplier": metadata.get("granite.residual_scale", 0.0, float) or 1.0,
        "attention_multiplier": metadata.get("granite.attention.scale", 0.0, float) or config["head_dim"] ** -0.5,
        "logits_scaling": metadata.get("granite.logit_scale", 0.0, float) or 1.0,
    }


ARCHITECTURE = Architecture(
    model_type="granite",
    parse_config=parse_config,
    build=GraniteForCausalLM,
    fused_sources=fused_sources,
    ignored_tensors=IGNORED_TENSORS,
    gguf=GGUFMapping(
        architecture="granite",
        config=gguf_config,
        layer_tensors=LLAMA_LAYER_TENSORS,
        config_tensors=("rope_freqs.weight",),
        restore_layout=undo_rope_permutation,
    ),
)
