"""Mistral family: Mistral 7B v0.1–v0.3, Ministral-style checkpoints — Llama's layers without
biases, with an optional sliding attention window (`sliding_window`: each token attends to the
last `sliding_window` tokens).

A window only matters once a sequence is longer than it: with a context window of at most the
sliding window (Mistral 7B v0.1 by default: 4096 and 4096; v0.2+ have no window) nothing changes.
A longer context window (`--context-window-size`) turns on the KV cache's sliding window, the way
WebLLM runs Mistral: prefill chunks of at most the window, and the cache keeps the last window of
tokens per layer. llama.cpp converts Mistral as a Llama (`general.architecture` "llama").
"""

from __future__ import annotations

from pathlib import Path

from .config_reader import ConfigReader
from .decoder import Architecture
from .llama import IGNORED_TENSORS, LlamaConfig, LlamaForCausalLM, fused_sources, llama_layers_config


def parse_config(hf_config: dict, path: Path, overrides: dict[str, int]) -> LlamaConfig:
    read = ConfigReader(hf_config, path)
    return llama_layers_config(read, read.sliding_window(read.decoder_fields(overrides)))


ARCHITECTURE = Architecture(
    model_type="mistral",
    parse_config=parse_config,
    build=LlamaForCausalLM,
    fused_sources=fused_sources,
    ignored_tensors=IGNORED_TENSORS,
)
