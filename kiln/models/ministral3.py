"""Ministral 3 family: Ministral 3 (3B, 8B, 14B; `ministral3`), and the text tower of the multimodal
`mistral3` checkpoints they are released as (Mistral Small 3.1 and 3.2 too, whose text tower is a
`mistral`). Mistral's layers (no biases) with:
- YaRN RoPE (`rope_parameters`), which Kiln applies in the model (`MODEL_ROPES`);
- Llama 4's query scale by position: after RoPE, each query is multiplied by
  1 + β·ln(1 + ⌊pos / original⌋), β = `llama_4_scaling_beta` and original = the rope's
  `original_max_position_embeddings` (16384 in Ministral 3), pos the token's absolute position: the
  one the KV cache gives the step, as RoPE's. transformers computes the factor in float32 and rounds
  it to the query's dtype; so does Kiln. Within the original context the factor is 1.

A `mistral3` checkpoint keeps the text tower's tensors under `language_model.model.` and its head as
`language_model.lm_head.weight` (as transformers 5.25 saves them; `model.language_model.` and `lm_head.weight`
in the layout it loads into), beside a Pixtral vision tower and a projector that Kiln leaves out.
Its output head ties to the embeddings as the top-level `tie_word_embeddings` says (transformers'
Mistral3Config: true when left out). Ministral 3's instruct checkpoints are published FP8
(`quantization_config`), which every family refuses (the BF16 releases build). llama.cpp converts
both as "mistral3" (`gguf_config`: a Mistral Small 3.1 without YaRN or β), its earlier versions the
Mistral Smalls as a "llama".
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache

from kiln.errors import KilnError

from . import mistral
from .config_reader import ConfigReader
from .decoder import Architecture
from .gguf import LLAMA_LAYER_TENSORS, GGUFMapping, GGUFTensors, Metadata, decoder_hparams
from .llama import (
    IGNORED_TENSORS,
    LlamaAttention,
    LlamaConfig,
    LlamaForCausalLM,
    fused_sources,
    llama_layers_config,
    undo_rope_permutation,
)


@dataclass
class Ministral3Config(LlamaConfig):
    query_scale_beta: float = 0.0  # 0: no query scale (a Mistral)
    query_scale_positions: int = 1  # the scale steps up every this many positions


def parse_config(hf_config: dict, path: Path, overrides: dict[str, int]) -> Ministral3Config:
    read = ConfigReader(hf_config, path)
    fields = read.sliding_window(read.decoder_fields(overrides))
    rope = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    beta = rope.get("llama_4_scaling_beta")
    original = (fields["rope_scaling"] or rope).get("original_max_position_embeddings")
    if not isinstance(beta, (int, float)) or isinstance(beta, bool) or beta < 0 or not isinstance(original, int):
        raise KilnError(
            "config.json rope_parameters should give the query scale's llama_4_scaling_beta (a number, "
            f"got {beta!r}) and original_max_position_embeddings (got {original!r}), as transformers needs them",
            path,
        )
    if beta and fields.get("sliding_window_size"):
        raise KilnError(
            f"config.json sliding_window {fields['sliding_window_size']} is shorter than the context window "
            f"({fields['context_window_size']}), and TVM's sliding-window KV cache does not give the absolute "
            "positions the query scale needs; build with --context-window-size "
            f"{fields['sliding_window_size']} or less",
            path,
        )
    return llama_layers_config(
        read, fields, Ministral3Config, query_scale_beta=float(beta), query_scale_positions=original
    )


def parse_multimodal_config(hf_config: dict, path: Path, overrides: dict[str, int]) -> Ministral3Config:
    """A `mistral3` checkpoint: its text tower's config, `text_config` (a `ministral3` or a `mistral`),
    with the checkpoint's quantization and tied head."""
    text = hf_config.get("text_config")
    if not isinstance(text, dict):
        raise KilnError("config.json of a mistral3 checkpoint should hold its text tower's text_config", path)
    text = {
        **text,
        "quantization_config": hf_config.get("quantization_config"),
        "tie_word_embeddings": hf_config.get("tie_word_embeddings", True),
    }
    text_type = text.get("model_type", "mistral")
    if text_type == "ministral3":
        return parse_config(text, path, overrides)
    if text_type == "mistral":
        return Ministral3Config(**vars(mistral.parse_config(text, path, overrides)))
    raise KilnError(
        f"config.json text_config model_type {text_type!r}: Kiln builds mistral3 text towers of ministral3 or mistral",
        path,
    )


