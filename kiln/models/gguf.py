"""What a family declares about its GGUF files (llama.cpp's names), and the parts families share.

A GGUF names an architecture in `general.architecture`, keeps the hyperparameters under
`<architecture>.*` metadata keys and names tensors `blk.N.<part>.weight`. A family's
`GGUFMapping` turns those back into its Hugging Face config.json and tensor names; the reading
itself (and the tokenizer) is kiln/compile/source/gguf_source.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np

from kiln.errors import KilnError

GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LLAMA_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


class Metadata(Protocol):
    path: Any

    def get(self, key: str, default: Any = None, kind: Any = None) -> Any: ...

    def require(self, key: str, kind: Any = None) -> Any: ...

    def size(self, key: str, default: int | None = None) -> int: ...

    def __contains__(self, key: str) -> bool: ...


@dataclass(frozen=True)
class GGUFTensors:
    """The tensors of a GGUF as its family's config sees them: names, and values on request
    (rope factor tables are tensors in a GGUF and config fields in Hugging Face)."""

    names: set[str]
    read: Callable[[str], np.ndarray]


@dataclass(frozen=True)
class GGUFMapping:
    architecture: str  # general.architecture
    config: Callable[[Metadata, GGUFTensors], dict]  # → the family's config.json
    layer_tensors: dict[str, str]  # "blk.N.<part>" → "model.layers.N.<HF part>"
    global_tensors: dict[str, str] = field(default_factory=lambda: dict(GLOBAL_TENSORS))
    config_tensors: tuple[str, ...] = ()  # tensors the config consumes (e.g. "rope_freqs.weight")
    # (HF name, values, config) → values in Hugging Face layout. Only a reorder of whole rows, so
    # that it applies as well to a row of quantized blocks as to a row of floats.
    restore_layout: Callable[[str, np.ndarray, dict], np.ndarray] | None = None
    # (HF name, values) → values as Hugging Face stores them, for the tensors read as floats (norm
    # weights; never a quantized weight): llama.cpp stores Gemma's norm weights plus one.
    restore_values: Callable[[str, np.ndarray], np.ndarray] | None = None
    # Hugging Face parts named without ".weight" (Gemma 4's "layer_scalar"), to which llama.cpp's
    # converter added one.
    unsuffixed_parts: tuple[str, ...] = ()


def decoder_hparams(
    metadata: Metadata,
    tensors: GGUFTensors,
    model_type: str,
    architectures: list[str],
    partial_rotary: bool = False,
) -> dict:
    """The config.json fields every llama.cpp decoder stores the same way; RoPE over part of each
    head (`partial_rotary_factor`) only for a family that computes it."""
    arch = metadata.require("general.architecture", str)
    hidden_size = metadata.size(f"{arch}.embedding_length")
    num_heads = metadata.size(f"{arch}.attention.head_count")
    if f"{arch}.attention.key_length" not in metadata and hidden_size % num_heads:
        raise KilnError(
            f"{arch}.attention.head_count {num_heads} does not divide {arch}.embedding_length {hidden_size}",
            metadata.path,
        )
    head_dim = metadata.size(f"{arch}.attention.key_length", hidden_size // num_heads)
    rope_dims = metadata.size(f"{arch}.rope.dimension_count", head_dim)
    if rope_dims != head_dim and not partial_rotary:
        raise KilnError(
            f"RoPE over {rope_dims} of {head_dim} head dimensions ({arch}.rope.dimension_count) "
            f"is not supported for {arch}",
            metadata.path,
        )
    scaling = metadata.get(f"{arch}.rope.scaling.type", "none", str)
    if scaling != "none" and scaling not in ROPE_SCALINGS:
        raise KilnError(
            f"unsupported RoPE scaling {scaling!r} in {arch}.rope.scaling.type "
            f"(supported: none, {', '.join(ROPE_SCALINGS)})",
            metadata.path,
        )
    config = {
        "model_type": model_type,
        "architectures": architectures,
        "hidden_size": hidden_size,
        "intermediate_size": metadata.require(f"{arch}.feed_forward_length"),
        "num_hidden_layers": metadata.require(f"{arch}.block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": metadata.get(f"{arch}.attention.head_count_kv", num_heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": metadata.require(f"{arch}.attention.layer_norm_rms_epsilon"),
        "rope_theta": metadata.get(f"{arch}.rope.freq_base", 10000.0),
        "max_position_embeddings": metadata.require(f"{arch}.context_length"),
        "vocab_size": metadata.get(f"{arch}.vocab_size") or len(metadata.require("tokenizer.ggml.tokens", list)),
        "tie_word_embeddings": "output.weight" not in tensors.names,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
    }
    if rope_dims != head_dim:
        config["partial_rotary_factor"] = rope_dims / head_dim
    if scaling != "none":
        config["rope_scaling"] = ROPE_SCALINGS[scaling](metadata, arch)
    return config


def linear_scaling(metadata: Metadata, arch: str) -> dict:
    return {"rope_type": "linear", "factor": metadata.require(f"{arch}.rope.scaling.factor")}


def yarn_scaling(metadata: Metadata, arch: str) -> dict:
    """YaRN's config.json fields as llama.cpp's converter writes them (`attention_factor` as
    `yarn_attn_factor`); those it left out take transformers' defaults, as in llama.cpp."""
    optional = {
        "beta_fast": f"{arch}.rope.scaling.yarn_beta_fast",
        "beta_slow": f"{arch}.rope.scaling.yarn_beta_slow",
        "attention_factor": f"{arch}.rope.scaling.yarn_attn_factor",
    }
    return {
        "rope_type": "yarn",
        "factor": metadata.require(f"{arch}.rope.scaling.factor", float),
        "original_max_position_embeddings": metadata.require(f"{arch}.rope.scaling.original_context_length", int),
        **{field: value for field, key in optional.items() if (value := metadata.get(key, None, float)) is not None},
    }


# llama.cpp's rope.scaling.type → the config.json rope_scaling it stands for; a family refuses a
# scaling it does not compute when it reads the config, as for a config.json.
ROPE_SCALINGS: dict[str, Callable[[Metadata, str], dict]] = {
    "linear": linear_scaling,
    "yarn": yarn_scaling,
}
