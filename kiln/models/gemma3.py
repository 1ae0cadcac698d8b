"""Gemma 3 family (text): Gemma 3 270M and 1B (`gemma3_text`), and the text tower of the larger,
multimodal `gemma3` checkpoints.

What differs from Llama:
- embeddings scaled by sqrt(hidden_size), rounded to the model's float dtype as the reference does;
- RMSNorm multiplies by (1 + weight), in float32; four norms per layer (before and after attention
  and the feed-forward), and an RMSNorm over each query and key head;
- GeGLU with gelu-tanh; attention scaled by `query_pre_attn_scalar`^-0.5; tied embeddings;
  optional final-logit and attention-logit soft-caps (Gemma 2's, kiln/models/kv_cache/attention_softcap.py);
- local layers attend to the last `sliding_window` tokens, global layers to all, in the pattern of
  `layer_types` (or every `sliding_window_pattern`-th layer global, in older configs);
- the two kinds of layers have RoPE bases of their own (local 10k, global 1M with its rope scaling).

TVM's paged KV cache takes one RoPE base for every layer, so Kiln rotates q and k in the model with
the layer's frequencies (`rotate_qkv`) and runs the cache without RoPE. The cache then holds rotated
keys, which also keeps its prefix reuse and rollback exact. The local window is the cache's
per-layer "mha_sliding" kind: every layer keeps all its tokens and a local layer reads the pages of
its last window only. A window that never binds (a context no longer than it) is left out.

TVM 0.27's windowed prefill is exact only while no cached token falls out of a chunk's window: its
ragged kernel (attention within a chunk) knows no window, so prefill chunks are shorter than the
window (measured: window - 1 tokens give the reference's logits, the window or more do not); its
paged CPU kernel read an unset value once the window drops a cached token (NaN at random), which
Kiln fixes (kiln/models/kv_cache/paged_prefill_fix.py); its paged GPU kernels still go wrong there. So past the
window float32 CPU and wasm libraries prefill in chunks and the others one token at a time (the
library's metadata says which: kiln/compile/lower/library.py), and WebLLM, which cannot, gets a context of the
window (kiln/compile/chat_config/configure.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache

from kiln.errors import KilnError

from .config_reader import ConfigReader
from .decoder import Architecture, DecoderConfig, DecoderModel, rope_inv_freq, rotate_qkv
from .gguf import LLAMA_LAYER_TENSORS, GGUFMapping, GGUFTensors, Metadata, decoder_hparams
from .layers import Embedding, Linear
from .llama import fused_sources

LAYER_KINDS = ("sliding_attention", "full_attention")
ROPE_KEYS = ("rope_parameters", "rope_scaling", "rope_theta", "rope_local_base_freq")
# transformers' Gemma3TextConfig defaults: configs leave out what equals them (google/gemma-3-4b-it's
# text_config names only its sizes, window and rope scaling).
TEXT_DEFAULTS = dict(
    vocab_size=262208,
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=26,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    max_position_embeddings=131072,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    rope_local_base_freq=10_000.0,
    query_pre_attn_scalar=256,
    sliding_window=4096,
    sliding_window_pattern=6,
    tie_word_embeddings=True,
)


@dataclass
class Gemma3Config(DecoderConfig):
    intermediate_size: int = 0
    rms_norm_eps: float = 1e-6
    query_pre_attn_scalar: float = 256.0
    final_logit_softcapping: float | None = None
    # Per layer: the RoPE frequencies' base and linear scaling factor.
    layer_ropes: tuple[tuple[float, float], ...] = ()
    query_key_norm: bool = True  # an RMSNorm over each query and key head (Gemma 3; Gemma 2 has none)


def rope_of(params: dict[str, Any], path: Path) -> tuple[float, float]:
    """(base, linear factor) of one kind of layer's RoPE parameters."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "linear"):
        raise KilnError(
            f"config.json rope scaling '{rope_type}' is not supported for Gemma 3 (supported: default, linear)", path
        )
    theta, factor = params.get("rope_theta"), params.get("factor", 1.0) if rope_type == "linear" else 1.0
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf for v in (theta, factor)):
        raise KilnError(f"config.json RoPE parameters {params!r} need a positive rope_theta and factor", path)
    return float(theta), float(factor)


