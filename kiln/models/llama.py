"""Llama family: Llama 2/3.x, SmolLM2, TinyLlama — tied or untied embeddings, grouped-query
attention, optional attention and MLP biases.

Weights are fused at conversion time (q/k/v into `qkv_proj`, gate/up into `gate_up_proj`) so a
layer runs four matmuls; RoPE is applied inside TVM's paged KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache

from .config_reader import ConfigReader
from .decoder import Architecture, DecoderConfig, DecoderModel, apply_rope
from .gguf import LLAMA_LAYER_TENSORS, GGUFMapping, GGUFTensors, Metadata, decoder_hparams
from .layers import Embedding, Linear, RMSNorm


@dataclass
class LlamaConfig(DecoderConfig):
    intermediate_size: int = 0
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False


def llama_layers_config(
    read: ConfigReader, fields: dict[str, Any], config_class: type[LlamaConfig] = LlamaConfig, **family_fields
) -> LlamaConfig:
    """The config of a family built from Llama's layers: `fields` from `read.decoder_fields` (as
    the family adjusted them) and the family's own fields (of its `config_class`). The layers
    compute SiLU only."""
    read.expect("hidden_act", ("silu",), "silu")
    return config_class(
        **fields,
        intermediate_size=read.get("intermediate_size", int),
        rms_norm_eps=read.get("rms_norm_eps", float, 1e-6),
        **family_fields,
        extra=read.unused(),
    )


def parse_config(hf_config: dict, path: Path, overrides: dict[str, int]) -> LlamaConfig:
    read = ConfigReader(hf_config, path)
    attention_bias = read.get("attention_bias", bool, False)
    return llama_layers_config(
        read,
        read.decoder_fields(overrides),
        qkv_bias=attention_bias,
        o_proj_bias=attention_bias,
        mlp_bias=read.get("mlp_bias", bool, False),
    )


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig, dtype: str):
        self.config = config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.sm_scale = self.head_dim**-0.5  # the scores' scale before the softmax (Granite sets its own)
        qkv_heads = self.num_heads + 2 * self.num_kv_heads
        self.qkv_proj = Linear(config.hidden_size, qkv_heads * self.head_dim, dtype, bias=config.qkv_bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, dtype, bias=config.o_proj_bias)

    def forward(self, x: nn.Tensor, kv_cache: PagedKVCache, layer_id: int) -> nn.Tensor:
        batch, seq_len, _ = x.shape
        qkv = self.rope(self.fused_qkv(x), kv_cache, layer_id)
        attended = kv_cache.attention_with_fused_qkv(layer_id, qkv, self.num_heads, sm_scale=self.sm_scale)
        return self.o_proj(nn.op.reshape(attended, (batch, seq_len, self.num_heads * self.head_dim)))

    def fused_qkv(self, x: nn.Tensor) -> nn.Tensor:
        """The projected q, k and v as heads (Qwen3 and OLMo 2 normalize q and k here)."""
        batch, seq_len, _ = x.shape
        return nn.op.reshape(self.qkv_proj(x), (batch, seq_len, -1, self.head_dim))  # (batch, seq, heads, head_dim)

    def rope(self, qkv: nn.Tensor, kv_cache: PagedKVCache, layer_id: int) -> nn.Tensor:
        """What the layer's fused qkv gets from its positions before the cache: RoPE where the model
        applies it (SmolLM3 leaves some layers out; Ministral 3 also scales its queries by position)."""
        return apply_rope(qkv, kv_cache, self.config)


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig, dtype: str):
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, dtype, bias=config.mlp_bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, dtype, bias=config.mlp_bias)

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        gate, up = nn.op.split(self.gate_up_proj(x), 2, axis=-1)
        return self.down_proj(nn.op.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, dtype: str, attention: type[LlamaAttention]):
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = attention(config, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(config, dtype)

    def forward(self, x: nn.Tensor, kv_cache: PagedKVCache, layer_id: int) -> nn.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), kv_cache, layer_id)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(
        self, config: LlamaConfig, dtype: str, attention: type[LlamaAttention], layer: type[LlamaDecoderLayer]
    ):
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList([layer(config, dtype, attention) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


class LlamaForCausalLM(DecoderModel):
    # A family whose layers differ from Llama's only inside attention (Qwen3), or around it (Granite's
    # residual multiplier), subclasses with its own.
    attention_class: type[LlamaAttention] = LlamaAttention
    layer_class: type[LlamaDecoderLayer] = LlamaDecoderLayer

    def __init__(self, config: LlamaConfig, dtype: str):
        self.config = config
        self.dtype = dtype
        self.model = LlamaModel(config, dtype, self.attention_class, self.layer_class)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, dtype)

    def embed_tokens(self, token_ids: nn.Tensor) -> nn.Tensor:
        return self.model.embed_tokens(token_ids)

    def hidden_states(self, embeds: nn.Tensor, kv_cache: PagedKVCache) -> nn.Tensor:
        for layer_id, layer in enumerate(self.model.layers):
            embeds = layer(embeds, kv_cache, layer_id)
        return self.model.norm(embeds)

    def logits(self, hidden: nn.Tensor) -> nn.Tensor:
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.project(hidden)
        return nn.op.astype(self.lm_head(hidden), "float32")


def fused_sources(config: LlamaConfig) -> dict[str, list[str]]:
    fused = {}
    for i in range(config.num_hidden_layers):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        for kind in ("weight", "bias"):
            fused[f"{attn}.qkv_proj.{kind}"] = [f"{attn}.{p}_proj.{kind}" for p in "qkv"]
            fused[f"{mlp}.gate_up_proj.{kind}"] = [f"{mlp}.gate_proj.{kind}", f"{mlp}.up_proj.{kind}"]
    return fused


# Rotary tables some checkpoints save; Kiln's KV cache computes RoPE from the config.
IGNORED_TENSORS = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)


def gguf_config(
    metadata: Metadata,
    tensors: GGUFTensors,
    model_type: str = "llama",
    architectures: tuple[str, ...] = ("LlamaForCausalLM",),
) -> dict:
    """Also the config of the families llama.cpp converts as a Llama under a name of their own (Granite)."""
    config = decoder_hparams(metadata, tensors, model_type, list(architectures))
    config["attention_bias"] = "blk.0.attn_q.bias" in tensors.names
    config["mlp_bias"] = "blk.0.ffn_up.bias" in tensors.names
    if "rope_freqs.weight" in tensors.names:
        # Llama 3.1+: llama.cpp stores the llama3 rope scaling as the per-dimension divisors it
        # computes from it. Longrope divides by such a table; equal long and short factors and
        # no attention factor (max = original positions) give exactly llama3's RoPE.
        factors = tensors.read("rope_freqs.weight").astype(np.float64).tolist()
        positions = config["max_position_embeddings"]
        config["rope_scaling"] = {
            "rope_type": "longrope",
            "long_factor": factors,
            "short_factor": factors,
            "original_max_position_embeddings": positions,
            "max_position_embeddings": positions,
        }
    return config


def undo_rope_permutation(hf_name: str, values: np.ndarray, config: dict) -> np.ndarray:
    """Put the rows of Q and K back in Hugging Face order.

    llama.cpp's converter reorders each head's rows of a Llama from the "rotate half" RoPE layout
    of Hugging Face ([first halves..., second halves...]) to interleaved pairs; this is the
    inverse of that reshape-and-swap (biases included: they are rows too).
    """
    if ".self_attn.q_proj." in hf_name:
        num_heads = config["num_attention_heads"]
    elif ".self_attn.k_proj." in hf_name:
        num_heads = config["num_key_value_heads"]
    else:
        return values
    half_head = values.shape[0] // num_heads // 2
    interleaved = values.reshape(num_heads, half_head, 2, *values.shape[1:])
    return interleaved.swapaxes(1, 2).reshape(values.shape)


ARCHITECTURE = Architecture(
    model_type="llama",
    parse_config=parse_config,
    build=LlamaForCausalLM,
    fused_sources=fused_sources,
    ignored_tensors=IGNORED_TENSORS,
    sentence_embeddings=True,
    gguf=GGUFMapping(
        architecture="llama",
        config=gguf_config,
        layer_tensors=LLAMA_LAYER_TENSORS,
        config_tensors=("rope_freqs.weight",),
        restore_layout=undo_rope_permutation,
    ),
)