def scale_queries(qkv: nn.Tensor, kv_cache: PagedKVCache, config: Ministral3Config) -> nn.Tensor:
    """The query heads of a fused qkv (batch, seq, heads, head_dim) times 1 + β·ln(1 + ⌊pos / original⌋),
    at the positions the KV cache gives this step."""
    batch, seq_len, _, _ = qkv.shape
    positions = kv_cache.get_query_positions(batch * seq_len)
    beta, original, query_heads = config.query_scale_beta, config.query_scale_positions, config.num_attention_heads

    def scale(x: te.Tensor, pos: te.Tensor) -> te.Tensor:
        def value(b, s, h, d):
            steps = tirx.floordiv(pos[b * x.shape[1] + s], original).astype("float32")
            factor = tirx.const(1, "float32") + np.float32(beta) * tirx.log(steps + tirx.const(1, "float32"))
            return tirx.if_then_else(h < query_heads, x[b, s, h, d] * factor.astype(x.dtype), x[b, s, h, d])

        return te.compute(x.shape, value, name="query_scale")

    return nn.op.tensor_expr_op(scale, "query_scale", [qkv, positions])


class Ministral3Attention(LlamaAttention):
    def rope(self, qkv: nn.Tensor, kv_cache: PagedKVCache, layer_id: int) -> nn.Tensor:
        qkv = super().rope(qkv, kv_cache, layer_id)
        return scale_queries(qkv, kv_cache, self.config) if self.config.query_scale_beta else qkv


class Ministral3ForCausalLM(LlamaForCausalLM):
    attention_class = Ministral3Attention


def gguf_config(metadata: Metadata, tensors: GGUFTensors) -> dict:
    """llama.cpp's Mistral3Model converter (architecture "mistral3"): Llama's hyperparameters (Q and K
    permuted), YaRN's fields as config.json gave them, its mscale_all_dim as `yarn_log_multiplier` (mscale
    is 1 in every Ministral 3) and β as `attention.temperature_scale`, which llama.cpp's loader takes as
    0 (no query scale) when left out."""
    arch = "mistral3"
    config = decoder_hparams(metadata, tensors, "ministral3", ["Ministral3ForCausalLM"])
    yarn = config.pop("rope_scaling", None)
    rope = {
        "rope_type": "default",
        "rope_theta": config.pop("rope_theta"),
        # llama.cpp's original context for the query scale: the YaRN one, else the trained one.
        "original_max_position_embeddings": metadata.get(
            f"{arch}.rope.scaling.original_context_length", config["max_position_embeddings"], int
        ),
        "llama_4_scaling_beta": metadata.get(f"{arch}.attention.temperature_scale", 0.0, float),
    }
    if yarn:
        rope |= yarn
        if log_multiplier := metadata.get(f"{arch}.rope.scaling.yarn_log_multiplier", None, float):
            rope |= {"mscale": 1.0, "mscale_all_dim": log_multiplier}
    return {**config, "rope_parameters": rope}


ARCHITECTURE = Architecture(
    model_type="ministral3",
    parse_config=parse_config,
    build=Ministral3ForCausalLM,
    fused_sources=fused_sources,
    ignored_tensors=IGNORED_TENSORS,
    gguf=GGUFMapping(
        architecture="mistral3",
        config=gguf_config,
        layer_tensors=LLAMA_LAYER_TENSORS,
        restore_layout=undo_rope_permutation,
    ),
)

MULTIMODAL_ARCHITECTURE = Architecture(
    model_type="mistral3",
    parse_config=parse_multimodal_config,
    build=Ministral3ForCausalLM,
    fused_sources=fused_sources,
    # The Pixtral vision tower and its projector (Kiln builds the text tower), and the output head
    # that some layouts save beside the embeddings it is tied to.
    ignored_tensors=(
        r"(model\.)?(vision_tower|multi_modal_projector)\..*",
        r"(language_model\.)?lm_head\.weight",
        *IGNORED_TENSORS,
    ),
    decoder_prefixes=("model.language_model.", "language_model.model."),
    head_prefixes=("", "language_model."),
)