def ropes_by_kind(hf_config: dict, path: Path) -> dict[str, tuple[float, float]]:
    """Each kind of layer's RoPE: transformers 5 keeps them in `rope_parameters` by layer kind, earlier
    configs as rope_theta + rope_scaling (global layers) and rope_local_base_freq (local layers)."""
    params = hf_config.get("rope_parameters")
    if isinstance(params, dict) and set(LAYER_KINDS) <= set(params):
        return {kind: rope_of(params[kind], path) for kind in LAYER_KINDS}
    scaling = hf_config.get("rope_scaling") or {}
    if not isinstance(scaling, dict):
        raise KilnError(f"config.json rope_scaling should be an object, got {scaling!r}", path)
    return {
        "full_attention": rope_of({**scaling, "rope_theta": hf_config.get("rope_theta", 1_000_000.0)}, path),
        "sliding_attention": rope_of({"rope_theta": hf_config.get("rope_local_base_freq", 10_000.0)}, path),
    }


def layer_kinds(read: ConfigReader, num_layers: int, global_every: int) -> list[str]:
    kinds = read.get("layer_types", list, None)
    if kinds is None:
        pattern = read.get("sliding_window_pattern", int, global_every)
        return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]
    if len(kinds) != num_layers or not set(kinds) <= set(LAYER_KINDS):
        raise KilnError(
            f"config.json layer_types should name {num_layers} layers, each one of {', '.join(LAYER_KINDS)}", read.path
        )
    return kinds


def text_tower_config(hf_config: dict, path: Path, text_type: str) -> dict:
    """A multimodal Gemma checkpoint's text tower config (`text_config`), as a `text_type` config with
    the checkpoint's tied head."""
    text = hf_config.get("text_config")
    if not isinstance(text, dict):
        raise KilnError(
            f"config.json of a {hf_config.get('model_type')} checkpoint should hold its text tower's text_config", path
        )
    tied = hf_config.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
    return {**text, "model_type": text_type, "tie_word_embeddings": tied}


def parse_multimodal_config(hf_config: dict, path: Path, overrides: dict[str, int]) -> Gemma3Config:
    """A `gemma3` checkpoint (Gemma 3 4B, 12B, 27B): its text tower's config, `text_config`."""
    return parse_text_config(text_tower_config(hf_config, path, "gemma3_text"), path, overrides)


def parse_text_config(hf_config: dict, path: Path, overrides: dict[str, int]) -> Gemma3Config:
    hf_config = {**TEXT_DEFAULTS, **{k: v for k, v in hf_config.items() if v is not None}}
    ropes = ropes_by_kind(hf_config, path)
    read = ConfigReader({k: v for k, v in hf_config.items() if k not in ROPE_KEYS}, path)
    return gemma_config(read, overrides, ropes, global_every=6)


