"""BERT family: BERT and the sentence encoders built on it (MiniLM, BGE, E5, GTE) — absolute
position embeddings, post-norm layers (LayerNorm after each residual add), GELU, biases
everywhere, bidirectional attention over the whole input.

Inputs are single texts: every token gets the token-type embedding of type 0 (sentence-transformers
passes no other). The pooler (`pooler.dense`, BERT's
next-sentence head) and the masked-LM head are not part of an embedding and are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tvm import te, topi
from tvm.relax.frontend import nn

from .config_reader import ConfigReader
from .decoder import Architecture
from .embedding import EncoderConfig, EncoderModel, dense_modules, masked_attention
from .layers import Embedding, Linear

SQRT_HALF = 0.5**0.5


def gelu(x: nn.Tensor) -> nn.Tensor:
    """GELU, x·(1 + erf(x/√2))/2, with erf as TVM's rational approximation (`topi.fast_erf`, Eigen's:
    within float32 rounding): LLVM vectorizes it, where it calls libm's erff once per element
    (MiniLM's feed-forward matmul took 3× its time with erff in its epilogue)."""

    def compute(t: te.Tensor) -> te.Tensor:
        erf = topi.fast_erf(te.compute(t.shape, lambda *i: t(*i) * SQRT_HALF, name="gelu_scaled"))
        return te.compute(t.shape, lambda *i: 0.5 * t(*i) * (1.0 + erf(*i)), name="gelu")

    return nn.op.tensor_expr_op(compute, "gelu", [x])


# transformers' names of BERT's activations and the op computing each.
ACTIVATIONS = {
    "gelu": gelu,
    "gelu_new": lambda x: nn.op.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: nn.op.gelu(x, approximate="tanh"),
}


@dataclass
class BertConfig(EncoderConfig):
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"


def parse_config(hf_config: dict, path: Path, overrides: dict[str, int]) -> BertConfig:
    read = ConfigReader(hf_config, path)
    read.expect("position_embedding_type", ("absolute",), "absolute")
    read.expect("is_decoder", (False,), False)
    hidden_act = read.expect("hidden_act", tuple(ACTIVATIONS), "gelu")
    max_positions = read.get("max_position_embeddings", int, 512)
    return BertConfig(
        hidden_size=read.get("hidden_size", int),
        num_hidden_layers=read.get("num_hidden_layers", int),
        num_attention_heads=read.get("num_attention_heads", int),
        intermediate_size=read.get("intermediate_size", int),
        vocab_size=read.get("vocab_size", int),
        max_position_embeddings=min(max_positions, overrides.get("context_window_size", max_positions)),
        type_vocab_size=read.get("type_vocab_size", int, 2),
        layer_norm_eps=read.get("layer_norm_eps", float, 1e-12),
        hidden_act=hidden_act,
        extra=read.unused(),
    )


class LayerNorm(nn.Module):
    def __init__(self, width: int, eps: float, dtype: str):
        self.eps = eps
        self.weight = nn.Parameter((width,), dtype)
        self.bias = nn.Parameter((width,), dtype)

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        return nn.op.layer_norm(x, [x.shape[-1]], self.weight, self.bias, eps=self.eps)


class Table(nn.Module):
    """A table read by position or type (kept in the float dtype, unlike the token `Embedding`)."""

    def __init__(self, rows: int, width: int, dtype: str):
        self.weight = nn.Parameter((rows, width), dtype)


class BertEmbeddings(nn.Module):
    def __init__(self, config: BertConfig, dtype: str):
        self.word_embeddings = Embedding(config.vocab_size, config.hidden_size, dtype)
        self.position_embeddings = Table(config.max_position_embeddings, config.hidden_size, dtype)
        self.token_type_embeddings = Table(config.type_vocab_size, config.hidden_size, dtype)
        self.LayerNorm = LayerNorm(config.hidden_size, config.layer_norm_eps, dtype)

    def forward(self, input_ids: nn.Tensor) -> nn.Tensor:
        batch, seq_len = input_ids.shape
        # a token embedding (quantized ones too) takes a row of ids
        words = self.word_embeddings(nn.op.reshape(input_ids, (batch * seq_len,)))

        def positions(position: te.Tensor, token_type: te.Tensor) -> te.Tensor:
            return te.compute((1, seq_len, position.shape[1]), lambda _, i, c: token_type[0, c] + position[i, c])

        tables = [self.position_embeddings.weight, self.token_type_embeddings.weight]
        words = nn.op.reshape(words, (batch, seq_len, -1))
        return self.LayerNorm(words + nn.op.tensor_expr_op(positions, "positions", tables))


class BertSelfAttention(nn.Module):
    def __init__(self, config: BertConfig, dtype: str):
        self.num_heads = config.num_attention_heads
        self.qkv = Linear(config.hidden_size, 3 * config.hidden_size, dtype, bias=True)

    def forward(self, x: nn.Tensor, attention_mask: nn.Tensor) -> nn.Tensor:
        batch, seq_len = attention_mask.shape
        qkv = nn.op.reshape(self.qkv(x), (batch, seq_len, 3 * self.num_heads, -1))  # (batch, seq, 3·heads, head_dim)
        return nn.op.reshape(masked_attention(qkv, attention_mask, self.num_heads), x.shape)


class BertOutput(nn.Module):
    """A projection added to the residual, then normalized (post-norm)."""

    def __init__(self, in_features: int, config: BertConfig, dtype: str):
        self.dense = Linear(in_features, config.hidden_size, dtype, bias=True)
        self.LayerNorm = LayerNorm(config.hidden_size, config.layer_norm_eps, dtype)

    def forward(self, x: nn.Tensor, residual: nn.Tensor) -> nn.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: BertConfig, dtype: str):
        setattr(self, "self", BertSelfAttention(config, dtype))  # transformers' name for it
        self.output = BertOutput(config.hidden_size, config, dtype)

    def forward(self, x: nn.Tensor, attention_mask: nn.Tensor) -> nn.Tensor:
        return self.output(getattr(self, "self")(x, attention_mask), x)


