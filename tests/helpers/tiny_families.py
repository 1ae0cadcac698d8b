"""Tiny random checkpoints of every model family, made with transformers' own config and model
classes, and the same weights written as a GGUF the way llama.cpp's converter names and lays them
out. Biases and norm weights are randomized too (transformers initializes them to 0 and 1, which
would hide a bias or norm that is dropped or swapped)."""

from __future__ import annotations

import json
import math
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import gguf
import numpy as np

from helpers.random_blocks import BLOCK_SHAPES, HALF_FIELDS, random_blocks
from helpers.tiny_llama import VOCAB_SIZE, write_tokenizer

COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    bos_token_id=0,
    eos_token_id=2,
    pad_token_id=0,
    # Larger than the usual 0.02 so that logits are peaked and greedy choices are clear.
    initializer_range=0.15,
)


def rope_parameters(config) -> dict:
    """rope_theta and the scaling fields (transformers 5 keeps them in `rope_parameters`, Gemma 3's by
    kind of layer: the global layers' here)."""
    params = getattr(config, "rope_parameters", None) or {
        "rope_theta": config.rope_theta,
        **(config.rope_scaling or {}),
    }
    return params.get("full_attention", params)


def llama3_rope_factors(config) -> np.ndarray:
    """llama.cpp's converter: the llama3 rope scaling as per-dimension frequency divisors."""
    scaling = rope_parameters(config)
    head_dim = config.hidden_size // config.num_attention_heads
    freqs = 1.0 / (scaling["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    old_context = scaling["original_max_position_embeddings"]
    low_wavelen = old_context / scaling["low_freq_factor"]
    high_wavelen = old_context / scaling["high_freq_factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(scaling["factor"])
        else:
            smooth = (old_context / wavelen - scaling["low_freq_factor"]) / (
                scaling["high_freq_factor"] - scaling["low_freq_factor"]
            )
            factors.append(1 / ((1 - smooth) / scaling["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def permute_for_llama_cpp(weight: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to a Llama's Q and K rows (and biases)."""
    halves = weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
    return halves.swapaxes(1, 2).reshape(weight.shape)


@dataclass(frozen=True)
class TinyFamily:
    """A family's tiny model: how to make its transformers config and model, and how llama.cpp
    names it (GGUF architecture, Hugging Face → GGUF tensor parts, per-layer and global; None: Kiln
    reads no GGUF of the family)."""

    make: Callable[[], tuple]  # () → (transformers config, model class)
    gguf_architecture: str | None
    layer_tensors: dict[str, str]  # HF part after "model.layers.N." → GGUF part after "blk.N."
    permute_qk: bool = False
    extra_gguf: Callable[[object, gguf.GGUFWriter], None] = lambda config, writer: None
    # A GGUF that loses a sliding window (llama.cpp converts Mistral as a Llama) agrees with the
    # Hugging Face build only while the window does not bind.
    gguf_same_positions: int | None = None
    norm_shift: float = 0.0  # what llama.cpp's converter adds to the family's norm weights


LLAMA_PARTS = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama3_with_biases():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaConfig(
        **COMMON,
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ), LlamaForCausalLM


def add_llama3_rope_freqs(config, writer: gguf.GGUFWriter) -> None:
    writer.add_tensor("rope_freqs.weight", llama3_rope_factors(config))


def qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2Config(**COMMON, tie_word_embeddings=True), Qwen2ForCausalLM


def mistral():
    from transformers import MistralConfig, MistralForCausalLM

    return MistralConfig(**COMMON, sliding_window=MISTRAL_WINDOW, tie_word_embeddings=False), MistralForCausalLM


MISTRAL_WINDOW = 16  # shorter than the test prompts: the window binds
PHI3_PARTS = {
    "input_layernorm": "attn_norm",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
PHI3_ORIGINAL_CONTEXT = 512


def phi3_longrope():
    """Phi-3.5-mini's kind of config with Phi-4-mini's partial rotary factor: LongRoPE factors for
    the rotated pairs only, more positions than the original context (attention factor ≈ 1.15),
    and a sliding window longer than the context Kiln builds."""
    from transformers import Phi3Config, Phi3ForCausalLM

    partial_rotary_factor = 0.75
    rotary_dim = int(COMMON["hidden_size"] // COMMON["num_attention_heads"] * partial_rotary_factor)
    short_factor, long_factor = np.random.default_rng(3).uniform(1, 4, (2, rotary_dim // 2)).tolist()
    config = Phi3Config(
        **{**COMMON, "max_position_embeddings": 4096},
        original_max_position_embeddings=PHI3_ORIGINAL_CONTEXT,
        partial_rotary_factor=partial_rotary_factor,
        sliding_window=2047,
        tie_word_embeddings=False,
        rope_scaling={"rope_type": "longrope", "short_factor": short_factor, "long_factor": long_factor},
    )
    return config, Phi3ForCausalLM


def add_phi3_rope(config, writer: gguf.GGUFWriter) -> None:
    """llama.cpp's Phi3MiniModel converter: the original context, the sliding window (0: none) and
    LongRoPE's attention factor and factor tables."""
    scaling = rope_parameters(config)
    original = scaling["original_max_position_embeddings"]
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_sliding_window(config.sliding_window or 0)
    scale = config.max_position_embeddings / original
    writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
    writer.add_tensor("rope_factors_long.weight", np.array(scaling["long_factor"], dtype=np.float32))
    writer.add_tensor("rope_factors_short.weight", np.array(scaling["short_factor"], dtype=np.float32))


def qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    # Like every Qwen3, a head_dim that is not hidden_size / heads (16 here).
    return Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=True), Qwen3ForCausalLM


GEMMA_WINDOW = 16


def gemma3():
    """Gemma 3 4B's kind of config: local layers with their own RoPE base and a window shorter than
    the test prompts, a global layer with linear RoPE scaling, a final-logit soft-cap (Gemma 2's), and
    query_pre_attn_scalar = head_dim (llama.cpp assumes it) ≠ hidden_size / heads."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        **{**COMMON, "num_hidden_layers": 3},
        head_dim=32,
        query_pre_attn_scalar=32,
        sliding_window=GEMMA_WINDOW,
        final_logit_softcapping=15.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
        },
    )
    return config, Gemma3ForCausalLM


def add_gemma3_windows(config, writer: gguf.GGUFWriter) -> None:
    """llama.cpp's Gemma3Model converter: the window, the final soft-cap and the global layers' linear
    RoPE scaling; the local RoPE base and the windowed layers as llama.cpp's loader reads them."""
    writer.add_sliding_window(config.sliding_window)
    writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in config.layer_types])
    writer.add_rope_freq_base_swa(config.rope_parameters["sliding_attention"]["rope_theta"])
    writer.add_final_logit_softcapping(config.final_logit_softcapping)
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(rope_parameters(config)["factor"])


def gemma2():
    """Gemma 2 with the local layers' window shorter than the test prompts, head_dim ≠ hidden_size /
    heads (query_pre_attn_scalar = head_dim, as llama.cpp assumes), and an attention soft-cap low
    enough to change the logits by several units (Gemma 2's own cap, 50, is far above the tiny
    model's scores)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        **{**COMMON, "num_hidden_layers": 3},
        head_dim=32,
        query_pre_attn_scalar=32,
        sliding_window=GEMMA_WINDOW,
        attn_logit_softcapping=GEMMA2_ATTENTION_SOFTCAP,
        final_logit_softcapping=10.0,
    )
    return config, Gemma2ForCausalLM


GEMMA2_ATTENTION_SOFTCAP = 3.0


def add_gemma2_softcaps(config, writer: gguf.GGUFWriter) -> None:
    """llama.cpp's Gemma2Model converter: the window and both soft-caps."""
    writer.add_sliding_window(config.sliding_window)
    writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
    writer.add_final_logit_softcapping(config.final_logit_softcapping)


GEMMA4_WINDOW = 8
GEMMA4_HEAD_DIMS = (16, 32)  # local, global
GEMMA4_KV_HEADS = (2, 1)  # local, global


def gemma4():
    """Gemma 4 with every feature on: 5 layers, local heads of 16 and global ones of 32 with fewer KV
    heads whose keys are the values, the K/V of the last 2 layers shared (with double-wide MLPs),
    per-layer embeddings 8 wide, a window of 8, proportional RoPE on the global layers, a final
    soft-cap."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    config = Gemma4TextConfig(
        **{**COMMON, "num_hidden_layers": 5, "intermediate_size": 96, "num_key_value_heads": GEMMA4_KV_HEADS[0]},
        head_dim=GEMMA4_HEAD_DIMS[0],
        global_head_dim=GEMMA4_HEAD_DIMS[1],
        num_global_key_value_heads=GEMMA4_KV_HEADS[1],
        attention_k_eq_v=True,
        sliding_window=GEMMA4_WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=COMMON["vocab_size"],
        final_logit_softcapping=15.0,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
        },
    )
    return config, Gemma4ForCausalLM


def write_gemma4_hyperparameters(config, writer: gguf.GGUFWriter) -> None:
    """llama.cpp's Gemma4Model converter: the global head size as the key length and the local one's
    apart, KV heads and feed-forward widths per layer, the shared layers, the per-layer embedding
    width, the windows, both RoPE bases and the proportional RoPE as `rope_freqs` factors."""
    local = [kind == "sliding_attention" for kind in config.layer_types]
    first_shared = config.num_hidden_layers - config.num_kv_shared_layers
    width = config.intermediate_size
    local_head_dim, global_head_dim = GEMMA4_HEAD_DIMS
    writer.add_key_length(global_head_dim)
    writer.add_value_length(global_head_dim)
    writer.add_key_length_swa(local_head_dim)
    writer.add_value_length_swa(local_head_dim)
    writer.add_rope_dimension_count(global_head_dim)
    writer.add_rope_dimension_count_swa(local_head_dim)
    writer.add_head_count_kv([GEMMA4_KV_HEADS[0] if is_local else GEMMA4_KV_HEADS[1] for is_local in local])
    writer.add_feed_forward_length([width if i < first_shared else 2 * width for i in range(config.num_hidden_layers)])
    writer.add_shared_kv_layers(config.num_kv_shared_layers)
    writer.add_embedding_length_per_layer_input(config.hidden_size_per_layer_input)
    writer.add_sliding_window(config.sliding_window)
    writer.add_sliding_window_pattern(local)
    writer.add_rope_freq_base(config.rope_parameters["full_attention"]["rope_theta"])
    writer.add_rope_freq_base_swa(config.rope_parameters["sliding_attention"]["rope_theta"])
    writer.add_final_logit_softcapping(config.final_logit_softcapping)
    turning = int(global_head_dim * config.rope_parameters["full_attention"]["partial_rotary_factor"] / 2)
    factors = [1.0] * turning + [1e30] * (global_head_dim // 2 - turning)
    writer.add_tensor("rope_freqs.weight", np.array(factors, np.float32))


def granite():
    """Granite's four scalars, seeded random and each far from its default of 1 (the attention scale
    from 1/sqrt(head_dim) too), with tied embeddings as Granite 3.x has them."""
    from transformers import GraniteConfig, GraniteForCausalLM

    embedding, residual, attention, logits = np.random.default_rng(40).uniform((4, 0.2, 0.05, 1.5), (12, 0.6, 0.15, 3))
    config = GraniteConfig(
        **COMMON,
        tie_word_embeddings=True,
        embedding_multiplier=float(embedding),
        residual_multiplier=float(residual),
        attention_multiplier=float(attention),
        logits_scaling=float(logits),
    )
    return config, GraniteForCausalLM


def add_granite_scalars(config, writer: gguf.GGUFWriter) -> None:
    """llama.cpp's GraniteModel converter: the four scalars under its names."""
    writer.add_embedding_scale(config.embedding_multiplier)
    writer.add_residual_scale(config.residual_multiplier)
    writer.add_attention_scale(config.attention_multiplier)
    writer.add_logit_scale(config.logits_scaling)


def smollm3():
    """SmolLM3's layout: 4 layers, the 4th without RoPE as SmolLM3's every 4th (as llama.cpp runs a GGUF),
    tied embeddings, grouped-query attention."""
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    config = SmolLM3Config(**{**COMMON, "num_hidden_layers": 4}, no_rope_layer_interval=4, tie_word_embeddings=True)
    assert config.no_rope_layers == [1, 1, 1, 0]
    return config, SmolLM3ForCausalLM


def olmo2():
    """OLMo 2 as released: untied embeddings, no biases."""
    from transformers import Olmo2Config, Olmo2ForCausalLM

    return Olmo2Config(**COMMON, tie_word_embeddings=False), Olmo2ForCausalLM


OLMO3_WINDOW = 16  # shorter than the test prompts: the window binds


def olmo3():
    """OLMo 3 with transformers' layer pattern (every 4th layer full) and a window shorter than the
    test prompts; the two kinds of layers share their RoPE (as in llama.cpp, which has one base)."""
    from transformers import Olmo3Config, Olmo3ForCausalLM

    rope = {"rope_type": "default", "rope_theta": COMMON["rope_theta"]}
    config = Olmo3Config(
        **{key: value for key, value in COMMON.items() if key != "rope_theta"} | {"num_hidden_layers": 4},
        sliding_window=OLMO3_WINDOW,
        tie_word_embeddings=False,
        rope_parameters={"sliding_attention": dict(rope), "full_attention": dict(rope)},
    )
    return config, Olmo3ForCausalLM


def add_olmo3_windows(config, writer: gguf.GGUFWriter) -> None:
    """llama.cpp's Olmo2Model converter, which also converts OLMo 3: the window and the windowed layers."""
    writer.add_sliding_window(config.sliding_window)
    writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in config.layer_types])


OLMO2_PARTS = {
    **{hf: part for hf, part in LLAMA_PARTS.items() if part not in ("attn_norm", "ffn_norm")},
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "post_attention_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
# The test prompts run past it (34 tokens; 39 with 32 greedy ones after the first): the query scale
# steps up twice.
MINISTRAL3_ORIGINAL_CONTEXT = 16
MINISTRAL3_QUERY_SCALE_BETA = float(np.random.default_rng(41).uniform(0.5, 1.0))


def ministral3():
    """Ministral 3's kind of config (YaRN with its betas and mscale pair, Llama 4's query scale), over an
    original context the test prompts run past, with the query scale's β seeded random and far above
    Ministral 3's 0.1 (at 0.1 the scale is 1.07 from the original context on)."""
    from transformers import Ministral3Config, Ministral3ForCausalLM

    config = Ministral3Config(
        **{k: v for k, v in COMMON.items() if k != "rope_theta"},
        head_dim=COMMON["hidden_size"] // COMMON["num_attention_heads"],
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1000000.0,
            "factor": COMMON["max_position_embeddings"] / MINISTRAL3_ORIGINAL_CONTEXT,
            "original_max_position_embeddings": MINISTRAL3_ORIGINAL_CONTEXT,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "llama_4_scaling_beta": MINISTRAL3_QUERY_SCALE_BETA,
        },
    )
    return config, Ministral3ForCausalLM


def add_ministral3_rope(config, writer: gguf.GGUFWriter) -> None:
    """llama.cpp's Mistral3Model converter: YaRN's fields as config.json gives them, mscale_all_dim as
    the log multiplier and the query scale's β as the attention temperature scale."""
    scaling = rope_parameters(config)
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(scaling["factor"])
    writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_beta_fast(scaling["beta_fast"])
    writer.add_rope_scaling_yarn_beta_slow(scaling["beta_slow"])
    writer.add_rope_scaling_yarn_log_mul(scaling["mscale_all_dim"])
    writer.add_attn_temperature_scale(scaling["llama_4_scaling_beta"])


LFM2_LAYER_TYPES = ["conv", "full_attention", "conv", "conv", "full_attention"]


def lfm2():
    """LFM2 with both kinds of layer (conv, attention, two convs, attention), biased convolutions of 3
    taps, and an MLP width derived from `block_ff_dim` (2/3 of 128 rounded up to 32: 96)."""
    from transformers import Lfm2Config, Lfm2ForCausalLM

    config = Lfm2Config(
        **{k: v for k, v in COMMON.items() if k not in ("rms_norm_eps", "rope_theta", "num_hidden_layers")},
        num_hidden_layers=len(LFM2_LAYER_TYPES),
        norm_eps=1e-5,
        layer_types=LFM2_LAYER_TYPES,
        conv_L_cache=3,
        conv_bias=True,
        block_multiple_of=32,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )
    return config, Lfm2ForCausalLM


def write_lfm2_hyperparameters(config, writer: gguf.GGUFWriter) -> None:
    """llama.cpp's LFM2Model converter: KV heads 0 on the conv layers, the derived MLP width, the
    conv's taps."""
    writer.add_head_count_kv(
        [config.num_key_value_heads if kind == "full_attention" else 0 for kind in config.layer_types]
    )
    writer.add_feed_forward_length(LFM2_MLP_WIDTH)
    writer.add_shortconv_l_cache(config.conv_L_cache)


LFM2_MLP_WIDTH = 96
QWEN3_5_LAYER_TYPES = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]


def qwen3_5():
    """Qwen3.5 with its 3:1 pattern of Gated DeltaNet and gated full attention, 8 value heads to a key
    head, heads of 32 (RoPE over a quarter of each), A_log, dt_bias and the conv's taps randomized. The
    DeltaNet's fused input projection is 352 wide: with 4 value heads (136 wide), SwiftShader lost
    the WebGPU device in that matmul's prefill kernel past 64 rows."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        **{k: v for k, v in COMMON.items() if k not in ("rope_theta", "num_hidden_layers")},
        num_hidden_layers=len(QWEN3_5_LAYER_TYPES),
        layer_types=QWEN3_5_LAYER_TYPES,
        head_dim=32,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=16,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
    )
    return config, Qwen3_5ForCausalLM


GEMMA2_PARTS = {
    **LLAMA_PARTS,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
GEMMA3_PARTS = {**GEMMA2_PARTS, "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
LFM2_PARTS = {
    "operator_norm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.out_proj": "attn_output",
    "self_attn.q_layernorm": "attn_q_norm",
    "self_attn.k_layernorm": "attn_k_norm",
    "conv.conv": "shortconv.conv",
    "conv.in_proj": "shortconv.in_proj",
    "conv.out_proj": "shortconv.out_proj",
    "ffn_norm": "ffn_norm",
    "feed_forward.w1": "ffn_gate",
    "feed_forward.w3": "ffn_up",
    "feed_forward.w2": "ffn_down",
}
GEMMA4_PARTS = {
    **GEMMA3_PARTS,
    "per_layer_input_gate": "inp_gate",
    "per_layer_projection": "proj",
    "post_per_layer_input_norm": "post_norm",
    "layer_scalar": "layer_output_scale",
}


TINY_FAMILIES: dict[str, TinyFamily] = {
    "llama3": TinyFamily(llama3_with_biases, "llama", LLAMA_PARTS, permute_qk=True, extra_gguf=add_llama3_rope_freqs),
    "qwen2": TinyFamily(qwen2, "qwen2", LLAMA_PARTS),
    # llama.cpp converts Mistral as a Llama.
    "mistral": TinyFamily(mistral, "llama", LLAMA_PARTS, permute_qk=True, gguf_same_positions=MISTRAL_WINDOW),
    "phi3": TinyFamily(phi3_longrope, "phi3", PHI3_PARTS, extra_gguf=add_phi3_rope),
    "qwen3": TinyFamily(
        qwen3, "qwen3", {**LLAMA_PARTS, "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    ),
    "gemma2": TinyFamily(gemma2, "gemma2", GEMMA2_PARTS, extra_gguf=add_gemma2_softcaps, norm_shift=1.0),
    "gemma3": TinyFamily(gemma3, "gemma3", GEMMA3_PARTS, extra_gguf=add_gemma3_windows, norm_shift=1.0),
    "gemma4": TinyFamily(gemma4, "gemma4", GEMMA4_PARTS, extra_gguf=write_gemma4_hyperparameters),
    "lfm2": TinyFamily(lfm2, "lfm2", LFM2_PARTS, extra_gguf=write_lfm2_hyperparameters),
    "qwen3_5": TinyFamily(qwen3_5, None, {}),
    # llama.cpp converts Granite as a Llama (Q and K permuted) under its own name.
    "granite": TinyFamily(granite, "granite", LLAMA_PARTS, permute_qk=True, extra_gguf=add_granite_scalars),
    # llama.cpp converts SmolLM3 as a Llama (Q and K permuted) under its own name, the NoPE layers unwritten.
    "smollm3": TinyFamily(smollm3, "smollm3", LLAMA_PARTS, permute_qk=True),
    # llama.cpp converts OLMo 2 and 3 as "olmo2", Q and K unpermuted.
    "olmo2": TinyFamily(olmo2, "olmo2", OLMO2_PARTS),
    "olmo3": TinyFamily(olmo3, "olmo2", OLMO2_PARTS, extra_gguf=add_olmo3_windows),
    # llama.cpp converts Ministral 3 as a Llama (Q and K permuted) under the name "mistral3".
    "ministral3": TinyFamily(ministral3, "mistral3", LLAMA_PARTS, permute_qk=True, extra_gguf=add_ministral3_rope),
}
GGUF_FAMILIES = sorted(name for name, family in TINY_FAMILIES.items() if family.gguf_architecture)


# The families the tests also build for the browser and arm64 (llama3 and qwen3 are the Llama's and
# Qwen 2's layers with other parts).
BROWSER_FAMILIES = (
    "qwen2",
    "phi3",
    "mistral",
    "gemma2",
    "gemma3",
    "gemma4",
    "granite",
    "smollm3",
    "olmo2",
    "olmo3",
    "ministral3",
    "lfm2",
    "qwen3_5",
)


def all_local(make: Callable[[], tuple]) -> Callable[[], tuple]:
    """A Gemma's tiny config with every layer local: a window and no global layer."""

    def made():
        config, model_class = make()
        config.layer_types = ["sliding_attention"] * config.num_hidden_layers
        return config, model_class

    return made


ALL_LOCAL_FAMILIES: dict[str, TinyFamily] = {
    f"{name}-all-local": replace(TINY_FAMILIES[name], make=all_local(TINY_FAMILIES[name].make))
    for name in ("gemma2", "gemma3")
}


def with_yarn(make: Callable[[], tuple], **scaling) -> Callable[[], tuple]:
    """A family's tiny config with YaRN over `YARN_ORIGINAL_CONTEXT` positions, 4 times as many trained."""

    def made():
        config, model_class = make()
        config.rope_parameters = {
            "rope_type": "yarn",
            "rope_theta": rope_parameters(config)["rope_theta"],
            "factor": config.max_position_embeddings / YARN_ORIGINAL_CONTEXT,
            "original_max_position_embeddings": YARN_ORIGINAL_CONTEXT,
            **scaling,
        }
        return config, model_class

    return made


def mistral_without_window():
    """Mistral v0.2 and later: no sliding window (Kiln refuses a binding one with YaRN)."""
    config, model_class = mistral()
    config.sliding_window = None
    return config, model_class


YARN_ORIGINAL_CONTEXT = COMMON["max_position_embeddings"] // 4


def olmo3_yarn_on_full_layers():
    """OLMo 3's long-context RoPE: YaRN on the full layers only, the windowed layers' RoPE as it is
    (the model then rotates q and k with each layer's frequencies)."""
    config, model_class = olmo3()
    rope = config.rope_parameters["sliding_attention"]
    config.rope_parameters = {
        "sliding_attention": rope,
        "full_attention": {
            **rope,
            "rope_type": "yarn",
            "factor": config.max_position_embeddings / YARN_ORIGINAL_CONTEXT,
            "original_max_position_embeddings": YARN_ORIGINAL_CONTEXT,
        },
    }
    return config, model_class


# YaRN as Qwen2.5's model cards write it (no betas: 32 and 1), and with each of its optional fields.
YARN_FAMILIES: dict[str, TinyFamily] = {
    "qwen2-yarn": replace(TINY_FAMILIES["qwen2"], make=with_yarn(qwen2)),
    "qwen2-yarn-betas": replace(
        TINY_FAMILIES["qwen2"], make=with_yarn(qwen2, beta_fast=8.0, beta_slow=2.0, truncate=False)
    ),
    "qwen3-yarn": replace(TINY_FAMILIES["qwen3"], make=with_yarn(qwen3, mscale=2.0, mscale_all_dim=1.0)),
    "mistral-yarn": replace(
        TINY_FAMILIES["mistral"], make=with_yarn(mistral_without_window, beta_fast=16.0, attention_factor=1.25)
    ),
    "llama-yarn": replace(TINY_FAMILIES["llama3"], make=with_yarn(llama3_with_biases, beta_slow=2.0)),
    # YaRN on the RoPE layers only (SmolLM3 3B's long-context setting): the NoPE layer is left unrotated.
    "smollm3-yarn": replace(TINY_FAMILIES["smollm3"], make=with_yarn(smollm3, beta_fast=16.0)),
    "olmo3-yarn-full-layers": replace(TINY_FAMILIES["olmo3"], make=olmo3_yarn_on_full_layers),
    # With the query scale, which steps up at the original context (1 + β·ln 2 from there); without
    # betas, and with betas of its own and Ministral 3's mscale pair.
    "ministral3-yarn": replace(
        TINY_FAMILIES["ministral3"], make=with_yarn(ministral3, llama_4_scaling_beta=MINISTRAL3_QUERY_SCALE_BETA)
    ),
    "ministral3-yarn-betas": replace(
        TINY_FAMILIES["ministral3"],
        make=with_yarn(
            ministral3,
            beta_fast=16.0,
            beta_slow=2.0,
            mscale=1.0,
            mscale_all_dim=1.0,
            llama_4_scaling_beta=MINISTRAL3_QUERY_SCALE_BETA,
        ),
    ),
}


def randomize_biases_and_norms(model, seed: int) -> None:
    import torch

    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith((".bias", "dt_bias")):  # dt_bias: Qwen3.5's decay bias
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
            elif "norm" in name:
                parameter.copy_(1 + torch.randn(parameter.shape, generator=generator) * 0.2)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):  # Gemma 4's per-layer scale, saved with the weights
                buffer.copy_(0.5 + torch.rand(buffer.shape, generator=generator))


MADE_FAMILIES: dict[str, TinyFamily] = {**TINY_FAMILIES, **ALL_LOCAL_FAMILIES, **YARN_FAMILIES}


def make_tiny_family(name: str, folder: Path, seed: int = 0) -> Path:
    """The family's tiny model as a Hugging Face folder (safetensors, tokenizer, chat template)."""
    import torch

    config, model_class = MADE_FAMILIES[name].make()
    folder.mkdir(parents=True, exist_ok=True)
    write_tokenizer(folder)
    torch.manual_seed(seed)
    model = model_class(config).eval()
    randomize_biases_and_norms(model, seed)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


GLOBAL_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
    "model.per_layer_model_projection.weight": "per_layer_model_proj.weight",
    "model.per_layer_projection_norm.weight": "per_layer_proj_norm.weight",
    "model.embedding_norm.weight": "token_embd_norm.weight",  # LFM2's final norm
}


def write_family_gguf(name: str, hf_folder: Path, path: Path, extra_tensors: dict[str, np.ndarray] = {}) -> Path:
    """The Hugging Face folder's weights as a float32 GGUF in llama.cpp's names and layout, with
    the folder's tokenizer as llama.cpp stores a byte-level BPE vocabulary (and `extra_tensors`)."""
    from safetensors.numpy import load_file
    from transformers import AutoConfig

    family = TINY_FAMILIES[name]
    config = AutoConfig.from_pretrained(hf_folder)
    # Gemma 4's head size varies by layer: read the config's own (local) one, as llama.cpp's converter does.
    config.allow_global_per_layer_attribute_access = True
    tensors = load_file(hf_folder / "model.safetensors")
    writer = gguf.GGUFWriter(path, family.gguf_architecture)
    add_hyperparameters(writer, config)
    add_vocabulary(writer, hf_folder)
    family.extra_gguf(config, writer)

    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    for hf_name, values in tensors.items():
        values = values.astype(np.float32)
        if hf_name.endswith("norm.weight"):
            values = values + family.norm_shift
        if hf_name.startswith("model.layers."):
            _, _, layer, rest = hf_name.split(".", 3)
            # llama.cpp's converter gives a name without a kind (Gemma 4's layer_scalar) ".weight"
            part, kind = rest.rsplit(".", 1) if rest.endswith((".weight", ".bias")) else (rest, "weight")
            gguf_part = family.layer_tensors[part]
            if family.permute_qk and gguf_part in heads:
                values = permute_for_llama_cpp(values, heads[gguf_part])
            if (
                gguf_part == "shortconv.conv" and kind == "weight"
            ):  # LFM2's conv taps, [channels, 1, taps] squeezed to 2 dimensions
                values = values.squeeze(1)
            writer.add_tensor(f"blk.{layer}.{gguf_part}.{kind}", values)
        else:
            writer.add_tensor(GLOBAL_GGUF_NAMES[hf_name], values)
    for extra_name, values in extra_tensors.items():
        writer.add_tensor(extra_name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# A Llama whose rows are whole K-quant blocks (256 values), stored as a llama.cpp Q4_K_M file
# stores one: layer 0 has Q4_K_M's types, with V and down in Q6_K apart from Q4_K Q and K, gate
# and up, so the fused qkv and gate_up mix types; layer 1 mixes a type per part; layer 2 keeps one
# type per fused weight. Every type Kiln keeps as it is (ggml_blocks.BLOCK_TYPES) appears once at least.
MIXED_BLOCKS_SIZES = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3)
MIXED_BLOCK_TYPES = {
    "token_embd": "Q8_0",
    "output": "Q6_K",
    **{
        f"blk.0.{part}": kind
        for part, kind in dict(
            attn_q="Q4_K",
            attn_k="Q4_K",
            attn_v="Q6_K",
            attn_output="Q5_K",
            ffn_gate="Q4_K",
            ffn_up="Q4_K",
            ffn_down="Q6_K",
        ).items()
    },
    **{
        f"blk.1.{part}": kind
        for part, kind in dict(
            attn_q="Q4_0",
            attn_k="Q4_1",
            attn_v="Q5_1",
            attn_output="Q5_0",
            ffn_gate="F16",
            ffn_up="BF16",
            ffn_down="F32",
        ).items()
    },
    **{
        f"blk.2.{part}": kind
        for part, kind in dict(
            attn_q="Q5_K",
            attn_k="Q5_K",
            attn_v="Q5_K",
            attn_output="Q8_0",
            ffn_gate="Q6_K",
            ffn_up="Q6_K",
            ffn_down="Q4_0",
        ).items()
    },
}
# Every weight spreads like the tiny families' (initializer_range): mean about 0, this std.
MIXED_WEIGHT_STD = COMMON["initializer_range"]
# The midpoint of the quants of the types with a per-block minimum.
QUANT_MIDPOINTS = {"Q4_1": 7.5, "Q5_1": 15.5, "Q4_K": 7.5, "Q5_K": 15.5}


def mixed_blocks_config():
    from transformers import LlamaConfig

    return LlamaConfig(**{**COMMON, **MIXED_BLOCKS_SIZES}, tie_word_embeddings=False)


def read_halves(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The float16 field at `offset` of every block of a [..., block bytes] array, as float32."""
    return np.ascontiguousarray(blocks[..., offset : offset + 2]).view("<f2")[..., 0].astype(np.float32)


def write_halves(blocks: np.ndarray, offset: int, values: np.ndarray) -> None:
    blocks[..., offset : offset + 2] = values.astype("<f2")[..., None].view(np.uint8)


def center_minimums(type_name: str, blocks: np.ndarray) -> None:
    """random_blocks' minimums are random, so its Q4_1/Q5_1/Q4_K/Q5_K weights are mostly positive
    (and a model of them repeats a few tokens). A real file's minimums offset the quants by about
    half their range: set them so, in place (K-quants: each sub-block's min equal to its scale)."""
    if type_name not in QUANT_MIDPOINTS:
        return
    d = read_halves(blocks, 0)
    if type_name in ("Q4_1", "Q5_1"):  # weight = d·q + m
        write_halves(blocks, 2, -QUANT_MIDPOINTS[type_name] * d)
        return
    # weight = d·scale·q − dmin·min, scales and mins packed in 6 bits in bytes 4..15
    write_halves(blocks, 2, QUANT_MIDPOINTS[type_name] * d)
    blocks[..., 8:12] = blocks[..., 4:8]
    blocks[..., 12:16] = (blocks[..., 12:16] & 0x0F) * 0x11


def tensor_blocks(type_name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, row bytes] of valid `type_name` blocks of weights of mean about 0 and std
    MIXED_WEIGHT_STD (random_blocks' own, centered, their float16 scales rescaled), or zeros
    (weights of 0) for a type random_blocks does not make (Q2_K, Q3_K)."""
    if type_name in ("F32", "F16", "BF16"):
        return random_blocks(type_name, rows, cols, rng, MIXED_WEIGHT_STD)
    kind = gguf.GGMLQuantizationType[type_name]
    elements, size = gguf.GGML_QUANT_SIZES[kind]
    if type_name not in BLOCK_SHAPES:
        return np.zeros((rows, cols // elements * size), dtype=np.uint8)
    blocks = random_blocks(type_name, rows, cols, rng).reshape(rows, cols // elements, size)
    center_minimums(type_name, blocks)
    weights = gguf.quants.dequantize(blocks.reshape(rows, -1), kind)
    factor = MIXED_WEIGHT_STD / np.sqrt(np.mean(np.square(weights, dtype=np.float64)))
    for offset in HALF_FIELDS[type_name]:
        write_halves(blocks, offset, read_halves(blocks, offset) * factor)
    return blocks.reshape(rows, -1)


def layer_matrix_shapes(config) -> dict[str, tuple[int, int]]:
    """A Llama-style layer's matrices, by GGUF name: (rows, cols)."""
    hidden, kv_rows = config.hidden_size, config.num_key_value_heads * config.hidden_size // config.num_attention_heads
    return {
        "attn_q": (hidden, hidden),
        "attn_k": (kv_rows, hidden),
        "attn_v": (kv_rows, hidden),
        "attn_output": (hidden, hidden),
        "ffn_gate": (config.intermediate_size, hidden),
        "ffn_up": (config.intermediate_size, hidden),
        "ffn_down": (hidden, config.intermediate_size),
    }


def write_mixed_blocks_gguf(path: Path, types: dict[str, str] = MIXED_BLOCK_TYPES, seed: int = 0) -> Path:
    """A tiny Llama as a GGUF whose weights are random blocks of `types` (GGUF tensor name without
    ".weight" → ggml type), Q and K rows in llama.cpp's permuted order, norms in F32."""
    config = mixed_blocks_config()
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    add_hyperparameters(writer, config)
    with tempfile.TemporaryDirectory() as tokenizer_folder:
        write_tokenizer(Path(tokenizer_folder))
        add_vocabulary(writer, Path(tokenizer_folder))

    hidden, shapes = config.hidden_size, layer_matrix_shapes(config)
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}

    def add_blocks(name: str, rows: int, cols: int, permute_heads: int | None = None) -> None:
        blocks = tensor_blocks(types[name], rows, cols, rng)
        if permute_heads:
            blocks = permute_for_llama_cpp(blocks, permute_heads)
        writer.add_tensor(f"{name}.weight", blocks, raw_dtype=gguf.GGMLQuantizationType[types[name]])

    def add_norm(name: str) -> None:
        writer.add_tensor(name, (1 + rng.standard_normal(hidden) * 0.2).astype(np.float32))

    add_blocks("token_embd", config.vocab_size, hidden)
    for layer in range(config.num_hidden_layers):
        add_norm(f"blk.{layer}.attn_norm.weight")
        for part, (rows, cols) in shapes.items():
            add_blocks(f"blk.{layer}.{part}", rows, cols, heads.get(part))
        add_norm(f"blk.{layer}.ffn_norm.weight")
    add_norm("output_norm.weight")
    add_blocks("output", config.vocab_size, hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def add_hyperparameters(writer: gguf.GGUFWriter, config) -> None:
    """A transformers config as llama.cpp's converter writes it."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(getattr(config, "rms_norm_eps", None) or config.norm_eps)  # LFM2: norm_eps
    writer.add_rope_freq_base(rope_parameters(config)["rope_theta"])
    writer.add_rope_dimension_count(int(head_dim * rope_parameters(config).get("partial_rotary_factor", 1.0)))
    writer.add_vocab_size(config.vocab_size)


def add_vocabulary(writer: gguf.GGUFWriter, hf_folder: Path, size: int | None = None) -> None:
    """The folder's tokenizer as llama.cpp stores it; padded with unused tokens to `size` entries
    (an embedding of a real model's vocabulary, which llama.cpp checks against the token list)."""
    tokenizer = json.loads((hf_folder / "tokenizer.json").read_text())
    tokenizer_config = json.loads((hf_folder / "tokenizer_config.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    special = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    tokens = sorted({**vocab, **special}, key=lambda t: {**vocab, **special}[t])
    types = [int(gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL) for t in tokens]
    padding = (size or len(tokens)) - len(tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list([*tokens, *(f"<unused_{i}>" for i in range(padding))])
    writer.add_token_types([*types, *[int(gguf.TokenType.UNUSED)] * padding])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]])
    writer.add_bos_token_id(special[tokenizer_config["bos_token"]])
    writer.add_eos_token_id(special[tokenizer_config["eos_token"]])
    writer.add_add_bos_token(False)
    writer.add_chat_template(tokenizer_config["chat_template"])