def gemma_config(
    read: ConfigReader, overrides: dict[str, int], ropes: dict[str, tuple[float, float]], global_every: int, **family
) -> Gemma3Config:
    """What Gemma 2 and 3 read alike; `global_every`: the layer pattern of configs without `layer_types`."""
    read.expect("hidden_activation", ("gelu_pytorch_tanh",), read.hf_config.get("hidden_act", "gelu_pytorch_tanh"))
    read.expect("hidden_act", ("gelu_pytorch_tanh",), "gelu_pytorch_tanh")
    read.expect("attention_bias", (False,), False)
    bidirectional = read.get("use_bidirectional_attention", bool, False)
    fields = read.decoder_fields(overrides, max_context=8192)
    kinds = layer_kinds(read, fields["num_hidden_layers"], global_every)
    window = read.get("sliding_window", int)
    # A bidirectional window reaches window // 2 tokens each way (transformers' Gemma3TextConfig).
    binds = fields["context_window_size"] > (window // 2 + 1 if bidirectional else window)
    if binds:
        fields["prefill_chunk_size"] = min(fields["prefill_chunk_size"], window - 1)
    return Gemma3Config(
        **{
            **fields,
            "rope_theta": ropes["full_attention"][0],
            "rope_scaling": None,
            "tie_word_embeddings": read.get("tie_word_embeddings", bool, True),
        },
        windowed_layers=tuple(i for i, layer_type in enumerate(kinds) if layer_type == "sliding_attention")
        if binds
        else (),
        layer_window_size=window if binds else None,
        family_applies_rope=True,
        layer_ropes=tuple(ropes[kind] for kind in kinds),
        attention_logit_softcap=read.get("attn_logit_softcapping", float, None),
        bidirectional=bidirectional,
        intermediate_size=read.get("intermediate_size", int),
        rms_norm_eps=read.get("rms_norm_eps", float, 1e-6),
        query_pre_attn_scalar=read.get("query_pre_attn_scalar", float, 256.0),
        final_logit_softcapping=read.get("final_logit_softcapping", float, None),
        **family,
        extra=read.unused(),
    )


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), computed in float32 as the reference does; the result in the model's
    dtype, or in `out_dtype`."""

    def __init__(self, hidden_size: int, eps: float, dtype: str):
        self.eps = eps
        self.dtype = dtype
        self.weight = nn.Parameter((hidden_size,), dtype)

    def forward(self, x: nn.Tensor, out_dtype: str | None = None) -> nn.Tensor:
        scale = self.weight.astype("float32") + 1.0
        normed = nn.op.rms_norm(x.astype("float32"), scale, axes=[-1], epsilon=self.eps)
        return normed.astype(out_dtype or self.dtype)


class Gemma3Attention(nn.Module):
    def __init__(self, config: Gemma3Config, dtype: str, layer_id: int):
        self.config = config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        base, factor = config.layer_ropes[layer_id]
        self.inv_freq = rope_inv_freq(base, config.head_dim) / factor
        self.qkv_proj = Linear(config.hidden_size, (self.num_heads + 2 * self.num_kv_heads) * self.head_dim, dtype)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, dtype)
        if config.query_key_norm:
            self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps, dtype)

    def forward(self, x: nn.Tensor, kv_cache: PagedKVCache, layer_id: int) -> nn.Tensor:
        batch, seq_len, _ = x.shape
        qkv = nn.op.reshape(self.qkv_proj(x), (batch, seq_len, -1, self.head_dim))
        if self.config.query_key_norm:
            q, k, v = nn.op.split(qkv, [self.num_heads, self.num_heads + self.num_kv_heads], axis=2)
            qkv = nn.op.concat([self.q_norm(q), self.k_norm(k), v], dim=2)
        qkv = rotate_qkv(qkv, kv_cache, self.config, self.inv_freq)
        attended = kv_cache.attention_with_fused_qkv(
            layer_id, qkv, self.num_heads, sm_scale=self.config.query_pre_attn_scalar**-0.5
        )
        return self.o_proj(nn.op.reshape(attended, (batch, seq_len, self.num_heads * self.head_dim)))


class GemmaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, dtype: str):
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, dtype)
        self.down_proj = Linear(intermediate_size, hidden_size, dtype)

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        gate, up = nn.op.split(self.gate_up_proj(x), 2, axis=-1)
        return self.down_proj(nn.op.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: Gemma3Config, dtype: str, layer_id: int):
        width, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(width, eps, dtype)
        self.self_attn = Gemma3Attention(config, dtype, layer_id)
        self.post_attention_layernorm = GemmaRMSNorm(width, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(width, eps, dtype)
        self.mlp = GemmaMLP(width, config.intermediate_size, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(width, eps, dtype)

    def forward(self, x: nn.Tensor, kv_cache: PagedKVCache, layer_id: int) -> nn.Tensor:
        """`x`: the residual stream, in float32 whatever the model's dtype (see Gemma3ForCausalLM)."""
        attended = self.self_attn(self.input_layernorm(x), kv_cache, layer_id)
        x = x + self.post_attention_layernorm(attended, "float32")
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)), "float32")


class Gemma3Model(nn.Module):
    def __init__(self, config: Gemma3Config, dtype: str):
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList([Gemma3DecoderLayer(config, dtype, i) for i in range(config.num_hidden_layers)])
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


