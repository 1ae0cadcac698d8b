"""What every embedding model shares: the pooling that turns a batch's hidden states into one
vector per input, the exported function and its signature.

An embedding family subclasses `EncoderModel` and provides `hidden_states(input_ids, attention_mask)`
over a batch padded to one length (mask 1 for a token, 0 for padding, padding on the right); the
library then exports one function, `sentence_embeddings(input_ids, attention_mask) -> (batch, hidden)`,
the pooled vectors before any normalization (the engines truncate them to the requested dimensions,
then normalize: Matryoshka's order). No KV cache: an input runs whole, in one call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from tvm import te, tirx
from tvm.relax.frontend import nn

from .layers import Linear
from .stage_names import ATTENTION_SCORES, ATTENTION_VALUES, MASKED_SCORES

# sentence-transformers' pooling modes Kiln computes, by their names in 1_Pooling/config.json.
POOLING_MODES = ("cls", "mean", "max", "lasttoken")
# A batch's largest intermediate (attention scores, or the feed-forward's activations) is kept within
# this many bytes; the engines split a larger batch. A WebGPU binding must hold it (128 MiB is the
# default limit) and a library plans its memory for the largest batch of the longest inputs.
BATCH_BUFFER_BYTES = 32 << 20
MOST_INPUTS_PER_BATCH = 32
MASKED_SCORE = -1e30  # a padding key's attention score: exp() of it is 0


# sentence-transformers' Dense activations Kiln computes, by the last part of their torch name.
DENSE_ACTIVATIONS: dict[str, Callable[[nn.Tensor], nn.Tensor]] = {"Identity": lambda x: x, "Tanh": nn.op.tanh}


@dataclass(frozen=True)
class DenseLayer:
    """A sentence-transformers Dense module after the pooling: a linear map, then an activation."""

    in_features: int
    out_features: int
    bias: bool = True
    activation: str = "Tanh"  # a key of DENSE_ACTIVATIONS (sentence-transformers' default)


@dataclass(frozen=True)
class SentenceEmbedding:
    """How a checkpoint turns hidden states into its embedding (sentence-transformers' modules)."""

    pooling: str = "mean"
    dense: tuple[DenseLayer, ...] = ()  # after the pooling, before the normalization (EmbeddingGemma's two)
    normalize: bool = False
    max_sequence_length: int | None = None  # sentence_bert_config.json's max_seq_length
    # Shorter lengths the model was trained to give (Matryoshka); the full width is always allowed.
    dimensions: tuple[int, ...] = ()


@dataclass
class EncoderConfig:
    """Fields every embedding model has; a family's config extends it."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    embedding: SentenceEmbedding = field(default_factory=SentenceEmbedding)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def embedding_width(self) -> int:
        """The width of the vectors: the hidden size, or the last Dense module's."""
        dense = self.embedding.dense
        return dense[-1].out_features if dense else self.hidden_size

    @property
    def max_sequence_length(self) -> int:
        """The longest input, special tokens included: the checkpoint's, within the positions the model
        has and the longest whose largest intermediate fits `BATCH_BUFFER_BYTES` (`longest_in_budget`)."""
        checkpoint = self.embedding.max_sequence_length or self.max_position_embeddings
        return min(checkpoint, self.max_position_embeddings, self.longest_in_budget)

    @property
    def longest_in_budget(self) -> int:
        """The longest input whose attention scores (heads · length² floats) and feed-forward activations
        (length · intermediate_size floats) each fit `BATCH_BUFFER_BYTES`: a decoder embedder's 32k positions
        would take gigabytes of scores (bert's 512 take 12 MiB)."""
        floats = BATCH_BUFFER_BYTES // 4
        return min(math.isqrt(floats // self.num_attention_heads), floats // self.intermediate_size)

    @property
    def max_batch_size(self) -> int:
        """The most inputs of the longest length one call takes (`BATCH_BUFFER_BYTES`)."""
        length = self.max_sequence_length
        per_input = 4 * length * max(self.num_attention_heads * length, self.intermediate_size)
        return max(1, min(MOST_INPUTS_PER_BATCH, BATCH_BUFFER_BYTES // per_input))


def pooled(hidden: nn.Tensor, attention_mask: nn.Tensor, mode: str) -> nn.Tensor:
    """One vector per input (batch, hidden) from its tokens' hidden states, padding left out."""

    def pool(x: te.Tensor, mask: te.Tensor) -> te.Tensor:
        batch, seq_len, width = x.shape

        def over_tokens(name: str) -> tirx.IterVar:
            return te.reduce_axis((0, seq_len), name=name)

        j = over_tokens("j")
        lengths = te.compute((batch,), lambda b: te.sum(mask[b, j], axis=j), name="lengths")
        kept = lambda b, t, value, masked: tirx.if_then_else(mask[b, t] > 0, value, tirx.const(masked, x.dtype))  # noqa: E731
        t = over_tokens("t")
        sums = te.compute((batch, width), lambda b, c: te.sum(kept(b, t, x[b, t, c], 0.0), axis=t), name="sums")

        def mean(b, c):
            return sums[b, c] / tirx.max(lengths[b], 1).astype(x.dtype)

        def maximum(b, c):
            t = over_tokens("t")
            return te.max(kept(b, t, x[b, t, c], MASKED_SCORE), axis=t)

        pools: dict[str, Callable[..., tirx.PrimExpr]] = {
            "cls": lambda b, c: x[b, 0, c],
            "lasttoken": lambda b, c: x[b, tirx.max(lengths[b] - 1, 0), c],
            "mean": mean,
            "max": maximum,
        }
        return te.compute((batch, width), pools[mode], name="pooled")

    return nn.op.tensor_expr_op(pool, f"pool_{mode}", [hidden, attention_mask])


class Dense(nn.Module):
    def __init__(self, layer: DenseLayer, dtype: str):
        self.linear = Linear(layer.in_features, layer.out_features, dtype, bias=layer.bias)
        self.activation = DENSE_ACTIVATIONS[layer.activation]

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        return self.activation(self.linear(x))


class EncoderModel(nn.Module):
    """Base of every embedding family's top-level module. `dtype` is the activation dtype. A family
    sets `dense` (`dense_modules`): the checkpoint's Dense modules, weights "dense.<i>.linear.*"."""

    config: EncoderConfig
    dtype: str
    dense: nn.ModuleList

    def hidden_states(self, input_ids: nn.Tensor, attention_mask: nn.Tensor) -> nn.Tensor:
        raise NotImplementedError

    def sentence_embeddings(self, input_ids: nn.Tensor, attention_mask: nn.Tensor) -> nn.Tensor:
        vectors = pooled(self.hidden_states(input_ids, attention_mask), attention_mask, self.config.embedding.pooling)
        if len(self.dense):
            batch, width = vectors.shape
            rows = nn.op.reshape(vectors, (1, batch, width))  # the inputs' vectors as one row, as a prefill's tokens
            for module in self.dense:
                rows = module(rows)
            vectors = nn.op.reshape(rows, (batch, self.config.embedding_width))
        return vectors.astype("float32")


def dense_modules(config: EncoderConfig, dtype: str) -> nn.ModuleList:
    return nn.ModuleList([Dense(layer, dtype) for layer in config.embedding.dense])


def encoder_export_spec(model: EncoderModel) -> dict[str, dict]:
    batch = nn.spec.Tensor(["batch", "seq_len"], "int32")
    return {
        "sentence_embeddings": {
            "input_ids": batch,
            "attention_mask": batch,
            "$": {"param_mode": "packed", "effect_mode": "none"},
        }
    }


def masked_scores(
    x: te.Tensor,
    mask: te.Tensor,
    num_heads: int,
    group: int,
    scale: float,
    sees: Callable[[tirx.PrimExpr, tirx.PrimExpr], tirx.PrimExpr] | None = None,
) -> te.Tensor:
    """masked_attention's scores: query i's product with key j of its input, scaled, float32, where
    the mask (and `sees`) let i see j, else MASKED_SCORE: (batch, heads, seq, seq)."""
    batch, seq_len, _, head_dim = x.shape
    d = te.reduce_axis((0, head_dim), name="d")
    # The heads an int64 axis like the others: an int32 one among them made TVM refuse the CPU
    # schedule's reverse_compute_at (EncoderAttentionScores).
    raw = te.compute(
        (batch, tirx.IntImm("int64", num_heads), seq_len, seq_len),
        lambda b, h, i, j: te.sum(
            x[b, i, h, d].astype("float32") * x[b, j, num_heads + h // group, d].astype("float32"), axis=d
        ),
        name=ATTENTION_SCORES,
    )

    def masked(b, h, i, j):
        seen = mask[b, j] > 0 if sees is None else tirx.all(mask[b, j] > 0, sees(i, j))
        return tirx.if_then_else(seen, raw[b, h, i, j] * scale, tirx.const(MASKED_SCORE))

    return te.compute(raw.shape, masked, name=MASKED_SCORES)


def masked_attention(
    qkv: nn.Tensor,
    attention_mask: nn.Tensor,
    num_heads: int,
    num_kv_heads: int | None = None,
    scale: float | None = None,
    sees: Callable[[tirx.PrimExpr, tirx.PrimExpr], tirx.PrimExpr] | None = None,
) -> nn.Tensor:
    """Each token attends to the tokens of its input, padding left out (and, with `sees`, to the keys
    j that query i sees: causal attention, a window): a fused q, k, v of shape (batch, seq, heads + 2 ·
    kv_heads, head_dim) → (batch, seq, heads · head_dim). Grouped-query: a query head reads kv head
    h // (heads / kv_heads). `scale` (default 1/√head_dim) multiplies the scores; scores and softmax
    are float32."""
    batch, seq_len, _, head_dim = qkv.shape
    num_kv_heads = num_kv_heads or num_heads
    group = num_heads // num_kv_heads
    scale = float(head_dim) ** -0.5 if scale is None else scale

    def values(p: te.Tensor, x: te.Tensor) -> te.Tensor:
        j = te.reduce_axis((0, seq_len), name="j")
        return te.compute(
            (batch, seq_len, num_heads, head_dim),
            lambda b, i, h, d: te.sum(
                p[b, h, i, j] * x[b, j, num_heads + num_kv_heads + h // group, d].astype("float32"), axis=j
            ),
            name=ATTENTION_VALUES,
        )

    def scores(x: te.Tensor, mask: te.Tensor) -> te.Tensor:
        return masked_scores(x, mask, num_heads, group, scale, sees)

    probabilities = nn.op.softmax(nn.op.tensor_expr_op(scores, "attention_scores", [qkv, attention_mask]), axis=-1)
    context = nn.op.tensor_expr_op(values, "attention_values", [probabilities, qkv]).astype(qkv.dtype)
    return nn.op.reshape(context, (batch, seq_len, num_heads * head_dim))
