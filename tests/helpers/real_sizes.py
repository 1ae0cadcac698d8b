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
REAL_SIZES = {
    "qwen2.5-0.5b": ("Qwen2ForCausalLM", "Qwen2Config", QWEN25_05B),
    "gemma3-270m": (
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        GEMMA3_270M,
    ),
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
    model.save_pretrained(folder, safe_serialization=True)
    return folder
