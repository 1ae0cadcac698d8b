"""What every decoder-only family shares: the exported functions and their signatures.

A family subclasses `DecoderModel` and provides `embed_tokens`, `hidden_states` (the layer stack
and final norm over the paged KV cache) and `logits`; the functions WebLLM and Kiln's engines
call — embed, prefill, decode, prefill_all_logits and create_tir_paged_kv_cache — are defined once
here, with batch_prefill and batch_decode, which MLC-LLM's C++ engine (its Android and iOS apps)
runs instead of prefill and decode. A hybrid family (its config's `recurrent_layers` and
`recurrent_state`) also gets create_rnn_state, and its step functions take and return the recurrent
state after the KV cache, as WebLLM calls a model whose `kv_state_kind` is "hybrid"; its
hidden_states takes the state too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import tvm
from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache, RopeMode, TIRPagedKVCache
from tvm import relax as rx

from kiln.targets import building

from .kv_cache.attention_softcap import soft_cap_attention_kernels
from .kv_cache.cache_kernels import declare_cache_kernels_noalias, leave_out_unused_attention_kernels
from .kv_cache.cpu_decode_attention import replace_decode_attention_kernel
from .kv_cache.gpu_decode_attention import narrow_webgpu_decode_kernels
from .kv_cache.gpu_merge_state import replace_gpu_merge_state_kernel
from .kv_cache.gpu_wide_heads import wide_head_prefill_tiles
from .kv_cache.kernel_memo import kernels_made_once
from .gguf import GGUFMapping
from .kv_cache.cpu_prefill_attention import replace_prefill_attention_kernels
from .kv_cache.paged_prefill_fix import fix_paged_prefill_kernels
from .layers import gather_positions, last_position
from .recurrent_state import RecurrentState, StateSpec


@dataclass
class DecoderConfig:
    """Fields the shared decoder machinery needs; a family's config extends it."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float
    context_window_size: int
    prefill_chunk_size: int
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    rotary_dim: int | None = None  # RoPE over the first `rotary_dim` dimensions of a head (default: all)
    # Each token attends to the last `sliding_window_size` tokens only; set when the context
    # window is longer than the model's window (a window that never binds is left out).
    sliding_window_size: int | None = None
    # Layers that attend to the last `layer_window_size` tokens only, the others to all (Gemma's
    # interleaved local and global layers): the KV cache's per-layer "mha_sliding" kind.
    windowed_layers: tuple[int, ...] = ()
    layer_window_size: int | None = None
    # The family rotates q and k itself (per-layer RoPE bases); the KV cache then applies none.
    family_applies_rope: bool = False
    # Attention scores s become cap · tanh(s / cap) before the softmax (Gemma 2).
    attention_logit_softcap: float | None = None
    # Every token attends to the tokens after it too (EmbeddingGemma): an embedding model only.
    bidirectional: bool = False
    # Layers that store no K/V and attend over an earlier layer's (Gemma 4's last layers): the KV
    # cache holds the other layers only, in their order (`cache_layer_ids`).
    kv_shared_layers: tuple[int, ...] = ()
    # Layers that keep a recurrent state instead of K/V (LFM2's short convolutions): a hybrid model,
    # whose functions take the state beside the KV cache (kiln/models/recurrent_state.py). Each such
    # layer keeps the states of `recurrent_state`, per sequence: (shape, dtype; None: the model's).
    recurrent_layers: tuple[int, ...] = ()
    recurrent_state: tuple[tuple[tuple[int, ...], str | None], ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Architecture:
    """One registry entry: how to read a family's config, build its module, and find its weights."""

    model_type: str
    parse_config: Callable[[dict, Path, dict[str, int]], DecoderConfig]
    build: Callable[[DecoderConfig, str], "DecoderModel"]
    # Kiln weight name -> source tensors concatenated along axis 0 (fused projections);
    # weights not listed come from the source tensor of the same name.
    fused_sources: Callable[[DecoderConfig], dict[str, list[str]]]
    # Source tensors deliberately not used (regular expressions); any other unused tensor is an error.
    ignored_tensors: tuple[str, ...] = ()
    gguf: GGUFMapping | None = None
    # Where a checkpoint may keep the decoder's "model.*" tensors, when it holds more than the decoder
    # (the text tower of a multimodal checkpoint, named otherwise by other transformers versions).
    decoder_prefixes: tuple[str, ...] = ("model.",)
    # The tensor whose name, after one of `decoder_prefixes`, tells which prefix a checkpoint uses.
    prefix_probe: str = "embed_tokens.weight"
    # Where such a checkpoint may keep the output head, "lm_head.*" (transformers 5 saves a mistral3's as
    # "language_model.lm_head.weight", beside "language_model.model.*").
    head_prefixes: tuple[str, ...] = ("",)
    # The family's layers also run as an embedding model (kiln/models/decoder_embedding.py), for its
    # sentence-transformers checkpoints (Qwen3-Embedding).
    sentence_embeddings: bool = False

    def decoder_prefix(self, tensor_names: list[str]) -> str:
        names = set(tensor_names)
        return next((p for p in self.decoder_prefixes if p + self.prefix_probe in names), self.decoder_prefixes[0])

    def head_prefix(self, tensor_names: list[str]) -> str:
        names = set(tensor_names)
        return next((p for p in self.head_prefixes if f"{p}lm_head.weight" in names), self.head_prefixes[0])


class DecoderModel(nn.Module):
    """Base of every family's top-level module. `dtype` is the activation and KV cache dtype."""

    config: DecoderConfig
    dtype: str

    def embed_tokens(self, token_ids: nn.Tensor) -> nn.Tensor:
        raise NotImplementedError

    def hidden_states(self, embeds: nn.Tensor, kv_cache: PagedKVCache) -> nn.Tensor:
        raise NotImplementedError

    def logits(self, hidden: nn.Tensor) -> nn.Tensor:
        raise NotImplementedError

    def recurrent_states(self) -> list[StateSpec]:
        """The states each of a hybrid model's recurrent layers keeps per sequence; none for others."""
        return [StateSpec(tuple(shape), dtype or self.dtype) for shape, dtype in self.config.recurrent_state]

    def embed(self, input_ids: nn.Tensor) -> nn.Tensor:
        return self.embed_tokens(input_ids)

    def embed_width(self) -> int:
        """The width of what `embed` gives a token, which prefill and decode take."""
        return self.config.hidden_size

    def prefill(self, input_embed: nn.Tensor, paged_kv_cache: PagedKVCache, rnn_state: RecurrentState | None = None):
        hidden = self.layers(input_embed, paged_kv_cache, rnn_state)
        return states_after(self.logits(last_position(hidden)), paged_kv_cache, rnn_state)

    def decode(self, input_embed: nn.Tensor, paged_kv_cache: PagedKVCache, rnn_state: RecurrentState | None = None):
        logits = self.logits(self.layers(input_embed, paged_kv_cache, rnn_state))
        return states_after(logits, paged_kv_cache, rnn_state)

    def batch_prefill(
        self,
        input_embeds: nn.Tensor,
        logit_positions: nn.Tensor,
        paged_kv_cache: PagedKVCache,
        rnn_state: RecurrentState | None = None,
    ):
        hidden = self.layers(input_embeds, paged_kv_cache, rnn_state)
        return states_after(self.logits(gather_positions(hidden, logit_positions)), paged_kv_cache, rnn_state)

    def batch_decode(
        self, input_embeds: nn.Tensor, paged_kv_cache: PagedKVCache, rnn_state: RecurrentState | None = None
    ):
        """The batch's tokens laid out as one row, as prefill lays out a prompt's: the layers then
        run prefill's kernels (TVM gives operators of one shape one kernel), not copies for a
        (batch, 1) shape that every library would compile and WebGPU would make pipelines of. A
        hybrid model's recurrent layers read one sequence's state: its batch is one sequence (the
        engines' and WebLLM's)."""
        batch_size, _, hidden_size = input_embeds.shape
        tokens = nn.op.reshape(input_embeds, (1, batch_size, hidden_size))
        logits = self.logits(self.layers(tokens, paged_kv_cache, rnn_state))
        return states_after(nn.op.reshape(logits, (batch_size, 1, logits.shape[-1])), paged_kv_cache, rnn_state)

    def prefill_all_logits(
        self, input_embed: nn.Tensor, paged_kv_cache: PagedKVCache, rnn_state: RecurrentState | None = None
    ):
        """Logits of every position: forced decoding in one pass (parity checks; WebLLM ignores it)."""
        logits = self.logits(self.layers(input_embed, paged_kv_cache, rnn_state))
        return states_after(logits, paged_kv_cache, rnn_state)

    def verify(self, input_embed: nn.Tensor, paged_kv_cache: PagedKVCache, rnn_state: RecurrentState | None = None):
        """`prefill_all_logits` over a few rows known at compile time (`export_spec`'s `verify_rows`): a
        speculative verify pass, whose matmuls then run decode's kernels with the rows inside."""
        return self.prefill_all_logits(input_embed, paged_kv_cache, rnn_state)

    def layers(self, embeds: nn.Tensor, kv_cache: PagedKVCache, rnn_state: RecurrentState | None) -> nn.Tensor:
        if rnn_state is None:
            return self.hidden_states(embeds, kv_cache)
        rnn_state.specs = self.recurrent_states()
        return self.hidden_states(embeds, kv_cache, rnn_state)

    def create_rnn_state(self, max_batch_size: tvm.tirx.Var, max_history: tvm.tirx.Var) -> RecurrentState:
        layers = len(self.config.recurrent_layers)
        return RecurrentState.create(max_batch_size, max_history, layers, self.recurrent_states())

    def rnn_state_snapshot(self, rnn_state: RecurrentState) -> tuple[nn.Tensor, ...]:
        """A copy of the recurrent state of the sequence the engine began a step of one token for: each
        recurrent layer's states, layer by layer (copies the runtime makes, no kernel: a kernel joining
        them would bind more buffers than WebGPU grants). The engines keep it to come back to a point
        the state's history no longer reaches (`rnn_state_restore`)."""
        rnn_state.specs = self.recurrent_states()
        layers, states = range(len(self.config.recurrent_layers)), range(len(rnn_state.specs))
        return tuple(rnn_state.get(layer, state, 1) for layer in layers for state in states)

    def rnn_state_restore(self, rnn_state: RecurrentState, snapshot: tuple[nn.Tensor, ...]) -> RecurrentState:
        """Write a snapshot as the state that step makes: ending it, the sequence holds the snapshot."""
        rnn_state.specs = self.recurrent_states()
        layers, states = range(len(self.config.recurrent_layers)), range(len(rnn_state.specs))
        for (layer, state), value in zip([(i, j) for i in layers for j in states], snapshot, strict=True):
            rnn_state.set(layer, state, value)
        return rnn_state

    def create_tir_paged_kv_cache(
        self,
        max_batch_size: tvm.tirx.Var,
        max_total_seq_len: tvm.tirx.Var,
        prefill_chunk_size: tvm.tirx.Var,
        page_size: tvm.tirx.Var,
        support_sliding_window: tvm.tirx.Var,
    ) -> PagedKVCache:
        c = self.config
        rope_scaling = {} if rope_in_model(c) else c.rope_scaling or {}  # for the cache's kernels
        layer_kinds = cache_layer_kinds(c)
        with kernels_made_once(), wide_head_prefill_tiles():
            cache = TIRPagedKVCache(
                attn_kind=layer_kinds,
                max_batch_size=max_batch_size,
                max_total_seq_len=max_total_seq_len,
                prefill_chunk_size=prefill_chunk_size,
                page_size=page_size,
                support_sliding_window=support_sliding_window,
                layer_sliding_window_size=c.layer_window_size or 1,
                layer_partition=rx.ShapeExpr([0, len(layer_kinds)]),
                num_hidden_layers=len(layer_kinds),
                num_attention_heads=c.num_attention_heads,
                num_key_value_heads=c.num_key_value_heads,
                qk_head_dim=c.head_dim,
                v_head_dim=c.head_dim,
                mla_original_qk_head_dim=0,
                mla_original_v_head_dim=0,
                rope_mode=RopeMode.NONE if rope_in_model(c) else RopeMode.NORMAL,
                rope_scale=1,
                rope_theta=c.rope_theta,
                rope_scaling=rope_scaling,
                rope_ext_factors=rx.prim_value(0),
                rotary_dim=c.rotary_dim or c.head_dim,
                enable_disaggregation=False,
                dtype=self.dtype,
                target=tvm.target.Target.current(),
            )
        fix_paged_prefill_kernels()
        replace_decode_attention_kernel(c.num_key_value_heads, c.num_attention_heads, c.head_dim, self.dtype)
        if c.sliding_window_size is None:  # a window over the whole model keeps TVM's, which follow it
            replace_prefill_attention_kernels(c.num_key_value_heads, c.num_attention_heads, c.head_dim, self.dtype)
        narrow_webgpu_decode_kernels(
            c.num_key_value_heads,
            c.num_attention_heads,
            c.head_dim,
            self.dtype,
            rope_scaling,
        )
        replace_gpu_merge_state_kernel(self.dtype)
        if c.attention_logit_softcap is not None:
            soft_cap_attention_kernels(c.attention_logit_softcap)
        if building().cpu_kernels:
            declare_cache_kernels_noalias()  # after the replacements: Kiln's own decode kernel is one of them too
        leave_out_unused_attention_kernels(cache, windowed=c.sliding_window_size is not None or bool(c.windowed_layers))
        return cache


def cache_layer_kinds(config: DecoderConfig) -> list[str]:
    """The KV cache's kind of each layer: "mha_sliding" for a windowed one. TVM 0.27's cache needs
    an "mha" layer beside them (it allocates the buffers a "mha_sliding" layer's fused QKV is split
    into only when one exists, and fails on the first step without), so a model whose layers all
    have a window gets one more layer in its cache, which no layer of the model uses."""
    kinds = ["mha_sliding" if i in config.windowed_layers else "mha" for i in cache_layer_ids(config)]
    return kinds if "mha" in kinds else [*kinds, "mha"]


def states_after(result: nn.Tensor, kv_cache: PagedKVCache, rnn_state: RecurrentState | None) -> tuple:
    """A step function's outputs: its result, then the states it carries on."""
    return (result, kv_cache) if rnn_state is None else (result, kv_cache, rnn_state)


def cache_layer_ids(config: DecoderConfig) -> dict[int, int]:
    """Each layer that stores K/V, and the index of its layer in the KV cache."""
    stateless = {*config.kv_shared_layers, *config.recurrent_layers}
    owners = [i for i in range(config.num_hidden_layers) if i not in stateless]
    return {layer: index for index, layer in enumerate(owners)}


def recurrent_layer_ids(config: DecoderConfig) -> dict[int, int]:
    """Each recurrent layer, and the index of its layer in the recurrent state."""
    return {layer: index for index, layer in enumerate(config.recurrent_layers)}


def rope_in_model(config: DecoderConfig) -> bool:
    """TVM's paged KV cache applies the default, llama3 and gptj ropes; the model applies the others
    (`MODEL_ROPES`) and any a family applies itself."""
    return config.family_applies_rope or rope_type(config) in MODEL_ROPES


def rope_type(config: DecoderConfig) -> str | None:
    return (config.rope_scaling or {}).get("rope_type")


def rope_inv_freq(theta: float, rotary_dim: int) -> np.ndarray:
    """RoPE's frequencies: theta^(-2i/d) for each rotated pair."""
    return 1.0 / theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)


