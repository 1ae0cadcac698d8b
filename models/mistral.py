"""Mistral family: Mistral 7B v0.1–v0.3, Ministral-style checkpoints — Llama's layers without
biases, with an optional sliding attention window (`sliding_window`).

A window only matters once a sequence is longer than it. Kiln builds a context window of at most
the sliding window (Mistral 7B v0.1: 4096 and 4096 by default; v0.2+ have no window), and refuses
a longer context with a clear error: attending beyond the window's reach would silently change the
model. llama.cpp converts Mistral as a Llama (its GGUFs say `general.architecture` "llama").
"""

from __future__ import annotations

from pathlib import Path

from kiln.errors import KilnError

from .decoder import Architecture, ConfigReader
from .llama import IGNORED_TENSORS, LlamaConfig, LlamaForCausalLM, fused_sources


def parse_config(hf_config: dict, path: Path, overrides: dict[str, int]) -> LlamaConfig:
    read = ConfigReader(hf_config, path)
    read.expect("hidden_act", ("silu",), "silu")
    window = read.get("sliding_window", int, None)
    fields = read.decoder_fields(overrides, max_context=min(4096, window or 4096))
    if window is not None and fields["context_window_size"] > window:
        raise KilnError(f"a context window of {fields['context_window_size']} is longer than the model's "
                        f"sliding_window of {window}: sliding-window attention is not supported yet, "
                        f"build with --context-window-size {window} or less", path)
    return LlamaConfig(
        **fields,
        intermediate_size=read.get("intermediate_size", int),
        rms_norm_eps=read.get("rms_norm_eps", float, 1e-6),
        extra=read.unused(),
    )


ARCHITECTURE = Architecture(
    model_type="mistral",
    parse_config=parse_config,
    build=LlamaForCausalLM,
    fused_sources=fused_sources,
    ignored_tensors=IGNORED_TENSORS,
)
