"""Gemma 4 family (text): the text decoder of Gemma 4 E2B and E4B (`gemma4_text`, and the text tower
of the multimodal `gemma4` checkpoints).

What differs from Gemma 3 (kiln/models/gemma3.py, whose layer pattern, windows and float32 residual
stream it keeps):
- RMSNorm multiplies by `weight`, not `1 + weight`; values get a norm without a weight; the
  attention scale is 1 (the q and k norms set the scale);
- global layers have heads of their own size (`global_head_dim`, 512 beside 256) and may have fewer
  KV heads, whose keys are also the values (`attention_k_eq_v`); their RoPE is "proportional": it
  rotates a share of each head's pairs, at frequencies over the whole head, and leaves the others
  (frequency 0);
- the last `num_kv_shared_layers` layers compute no K/V: each attends over the K/V of the last
  earlier layer of its kind, and has a twice as wide MLP with `use_double_wide_mlp`;
- per-layer embeddings (PLE): a second table, looked up by token id, holds a small vector per layer
  (`hidden_size_per_layer_input` wide); it is added to a projection of the token's embedding, and
  each layer gates its slice into the residual stream after its MLP; then each layer scales the
  stream by its `layer_scalar`.

`embed` computes the whole PLE input once per token and returns it beside the embedding, so prefill
and decode take one row per token (`embed_width`) as in every family, and the engines need nothing
new. TVM's paged KV cache has one head size and one KV-head count for all its layers: it is sized
for the largest, and a layer's heads are zero-padded into it (zero dimensions add nothing to q·k, and
zero value dimensions are sliced off the output); a global layer's fewer KV heads are repeated to
the cache's count, which gives each query head the KV head it reads. The shared layers read their
source layer's cache through `attention_with_shared_kv` and hold no cache layer of their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache

from kiln.errors import KilnError

from .config_reader import ConfigReader
from .decoder import Architecture, DecoderConfig, cache_layer_ids, rotate_qkv
from .gemma3 import (
    GEMMA_LAYER_TENSORS,
    LAYER_KINDS,
    Gemma3ForCausalLM,
    GemmaMLP,
    layer_kinds,
    swa_layers,
    text_tower_config,
)
from .gguf import GLOBAL_TENSORS, GGUFMapping, GGUFTensors, Metadata, decoder_hparams
from .layers import Embedding, Linear

ROPE_KEYS = ("rope_parameters", "rope_scaling", "rope_theta")
ROPE_TYPES = ("default", "proportional")
# transformers' Gemma4TextConfig defaults: configs leave out what equals them.
TEXT_DEFAULTS = dict(
    vocab_size=262_144,
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=30,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    max_position_embeddings=131_072,
    rms_norm_eps=1e-6,
    sliding_window=512,
    tie_word_embeddings=True,
    vocab_size_per_layer_input=262_144,
    hidden_size_per_layer_input=256,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
    },
)
GLOBAL_HEAD_DIM = 512
PER_LAYER_FIELDS = ("head_dim", "num_key_value_heads")


@dataclass
class Gemma4Config(DecoderConfig):
    """`head_dim` and `num_key_value_heads` are the KV cache's: the largest of any layer's."""

    intermediate_size: int = 0
    rms_norm_eps: float = 1e-6
    final_logit_softcapping: float | None = None
    layer_head_dims: tuple[int, ...] = ()
    layer_kv_heads: tuple[int, ...] = ()
    # Per layer: its RoPE (rope_theta, the share of its head's pairs that turn, the frequencies' divisor).
    layer_ropes: tuple[tuple[float, float, float], ...] = ()
    # Per layer: the layer whose K/V it attends over (itself, or for a shared layer its source).
    kv_sources: tuple[int, ...] = ()
    keys_are_values: tuple[bool, ...] = ()  # per layer: no v_proj, the keys' projection is also the values'
    layer_intermediate_sizes: tuple[int, ...] = ()
    per_layer_input_size: int = 0  # PLE: each layer's slice of the per-layer embedding (0: none)
    per_layer_vocab_size: int = 0


def layer_rope(params: dict, path: Path) -> tuple[float, float, float]:
    """(rope_theta, the share of the pairs that turn, the divisor of the frequencies) of one kind of
    layer; the default RoPE turns every pair."""
    rope_type = params.get("rope_type", "default")
    theta = params.get("rope_theta")
    share, factor = params.get("partial_rotary_factor", 1.0), params.get("factor", 1.0)
    numbers = (theta, share, factor)
    if rope_type not in ROPE_TYPES or not all(isinstance(v, (int, float)) and v > 0 for v in numbers) or share > 1:
        raise KilnError(
            f"config.json RoPE parameters {params!r}: Gemma 4 supports the {' and '.join(ROPE_TYPES)} RoPE "
            "with a rope_theta (and a partial_rotary_factor up to 1)",
            path,
        )
    return (float(theta), float(share), float(factor)) if rope_type == "proportional" else (float(theta), 1.0, 1.0)


def proportional_inv_freq(rope: tuple[float, float, float], head_dim: int) -> np.ndarray:
    """transformers' `_compute_proportional_rope_parameters` (the default RoPE is its case of every pair
    turning): the first share of a head's pairs turn at theta^(-2i/head_dim), the rest not at all (0),
    all divided by the factor."""
    theta, share, factor = rope
    turning = int(share * head_dim // 2)
    inv_freq = 1.0 / theta ** (np.arange(0, 2 * turning, 2, dtype=np.float32) / head_dim)
    return np.concatenate([inv_freq, np.zeros(head_dim // 2 - turning, np.float32)]) / np.float32(factor)


def per_layer_overrides(read: ConfigReader, kinds: list[str]) -> dict[int, dict]:
    """The head size and KV heads of layers that differ: `per_layer_config` as transformers saves it
    (null: none differ), else its defaults (`global_head_dim` for the global layers, and
    `num_global_key_value_heads` when their keys are their values). Each value is checked as the
    config's own fields are."""
    if "per_layer_config" not in read.hf_config:
        overrides = {"head_dim": read.get("global_head_dim", int, GLOBAL_HEAD_DIM)}
        global_kv_heads = read.get("num_global_key_value_heads", int, None)
        if read.get("attention_k_eq_v", bool, False) and global_kv_heads:
            overrides["num_key_value_heads"] = global_kv_heads
        return {i: overrides for i, kind in enumerate(kinds) if kind == "full_attention"}
    given = read.get("per_layer_config", dict, None)
    layers = {}
    for key, fields in (given or {}).items():
        if not (key.isdigit() and int(key) < len(kinds)) or not isinstance(fields, dict):
            raise KilnError(f"config.json per_layer_config names no layer of {len(kinds)}: {key!r}", read.path)
        if not set(fields) <= set(PER_LAYER_FIELDS):
            raise KilnError(
                f"config.json per_layer_config[{key}] sets {sorted(set(fields) - set(PER_LAYER_FIELDS))}; "
                f"Kiln's Gemma 4 reads {' and '.join(PER_LAYER_FIELDS)} per layer",
                read.path,
            )
        layer = ConfigReader(fields, read.path)
        layers[int(key)] = {field: layer.get(field, int) for field in fields}
    return layers


