"""Tiny random checkpoints of every model family, made with transformers' own config and model
classes, and the same weights written as a GGUF the way llama.cpp's converter names and lays them
out. Biases and norm weights are randomized too (transformers initializes them to 0 and 1, which
would hide a bias or norm that is dropped or swapped)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import gguf
import numpy as np

from tiny_llama import VOCAB_SIZE, write_tokenizer

COMMON = dict(
    vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
    rope_theta=10000.0, bos_token_id=0, eos_token_id=2, pad_token_id=0,
    # Larger than the usual 0.02 so that logits are peaked and greedy choices are clear.
    initializer_range=0.15,
)


def rope_parameters(config) -> dict:
    """rope_theta and the scaling fields (transformers 5 keeps them in `rope_parameters`)."""
    return getattr(config, "rope_parameters", None) or {"rope_theta": config.rope_theta, **(config.rope_scaling or {})}


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
                scaling["high_freq_factor"] - scaling["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / scaling["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def permute_for_llama_cpp(weight: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to a Llama's Q and K rows (and biases)."""
    halves = weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
    return halves.swapaxes(1, 2).reshape(weight.shape)


@dataclass(frozen=True)
class TinyFamily:
    """A family's tiny model: how to make its transformers config and model, and how llama.cpp
    names it (GGUF architecture, Hugging Face → GGUF tensor parts, per-layer and global)."""

    make: Callable[[], tuple]  # () → (transformers config, model class)
    gguf_architecture: str
    layer_tensors: dict[str, str]  # HF part after "model.layers.N." → GGUF part after "blk.N."
    permute_qk: bool = False
    extra_gguf: Callable[[object, gguf.GGUFWriter], None] = lambda config, writer: None
    # A GGUF that loses a sliding window (llama.cpp converts Mistral as a Llama) agrees with the
    # Hugging Face build only while the window does not bind.
    gguf_same_positions: int | None = None


LLAMA_PARTS = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def llama3_with_biases():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaConfig(**COMMON, attention_bias=True, mlp_bias=True, tie_word_embeddings=False,
                       rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64}), LlamaForCausalLM


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
    "input_layernorm": "attn_norm", "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
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
    config = Phi3Config(**{**COMMON, "max_position_embeddings": 4096},
                        original_max_position_embeddings=PHI3_ORIGINAL_CONTEXT,
                        partial_rotary_factor=partial_rotary_factor, sliding_window=2047, tie_word_embeddings=False,
                        rope_scaling={"rope_type": "longrope", "short_factor": short_factor,
                                      "long_factor": long_factor})
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


TINY_FAMILIES: dict[str, TinyFamily] = {
    "llama3": TinyFamily(llama3_with_biases, "llama", LLAMA_PARTS, permute_qk=True, extra_gguf=add_llama3_rope_freqs),
    "qwen2": TinyFamily(qwen2, "qwen2", LLAMA_PARTS),
    # llama.cpp converts Mistral as a Llama.
    "mistral": TinyFamily(mistral, "llama", LLAMA_PARTS, permute_qk=True, gguf_same_positions=MISTRAL_WINDOW),
    "phi3": TinyFamily(phi3_longrope, "phi3", PHI3_PARTS, extra_gguf=add_phi3_rope),
    "qwen3": TinyFamily(qwen3, "qwen3",
                        {**LLAMA_PARTS, "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}),
}


def randomize_biases_and_norms(model, seed: int) -> None:
    import torch

    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(".bias"):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
            elif "norm" in name:
                parameter.copy_(1 + torch.randn(parameter.shape, generator=generator) * 0.2)


def make_tiny_family(name: str, folder: Path, seed: int = 0) -> Path:
    """The family's tiny model as a Hugging Face folder (safetensors, tokenizer, chat template)."""
    import torch

    config, model_class = TINY_FAMILIES[name].make()
    folder.mkdir(parents=True, exist_ok=True)
    write_tokenizer(folder)
    torch.manual_seed(seed)
    model = model_class(config).eval()
    randomize_biases_and_norms(model, seed)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def write_family_gguf(name: str, hf_folder: Path, path: Path, extra_tensors: dict[str, np.ndarray] = {}) -> Path:
    """The Hugging Face folder's weights as a float32 GGUF in llama.cpp's names and layout, with
    the folder's tokenizer as llama.cpp stores a byte-level BPE vocabulary (and `extra_tensors`)."""
    from safetensors.numpy import load_file
    from transformers import AutoConfig

    family = TINY_FAMILIES[name]
    config = AutoConfig.from_pretrained(hf_folder)
    tensors = load_file(hf_folder / "model.safetensors")
    writer = gguf.GGUFWriter(path, family.gguf_architecture)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(rope_parameters(config)["rope_theta"])
    writer.add_rope_dimension_count(int(head_dim * rope_parameters(config).get("partial_rotary_factor", 1.0)))
    writer.add_vocab_size(config.vocab_size)
    add_vocabulary(writer, hf_folder)
    family.extra_gguf(config, writer)

    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    for hf_name, values in tensors.items():
        values = values.astype(np.float32)
        if hf_name.startswith("model.layers."):
            _, _, layer, rest = hf_name.split(".", 3)
            part, kind = rest.rsplit(".", 1)
            gguf_part = family.layer_tensors[part]
            if family.permute_qk and gguf_part in heads:
                values = permute_for_llama_cpp(values, heads[gguf_part])
            writer.add_tensor(f"blk.{layer}.{gguf_part}.{kind}", values)
        else:
            global_names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                            "lm_head.weight": "output.weight"}
            writer.add_tensor(global_names[hf_name], values)
    for extra_name, values in extra_tensors.items():
        writer.add_tensor(extra_name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def add_vocabulary(writer: gguf.GGUFWriter, hf_folder: Path) -> None:
    tokenizer = json.loads((hf_folder / "tokenizer.json").read_text())
    tokenizer_config = json.loads((hf_folder / "tokenizer_config.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    special = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    tokens = sorted({**vocab, **special}, key=lambda t: {**vocab, **special}[t])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]])
    writer.add_bos_token_id(special[tokenizer_config["bos_token"]])
    writer.add_eos_token_id(special[tokenizer_config["eos_token"]])
    writer.add_add_bos_token(False)
    writer.add_chat_template(tokenizer_config["chat_template"])
