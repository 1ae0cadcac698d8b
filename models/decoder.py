"""What every decoder-only family shares: the exported functions and their signatures.

A family subclasses `DecoderModel` and provides `embed_tokens`, `hidden_states` (the layer stack
and final norm over the paged KV cache) and `logits`; the functions WebLLM and Kiln's engines
call — embed, prefill, decode, batch_prefill, batch_decode, prefill_all_logits and
create_tir_paged_kv_cache — are defined once here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import tvm
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache, RopeMode, TIRPagedKVCache
from tvm import relax as rx

from kiln.errors import KilnError

from .layers import gather_positions, last_position

SUPPORTED_ROPE_SCALING = ("llama3", "yarn", "longrope", "gptj")


@dataclass
class DecoderConfig:
    """Fields the shared decoder machinery needs; a family's config extends it."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float
    context_window_size: int
    prefill_chunk_size: int
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


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
        if kind in (int, float) and value <= 0:
            raise KilnError(f"config.json field '{key}' should be positive, got {value!r}", self.path)
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
                raise KilnError(f"config.json rope scaling '{rope_type}' is not supported "
                                f"(supported: {', '.join(SUPPORTED_ROPE_SCALING)})", self.path)
            scaling = {**scaling, "rope_type": rope_type}
        return theta, scaling

    def unused(self) -> dict[str, Any]:
        return {k: v for k, v in self.hf_config.items() if k not in self.used}


@dataclass(frozen=True)
class Architecture:
    """One registry entry: how to read a family's config, build its module, and find its weights."""

    model_type: str
    parse_config: Callable[[dict, Path, dict[str, int]], DecoderConfig]
    build: Callable[[DecoderConfig, str], "DecoderModel"]
    # Kiln weight name -> source tensors concatenated along axis 0 (fused projections);
    # weights not listed come from the source tensor of the same name.
    fused_sources: Callable[[DecoderConfig], dict[str, list[str]]]


class DecoderModel(nn.Module):
    """Base of every family's top-level module. `dtype` is the activation and KV cache dtype."""

    config: DecoderConfig
    dtype: str

    def embed_tokens(self, token_ids: nn.Tensor) -> nn.Tensor:
        raise NotImplementedError

    def hidden_states(self, embeds: nn.Tensor, kv_cache: PagedKVCache) -> nn.Tensor:
        raise NotImplementedError

    def logits(self, hidden: nn.Tensor) -> nn.Tensor:
        raise NotImplementedError

    def embed(self, input_ids: nn.Tensor) -> nn.Tensor:
        return self.embed_tokens(input_ids)

    def prefill(self, input_embed: nn.Tensor, paged_kv_cache: PagedKVCache):
        hidden = self.hidden_states(input_embed, paged_kv_cache)
        return self.logits(last_position(hidden)), paged_kv_cache

    def decode(self, input_embed: nn.Tensor, paged_kv_cache: PagedKVCache):
        return self.logits(self.hidden_states(input_embed, paged_kv_cache)), paged_kv_cache

    def batch_prefill(self, input_embeds: nn.Tensor, logit_positions: nn.Tensor, paged_kv_cache: PagedKVCache):
        hidden = self.hidden_states(input_embeds, paged_kv_cache)
        return self.logits(gather_positions(hidden, logit_positions)), paged_kv_cache

    def batch_decode(self, input_embeds: nn.Tensor, paged_kv_cache: PagedKVCache):
        return self.logits(self.hidden_states(input_embeds, paged_kv_cache)), paged_kv_cache

    def prefill_all_logits(self, input_embed: nn.Tensor, paged_kv_cache: PagedKVCache):
        """Logits of every position: forced decoding in one pass (parity checks; WebLLM ignores it)."""
        return self.logits(self.hidden_states(input_embed, paged_kv_cache)), paged_kv_cache

    def create_tir_paged_kv_cache(
        self,
        max_batch_size: tvm.tirx.Var,
        max_total_seq_len: tvm.tirx.Var,
        prefill_chunk_size: tvm.tirx.Var,
        page_size: tvm.tirx.Var,
        support_sliding_window: tvm.tirx.Var,
    ) -> PagedKVCache:
        c = self.config
        return TIRPagedKVCache(
            attn_kind="mha",
            max_batch_size=max_batch_size,
            max_total_seq_len=max_total_seq_len,
            prefill_chunk_size=prefill_chunk_size,
            page_size=page_size,
            support_sliding_window=support_sliding_window,
            layer_partition=rx.ShapeExpr([0, c.num_hidden_layers]),
            num_hidden_layers=c.num_hidden_layers,
            num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_key_value_heads,
            qk_head_dim=c.head_dim,
            v_head_dim=c.head_dim,
            mla_original_qk_head_dim=0,
            mla_original_v_head_dim=0,
            rope_mode=RopeMode.NORMAL,
            rope_scale=1,
            rope_theta=c.rope_theta,
            rope_scaling=c.rope_scaling or {},
            rope_ext_factors=rx.prim_value(0),
            rotary_dim=c.head_dim,
            enable_disaggregation=False,
            dtype=self.dtype,
            target=tvm.target.Target.current(),
        )


def export_spec(model: DecoderModel) -> dict[str, dict]:
    """The signatures of the exported functions (the same for every decoder family)."""
    hidden, dtype = model.config.hidden_size, model.dtype
    kv_cache = nn.spec.Object(object_type=PagedKVCache)
    with_params = {"param_mode": "packed", "effect_mode": "none"}
    return {
        "embed": {"input_ids": nn.spec.Tensor(["seq_len"], "int32"), "$": with_params},
        "prefill": {
            "input_embed": nn.spec.Tensor([1, "seq_len", hidden], dtype),
            "paged_kv_cache": kv_cache,
            "$": with_params,
        },
        "decode": {
            "input_embed": nn.spec.Tensor([1, 1, hidden], dtype),
            "paged_kv_cache": kv_cache,
            "$": with_params,
        },
        "batch_prefill": {
            "input_embeds": nn.spec.Tensor([1, "seq_len", hidden], dtype),
            "logit_positions": nn.spec.Tensor(["batch_size"], "int32"),
            "paged_kv_cache": kv_cache,
            "$": with_params,
        },
        "batch_decode": {
            "input_embeds": nn.spec.Tensor(["batch_size", 1, hidden], dtype),
            "paged_kv_cache": kv_cache,
            "$": with_params,
        },
        "prefill_all_logits": {
            "input_embed": nn.spec.Tensor([1, "seq_len", hidden], dtype),
            "paged_kv_cache": kv_cache,
            "$": with_params,
        },
        "create_tir_paged_kv_cache": {
            "max_batch_size": int,
            "max_total_seq_len": int,
            "prefill_chunk_size": int,
            "page_size": int,
            "support_sliding_window": int,
            "$": {"param_mode": "none", "effect_mode": "none"},
        },
    }
