"""OLMo 3 family: AllenAI's OLMo 3 (7B, 32B) — OLMo 2's layers (kiln/models/olmo2.py) with windowed
layers and RoPE by kind of layer:
- `layer_types` names each layer "sliding_attention" (attends to the last `sliding_window` tokens)
  or "full_attention"; left out, every 4th layer is full (transformers' Olmo3Config);
- `rope_parameters` may hold each kind's RoPE (transformers 5). Older configs give one `rope_theta`
  and a `rope_scaling` that transformers applies to the full layers only (OLMo 3's long-context
  checkpoints scale the full layers' RoPE with YaRN and leave the windowed layers' as it is).

The windowed layers are the KV cache's per-layer "mha_sliding" kind, as Gemma 3's local layers, with
its prefill chunks shorter than the window (kiln/models/gemma3.py says why). When the two kinds' RoPE
is the same the cache (or `apply_rope`) applies it; when they differ the model rotates q and k with
each layer's frequencies (`rotate_qkv`), for the default RoPE and YaRN.

llama.cpp converts OLMo 3 as "olmo2" with the window: olmo2.py's GGUF mapping reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tvm.relax.frontend import nn
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache

from kiln.errors import KilnError

from . import olmo2
from .config_reader import ConfigReader
from .decoder import MODEL_ROPES, Architecture, rope_inv_freq, rotate_qkv
from .gemma3 import LAYER_KINDS, layer_kinds
from .llama import IGNORED_TENSORS, LlamaConfig, fused_sources, llama_layers_config
from .olmo2 import Olmo2Attention, Olmo2ForCausalLM

ROPE_KEYS = ("rope_parameters", "rope_scaling", "rope_theta")
# transformers' Olmo3Config defaults beyond Olmo2Config's.
DEFAULTS = dict(olmo2.DEFAULTS, sliding_window=4096, rope_theta=500_000.0)
# The ropes the model computes per layer when the two kinds differ.
LAYER_ROPES = ("default", "yarn")


@dataclass
class Olmo3Config(LlamaConfig):
    # Per layer when the kinds' RoPE differ: its rope_theta and rope scaling (None: the default RoPE).
    layer_ropes: tuple[tuple[float, dict[str, Any] | None], ...] = ()


def rope_parameters_by_kind(hf_config: dict) -> dict[str, dict]:
    """Each kind of layer's RoPE parameters: transformers 5 keeps them in `rope_parameters` by kind;
    earlier configs give rope_theta to both and rope_scaling to the full layers."""
    params = hf_config.get("rope_parameters")
    if isinstance(params, dict) and set(LAYER_KINDS) <= set(params):
        return {kind: params[kind] for kind in LAYER_KINDS}
    flat = params if isinstance(params, dict) else {"rope_theta": hf_config["rope_theta"]}
    scaling = hf_config.get("rope_scaling") or {}
    return {"sliding_attention": {"rope_theta": flat["rope_theta"]}, "full_attention": {**flat, **scaling}}


def parse_config(hf_config: dict, path: Path, overrides: dict[str, int]) -> Olmo3Config:
    hf_config = {**DEFAULTS, **{k: v for k, v in hf_config.items() if v is not None or k == "sliding_window"}}
    others = {k: v for k, v in hf_config.items() if k not in ROPE_KEYS}
    # Each kind's RoPE read as a config of its own, so that it is checked as any family's.
    ropes = {
        kind: ConfigReader({**others, "rope_parameters": params}, path).rope()
        for kind, params in rope_parameters_by_kind(hf_config).items()
    }
    read = ConfigReader({**others, "rope_parameters": rope_parameters_by_kind(hf_config)["full_attention"]}, path)
    fields = read.decoder_fields(overrides)
    kinds = layer_kinds(read, fields["num_hidden_layers"], 4)
    window = read.get("sliding_window", int, None)
    if window is None and "sliding_attention" in kinds:
        # transformers fails on such a config rather than read it as no window.
        raise KilnError("config.json sliding_window is null, and layer_types has sliding_attention layers", path)
    binds = window is not None and fields["context_window_size"] > window
    if binds:
        fields["prefill_chunk_size"] = min(fields["prefill_chunk_size"], window - 1)
    per_layer = ropes["sliding_attention"] != ropes["full_attention"]
    if per_layer:
        for theta, scaling in ropes.values():
            if (scaling or {}).get("rope_type", "default") not in LAYER_ROPES:
                raise KilnError(
                    f"config.json rope scaling '{scaling['rope_type']}' on one kind of layer only is not supported "
                    f"for OLMo 3 (supported: {', '.join(LAYER_ROPES)})",
                    path,
                )
        fields = {**fields, "rope_scaling": None}
    return llama_layers_config(
        read,
        fields,
        Olmo3Config,
        **olmo2.olmo_fields(read),
        windowed_layers=tuple(i for i, kind in enumerate(kinds) if kind == "sliding_attention") if binds else (),
        layer_window_size=window if binds else None,
        family_applies_rope=per_layer,
        layer_ropes=tuple(ropes[kind] for kind in kinds) if per_layer else (),
    )


class Olmo3Attention(Olmo2Attention):
    def rope(self, qkv: nn.Tensor, kv_cache: PagedKVCache, layer_id: int) -> nn.Tensor:
        if not self.config.family_applies_rope:
            return super().rope(qkv, kv_cache, layer_id)
        theta, scaling = self.config.layer_ropes[layer_id]
        if scaling is None:
            return rotate_qkv(qkv, kv_cache, self.config, rope_inv_freq(theta, self.head_dim))
        layer_config = replace(self.config, rope_theta=theta, rope_scaling=scaling)
        return rotate_qkv(qkv, kv_cache, self.config, *MODEL_ROPES[scaling["rope_type"]](layer_config))


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    attention_class = Olmo3Attention


ARCHITECTURE = Architecture(
    model_type="olmo3",
    parse_config=parse_config,
    build=Olmo3ForCausalLM,
    fused_sources=fused_sources,
    ignored_tensors=IGNORED_TENSORS,
)
