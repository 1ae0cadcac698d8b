"""OLMo 2 family: AllenAI's OLMo 2 (1B–32B) — Llama's layers with the norms moved:
- no norm before a sublayer; its output is normalized before the residual add
  (`post_attention_layernorm` after attention, `post_feedforward_layernorm` after the MLP);
- q and k are normalized over the whole projection (`q_norm` of width heads·head_dim, `k_norm` of
  kv_heads·head_dim), not per head as Qwen3's, before RoPE;
- untied embeddings, RMSNorm epsilon 1e-5 by default; `attention_bias` on q, k, v and o, no MLP bias.

The norms sit between the fused qkv projection and the paged KV cache, which applies RoPE: the
projection's q, k and v columns are split, q and k normalized, and concatenated back.

llama.cpp names the architecture "olmo2" and stores Q and K unpermuted ("rotate half" RoPE). Its
converter writes OLMo 3 under the same name, with the window and the windowed layers: such a GGUF
reads here as an `olmo3` config (kiln/models/olmo3.py). A GGUF with YaRN (OLMo 3's long-context
checkpoints) is refused by the shared hyperparameter reader.
"""

from __future__ import annotations

from pathlib import Path

from tvm.relax.frontend import nn
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache

from .config_reader import ConfigReader
from .decoder import Architecture
from .gemma3 import swa_layers
from .gguf import LLAMA_LAYER_TENSORS, GGUFMapping, GGUFTensors, Metadata, decoder_hparams
from .layers import RMSNorm
from .llama import (
    IGNORED_TENSORS,
    LlamaAttention,
    LlamaConfig,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    fused_sources,
    llama_layers_config,
)

# transformers' Olmo2Config defaults, for configs that leave fields out.
DEFAULTS = dict(
    vocab_size=50304,
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


def olmo_fields(read: ConfigReader) -> dict:
    """The layer fields OLMo 2 and 3 read alike."""
    attention_bias = read.get("attention_bias", bool, False)
    return dict(qkv_bias=attention_bias, o_proj_bias=attention_bias, mlp_bias=False)


def parse_config(hf_config: dict, path: Path, overrides: dict[str, int]) -> LlamaConfig:
    read = ConfigReader({**DEFAULTS, **hf_config}, path)
    return llama_layers_config(read, read.decoder_fields(overrides), **olmo_fields(read))


class Olmo2Attention(LlamaAttention):
    def __init__(self, config: LlamaConfig, dtype: str):
        super().__init__(config, dtype)
        self.q_norm = RMSNorm(self.num_heads * self.head_dim, config.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(self.num_kv_heads * self.head_dim, config.rms_norm_eps, dtype)

    def fused_qkv(self, x: nn.Tensor) -> nn.Tensor:
        """The fused projection, q and k normalized over all their heads: (batch, seq, heads, head_dim)."""
        batch, seq_len, _ = x.shape
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = nn.op.split(self.qkv_proj(x), [q_width, q_width + kv_width], axis=-1)  # (batch, seq, width)
        qkv = nn.op.concat([self.q_norm(q), self.k_norm(k), v], dim=-1)
        return nn.op.reshape(qkv, (batch, seq_len, -1, self.head_dim))


class Olmo2DecoderLayer(LlamaDecoderLayer):
    """Llama's layer with its norms after the sublayers: `post_attention_layernorm` normalizes the
    attention's output (Llama's normalizes the MLP's input) and `post_feedforward_layernorm` the MLP's."""

    def __init__(self, config: LlamaConfig, dtype: str, attention: type[LlamaAttention]):
        super().__init__(config, dtype, attention)
        del self.input_layernorm  # no norm before a sublayer
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, x: nn.Tensor, kv_cache: PagedKVCache, layer_id: int) -> nn.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(x, kv_cache, layer_id))
        return x + self.post_feedforward_layernorm(self.mlp(x))


class Olmo2ForCausalLM(LlamaForCausalLM):
    attention_class = Olmo2Attention
    layer_class = Olmo2DecoderLayer


def gguf_config(metadata: Metadata, tensors: GGUFTensors) -> dict:
    """llama.cpp's Olmo2Model converter, which also converts OLMo 3: a GGUF with a sliding window is
    an OLMo 3, its windowed layers one flag each in `olmo2.attention.sliding_window_pattern`."""
    config = decoder_hparams(metadata, tensors, "olmo2", ["Olmo2ForCausalLM"])
    config["attention_bias"] = "blk.0.attn_q.bias" in tensors.names
    window = metadata.get("olmo2.attention.sliding_window", 0, int)
    if not window:
        return config
    # llama.cpp's loader takes every 4th layer as full when the converter wrote no pattern.
    windowed = swa_layers(metadata, config["num_hidden_layers"], 4)
    return {
        **config,
        "model_type": "olmo3",
        "architectures": ["Olmo3ForCausalLM"],
        "sliding_window": window,
        "layer_types": ["sliding_attention" if flag else "full_attention" for flag in windowed],
    }


OLMO2_LAYER_TENSORS = {
    **{part: name for part, name in LLAMA_LAYER_TENSORS.items() if part not in ("attn_norm", "ffn_norm")},
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}

ARCHITECTURE = Architecture(
    model_type="olmo2",
    parse_config=parse_config,
    build=Olmo2ForCausalLM,
    fused_sources=fused_sources,
    ignored_tensors=IGNORED_TENSORS,
    gguf=GGUFMapping(architecture="olmo2", config=gguf_config, layer_tensors=OLMO2_LAYER_TENSORS),
)