def kv_sources(kinds: list[str], shared: int, path: Path) -> tuple[int, ...]:
    """transformers' `kv_sharing_modes`: each of the last `shared` layers reads the last earlier
    unshared layer of its kind."""
    first_shared = len(kinds) - shared
    if not 0 <= shared < len(kinds):
        raise KilnError(f"config.json num_kv_shared_layers {shared} leaves no layer of {len(kinds)} its own K/V", path)
    sources = list(range(len(kinds)))
    for layer in range(first_shared, len(kinds)):
        owners = [i for i in range(first_shared) if kinds[i] == kinds[layer]]
        if not owners:
            raise KilnError(
                f"config.json: layer {layer} shares the K/V of a {kinds[layer]} layer, and none has its own", path
            )
        sources[layer] = owners[-1]
    return tuple(sources)


def parse_multimodal_config(hf_config: dict, path: Path, overrides: dict[str, int]) -> Gemma4Config:
    """A `gemma4` checkpoint (Gemma 4 E2B, E4B): its text decoder's config, `text_config`."""
    return parse_text_config(text_tower_config(hf_config, path, "gemma4_text"), path, overrides)


def parse_text_config(hf_config: dict, path: Path, overrides: dict[str, int]) -> Gemma4Config:
    by_layer_given = {k: hf_config[k] for k in ("per_layer_config",) if k in hf_config}
    hf_config = {**TEXT_DEFAULTS, **{k: v for k, v in hf_config.items() if v is not None}, **by_layer_given}
    ropes = hf_config["rope_parameters"]
    given = {k: v for k, v in hf_config.items() if k not in ROPE_KEYS}
    read = ConfigReader(given, path)
    read.expect("hidden_activation", ("gelu_pytorch_tanh",), "gelu_pytorch_tanh")
    read.expect("attention_bias", (False,), False)
    read.expect("enable_moe_block", (False,), False)
    read.expect("use_bidirectional_attention", (None, "vision"), None)  # "vision": text tokens stay causal
    layers = read.get("num_hidden_layers", int)
    kinds = layer_kinds(read, layers, 6)
    if not isinstance(ropes, dict) or not set(kinds) <= set(ropes):
        raise KilnError(
            f"config.json rope_parameters should hold the RoPE of each kind of layer ({', '.join(LAYER_KINDS)})", path
        )
    by_layer = per_layer_overrides(read, kinds)
    head_dims = [by_layer.get(i, {}).get("head_dim", read.get("head_dim", int)) for i in range(layers)]
    kv_heads = [
        by_layer.get(i, {}).get("num_key_value_heads", read.get("num_key_value_heads", int)) for i in range(layers)
    ]
    heads = read.get("num_attention_heads", int)
    if any(heads % n or max(kv_heads) % n for n in kv_heads):
        raise KilnError(
            f"config.json: Gemma 4's KV heads per layer {sorted(set(kv_heads))} should each divide "
            f"num_attention_heads {heads} and the largest of them",
            path,
        )
    # The cache's head size and KV heads: the largest of any layer's.
    read.hf_config = {**given, "head_dim": max(head_dims), "num_key_value_heads": max(kv_heads)}
    fields = read.decoder_fields(overrides, max_context=8192, partial_rotary=True)
    window = read.get("sliding_window", int)
    binds = fields["context_window_size"] > window
    if binds:
        fields["prefill_chunk_size"] = min(fields["prefill_chunk_size"], window - 1)
    sources = kv_sources(
        kinds, read.get("num_kv_shared_layers", int, 0) if given.get("num_kv_shared_layers") else 0, path
    )
    shared = tuple(i for i, source in enumerate(sources) if source != i)
    width = read.get("intermediate_size", int)
    double_wide = read.get("use_double_wide_mlp", bool, False)
    keys_are_values = read.get("attention_k_eq_v", bool, False)
    ple = read.get("hidden_size_per_layer_input", int) if given.get("hidden_size_per_layer_input") else 0
    return Gemma4Config(
        **{**fields, "rope_scaling": None, "tie_word_embeddings": read.get("tie_word_embeddings", bool, True)},
        windowed_layers=tuple(i for i, kind in enumerate(kinds) if kind == "sliding_attention") if binds else (),
        layer_window_size=window if binds else None,
        family_applies_rope=True,
        kv_shared_layers=shared,
        intermediate_size=width,
        rms_norm_eps=read.get("rms_norm_eps", float, 1e-6),
        final_logit_softcapping=read.get("final_logit_softcapping", float, None),
        layer_head_dims=tuple(head_dims),
        layer_kv_heads=tuple(kv_heads),
        layer_ropes=tuple(layer_rope(ropes[kind], path) for kind in kinds),
        kv_sources=sources,
        keys_are_values=tuple(keys_are_values and kind == "full_attention" for kind in kinds),
        layer_intermediate_sizes=tuple(width * (2 if double_wide and i in shared else 1) for i in range(layers)),
        per_layer_input_size=ple,
        per_layer_vocab_size=read.get("vocab_size_per_layer_input", int) if ple else 0,
        extra=read.unused(),
    )


