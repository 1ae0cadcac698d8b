"""Qwen2 family: Qwen2, Qwen2.5 (and Coder) — Llama's layers with biases on the q/k/v projections
(fused with the weights into `qkv_proj.bias`), none on o_proj, tied or untied embeddings.

Qwen2's optional sliding window (`use_sliding_window`) is off in every released checkpoint and
refused when on. llama.cpp stores Qwen2 unpermuted (its RoPE is the "rotate half" one).
"""

from __future__ import annotations

from pathlib import Path

from .config_reader import ConfigReader
from .decoder import Architecture
from .gguf import LLAMA_LAYER_TENSORS, GGUFMapping, GGUFTensors, Metadata, decoder_hparams
from .llama import IGNORED_TENSORS, LlamaConfig, LlamaForCausalLM, fused_sources, llama_layers_config


def parse_config(hf_config: dict, path: Path, overrides: dict[str, int]) -> LlamaConfig:
    read = ConfigReader(hf_config, path)
    read.expect("use_sliding_window", (False,), False)
    return llama_layers_config(read, read.decoder_fields(overrides), qkv_bias=True)


def gguf_config(metadata: Metadata, tensors: GGUFTensors) -> dict:
    return decoder_hparams(metadata, tensors, "qwen2", ["Qwen2ForCausalLM"])


ARCHITECTURE = Architecture(
    model_type="qwen2",
    parse_config=parse_config,
    build=LlamaForCausalLM,
    fused_sources=fused_sources,
    ignored_tensors=IGNORED_TENSORS,
    sentence_embeddings=True,
    gguf=GGUFMapping(architecture="qwen2", config=gguf_config, layer_tensors=LLAMA_LAYER_TENSORS),
)