class BertIntermediate(nn.Module):
    def __init__(self, config: BertConfig, dtype: str):
        self.dense = Linear(config.hidden_size, config.intermediate_size, dtype, bias=True)
        self.activation = ACTIVATIONS[config.hidden_act]

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        return self.activation(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, config: BertConfig, dtype: str):
        self.attention = BertAttention(config, dtype)
        self.intermediate = BertIntermediate(config, dtype)
        self.output = BertOutput(config.intermediate_size, config, dtype)

    def forward(self, x: nn.Tensor, attention_mask: nn.Tensor) -> nn.Tensor:
        attended = self.attention(x, attention_mask)
        return self.output(self.intermediate(attended), attended)


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig, dtype: str):
        self.layer = nn.ModuleList([BertLayer(config, dtype) for _ in range(config.num_hidden_layers)])


class BertBody(nn.Module):
    def __init__(self, config: BertConfig, dtype: str):
        self.embeddings = BertEmbeddings(config, dtype)
        self.encoder = BertEncoder(config, dtype)


class BertModel(EncoderModel):
    def __init__(self, config: BertConfig, dtype: str):
        self.config = config
        self.dtype = dtype
        self.model = BertBody(config, dtype)
        self.dense = dense_modules(config, dtype)

    def hidden_states(self, input_ids: nn.Tensor, attention_mask: nn.Tensor) -> nn.Tensor:
        """The layers see the batch's tokens as one row (1, batch · seq, hidden), as a prefill's: every
        linear layer is then one matmul over a symbolic number of rows, which the CPU and WebGPU
        prefill schedules take (with two symbolic extents, WebGPU fell back to a workgroup per output)."""
        batch, seq_len = input_ids.shape
        x = nn.op.reshape(self.model.embeddings(input_ids), (1, batch * seq_len, self.config.hidden_size))
        for layer in self.model.encoder.layer:
            x = layer(x, attention_mask)
        return nn.op.reshape(x, (batch, seq_len, self.config.hidden_size))


def fused_sources(config: BertConfig) -> dict[str, list[str]]:
    fused = {}
    for i in range(config.num_hidden_layers):
        attention = f"model.encoder.layer.{i}.attention.self"
        for kind in ("weight", "bias"):
            fused[f"{attention}.qkv.{kind}"] = [f"{attention}.{p}.{kind}" for p in ("query", "key", "value")]
    return fused


ARCHITECTURE = Architecture(
    model_type="bert",
    parse_config=parse_config,
    build=BertModel,
    fused_sources=fused_sources,
    ignored_tensors=(
        r"(bert\.)?embeddings\.position_ids",
        r"(bert\.)?pooler\..*",
        r"cls\..*",  # BertForMaskedLM's and BertForPreTraining's heads
    ),
    decoder_prefixes=("", "bert."),
    prefix_probe="embeddings.word_embeddings.weight",
)