class Gemma4RMSNorm(nn.Module):
    """x / rms(x) · weight in float32, as the reference computes it (without a weight: x / rms(x));
    the result in the model's dtype, or in `out_dtype`."""

    def __init__(self, width: int, eps: float, dtype: str, scaled: bool = True):
        self.eps = eps
        self.dtype = dtype
        self.width = width
        self.weight = nn.Parameter((width,), dtype) if scaled else None

    def forward(self, x: nn.Tensor, out_dtype: str | None = None) -> nn.Tensor:
        scale = (
            self.weight.astype("float32")
            if self.weight is not None
            else nn.Tensor.from_const(np.ones(self.width, np.float32))
        )
        normed = nn.op.rms_norm(x.astype("float32"), scale, axes=[-1], epsilon=self.eps)
        return normed.astype(out_dtype or self.dtype)


def padded_heads(x: nn.Tensor, heads: int, head_dim: int) -> nn.Tensor:
    """(batch, seq, h, d) heads as the KV cache holds them: each repeated to `heads`, zero-padded to
    `head_dim`."""
    if x.shape[2] != heads:
        x = nn.op.repeat(x, heads // int(x.shape[2]), axis=2)
    if x.shape[3] != head_dim:
        x = nn.op.pad(x, [0, 0, 0, 0, 0, 0, 0, head_dim - int(x.shape[3])])
    return x


class Gemma4Attention(nn.Module):
    def __init__(self, config: Gemma4Config, dtype: str, layer_id: int):
        self.config = config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.layer_kv_heads[layer_id]
        self.head_dim = config.layer_head_dims[layer_id]
        self.inv_freq = proportional_inv_freq(config.layer_ropes[layer_id], self.head_dim)
        self.source = config.kv_sources[layer_id]
        self.owns_kv = self.source == layer_id
        self.cache_layer = cache_layer_ids(config)[self.source]  # where the K/V it reads are: its own or its source's
        self.keys_are_values = config.keys_are_values[layer_id]
        kv_projections = (1 if self.keys_are_values else 2) * self.num_kv_heads if self.owns_kv else 0
        self.qkv_proj = Linear(config.hidden_size, (self.num_heads + kv_projections) * self.head_dim, dtype)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, dtype)
        self.q_norm = Gemma4RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        if self.owns_kv:
            self.k_norm = Gemma4RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
            self.v_norm = Gemma4RMSNorm(self.head_dim, config.rms_norm_eps, dtype, scaled=False)

    def rotate(self, qk: nn.Tensor, kv_cache: PagedKVCache, heads: int) -> nn.Tensor:
        return rotate_qkv(qk, kv_cache, self.config, self.inv_freq, rotated_heads=heads)

    def forward(self, x: nn.Tensor, kv_cache: PagedKVCache, layer_id: int, shared_kv: dict) -> nn.Tensor:
        """`shared_kv`: each K/V-owning layer's keys and values of this step, as the cache holds them."""
        c = self.config
        batch, seq_len, _ = x.shape
        projected = nn.op.reshape(self.qkv_proj(x), (batch, seq_len, -1, self.head_dim))
        if self.owns_kv:
            if self.keys_are_values:
                q, k = nn.op.split(projected, [self.num_heads], axis=2)
                v = k
            else:
                q, k, v = nn.op.split(projected, [self.num_heads, self.num_heads + self.num_kv_heads], axis=2)
            qk = self.rotate(
                nn.op.concat([self.q_norm(q), self.k_norm(k)], dim=2), kv_cache, self.num_heads + self.num_kv_heads
            )
            q, k = nn.op.split(qk, [self.num_heads], axis=2)
            k = padded_heads(k, c.num_key_value_heads, c.head_dim)
            v = padded_heads(self.v_norm(v), c.num_key_value_heads, c.head_dim)
            shared_kv[layer_id] = k, v
            qkv = nn.op.concat([padded_heads(q, self.num_heads, c.head_dim), k, v], dim=2)
            attended = kv_cache.attention_with_fused_qkv(self.cache_layer, qkv, self.num_heads, sm_scale=1.0)
        else:
            q = padded_heads(self.rotate(self.q_norm(projected), kv_cache, self.num_heads), self.num_heads, c.head_dim)
            k, v = shared_kv[self.source]
            attended = kv_cache.attention_with_shared_kv(self.cache_layer, q, k, v, sm_scale=1.0)
        if self.head_dim != c.head_dim:
            attended = nn.op.split(attended, [self.head_dim], axis=3)[0]
        return self.o_proj(nn.op.reshape(attended, (batch, seq_len, self.num_heads * self.head_dim)))


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, config: Gemma4Config, dtype: str, layer_id: int):
        width, eps = config.hidden_size, config.rms_norm_eps
        self.dtype = dtype
        self.input_layernorm = Gemma4RMSNorm(width, eps, dtype)
        self.self_attn = Gemma4Attention(config, dtype, layer_id)
        self.post_attention_layernorm = Gemma4RMSNorm(width, eps, dtype)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(width, eps, dtype)
        self.mlp = GemmaMLP(width, config.layer_intermediate_sizes[layer_id], dtype)
        self.post_feedforward_layernorm = Gemma4RMSNorm(width, eps, dtype)
        if config.per_layer_input_size:
            self.per_layer_input_gate = Linear(width, config.per_layer_input_size, dtype)
            self.per_layer_projection = Linear(config.per_layer_input_size, width, dtype)
            self.post_per_layer_input_norm = Gemma4RMSNorm(width, eps, dtype)
        self.layer_scalar = nn.Parameter((1,), dtype)

    def forward(
        self, x: nn.Tensor, per_layer_input: nn.Tensor | None, kv_cache: PagedKVCache, layer_id: int, shared_kv: dict
    ) -> nn.Tensor:
        """`x`: the residual stream, in float32 whatever the model's dtype (as Gemma 3's)."""
        attended = self.self_attn(self.input_layernorm(x), kv_cache, layer_id, shared_kv)
        x = x + self.post_attention_layernorm(attended, "float32")
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)), "float32")
        if per_layer_input is not None:
            gated = nn.op.gelu(self.per_layer_input_gate(x.astype(self.dtype)), approximate="tanh") * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gated), "float32")
        return x * self.layer_scalar.astype("float32")


