"""Llama family: Llama 2/3, SmolLM2, TinyLlama — tied or untied embeddings, grouped-query attention.

Weights are fused at conversion time (q/k/v into `qkv_proj`, gate/up into `gate_up_proj`) so a
layer runs four matmuls; RoPE is applied inside TVM's paged KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tvm.relax.frontend import nn
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache

from .decoder import Architecture, ConfigReader, DecoderConfig, DecoderModel
from .layers import Embedding, Linear, RMSNorm


@dataclass
class LlamaConfig(DecoderConfig):
    intermediate_size: int = 0
    rms_norm_eps: float = 1e-6


def parse_config(hf_config: dict, path: Path, overrides: dict[str, int]) -> LlamaConfig:
    read = ConfigReader(hf_config, path)
    hidden_size = read.get("hidden_size", int)
    num_heads = read.get("num_attention_heads", int)
    rope_theta, rope_scaling = read.rope()
    max_positions = read.get("max_position_embeddings", int, 4096)
    context = overrides.get("context_window_size") or min(max_positions, 4096)
    return LlamaConfig(
        hidden_size=hidden_size,
        intermediate_size=read.get("intermediate_size", int),
        num_hidden_layers=read.get("num_hidden_layers", int),
        num_attention_heads=num_heads,
        num_key_value_heads=read.get("num_key_value_heads", int, num_heads),
        head_dim=read.get("head_dim", int, hidden_size // num_heads),
        vocab_size=read.get("vocab_size", int),
        rms_norm_eps=read.get("rms_norm_eps", float, 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=read.get("tie_word_embeddings", bool, False),
        context_window_size=context,
        prefill_chunk_size=overrides.get("prefill_chunk_size") or min(context, 2048),
        extra=read.unused(),
    )


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig, dtype: str):
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        qkv_heads = self.num_heads + 2 * self.num_kv_heads
        self.qkv_proj = Linear(config.hidden_size, qkv_heads * self.head_dim, dtype)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, dtype)

    def forward(self, x: nn.Tensor, kv_cache: PagedKVCache, layer_id: int) -> nn.Tensor:
        batch, seq_len, _ = x.shape
        qkv = nn.op.reshape(self.qkv_proj(x), (batch, seq_len, -1, self.head_dim))
        attended = kv_cache.attention_with_fused_qkv(
            layer_id, qkv, self.num_heads, sm_scale=self.head_dim**-0.5
        )
        return self.o_proj(nn.op.reshape(attended, (batch, seq_len, self.num_heads * self.head_dim)))


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig, dtype: str):
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, dtype)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, dtype)

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        gate, up = nn.op.split(self.gate_up_proj(x), 2, axis=-1)
        return self.down_proj(nn.op.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, dtype: str):
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(config, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(config, dtype)

    def forward(self, x: nn.Tensor, kv_cache: PagedKVCache, layer_id: int) -> nn.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), kv_cache, layer_id)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig, dtype: str):
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, dtype) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


class LlamaForCausalLM(DecoderModel):
    def __init__(self, config: LlamaConfig, dtype: str):
        self.config = config
        self.dtype = dtype
        self.model = LlamaModel(config, dtype)
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
        fused[f"{attn}.qkv_proj.weight"] = [f"{attn}.{p}_proj.weight" for p in "qkv"]
        fused[f"{mlp}.gate_up_proj.weight"] = [f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"]
    return fused


ARCHITECTURE = Architecture(
    model_type="llama",
    parse_config=parse_config,
    build=LlamaForCausalLM,
    fused_sources=fused_sources,
)
