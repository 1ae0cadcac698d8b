"""Decoder embedders: a decoder family's layers as an embedding model — Qwen3-Embedding, EmbeddingGemma
(Gemma 3's layers with attention both ways, `use_bidirectional_attention`), and the sentence-transformers
checkpoints of the other families that set `Architecture.sentence_embeddings`. Attention over each input
of a padded batch (causal, or both ways; within a layer's window where it has one), the family's final
norm, then the checkpoint's pooling, Dense modules and normalization, as for an encoder
(kiln/models/embedding.py).

The layers run as in a chat model's prefill, with `WholeInputs` where they expect the paged KV cache:
it gives each token its position in its own input and attends over that input, so the library needs
no cache and runs a batch in one call, as an encoder's does. Inputs sit on the right of their row (the
engines pad after them); sentence-transformers pads Qwen3-Embedding's on the left, which moves every
position of an input by the same amount, and RoPE's scores depend only on the distance between two.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np
from tvm import te, tirx
from tvm.relax.frontend import nn

from kiln.errors import KilnError

from .decoder import Architecture, DecoderConfig, DecoderModel, rope_in_model, rope_inv_freq, rope_type, rotate_qkv
from .embedding import EncoderConfig, EncoderModel, dense_modules, masked_attention


@dataclass
class DecoderEmbedderConfig(EncoderConfig):
    decoder: DecoderConfig | None = None  # the family's own config, its output head tied (never used)

    @property
    def head_dim(self) -> int:
        return self.decoder.head_dim

    @classmethod
    def of(cls, decoder: DecoderConfig, path: Path) -> DecoderEmbedderConfig:
        """The embedder of a decoder whose attention `WholeInputs` can stand in for: the default RoPE or
        one the model applies itself, whole inputs or windowed layers (no window over every layer)."""
        refused = {
            "a sliding window over every layer": decoder.sliding_window_size,
            "soft-capped attention scores": decoder.attention_logit_softcap,
            f"rope_type {rope_type(decoder)!r}": not rope_in_model(decoder)
            and rope_type(decoder) not in (None, "default"),
        }
        for what, present in refused.items():
            if present:
                raise KilnError(f"an embedding model with {what}, which Kiln's decoder embedders do not run", path)
        return cls(
            hidden_size=decoder.hidden_size,
            num_hidden_layers=decoder.num_hidden_layers,
            num_attention_heads=decoder.num_attention_heads,
            intermediate_size=decoder.intermediate_size,
            vocab_size=decoder.vocab_size,
            max_position_embeddings=decoder.context_window_size,
            decoder=replace(decoder, tie_word_embeddings=True),
            extra=decoder.extra,
        )


class WholeInputs:
    """What a decoder family's layers call on the paged KV cache, over a batch of whole inputs laid end
    to end in one row (1, batch · seq, ·): each token's position in its input, and attention over its
    input (RoPE first, where the cache would apply it) — up to itself, or both ways for a bidirectional
    embedder — within the layer's window, if it has one."""

    def __init__(self, config: DecoderConfig, attention_mask: nn.Tensor):
        self.config = config
        self.attention_mask = attention_mask

    def sees(self, layer_id: int) -> Callable[[tirx.PrimExpr, tirx.PrimExpr], tirx.PrimExpr] | None:
        """Which keys j query i attends to in layer `layer_id` (None: all), as transformers masks them: a
        causal window holds the last `window` tokens; a bidirectional one reaches window // 2 tokens each
        way (Gemma3TextConfig's (window // 2) + 1, an exclusive bound)."""
        window = self.config.layer_window_size if layer_id in self.config.windowed_layers else None
        if window is None:
            return None if self.config.bidirectional else lambda i, j: j <= i
        if self.config.bidirectional:
            reach = window // 2 + 1
            return lambda i, j: tirx.all(i - j < reach, j - i < reach)
        return lambda i, j: tirx.all(j <= i, i - j < window)

    def get_query_positions(self, total_tokens) -> nn.Tensor:
        _, seq_len = self.attention_mask.shape

        def positions(mask: te.Tensor) -> te.Tensor:
            return te.compute((total_tokens,), lambda k: (k % seq_len).astype("int32"), name="positions")

        return nn.op.tensor_expr_op(positions, "positions", [self.attention_mask])

    def attention_with_fused_qkv(self, layer_id: int, qkv: nn.Tensor, num_qo_heads: int, sm_scale: float):
        config = self.config
        if not rope_in_model(config):
            inv_freq = rope_inv_freq(config.rope_theta, config.rotary_dim or config.head_dim)
            qkv = rotate_qkv(qkv, self, config, inv_freq.astype(np.float32))
        batch, seq_len = self.attention_mask.shape
        inputs = nn.op.reshape(qkv, (batch, seq_len, -1, config.head_dim))
        attended = masked_attention(
            inputs, self.attention_mask, num_qo_heads, config.num_key_value_heads, sm_scale, self.sees(layer_id)
        )
        return nn.op.reshape(attended, (*qkv.shape[:2], num_qo_heads, config.head_dim))


class DecoderEmbedder(EncoderModel):
    """A decoder family's module run as an embedding model; its weights keep the decoder's names."""

    def __init__(self, config: DecoderEmbedderConfig, decoder: DecoderModel):
        outside = [name for name, _ in decoder.named_parameters() if not name.startswith("model.")]
        if outside:
            raise KilnError(f"the {type(decoder).__name__} embedder has weights outside its model: {outside[0]}")
        self.config = config
        self.dtype = decoder.dtype
        self.model = decoder.model
        self.dense = dense_modules(config, decoder.dtype)
        self.decoder_steps = (decoder.embed_tokens, decoder.hidden_states)  # bound methods: no weights of their own

    def hidden_states(self, input_ids: nn.Tensor, attention_mask: nn.Tensor) -> nn.Tensor:
        batch, seq_len = input_ids.shape
        embed_tokens, layers = self.decoder_steps
        embeds = nn.op.reshape(embed_tokens(nn.op.reshape(input_ids, (batch * seq_len,))), (1, batch * seq_len, -1))
        hidden = layers(embeds, WholeInputs(self.config.decoder, attention_mask))
        return nn.op.reshape(hidden, (batch, seq_len, self.config.hidden_size))


def embedder_architecture(arch: Architecture) -> Architecture:
    """`arch` for its sentence-transformers checkpoints: an embedding model of the family's layers. Such a
    checkpoint keeps the decoder without its head, often without the "model." prefix (Qwen3Model's)."""
    return replace(
        arch,
        parse_config=lambda hf_config, path, overrides: DecoderEmbedderConfig.of(
            arch.parse_config(hf_config, path, overrides), path
        ),
        build=lambda config, dtype: DecoderEmbedder(config, arch.build(config.decoder, dtype)),
        fused_sources=lambda config: arch.fused_sources(config.decoder),
        ignored_tensors=(*arch.ignored_tensors, r"lm_head\.weight"),
        decoder_prefixes=(*arch.decoder_prefixes, ""),
        gguf=None,
    )