class Gemma4Model(nn.Module):
    def __init__(self, config: Gemma4Config, dtype: str):
        width, layers = config.hidden_size, config.num_hidden_layers
        self.embed_tokens = Embedding(config.vocab_size, width, dtype)
        self.layers = nn.ModuleList([Gemma4DecoderLayer(config, dtype, i) for i in range(layers)])
        self.norm = Gemma4RMSNorm(width, config.rms_norm_eps, dtype)
        if config.per_layer_input_size:
            ple = config.per_layer_input_size
            self.embed_tokens_per_layer = Embedding(config.per_layer_vocab_size, layers * ple, dtype)
            self.per_layer_model_projection = Linear(width, layers * ple, dtype)
            self.per_layer_projection_norm = Gemma4RMSNorm(ple, config.rms_norm_eps, dtype)


def scale_in(dtype: str, value: float) -> float:
    """`value` rounded to the model's float dtype, as the reference's scaled embeddings round it."""
    return float(np.array(value, dtype=dtype))


class Gemma4ForCausalLM(Gemma3ForCausalLM):
    """Gemma 3's output head and final soft-cap (`logits`); the rest its own."""

    def __init__(self, config: Gemma4Config, dtype: str):
        self.config = config
        self.dtype = dtype
        self.model = Gemma4Model(config, dtype)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, dtype)

    def embed_width(self) -> int:
        return self.config.hidden_size + self.config.num_hidden_layers * self.config.per_layer_input_size

    def embed_tokens(self, token_ids: nn.Tensor) -> nn.Tensor:
        """The token's embedding, and beside it the PLE input of every layer (transformers'
        `get_per_layer_inputs` and `project_per_layer_inputs`)."""
        c, m = self.config, self.model
        embeds = m.embed_tokens(token_ids) * scale_in(self.dtype, c.hidden_size**0.5)
        if not c.per_layer_input_size:
            return embeds
        seq_len, ple = token_ids.shape[0], c.per_layer_input_size
        by_token = m.embed_tokens_per_layer(token_ids) * scale_in(self.dtype, ple**0.5)
        projected = m.per_layer_model_projection(embeds) * scale_in(self.dtype, c.hidden_size**-0.5)
        projected = m.per_layer_projection_norm(nn.op.reshape(projected, (seq_len, c.num_hidden_layers, ple)))
        per_layer = (nn.op.reshape(projected, (seq_len, -1)) + by_token) * scale_in(self.dtype, 2.0**-0.5)
        return nn.op.concat([embeds, per_layer], dim=-1)

    def hidden_states(self, embeds: nn.Tensor, kv_cache: PagedKVCache) -> nn.Tensor:
        c = self.config
        per_layer = [None] * c.num_hidden_layers
        if c.per_layer_input_size:
            embeds, *per_layer = nn.op.split(
                embeds, [c.hidden_size + i * c.per_layer_input_size for i in range(c.num_hidden_layers)], axis=-1
            )
        residual = embeds.astype("float32")
        shared_kv: dict = {}
        for layer_id, layer in enumerate(self.model.layers):
            residual = layer(residual, per_layer[layer_id], kv_cache, layer_id, shared_kv)
        return self.model.norm(residual)


