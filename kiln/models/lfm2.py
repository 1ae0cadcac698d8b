"""LFM2 family (Liquid's LFM2 and LFM2.5, `lfm2`): a hybrid of short-convolution layers and attention.

- A conv layer projects its input to three gates B, C and x (`in_proj`), runs B·x through a causal
  depthwise convolution of `conv_L_cache` taps, multiplies by C and projects back (`out_proj`). Its
  recurrent state is the last `conv_L_cache - 1` inputs of the convolution, per sequence
  (kiln/models/recurrent_state.py).
- An attention layer (`full_attn_idxs`, or `layer_types` "full_attention") is Qwen3's: an RMSNorm over
  each query and key head (`q_layernorm`, `k_layernorm`) before RoPE, its output projection named
  `out_proj`.
- Every layer: `operator_norm` → conv or attention → residual, `ffn_norm` → SwiGLU (`w1`, `w3`, `w2`)
  → residual; `embedding_norm` is the final norm (after the layers, despite its name).
- The MLP's width is derived from `block_ff_dim` (transformers: 2/3 of it, times
  `block_ffn_dim_multiplier`, rounded up to `block_multiple_of`) when `block_auto_adjust_ff_dim`.

Kiln's module names follow Qwen3's; `fused_sources` takes each weight from LFM2's names.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tvm.relax.frontend import nn

from kiln.errors import KilnError

from .causal_conv import DepthwiseConv, conv_state
from .config_reader import ConfigReader
from .decoder import Architecture
from .gguf import GGUFMapping, GGUFTensors, Metadata, decoder_hparams
from .hybrid import HybridForCausalLM
from .layers import Linear, RMSNorm
from .llama import LlamaConfig, LlamaMLP
from .qwen3 import Qwen3Attention
from .recurrent_state import RecurrentState

LAYER_KINDS = ("conv", "full_attention")
CONV_STATE = 0  # the conv layers' one state: their last inputs


@dataclass
class Lfm2Config(LlamaConfig):
    conv_kernel: int = 3  # conv_L_cache
    conv_bias: bool = False


def mlp_width(read: ConfigReader) -> int:
    width = read.get("block_ff_dim", int, None) or read.get("intermediate_size", int)
    if not read.get("block_auto_adjust_ff_dim", bool, True):
        return width
    width = int(2 * width / 3)
    multiplier = read.get("block_ffn_dim_multiplier", float, 1.0)
    width = int(multiplier * width)
    multiple = read.get("block_multiple_of", int, 256)
    return multiple * -(-width // multiple)


def layer_types(read: ConfigReader, layers: int) -> list[str]:
    """Each layer's kind, from `layer_types` or (older configs) `full_attn_idxs`."""
    kinds = read.get("layer_types", list, None)
    if kinds is None:
        attention = read.get("full_attn_idxs", list, None)
        attention = list(range(layers)) if attention is None else attention
        if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers for i in attention):
            raise KilnError(
                f"config.json full_attn_idxs should list layers 0 to {layers - 1}, got {attention}", read.path
            )
        kinds = ["full_attention" if i in attention else "conv" for i in range(layers)]
    unknown = sorted({str(kind) for kind in kinds if kind not in LAYER_KINDS})
    if unknown:
        raise KilnError(
            f"config.json layer_types has {', '.join(unknown)}; Kiln's lfm2 knows {' and '.join(LAYER_KINDS)}",
            read.path,
        )
    if len(kinds) != layers:
        raise KilnError(f"config.json layer_types lists {len(kinds)} layers, num_hidden_layers is {layers}", read.path)
    if "full_attention" not in kinds:
        raise KilnError("config.json layer_types has no attention layer; Kiln's lfm2 needs one", read.path)
    return kinds


def parse_config(hf_config: dict, path: Path, overrides: dict[str, int]) -> Lfm2Config:
    read = ConfigReader(hf_config, path)
    fields = read.decoder_fields(overrides)
    kinds = layer_types(read, fields["num_hidden_layers"])
    hidden = fields["hidden_size"]
    for key in ("conv_dim", "conv_dim_out", "block_dim"):  # each equals hidden_size in every release
        if read.get(key, int, hidden) != hidden:
            raise KilnError(f"config.json {key} should equal hidden_size {hidden}; Kiln's lfm2 computes no other", path)
    read.expect("block_use_swiglu", (True,), True)
    taps = read.get("conv_L_cache", int, 3)
    if taps < 2:
        raise KilnError(
            f"config.json conv_L_cache {taps}: a causal convolution of Kiln's lfm2 has 2 taps or more", path
        )
    return Lfm2Config(
        **{
            **fields,
            "tie_word_embeddings": read.get("tie_embedding", bool, read.get("tie_word_embeddings", bool, True)),
        },
        recurrent_layers=tuple(i for i, kind in enumerate(kinds) if kind == "conv"),
        recurrent_state=(conv_state(fields["hidden_size"], taps),),
        intermediate_size=mlp_width(read),
        rms_norm_eps=read.get("norm_eps", float, 1e-5),
        conv_kernel=taps,
        conv_bias=read.get("conv_bias", bool, False),
        extra=read.unused(),
    )