def longrope_inv_freq(config: DecoderConfig) -> tuple[np.ndarray, float]:
    """Phi-3's longrope (and llama.cpp's per-dimension `rope_freqs` tables): each frequency divided
    by its factor, cos and sin scaled by the attention factor. The short factors hold up to
    `original_max_position_embeddings`; contexts beyond it are refused by the family."""
    scaling = config.rope_scaling
    rotary_dim = config.rotary_dim or config.head_dim
    inv_freq = rope_inv_freq(config.rope_theta, rotary_dim) / np.array(scaling["short_factor"], np.float64)
    original, longest = scaling["original_max_position_embeddings"], scaling["max_position_embeddings"]
    factor = scaling.get("attention_factor") or (
        math.sqrt(1 + math.log(longest / original) / math.log(original)) if longest > original else 1.0
    )
    return inv_freq.astype(np.float32), float(factor)


def yarn_inv_freq(config: DecoderConfig) -> tuple[np.ndarray, float]:
    """YaRN as transformers computes it (`modeling_rope_utils._compute_yarn_parameters`): each pair's
    frequency ramps, pair by pair, from kept (the pairs that turn more than `beta_fast` times over the
    original context) to divided by `factor` (those that turn less than `beta_slow` times), the ramp's
    ends rounded outwards unless `truncate` is false; cos and sin scaled by the attention factor.
    TVM's own YaRN kernel ramps by head element (the two halves of a pair then turn at different
    frequencies), rounds nothing, scales nothing and needs both betas written."""
    scaling = config.rope_scaling
    rotary_dim = config.rotary_dim or config.head_dim
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]

    def pair_turning(rotations: float) -> float:
        """The (fractional) pair that turns `rotations` times over the original context."""
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(config.rope_theta))

    low, high = pair_turning(scaling.get("beta_fast") or 32), pair_turning(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    # In float32, operation by operation as transformers computes them: the tables agree to the bit
    # (float64 ones differ by an ulp in most pairs: 2.9e-5 of logits on the tiny Mistral, 1.5e-5 so).
    f32 = np.float32
    divisors = f32(config.rope_theta) ** (np.arange(0, rotary_dim, 2, dtype=f32) / f32(rotary_dim))
    kept = 1 - np.clip((np.arange(rotary_dim // 2, dtype=f32) - f32(low)) / f32((high - low) or 0.001), 0, 1)
    inv_freq = 1 / (f32(factor) * divisors) * (1 - kept) + 1 / divisors * kept
    return inv_freq, yarn_attention_factor(scaling)


def yarn_attention_factor(scaling: dict[str, Any]) -> float:
    """`attention_factor`, else the YaRN paper's 0.1·m·ln(factor) + 1 (m = 1, or the ratio of it at
    `mscale` and at `mscale_all_dim` when both are given: DeepSeek's)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def mscale(m: float = 1.0) -> float:
        return 0.1 * m * math.log(scaling["factor"]) + 1.0 if scaling["factor"] > 1 else 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(scaling["mscale"]) / mscale(scaling["mscale_all_dim"])
    return mscale()


# The ropes the model applies (the cache's kernels then apply none): their frequencies and the factor
# that scales cos and sin. TVM's longrope kernel fails to build in this TVM (and would pick the
# factors by chunk length); its YaRN kernel is not transformers' YaRN (`yarn_inv_freq`).
MODEL_ROPES: dict[str, Callable[[DecoderConfig], tuple[np.ndarray, float]]] = {
    "longrope": longrope_inv_freq,
    "yarn": yarn_inv_freq,
}


def apply_rope(qkv: nn.Tensor, kv_cache: PagedKVCache, config: DecoderConfig) -> nn.Tensor:
    """RoPE on the q and k heads of a fused qkv (batch, seq, heads, head_dim) when the family's
    rope is one the model applies (`MODEL_ROPES`); the cache applies the others."""
    frequencies = MODEL_ROPES.get(rope_type(config))
    return qkv if frequencies is None else rotate_qkv(qkv, kv_cache, config, *frequencies(config))


def rotate_qkv(
    qkv: nn.Tensor,
    kv_cache: PagedKVCache,
    config: DecoderConfig,
    inv_freq: np.ndarray,
    attention_factor: float = 1.0,
    rotated_heads: int | None = None,
) -> nn.Tensor:
    """RoPE ("rotate half") of frequencies `inv_freq` on the q and k heads of a fused qkv (batch, seq,
    heads, head_dim), at the positions the KV cache gives this step; `rotated_heads`: how many heads
    come before the values (default: the config's query and KV heads)."""
    batch, seq_len, _, _ = qkv.shape
    positions = kv_cache.get_query_positions(batch * seq_len)
    if rotated_heads is None:
        rotated_heads = config.num_attention_heads + config.num_key_value_heads
    half = len(inv_freq)

    def rotate(x: te.Tensor, pos: te.Tensor, freq: te.Tensor) -> te.Tensor:
        def value(b, s, h, d):
            angle = pos[b * x.shape[1] + s].astype("float32") * freq[d % half]
            partner = tirx.if_then_else(d < half, -x[b, s, h, d + half], x[b, s, h, d - half]).astype("float32")
            rotated = (x[b, s, h, d].astype("float32") * tirx.cos(angle) + partner * tirx.sin(angle)) * attention_factor
            return tirx.if_then_else(tirx.all(h < rotated_heads, d < 2 * half), rotated.astype(x.dtype), x[b, s, h, d])

        return te.compute(x.shape, value, name="rope")

    return nn.op.tensor_expr_op(rotate, "rope", [qkv, positions, nn.Tensor.from_const(inv_freq.astype(np.float32))])


def export_spec(model: DecoderModel, verify_rows: Iterable[int] = ()) -> dict[str, dict]:
    """The signatures of the exported functions (the same for every decoder family), with a verify
    function `verify_<rows>` for each of `verify_rows` (`_metadata`'s, which the engines read)."""
    hidden, dtype = model.embed_width(), model.dtype
    kv_cache = nn.spec.Object(object_type=PagedKVCache)
    with_params = {"param_mode": "packed", "effect_mode": "none"}
    verify = {
        f"verify_{rows}": nn.spec.MethodSpec.from_raw(
            {"input_embed": nn.spec.Tensor([1, rows, hidden], dtype), "paged_kv_cache": kv_cache, "$": with_params},
            model.verify,
        )
        for rows in verify_rows
    }
    spec = {
        "embed": {"input_ids": nn.spec.Tensor(["seq_len"], "int32"), "$": with_params},
        "prefill": {
            "input_embed": nn.spec.Tensor([1, "seq_len", hidden], dtype),
            "paged_kv_cache": kv_cache,
            "$": with_params,
        },
        "decode": {
            "input_embed": nn.spec.Tensor([1, 1, hidden], dtype),
            "paged_kv_cache": kv_cache,
            "$": with_params,
        },
        "batch_prefill": {
            "input_embeds": nn.spec.Tensor([1, "seq_len", hidden], dtype),
            "logit_positions": nn.spec.Tensor(["batch_size"], "int32"),
            "paged_kv_cache": kv_cache,
            "$": with_params,
        },
        "batch_decode": {
            "input_embeds": nn.spec.Tensor(["batch_size", 1, hidden], dtype),
            "paged_kv_cache": kv_cache,
            "$": with_params,
        },
        "prefill_all_logits": {
            "input_embed": nn.spec.Tensor([1, "seq_len", hidden], dtype),
            "paged_kv_cache": kv_cache,
            "$": with_params,
        },
        "create_tir_paged_kv_cache": {
            "max_batch_size": int,
            "max_total_seq_len": int,
            "prefill_chunk_size": int,
            "page_size": int,
            "support_sliding_window": int,
            "$": {"param_mode": "none", "effect_mode": "none"},
        },
    }
    if not model.recurrent_states():
        return {**spec, **verify}  # (a recurrent state cannot undo a step of several tokens: no speculation)
    rnn_state = nn.spec.Object(object_type=RecurrentState)
    steps = {
        name: {**function, "rnn_state": rnn_state} for name, function in spec.items() if "paged_kv_cache" in function
    }
    without_params = {"param_mode": "none", "effect_mode": "none"}
    layers = range(len(model.config.recurrent_layers))
    snapshot = [nn.spec.Tensor([1, *state.shape], state.dtype) for _ in layers for state in model.recurrent_states()]
    return {
        **spec,
        **steps,
        "create_rnn_state": {"max_batch_size": int, "max_history": int, "$": without_params},
        "rnn_state_snapshot": {"rnn_state": rnn_state, "$": without_params},
        "rnn_state_restore": {"rnn_state": rnn_state, "snapshot": snapshot, "$": without_params},
    }