def fused_sources(config: Gemma4Config) -> dict[str, list[str]]:
    fused = {}
    for i in range(config.num_hidden_layers):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        projections = "q" if config.kv_sources[i] != i else "qk" if config.keys_are_values[i] else "qkv"
        fused[f"{attn}.qkv_proj.weight"] = [f"{attn}.{p}_proj.weight" for p in projections]
        fused[f"{mlp}.gate_up_proj.weight"] = [f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"]
    return fused


def per_layer_values(metadata: Metadata, key: str, layers: int) -> list[int]:
    """A count llama.cpp writes once, or per layer when layers differ."""
    value = metadata.require(key)
    values = value if isinstance(value, list) else [value] * layers
    if len(values) != layers or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
        raise KilnError(f"GGUF metadata {key} should be a positive count, or one per layer ({layers})", metadata.path)
    return values


def gguf_config(metadata: Metadata, tensors: GGUFTensors) -> dict:
    """llama.cpp's Gemma4Model converter: the global layers' head size as the key length and the
    local ones' as `key_length_swa`; KV heads and feed-forward widths per layer where they differ;
    the proportional RoPE as `rope_freqs` factors (1 for a turning pair, 1e30 for a still one) over
    the global head; norms as they are (no +1, unlike Gemma 3's)."""
    config = decoder_hparams(metadata, tensors, "gemma4_text", ["Gemma4ForCausalLM"])
    del config["hidden_act"]
    layers = config["num_hidden_layers"]
    window = metadata.size("gemma4.attention.sliding_window")
    kinds = ["sliding_attention" if local else "full_attention" for local in swa_layers(metadata, layers, 6)]
    shared = metadata.get("gemma4.attention.shared_kv_layers", 0, int)
    widths = per_layer_values(metadata, "gemma4.feed_forward_length", layers)
    kv_heads = per_layer_values(metadata, "gemma4.attention.head_count_kv", layers)
    global_head_dim = config["head_dim"]
    owners = [i for i in range(layers - shared) if kinds[i] == "full_attention"]
    factors = (
        tensors.read("rope_freqs.weight") if "rope_freqs.weight" in tensors.names else np.ones(global_head_dim // 2)
    )
    local_kv = {kv for kv, kind in zip(kv_heads, kinds) if kind == "sliding_attention"}
    global_kv = {kv for kv, kind in zip(kv_heads, kinds) if kind == "full_attention"}
    if len(local_kv) > 1 or len(global_kv) > 1:
        raise KilnError(
            "GGUF metadata gemma4.attention.head_count_kv should be one count per kind of layer", metadata.path
        )
    return {
        **config,
        "hidden_activation": "gelu_pytorch_tanh",
        "head_dim": metadata.size("gemma4.attention.key_length_swa", global_head_dim),
        "global_head_dim": global_head_dim,
        "num_key_value_heads": next(iter(local_kv or global_kv)),
        "num_global_key_value_heads": next(iter(global_kv or local_kv)),
        "attention_k_eq_v": bool(owners) and all(f"blk.{i}.attn_v.weight" not in tensors.names for i in owners),
        "intermediate_size": widths[0],
        "use_double_wide_mlp": widths[-1] == 2 * widths[0] and shared > 0,
        "num_kv_shared_layers": shared,
        "sliding_window": window,
        "layer_types": kinds,
        "hidden_size_per_layer_input": metadata.get("gemma4.embedding_length_per_layer_input", 0, int),
        "vocab_size_per_layer_input": config["vocab_size"],
        "rope_parameters": {
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": metadata.get("gemma4.rope.freq_base_swa", 10000.0, float),
            },
            "full_attention": {
                "rope_type": "proportional",
                "rope_theta": config.pop("rope_theta"),
                "partial_rotary_factor": 2 * int(np.sum(np.asarray(factors) < 1e29)) / global_head_dim,
            },
        },
        "final_logit_softcapping": metadata.get("gemma4.final_logit_softcapping", None, float),
    }


PER_LAYER_TENSORS = {
    "inp_gate": "per_layer_input_gate",
    "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm",
    "layer_output_scale": "layer_scalar",
}

ARCHITECTURE = Architecture(
    model_type="gemma4_text",
    parse_config=parse_text_config,
    build=Gemma4ForCausalLM,
    fused_sources=fused_sources,
    gguf=GGUFMapping(
        architecture="gemma4",
        config=gguf_config,
        layer_tensors={
            **GEMMA_LAYER_TENSORS,
            "attn_q_norm": "self_attn.q_norm",
            "attn_k_norm": "self_attn.k_norm",
            **PER_LAYER_TENSORS,
        },
        global_tensors={
            **GLOBAL_TENSORS,
            "per_layer_token_embd": "model.embed_tokens_per_layer",
            "per_layer_model_proj": "model.per_layer_model_projection",
            "per_layer_proj_norm": "model.per_layer_projection_norm",
        },
        config_tensors=("rope_freqs.weight",),
        # transformers' name has no ".weight"; llama.cpp's converter adds one.
        unsuffixed_parts=("layer_scalar",),
    ),
)

MULTIMODAL_ARCHITECTURE = Architecture(
    model_type="gemma4",
    parse_config=parse_multimodal_config,
    build=Gemma4ForCausalLM,
    fused_sources=fused_sources,
    # The vision and audio towers and their projections into the text decoder (Kiln builds the
    # decoder), and an output head saved beside the embeddings it is tied to.
    ignored_tensors=(
        r"model\.(vision_tower|audio_tower|embed_vision|embed_audio)\..*",
        r"(model\.language_model\.)?lm_head\.weight",
    ),
    decoder_prefixes=("model.language_model.",),
)

# Gemma 4 checkpoints of other kinds, named so that the refusal says what they are.
REFUSED_MODEL_TYPES = {
    "gemma4_assistant": "a Gemma 4 assistant (a draft model that reads its target's K/V) is not a decoder "
    "Kiln compiles; build its target, gemma4",
    "gemma4_unified_assistant": "a Gemma 4 unified assistant (a draft model that reads its target's K/V) is not "
    "a decoder Kiln compiles",
    "gemma4_unified": "Gemma 4 unified (the multimodal any-to-any model) is not supported; Kiln compiles the "
    "text decoder of gemma4 and gemma4_text checkpoints",
}
