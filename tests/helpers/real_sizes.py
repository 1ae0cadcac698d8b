"""Models at real sizes: random weights at published configs, made by transformers (no hub), with the
tiny tokenizer (its ids are below 384)."""

from __future__ import annotations

from pathlib import Path

from helpers.tiny_llama import write_tokenizer

# Qwen/Qwen2.5-0.5B-Instruct's config.json.
QWEN25_05B = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    use_sliding_window=False,
    sliding_window=32768,
    bos_token_id=151643,
    eos_token_id=151645,
)
# google/gemma-3-270m's config.json.
GEMMA3_270M = dict(
    vocab_size=262144,
    hidden_size=640,
    intermediate_size=2048,
    num_hidden_layers=18,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=256,
    query_pre_attn_scalar=256,
    sliding_window=512,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)],
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
    },
    tie_word_embeddings=True,
    bos_token_id=0,
    eos_token_id=2,
    pad_token_id=0,
)
# Qwen/Qwen3.5-0.8B's config.json as released (its text_config; the vision tower's left out).
QWEN3_5_08B_CONFIG = dict(
    architectures=["Qwen3_5ForConditionalGeneration"],
    model_type="qwen3_5",
    tie_word_embeddings=True,
    text_config=dict(
        vocab_size=248320,
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=24,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        attention_bias=False,
        attn_output_gate=True,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6,
        full_attention_interval=4,
        max_position_embeddings=262144,
        tie_word_embeddings=True,
        mtp_num_hidden_layers=1,
        mtp_use_dedicated_embeddings=False,
        rope_parameters={
            "mrope_interleaved": True,
            "mrope_section": [11, 11, 10],
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
        },
    ),
)
REAL_SIZES = {
    "qwen2.5-0.5b": ("Qwen2ForCausalLM", "Qwen2Config", QWEN25_05B),
    "gemma3-270m": (
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        GEMMA3_270M,
    ),
    "qwen3.5-0.8b": ("Qwen3_5ForCausalLM", "Qwen3_5TextConfig", QWEN3_5_08B_CONFIG["text_config"]),
}


def make_real_sized(name: str, folder: Path) -> Path:
    """A Hugging Face folder with random weights at `name`'s published config."""
    import torch
    import transformers

    model_class, config_class, config = REAL_SIZES[name]
    folder.mkdir(parents=True, exist_ok=True)
    write_tokenizer(folder)
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**config))
    model.to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)  # as the published checkpoints are
    return folder


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's `use_more_bits`: the layers whose attn_v and ffn_down a Q4_K_M file stores in Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def q4_k_m_type(part: str, layer: int, layers: int, cols: int) -> str:
    """The type llama.cpp's Q4_K_M recipe gives a layer's matrix, with its fallbacks for rows that
    are not whole 256-value K-quant blocks (Q4_K → Q5_0, Q6_K → Q8_0), as Qwen2.5 0.5B's rows of 896 need."""
    wanted = "Q6_K" if part in ("attn_v", "ffn_down") and more_bits(layer, layers) else "Q4_K"
    if cols % 256 == 0:
        return wanted
    return {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}[wanted]


def write_real_sized_q4_k_m_gguf(name: str, path: Path, seed: int = 0) -> Path:
    """`name`'s published config (a Qwen2-style model) as a GGUF of random blocks typed as llama.cpp's
    Q4_K_M recipe types them, the tied embedding in Q8_0 (Q6_K's fallback), norms and biases in F32;
    the tiny tokenizer's vocabulary padded with unused tokens to the config's size, so llama.cpp
    loads the same file."""
    import gguf
    import numpy as np
    import tempfile
    from transformers import Qwen2Config

    from helpers.tiny_families import (
        TINY_FAMILIES,
        add_hyperparameters,
        add_vocabulary,
        layer_matrix_shapes,
        tensor_blocks,
    )

    model_class, _, values = REAL_SIZES[name]
    assert model_class == "Qwen2ForCausalLM", "the Q4_K_M writer knows the Qwen2 layout"
    config = Qwen2Config(**values)
    family = TINY_FAMILIES["qwen2"]
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, family.gguf_architecture)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    add_hyperparameters(writer, config)
    with tempfile.TemporaryDirectory() as tokenizer_folder:
        write_tokenizer(Path(tokenizer_folder))
        add_vocabulary(writer, Path(tokenizer_folder), size=config.vocab_size)

    hidden, shapes = config.hidden_size, layer_matrix_shapes(config)

    def add_blocks(tensor: str, type_name: str, rows: int, cols: int) -> None:
        blocks = tensor_blocks(type_name, rows, cols, rng)
        writer.add_tensor(f"{tensor}.weight", blocks, raw_dtype=gguf.GGMLQuantizationType[type_name])

    def add_floats(tensor: str, size: int, mean: float) -> None:
        writer.add_tensor(tensor, (mean + rng.standard_normal(size) * 0.2).astype(np.float32))

    add_blocks("token_embd", "Q8_0", config.vocab_size, hidden)
    for layer in range(config.num_hidden_layers):
        add_floats(f"blk.{layer}.attn_norm.weight", hidden, 1.0)
        for part, (rows, cols) in shapes.items():
            add_blocks(f"blk.{layer}.{part}", q4_k_m_type(part, layer, config.num_hidden_layers, cols), rows, cols)
            if part in ("attn_q", "attn_k", "attn_v"):
                add_floats(f"blk.{layer}.{part}.bias", rows, 0.0)
        add_floats(f"blk.{layer}.ffn_norm.weight", hidden, 1.0)
    add_floats("output_norm.weight", hidden, 1.0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()
    return path


if __name__ == "__main__":
    import sys

    write_real_sized_q4_k_m_gguf(sys.argv[1], Path(sys.argv[2]))
