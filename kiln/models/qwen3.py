"""Qwen3 family: Qwen3 dense models (0.6B–32B) — Llama's layers with an RMSNorm over each query
and key head (`q_norm`, `k_norm`, weights of width head_dim) before RoPE, no biases, and a
`head_dim` of its own (128 where hidden_size / heads is 64 or 80).

The norms sit between the fused qkv projection and the paged KV cache, which applies RoPE: the
heads are split, q and k normalized, and concatenated back. A sliding window (`use_sliding_window`)
and attention biases are off in every released checkpoint and refused when on. llama.cpp stores
Qwen3 unpermuted ("rotate half" RoPE).
"""

from __future__ import annotations

from pathlib import Path

from tvm.relax.frontend import nn

from .config_reader import ConfigReader
from .decoder import Architecture
from .gguf import LLAMA_LAYER_TENSORS, GGUFMapping, GGUFTensors, Metadata, decoder_hparams
from .layers import RMSNorm
from .llama import IGNORED_TENSORS, LlamaAttention, LlamaConfig, LlamaForCausalLM, fused_sources, llama_layers_config


def parse_config(hf_config: dict, path: Path, overrides: dict[str, int]) -> LlamaConfig:
    read = ConfigReader(hf_config, path)
    read.expect("attention_bias", (False,), False)
    read.expect("use_sliding_window", (False,), False)
    return llama_layers_config(read, read.decoder_fields(overrides))


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: LlamaConfig, dtype: str):
        super().__init__(config, dtype)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype)

    def fused_qkv(self, x: nn.Tensor) -> nn.Tensor:
        """Llama's, with q and k normalized per head."""
        q, k, v = nn.op.split(super().fused_qkv(x), [self.num_heads, self.num_heads + self.num_kv_heads], axis=2)
        return nn.op.concat([self.q_norm(q), self.k_norm(k), v], dim=2)


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_class = Qwen3Attention


def gguf_config(metadata: Metadata, tensors: GGUFTensors) -> dict:
    return decoder_hparams(metadata, tensors, "qwen3", ["Qwen3ForCausalLM"])


ARCHITECTURE = Architecture(
    model_type="qwen3",
    parse_config=parse_config,
    build=Qwen3ForCausalLM,
    fused_sources=fused_sources,
    ignored_tensors=IGNORED_TENSORS,
    sentence_embeddings=True,
    gguf=GGUFMapping(
        architecture="qwen3",
        config=gguf_config,
        layer_tensors={**LLAMA_LAYER_TENSORS, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
    ),
)
