"""Untrusted inputs for the compiler's tests: a tiny valid Hugging Face folder to break."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from helpers.tiny_llama import write_tokenizer

HIDDEN, HEADS, KV_HEADS, INTERMEDIATE = 32, 2, 1, 64
KV_WIDTH = HIDDEN // HEADS * KV_HEADS


TINY_CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": HIDDEN,
    "intermediate_size": INTERMEDIATE,
    "num_hidden_layers": 1,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "vocab_size": 384,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
}
TINY_TENSORS = {
    "model.embed_tokens.weight": (384, HIDDEN),
    "model.norm.weight": (HIDDEN,),
    "model.layers.0.input_layernorm.weight": (HIDDEN,),
    "model.layers.0.post_attention_layernorm.weight": (HIDDEN,),
    "model.layers.0.self_attn.q_proj.weight": (HIDDEN, HIDDEN),
    "model.layers.0.self_attn.k_proj.weight": (KV_WIDTH, HIDDEN),
    "model.layers.0.self_attn.v_proj.weight": (KV_WIDTH, HIDDEN),
    "model.layers.0.self_attn.o_proj.weight": (HIDDEN, HIDDEN),
    "model.layers.0.mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
    "model.layers.0.mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
    "model.layers.0.mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
}


def write_hf_folder(folder: Path) -> Path:
    """A 1-layer Llama folder: config.json, a trained tokenizer with a ChatML template, random weights."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(TINY_CONFIG))
    write_tokenizer(folder)
    rng = np.random.default_rng(0)
    save_file(
        {name: rng.standard_normal(shape).astype(np.float32) * 0.1 for name, shape in TINY_TENSORS.items()},
        str(folder / "model.safetensors"),
    )
    return folder
