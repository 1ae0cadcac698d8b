"""Qwen3.5 family (dense): `qwen3_5_text`, and the text tower of the multimodal `qwen3_5` checkpoints
(`model.language_model.*`; the vision tower and the multi-token-prediction head `mtp.*` left out).

Three Gated DeltaNet layers for every full-attention layer (`layer_types`, or every
`full_attention_interval`-th layer attends):
- Gated DeltaNet (`linear_attn`): q, k and v projected together (`in_proj_qkv`), through a causal
  depthwise convolution of `linear_conv_kernel_dim` taps and SiLU; q and k L2-normalized (q also
  scaled by 1/√d_k) and each key head shared by `value heads / key heads` value heads; per value head
  a decay g = −exp(A_log)·softplus(a + dt_bias) and a write strength β = σ(b); the delta rule over a
  state S of d_k × d_v per value head, in float32: S ← S·e^g, S ← S + k ⊗ β(v − Sᵀk), o = Sᵀq; then an
  RMSNorm of o gated by SiLU(z) (`norm`, its weight as it is) and `out_proj`. The conv's last inputs
  and S are the layer's recurrent state (kiln/models/recurrent_state.py).
- full attention (`self_attn`): `q_proj` gives each head its query and an output gate side by side
  ([q | gate] per head); q and k normalized per head; RoPE over the first `partial_rotary_factor` of
  each head (Qwen3-VL's interleaved multimodal RoPE, which is plain RoPE when every position is a
  text position, as here); the output times σ(gate).
- RMSNorms scale by 1 + weight (Gemma's), except the gated one.

Kiln fuses q/k/v of an attention layer and the four input projections of a DeltaNet layer each into
one matmul. The delta rule runs in float32, token by token on a CPU and for a decode step, in its
chunked form for a GPU's prefill (kiln/models/delta_rule.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache

from kiln.errors import KilnError

from .causal_conv import DepthwiseConv, conv_state
from .config_reader import ConfigReader
from .decoder import Architecture
from .delta_rule import delta_rule
from .gemma3 import GemmaRMSNorm
from .hybrid import HybridForCausalLM
from .layers import Linear
from .llama import LlamaConfig, LlamaMLP
from .recurrent_state import RecurrentState

LAYER_KINDS = ("linear_attention", "full_attention")
CONV_STATE, DELTA_STATE = 0, 1
L2_NORM_EPS = 1e-6  # transformers' l2norm (as the FLA library's)
SOFTPLUS_THRESHOLD = 20.0  # torch's softplus: x itself above it


@dataclass
class Qwen35Config(LlamaConfig):
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    linear_conv_kernel: int = 4


def layer_types(read: ConfigReader, layers: int) -> list[str]:
    kinds = read.get("layer_types", list, None)
    if kinds is None:
        interval = read.get("full_attention_interval", int, 4)
        kinds = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    unknown = sorted({str(kind) for kind in kinds if kind not in LAYER_KINDS})
    if unknown:
        raise KilnError(
            f"config.json layer_types has {', '.join(unknown)}; Kiln's qwen3_5 knows {' and '.join(LAYER_KINDS)}",
            read.path,
        )
    if len(kinds) != layers:
        raise KilnError(f"config.json layer_types lists {len(kinds)} layers, num_hidden_layers is {layers}", read.path)
    if "full_attention" not in kinds:
        raise KilnError("config.json layer_types has no full_attention layer; Kiln's qwen3_5 needs one", read.path)
    return kinds


def parse_text_config(hf_config: dict, path: Path, overrides: dict[str, int]) -> Qwen35Config:
    read = ConfigReader(hf_config, path)
    read.expect("attention_bias", (False,), False)
    read.expect("hidden_act", ("silu",), "silu")
    fields = read.decoder_fields(overrides, partial_rotary=True)
    rope = read.hf_config.get("rope_parameters") or {}
    share = rope.get("partial_rotary_factor", read.hf_config.get("partial_rotary_factor", 0.25))
    rotary_dim = int(fields["head_dim"] * share) if isinstance(share, (int, float)) else 0
    if not 0 < rotary_dim <= fields["head_dim"] or rotary_dim % 2:
        raise KilnError(
            f"config.json partial_rotary_factor {share!r} should turn an even number of each head's "
            f"{fields['head_dim']} dimensions",
            path,
        )
    key_heads = read.get("linear_num_key_heads", int, 16)
    value_heads = read.get("linear_num_value_heads", int, 32)
    if value_heads % key_heads:
        raise KilnError(
            f"config.json linear_num_key_heads {key_heads} does not divide linear_num_value_heads {value_heads}", path
        )
    kinds = layer_types(read, fields["num_hidden_layers"])
    key_dim, value_dim = read.get("linear_key_head_dim", int, 128), read.get("linear_value_head_dim", int, 128)
    taps = read.get("linear_conv_kernel_dim", int, 4)
    return Qwen35Config(
        **fields,
        rotary_dim=rotary_dim,
        recurrent_layers=tuple(i for i, kind in enumerate(kinds) if kind == "linear_attention"),
        # the conv's last inputs (q, k and v), and the delta rule's state S per value head, by column
        recurrent_state=(
            conv_state(2 * key_heads * key_dim + value_heads * value_dim, taps),
            ((value_heads, key_dim, value_dim), "float32"),
        ),
        intermediate_size=read.get("intermediate_size", int),
        rms_norm_eps=read.get("rms_norm_eps", float, 1e-6),
        linear_key_heads=key_heads,
        linear_value_heads=value_heads,
        linear_key_dim=key_dim,
        linear_value_dim=value_dim,
        linear_conv_kernel=taps,
        extra=read.unused(),
    )


def parse_multimodal_config(hf_config: dict, path: Path, overrides: dict[str, int]) -> Qwen35Config:
    """A `qwen3_5` checkpoint: its text tower's config (`text_config`), with the checkpoint's tied head."""
    text = hf_config.get("text_config")
    if not isinstance(text, dict):
        raise KilnError("config.json of a qwen3_5 checkpoint should hold its text tower's text_config", path)
    tied = hf_config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    return parse_text_config({**text, "model_type": "qwen3_5_text", "tie_word_embeddings": tied}, path, overrides)


class Qwen35Attention(nn.Module):
    def __init__(self, config: Qwen35Config, dtype: str):
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        rows = (2 * self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, rows, dtype)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, dtype)

    def forward(self, x: nn.Tensor, kv_cache: PagedKVCache, layer_id: int) -> nn.Tensor:
        batch, seq_len, _ = x.shape
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = nn.op.reshape(self.qkv_proj(x), (batch, seq_len, -1, head_dim))
        queries_and_gates, k, v = nn.op.split(qkv, [2 * heads, 2 * heads + kv_heads], axis=2)
        q, gate = nn.op.split(nn.op.reshape(queries_and_gates, (batch, seq_len, heads, 2 * head_dim)), 2, axis=-1)
        qkv = nn.op.concat([self.q_norm(q), self.k_norm(k), v], dim=2)
        attended = kv_cache.attention_with_fused_qkv(layer_id, qkv, heads, sm_scale=head_dim**-0.5)
        gated = attended * nn.op.sigmoid(gate)
        return self.o_proj(nn.op.reshape(gated, (batch, seq_len, heads * head_dim)))


def l2_normalized(x: te.Tensor, scale: float) -> te.Tensor:
    """x / ‖x‖ over the last axis, times `scale`, in float32."""
    *_, width = x.shape
    i = te.reduce_axis((0, width), name="i")

    def squared(*idx):
        value = x[idx].astype("float32")
        return value * value

    squares = te.compute(x.shape[:-1], lambda *idx: te.sum(squared(*idx, i), axis=i), name="squares")
    return te.compute(
        x.shape,
        lambda *idx: x[idx].astype("float32") * tirx.rsqrt(squares[idx[:-1]] + L2_NORM_EPS) * scale,
        name="l2_normalized",
    )


def decay(a: te.Tensor, a_log: te.Tensor, dt_bias: te.Tensor) -> te.Tensor:
    """g = −exp(A_log) · softplus(a + dt_bias), per token and value head."""

    def softplus(x):  # log, not log1p: WGSL has no log1p (they part below e^-16, where g ≈ 0 either way)
        return tirx.if_then_else(x > SOFTPLUS_THRESHOLD, x, tirx.log(1 + tirx.exp(x)))

    return te.compute(
        a.shape,
        lambda b, t, h: -tirx.exp(a_log[h]) * softplus(a[b, t, h].astype("float32") + dt_bias[h]),
        name="decay",
    )


def gated_norm(o: te.Tensor, z: te.Tensor, weight: te.Tensor, eps: float) -> te.Tensor:
    """weight · o / rms(o) · SiLU(z) over each head's values, o taken in the model's dtype as transformers
    takes it."""
    *_, width = o.shape
    dtype = z.dtype

    def values(*idx):
        return o[idx].astype(dtype).astype("float32")

    i = te.reduce_axis((0, width), name="i")
    squares = te.compute(o.shape[:-1], lambda *idx: te.sum(values(*idx, i) * values(*idx, i), axis=i), name="squares")

    def gated(*idx):
        normed = (values(*idx) * tirx.rsqrt(squares[idx[:-1]] / width + eps)).astype(dtype)
        gate = z[idx].astype("float32")
        return ((weight[idx[-1]] * normed).astype("float32") * gate * tirx.sigmoid(gate)).astype(dtype)

    return te.compute(o.shape, gated, name="gated_norm")


class GatedRMSNorm(nn.Module):
    def __init__(self, width: int, eps: float, dtype: str):
        self.eps = eps
        self.weight = nn.Parameter((width,), dtype)

    def forward(self, o: nn.Tensor, z: nn.Tensor) -> nn.Tensor:
        eps = self.eps
        return nn.op.tensor_expr_op(lambda o, z, w: gated_norm(o, z, w, eps), "gated_norm", [o, z, self.weight])


class Qwen35GatedDeltaNet(nn.Module):
    def __init__(self, config: Qwen35Config, dtype: str):
        self.key_heads, self.value_heads = config.linear_key_heads, config.linear_value_heads
        self.key_dim, self.value_dim = config.linear_key_dim, config.linear_value_dim
        keys, values = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        self.splits = [2 * keys + values, 2 * keys + 2 * values, 2 * keys + 2 * values + self.value_heads]
        # in_proj_qkv, in_proj_z, in_proj_b and in_proj_a, fused
        self.in_proj = Linear(config.hidden_size, 2 * keys + 2 * values + 2 * self.value_heads, dtype)
        self.conv1d = DepthwiseConv(2 * keys + values, config.linear_conv_kernel, dtype, bias=False)
        self.A_log = nn.Parameter((self.value_heads,), "float32")
        self.dt_bias = nn.Parameter((self.value_heads,), "float32")
        self.norm = GatedRMSNorm(self.value_dim, config.rms_norm_eps, dtype)
        self.out_proj = Linear(values, config.hidden_size, dtype)

    def forward(self, x: nn.Tensor, states: RecurrentState, layer: int) -> nn.Tensor:
        batch, seq_len, _ = x.shape
        mixed, z, b, a = nn.op.split(self.in_proj(x), self.splits, axis=-1)
        mixed = nn.op.silu(self.conv1d(mixed, states, layer, CONV_STATE))
        keys = self.key_heads * self.key_dim
        q, k, v = nn.op.split(mixed, [keys, 2 * keys], axis=-1)
        q = nn.op.reshape(q, (batch, seq_len, self.key_heads, self.key_dim))
        k = nn.op.reshape(k, (batch, seq_len, self.key_heads, self.key_dim))
        v = nn.op.reshape(v, (batch, seq_len, self.value_heads, self.value_dim)).astype("float32")
        q = nn.op.tensor_expr_op(lambda x: l2_normalized(x, 1 / math.sqrt(self.key_dim)), "l2_normalized", [q])
        k = nn.op.tensor_expr_op(lambda x: l2_normalized(x, 1.0), "l2_normalized", [k])
        g = nn.op.tensor_expr_op(decay, "decay", [a, self.A_log, self.dt_bias])
        beta = nn.op.sigmoid(b.astype("float32"))
        past = states.get(layer, DELTA_STATE, batch)
        o, state = delta_rule(q, k, v, g, beta, past)
        states.set(layer, DELTA_STATE, state)
        normed = self.norm(o, nn.op.reshape(z, (batch, seq_len, self.value_heads, self.value_dim)))
        return self.out_proj(nn.op.reshape(normed, (batch, seq_len, self.value_heads * self.value_dim)))


class Qwen35DecoderLayer(nn.Module):
    def __init__(self, config: Qwen35Config, dtype: str, recurrent: bool):
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        if recurrent:
            self.linear_attn = Qwen35GatedDeltaNet(config, dtype)
        else:
            self.self_attn = Qwen35Attention(config, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(config, dtype)

    def forward(self, x: nn.Tensor, mixer) -> nn.Tensor:
        x = x + mixer(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen35ForCausalLM(HybridForCausalLM):
    layer_class = Qwen35DecoderLayer
    norm_class = GemmaRMSNorm
    norm_name = "norm"
    recurrent_name = "linear_attn"


def fused_sources(config: Qwen35Config) -> dict[str, list[str]]:
    fused = {}
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}"
        attn, linear, mlp = f"{layer}.self_attn", f"{layer}.linear_attn", f"{layer}.mlp"
        fused[f"{attn}.qkv_proj.weight"] = [f"{attn}.{p}_proj.weight" for p in "qkv"]
        fused[f"{linear}.in_proj.weight"] = [f"{linear}.in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")]
        fused[f"{mlp}.gate_up_proj.weight"] = [f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"]
    return fused


# The multi-token-prediction head (its speculation Kiln does not run).
IGNORED_TENSORS = (r"mtp\..*",)

ARCHITECTURE = Architecture(
    model_type="qwen3_5_text",
    parse_config=parse_text_config,
    build=Qwen35ForCausalLM,
    fused_sources=fused_sources,
    ignored_tensors=IGNORED_TENSORS,
)

MULTIMODAL_ARCHITECTURE = Architecture(
    model_type="qwen3_5",
    parse_config=parse_multimodal_config,
    build=Qwen35ForCausalLM,
    fused_sources=fused_sources,
    ignored_tensors=(*IGNORED_TENSORS, r"model\.visual\..*"),
    decoder_prefixes=("model.language_model.", "model."),
)