class Gemma3ForCausalLM(DecoderModel):
    def __init__(self, config: Gemma3Config, dtype: str):
        self.config = config
        self.dtype = dtype
        self.model = Gemma3Model(config, dtype)
        # sqrt(hidden_size) in the model's float dtype, as the reference rounds it.
        self.embed_scale = float(np.array(config.hidden_size**0.5, dtype=dtype))
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, dtype)

    def embed_tokens(self, token_ids: nn.Tensor) -> nn.Tensor:
        return self.model.embed_tokens(token_ids) * self.embed_scale

    def hidden_states(self, embeds: nn.Tensor, kv_cache: PagedKVCache) -> nn.Tensor:
        """The residual stream stays in float32: Gemma's grows past float16's range (65504) in real
        checkpoints, where a float16 stream turns to inf and the logits to NaN. Each layer reads it
        through a norm, which brings it back within float16's range."""
        residual = embeds.astype("float32")
        for layer_id, layer in enumerate(self.model.layers):
            residual = layer(residual, kv_cache, layer_id)
        return self.model.norm(residual)

    def logits(self, hidden: nn.Tensor) -> nn.Tensor:
        if self.config.tie_word_embeddings:
            logits = self.model.embed_tokens.project(hidden)
        else:
            logits = nn.op.astype(self.lm_head(hidden), "float32")
        cap = self.config.final_logit_softcapping
        return logits if cap is None else nn.op.tanh(logits / cap) * cap


def swa_layers(metadata: Metadata, num_layers: int, global_every: int) -> list[bool]:
    """llama.cpp's windowed layers: `attention.sliding_window_pattern` as one flag per layer, or as
    n (every n-th layer global), `global_every` when absent."""
    key = f"{metadata.require('general.architecture', str)}.attention.sliding_window_pattern"
    pattern = metadata.get(key, global_every)
    if isinstance(pattern, list):
        if len(pattern) != num_layers or not all(isinstance(flag, bool) for flag in pattern):
            raise KilnError(f"GGUF metadata {key} should hold one flag per layer ({num_layers})", metadata.path)
        return pattern
    if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 0:
        raise KilnError(f"GGUF metadata {key} should be a count, got {pattern!r}", metadata.path)
    return [pattern == 0 or i % pattern < pattern - 1 for i in range(num_layers)]


def gguf_config(metadata: Metadata, tensors: GGUFTensors) -> dict:
    """llama.cpp's Gemma3Model converter keeps the global layers' RoPE base as the RoPE base, the local
    one (10k when absent) apart, and no query_pre_attn_scalar: its loader takes head_dim, or
    hidden / heads for the 62-layer 27B, as Google's reference code does."""
    config = decoder_hparams(metadata, tensors, "gemma3_text", ["Gemma3ForCausalLM"])
    del config["hidden_act"]
    layers = config["num_hidden_layers"]
    window = metadata.get("gemma3.attention.sliding_window", 0, int)
    windowed = swa_layers(metadata, layers, 6) if window > 0 else [False] * layers
    return {
        **config,
        "hidden_activation": "gelu_pytorch_tanh",
        "rope_local_base_freq": metadata.get("gemma3.rope.freq_base_swa", 10000.0, float),
        "sliding_window": window or config["max_position_embeddings"],
        "layer_types": ["sliding_attention" if flag else "full_attention" for flag in windowed],
        "query_pre_attn_scalar": config["hidden_size"] // config["num_attention_heads"]
        if layers == 62
        else config["head_dim"],
        "final_logit_softcapping": metadata.get("gemma3.final_logit_softcapping", None, float),
    }


GEMMA_LAYER_TENSORS = {
    **LLAMA_LAYER_TENSORS,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def norm_weight_minus_one(hf_name: str, values: np.ndarray) -> np.ndarray:
    return values - 1 if hf_name.endswith("norm.weight") else values


ARCHITECTURE = Architecture(
    model_type="gemma3_text",
    parse_config=parse_text_config,
    build=Gemma3ForCausalLM,
    fused_sources=fused_sources,
    sentence_embeddings=True,
    gguf=GGUFMapping(
        architecture="gemma3",
        config=gguf_config,
        layer_tensors={**GEMMA_LAYER_TENSORS, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
        restore_values=norm_weight_minus_one,
    ),
)

MULTIMODAL_ARCHITECTURE = Architecture(
    model_type="gemma3",
    parse_config=parse_multimodal_config,
    build=Gemma3ForCausalLM,
    fused_sources=fused_sources,
    # The vision tower and its projector (Kiln builds the text tower), and the output head that
    # some layouts save beside the embeddings it is tied to.
    ignored_tensors=(r"(model\.)?(vision_tower|multi_modal_projector)\..*", r"(language_model\.)?lm_head\.weight"),
    decoder_prefixes=("model.language_model.", "language_model.model."),
)