class Lfm2ShortConv(nn.Module):
    def __init__(self, config: Lfm2Config, dtype: str):
        hidden = config.hidden_size
        self.in_proj = Linear(hidden, 3 * hidden, dtype, bias=config.conv_bias)
        self.conv = DepthwiseConv(hidden, config.conv_kernel, dtype, config.conv_bias)
        self.out_proj = Linear(hidden, hidden, dtype, bias=config.conv_bias)

    def forward(self, x: nn.Tensor, states: RecurrentState, layer: int) -> nn.Tensor:
        gate_b, gate_c, inputs = nn.op.split(self.in_proj(x), 3, axis=-1)
        return self.out_proj(gate_c * self.conv(gate_b * inputs, states, layer, CONV_STATE))


class Lfm2Attention(Qwen3Attention):
    """Qwen3's attention (LFM2's `out_proj`, `q_layernorm` and `k_layernorm` are its `o_proj`, `q_norm`
    and `k_norm`)."""


class Lfm2DecoderLayer(nn.Module):
    def __init__(self, config: Lfm2Config, dtype: str, recurrent: bool):
        self.operator_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        if recurrent:
            self.conv = Lfm2ShortConv(config, dtype)
        else:
            self.self_attn = Lfm2Attention(config, dtype)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.feed_forward = LlamaMLP(config, dtype)

    def forward(self, x: nn.Tensor, operator) -> nn.Tensor:
        x = x + operator(self.operator_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Lfm2ForCausalLM(HybridForCausalLM):
    layer_class = Lfm2DecoderLayer
    norm_class = RMSNorm
    norm_name = "embedding_norm"
    recurrent_name = "conv"


def fused_sources(config: Lfm2Config) -> dict[str, list[str]]:
    """Kiln's Qwen3-named attention and Llama-named MLP from LFM2's tensors."""
    fused = {}
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}"
        attn, mlp = f"{layer}.self_attn", f"{layer}.feed_forward"
        fused[f"{attn}.qkv_proj.weight"] = [f"{attn}.{p}_proj.weight" for p in "qkv"]
        fused[f"{attn}.o_proj.weight"] = [f"{attn}.out_proj.weight"]
        fused[f"{attn}.q_norm.weight"] = [f"{attn}.q_layernorm.weight"]
        fused[f"{attn}.k_norm.weight"] = [f"{attn}.k_layernorm.weight"]
        fused[f"{mlp}.gate_up_proj.weight"] = [f"{mlp}.w1.weight", f"{mlp}.w3.weight"]
        fused[f"{mlp}.down_proj.weight"] = [f"{mlp}.w2.weight"]
    return fused


def gguf_config(metadata: Metadata, tensors: GGUFTensors) -> dict:
    """llama.cpp's LFM2Model converter: a layer's KV heads 0 marks a conv layer; the MLP width as
    derived; the conv's taps as `shortconv.l_cache`."""
    kv_heads = metadata.require("lfm2.attention.head_count_kv")
    per_layer = kv_heads if isinstance(kv_heads, list) else [kv_heads] * metadata.require("lfm2.block_count")
    config = decoder_hparams(metadata, tensors, "lfm2", ["Lfm2ForCausalLM"])
    attention_heads = sorted({heads for heads in per_layer if heads})
    if len(attention_heads) != 1:
        raise KilnError(
            f"lfm2.attention.head_count_kv {kv_heads} should give every attention layer one count", metadata.path
        )
    config |= {
        "num_key_value_heads": attention_heads[0],
        "layer_types": ["full_attention" if heads else "conv" for heads in per_layer],
        "norm_eps": config.pop("rms_norm_eps"),
        "block_auto_adjust_ff_dim": False,
        "conv_L_cache": metadata.require("lfm2.shortconv.l_cache"),
        "conv_bias": "blk.0.shortconv.in_proj.bias" in tensors.names,
    }
    return config


def conv_taps_layout(hf_name: str, values: np.ndarray, config: dict) -> np.ndarray:
    """llama.cpp's converter squeezes a conv's taps to [channels, taps]; Hugging Face keeps [channels, 1, taps]."""
    return values[:, None, :] if hf_name.endswith(".conv.conv.weight") and values.ndim == 2 else values


ARCHITECTURE = Architecture(
    model_type="lfm2",
    parse_config=parse_config,
    build=Lfm2ForCausalLM,
    fused_sources=fused_sources,
    gguf=GGUFMapping(
        architecture="lfm2",
        config=gguf_config,
        layer_tensors={
            "attn_norm": "operator_norm",
            "attn_q": "self_attn.q_proj",
            "attn_k": "self_attn.k_proj",
            "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.out_proj",
            "attn_q_norm": "self_attn.q_layernorm",
            "attn_k_norm": "self_attn.k_layernorm",
            "shortconv.conv": "conv.conv",
            "shortconv.in_proj": "conv.in_proj",
            "shortconv.out_proj": "conv.out_proj",
            "ffn_norm": "ffn_norm",
            "ffn_gate": "feed_forward.w1",
            "ffn_up": "feed_forward.w3",
            "ffn_down": "feed_forward.w2",
        },
        global_tensors={
            "token_embd": "model.embed_tokens",
            "token_embd_norm": "model.embedding_norm",
            "output": "lm_head",
        },
        restore_layout=conv_taps_layout,
    ),
)
