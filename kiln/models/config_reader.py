"""Typed fields of a Hugging Face config.json, read with errors that name the file: every family
reads its config through one."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from kiln.errors import KilnError

from .decoder import MODEL_ROPES

SUPPORTED_ROPE_SCALING = ("llama3", "yarn", "longrope", "gptj")
# Ropes scaled from a pretraining context: transformers reads it from the top level of config.json
# first, then from the scaling's own fields, then takes max_position_embeddings (standardize_rope_params).
ORIGINAL_CONTEXT_ROPES = ("llama3", "yarn", "longrope")
# Far above the largest published models (Llama 3.1 405B: hidden 16384, 126 layers; vocabularies
# of 256k): a larger value is a corrupt or hostile config.json, refused before anything is sized by it.
SIZE_LIMITS = {
    "hidden_size": 1 << 17,
    "intermediate_size": 1 << 19,
    "num_hidden_layers": 1 << 10,
    "num_attention_heads": 1 << 10,
    "num_key_value_heads": 1 << 10,
    "head_dim": 1 << 12,
    "global_head_dim": 1 << 12,  # Gemma 4's global layers
    "num_global_key_value_heads": 1 << 10,
    "vocab_size": 1 << 22,
    "max_position_embeddings": 1 << 27,
    "original_max_position_embeddings": 1 << 27,
    "sliding_window": 1 << 27,
}


class ConfigReader:
    """Reads typed fields from a Hugging Face config.json, naming the file in every error."""

    def __init__(self, hf_config: dict, path: Path):
        self.hf_config = hf_config
        self.path = path
        self.used: set[str] = set()

    def get(self, key: str, kind: type, default: Any = KilnError):
        self.used.add(key)
        if key not in self.hf_config or self.hf_config[key] is None:
            if default is KilnError:
                raise KilnError(f"config.json lacks the required field '{key}'", self.path)
            return default
        value = self.hf_config[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
            raise KilnError(f"config.json field '{key}' should be {kind.__name__}, got {value!r}", self.path)
        if kind in (int, float) and not 0 < value < math.inf:
            raise KilnError(f"config.json field '{key}' should be positive, got {value!r}", self.path)
        if key in SIZE_LIMITS and value > SIZE_LIMITS[key]:
            raise KilnError(
                f"config.json field '{key}' is {value}, beyond any real model's (at most {SIZE_LIMITS[key]})", self.path
            )
        return value

    def rope(self) -> tuple[float, dict[str, Any] | None]:
        """rope_theta and rope_scaling; transformers 5 nests both in `rope_parameters`."""
        params = self.get("rope_parameters", dict, {}) or {}
        theta = float(params.get("rope_theta", self.get("rope_theta", float, 10000.0)))
        scaling = self.get("rope_scaling", dict, None) or (params if "rope_type" in params else None)
        if scaling is not None:
            rope_type = scaling.get("rope_type", scaling.get("type"))
            if rope_type == "default":
                return theta, None
            if rope_type not in SUPPORTED_ROPE_SCALING:
                raise KilnError(
                    f"config.json rope scaling '{rope_type}' is not supported "
                    f"(supported: {', '.join(SUPPORTED_ROPE_SCALING)})",
                    self.path,
                )
            scaling = {**scaling, "rope_type": rope_type}
            if rope_type in ORIGINAL_CONTEXT_ROPES:
                scaling |= self.original_context(scaling)
        return theta, scaling

    def original_context(self, scaling: dict[str, Any]) -> dict[str, Any]:
        """The pretraining context a scaled rope starts from, and YaRN's factor when it is left out
        (transformers: the ratio of the trained context to it)."""
        trained = self.get("max_position_embeddings", int, 4096)
        original = self.get(
            "original_max_position_embeddings", int, scaling.get("original_max_position_embeddings") or trained
        )
        fields = {"original_max_position_embeddings": original}
        if scaling["rope_type"] == "yarn" and scaling.get("factor") is None:
            fields["factor"] = trained / original
        return fields

    def decoder_fields(
        self, overrides: dict[str, int], max_context: int = 4096, partial_rotary: bool = False
    ) -> dict[str, Any]:
        """The `DecoderConfig` fields, read the way every Hugging Face decoder stores them; the
        context window defaults to the model's, at most `max_context`. RoPE over part of each head
        (`partial_rotary_factor`) is refused unless the family reads it itself."""
        self.refuse_prequantized()
        if not partial_rotary:
            rope_parameters = self.hf_config.get("rope_parameters") or {}
            self.expect("partial_rotary_factor", (1, 1.0), rope_parameters.get("partial_rotary_factor", 1.0))
        hidden_size = self.get("hidden_size", int)
        num_heads = self.get("num_attention_heads", int)
        num_kv_heads = self.get("num_key_value_heads", int, num_heads)
        if self.hf_config.get("head_dim") is None and hidden_size % num_heads:
            raise KilnError(
                f"config.json num_attention_heads {num_heads} does not divide hidden_size {hidden_size}", self.path
            )
        if num_heads % num_kv_heads:
            raise KilnError(
                f"config.json num_key_value_heads {num_kv_heads} does not divide num_attention_heads {num_heads}",
                self.path,
            )
        rope_theta, rope_scaling = self.rope()
        trained_context = self.get("max_position_embeddings", int, 4096)
        context = overrides.get("context_window_size") or min(trained_context, max_context)
        return dict(
            hidden_size=hidden_size,
            num_hidden_layers=self.get("num_hidden_layers", int),
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=self.get("head_dim", int, hidden_size // num_heads),
            vocab_size=self.get("vocab_size", int),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=self.get("tie_word_embeddings", bool, False),
            context_window_size=context,
            prefill_chunk_size=overrides.get("prefill_chunk_size") or min(context, 2048),
        )

    def refuse_prequantized(self) -> None:
        """Weights stored quantized by another tool (`quantization_config`: FP8 with its weight_scale or
        weight_scale_inv tensors, GPTQ, AWQ, …) are not float weights, and Kiln does not dequantize them."""
        quantization = self.get("quantization_config", dict, None)
        if quantization is not None:
            method = quantization.get("quant_method", "unnamed")
            raise KilnError(
                f"config.json quantization_config: the weights are stored {method}-quantized, and Kiln reads "
                f"float weights (F32, F16, BF16) only; build from the model's BF16 release, or dequantize it first",
                self.path,
            )

    def sliding_window(self, fields: dict[str, Any], key: str = "sliding_window") -> dict[str, Any]:
        """`decoder_fields` with the model's sliding window turned on when the context window is
        longer than it (a window that never binds is left out). WebLLM sizes its KV cache to the
        window it keeps (window - 1 past tokens): a prefill chunk must fit in it."""
        window = self.get(key, int, None)
        if window is None or fields["context_window_size"] <= window:
            return fields
        rope_type = (fields["rope_scaling"] or {}).get("rope_type")
        if rope_type in MODEL_ROPES:
            # Measured on a tiny YaRN Mistral: logits 7 apart from transformers' from the first
            # position the window leaves a token out.
            raise KilnError(
                f"config.json {key} {window} is shorter than the context window "
                f"({fields['context_window_size']}), and TVM's sliding-window KV cache does not "
                f"position the {rope_type} RoPE Kiln applies in the model; build with "
                f"--context-window-size {window} or less",
                self.path,
            )
        return {
            **fields,
            "sliding_window_size": window,
            "prefill_chunk_size": min(fields["prefill_chunk_size"], window - 1),
        }

    def expect(self, key: str, allowed: tuple, default: Any) -> Any:
        """A field whose other values would change the math in ways the family does not compute."""
        self.used.add(key)
        value = self.hf_config.get(key, default)
        if value is None:
            value = default
        if value not in allowed:
            raise KilnError(
                f"config.json field '{key}' is {value!r}; Kiln's {self.hf_config.get('model_type')} "
                f"supports {' or '.join(repr(a) for a in allowed)}",
                self.path,
            )
        return value

    def unused(self) -> dict[str, Any]:
        return {k: v for k, v in self.hf_config.items() if k not in self.used}
