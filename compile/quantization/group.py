"""MLC's group quantization (`q4f16_1`, `q4f32_1`, `q8f16_1`, `q8f32_1`), in MLC's format.

Group quantization is symmetric along the input dimension: a group of `group_size` weights shares
one scale `max|w| / max_q`, each weight is stored as `round(w / scale) + max_q` in `bits` bits,
`32 / bits` values per little-endian uint32. Parameters become `<name>.q_weight` (uint32) and
`<name>.q_scale` (the model's float dtype). Dequantization is written into the same tensor
expression as the matmul, so every matmul kernel reads the packed weights directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tvm import te, tirx
from tvm.relax.frontend import nn

from kiln.errors import KilnError
from kiln.models.layers import Embedding, Linear, add_bias, matmul_transposed

from ..source_weights import SourceWeights
from .stored import Stored
from .stored import Stored


@dataclass(frozen=True)
class GroupFormat:
    bits: int
    group_size: int
    dtype: str

    @property
    def values_per_word(self) -> int:
        return 32 // self.bits

    @property
    def max_q(self) -> int:
        return 2 ** (self.bits - 1) - 1

    def packed_parameters(self, rows: int, cols: int) -> tuple[nn.Parameter, nn.Parameter]:
        """`q_weight` and `q_scale` for a float [rows, cols] weight."""
        return (nn.Parameter((rows, cols // self.values_per_word), "uint32"),
                nn.Parameter((rows, cols // self.group_size), self.dtype))

    def dequantize_te(self, q_weight: te.Tensor, q_scale: te.Tensor, rows, cols: int) -> te.Tensor:
        mask = tirx.const((1 << self.bits) - 1, "uint32")

        def value(row, col):
            word = q_weight[row, col // self.values_per_word]
            shift = ((col % self.values_per_word) * self.bits).astype("uint32")
            quantized = ((word >> shift) & mask).astype(self.dtype) - tirx.const(self.max_q, self.dtype)
            return quantized * q_scale[row, col // self.group_size]

        return te.compute((rows, cols), value, name="dequantize")


class GroupQuantLinear(nn.Module):
    def __init__(self, linear: Linear, fmt: GroupFormat):
        self.fmt = fmt
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.q_weight, self.q_scale = fmt.packed_parameters(self.out_features, self.in_features)
        self.bias = linear.bias

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        y = nn.op.tensor_expr_op(
            lambda x, w, s: matmul_transposed(
                x, self.fmt.dequantize_te(w, s, self.out_features, self.in_features), x.dtype
            ),
            "dequantize_matmul",
            [x, self.q_weight, self.q_scale],
        )
        return add_bias(y, self.bias)


class GroupQuantEmbedding(nn.Module):
    def __init__(self, embedding: Embedding, fmt: GroupFormat):
        self.fmt = fmt
        self.vocab_size, self.hidden_size = embedding.vocab_size, embedding.hidden_size
        self.q_weight, self.q_scale = fmt.packed_parameters(self.vocab_size, self.hidden_size)

    def forward(self, token_ids: nn.Tensor) -> nn.Tensor:
        def gather_rows(w, s, ids):
            rows = te.compute((ids.shape[0], w.shape[1]), lambda i, j: w[ids[i], j], name="rows")
            scales = te.compute((ids.shape[0], s.shape[1]), lambda i, j: s[ids[i], j], name="row_scales")
            return self.fmt.dequantize_te(rows, scales, ids.shape[0], self.hidden_size)

        return nn.op.tensor_expr_op(gather_rows, "dequantize_take", [self.q_weight, self.q_scale, token_ids])

    def project(self, x: nn.Tensor) -> nn.Tensor:
        return nn.op.tensor_expr_op(
            lambda x, w, s: matmul_transposed(
                x, self.fmt.dequantize_te(w, s, self.vocab_size, self.hidden_size), "float32"
            ),
            "dequantize_lm_head",
            [x, self.q_weight, self.q_scale],
        )


@dataclass(frozen=True)
class GroupQuantization:
    name: str
    model_dtype: str
    bits: int
    group_size: int = 32

    @property
    def group_format(self) -> GroupFormat:
        return GroupFormat(self.bits, self.group_size, self.model_dtype)

    def quantize_model(self, model: nn.Module, weights: SourceWeights) -> nn.Module:
        fmt = self.group_format

        class Rewriter(nn.Mutator):
            def visit_module(self, name: str, node: nn.Module):
                if isinstance(node, Linear):
                    check_divisible(name, node.in_features, fmt)
                    return GroupQuantLinear(node, fmt)
                if isinstance(node, Embedding):
                    check_divisible(name, node.hidden_size, fmt)
                    return GroupQuantEmbedding(node, fmt)
                return self.visit(name, node)

        return Rewriter().visit("", model)

    def pack(self, name: str, weights: SourceWeights, expected: set[str]) -> dict[str, Stored]:
        module = name.removesuffix(".weight")
        if f"{module}.q_weight" not in expected:
            return {name: Stored(weights.load(name).astype(self.model_dtype))}
        q_weight, q_scale = quantize_group(weights.load(name), self.group_format)
        return {f"{module}.q_weight": Stored(q_weight), f"{module}.q_scale": Stored(q_scale)}


def check_divisible(module: str, width: int, fmt: GroupFormat) -> None:
    if width % fmt.group_size or width % fmt.values_per_word:
        raise KilnError(
            f"cannot quantize {module}: its input width {width} is not a multiple of the group size {fmt.group_size}"
        )


def quantize_group(weight: np.ndarray, fmt: GroupFormat) -> tuple[np.ndarray, np.ndarray]:
    rows, cols = weight.shape
    groups = weight.astype(np.float32).reshape(rows, cols // fmt.group_size, fmt.group_size)
    scale = (np.abs(groups).max(axis=-1) / fmt.max_q).astype(fmt.dtype)
    safe_scale = np.where(scale == 0, 1, scale).astype(np.float32)[..., None]
    stored = np.clip(np.round(groups / safe_scale), -fmt.max_q, fmt.max_q).astype(np.int64) + fmt.max_q
    words = stored.reshape(rows, cols // fmt.values_per_word, fmt.values_per_word).astype(np.uint32)
    shifts = (np.arange(fmt.values_per_word, dtype=np.uint32) * fmt.bits)[None, None, :]
    packed = np.bitwise_or.reduce(words << shifts, axis=-1).astype(np.uint32)
    return packed, scale


def dequantize_group(q_weight: np.ndarray, q_scale: np.ndarray, fmt: GroupFormat) -> np.ndarray:
    """The float32 weights a packed parameter stands for (what the kernels compute with)."""
    rows = q_weight.shape[0]
    shifts = (np.arange(fmt.values_per_word, dtype=np.uint32) * fmt.bits)[None, None, :]
    stored = (q_weight[..., None] >> shifts) & np.uint32((1 << fmt.bits) - 1)
    values = stored.reshape(rows, -1).astype(np.float32) - fmt.max_q
    return values * np.repeat(q_scale.astype(np.float32), fmt.group_size, axis=1)


SCHEMES = tuple(
    GroupQuantization(f"q{bits}f{width}_1", f"float{width}", bits) for bits in (4, 8) for width in (32, 16)
)
