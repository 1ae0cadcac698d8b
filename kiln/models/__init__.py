"""Model families: one file per architecture, one registry keyed by `model_type`."""

from __future__ import annotations

from pathlib import Path

from kiln.errors import KilnError

from . import (
    bert,
    gemma2,
    gemma3,
    gemma4,
    granite,
    lfm2,
    llama,
    ministral3,
    mistral,
    olmo2,
    olmo3,
    phi3,
    qwen2,
    qwen3,
    qwen3_5,
    smollm3,
)
from .decoder_embedding import embedder_architecture
from .decoder import Architecture, DecoderConfig, DecoderModel, export_spec
from .embedding import EncoderConfig, EncoderModel, SentenceEmbedding, encoder_export_spec
from .gguf import GGUFMapping, GGUFTensors

MODELS: dict[str, Architecture] = {
    arch.model_type: arch
    for arch in (
        llama.ARCHITECTURE,
        qwen2.ARCHITECTURE,
        mistral.ARCHITECTURE,
        qwen3.ARCHITECTURE,
        phi3.ARCHITECTURE,
        gemma2.ARCHITECTURE,
        gemma3.ARCHITECTURE,
        gemma3.MULTIMODAL_ARCHITECTURE,
        gemma4.ARCHITECTURE,
        gemma4.MULTIMODAL_ARCHITECTURE,
        granite.ARCHITECTURE,
        smollm3.ARCHITECTURE,
        olmo2.ARCHITECTURE,
        olmo3.ARCHITECTURE,
        ministral3.ARCHITECTURE,
        ministral3.MULTIMODAL_ARCHITECTURE,
        lfm2.ARCHITECTURE,
        qwen3_5.ARCHITECTURE,
        qwen3_5.MULTIMODAL_ARCHITECTURE,
        bert.ARCHITECTURE,
    )
}


def architecture_for(hf_config: dict, path: Path, embedding: bool = False) -> Architecture:
    """The family of a checkpoint's config; `embedding` (a sentence-transformers checkpoint): a decoder
    family's embedder where the family has one."""
    model_type = hf_config.get("model_type")
    if model_type in REFUSED_MODEL_TYPES:
        raise KilnError(f"model_type {model_type!r}: {REFUSED_MODEL_TYPES[model_type]}", path)
    if model_type not in MODELS:
        raise KilnError(f"unknown model_type {model_type!r} (supported: {', '.join(sorted(MODELS))})", path)
    arch = MODELS[model_type]
    return embedder_architecture(arch) if embedding and arch.sentence_embeddings else arch


# Model types whose checkpoints Kiln recognizes and refuses, with the reason.
REFUSED_MODEL_TYPES: dict[str, str] = {**gemma4.REFUSED_MODEL_TYPES}


# Decoder families whose sentence-transformers checkpoints compile to embedding models (beside the encoders').
EMBEDDER_FAMILIES = sorted(arch.model_type for arch in MODELS.values() if arch.sentence_embeddings)


__all__ = [
    "MODELS",
    "EMBEDDER_FAMILIES",
    "Architecture",
    "DecoderConfig",
    "DecoderModel",
    "EncoderConfig",
    "EncoderModel",
    "SentenceEmbedding",
    "encoder_export_spec",
    "GGUFMapping",
    "GGUFTensors",
    "architecture_for",
    "export_spec",
]
