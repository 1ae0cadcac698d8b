"""MLC's group quantization (`q4f16_1`, `q4f32_1`, `q8f16_1`, `q8f32_1`), in MLC's format.

Groups run along the input dimension: a group of `group_size` weights shares one scale, each
weight is stored as `round(w / scale) + max_q` in `bits` bits, `32 / bits` values per
little-endian uint32, and stands for `(stored - max_q) * scale`. Parameters become
`<name>.q_weight` (uint32) and `<name>.q_scale` (the model's float dtype). Dequantization is
written into the same tensor expression as the matmul, so every matmul kernel reads the packed
weights directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tvm import te, tirx
from tvm.relax.frontend import nn

from kiln.compile.quantization import factored_decode
from kiln.compile.quantization.stored import Stored
from kiln.compile.source.source_weights import SourceWeights
from kiln.models.layers import Embedding, Linear, add_bias, matmul_transposed
from kiln.models.stage_names import DEQUANTIZE, GATHERED_ROW_SCALES, GATHERED_ROWS


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

    def fits(self, width: int) -> bool:
        """Whether rows of `width` weights are whole groups. A matrix whose rows are not keeps its
        float weights, as llama.cpp keeps such tensors (Gemma 4's per-layer projections in the
        tests, 8 wide; real models have none)."""
        return width % self.group_size == 0 and width % self.values_per_word == 0

    def packed_parameters(self, rows: int, cols: int) -> tuple[nn.Parameter, nn.Parameter]:
        """`q_weight` and `q_scale` for a float [rows, cols] weight."""
        return (
            nn.Parameter((rows, cols // self.values_per_word), "uint32"),
            nn.Parameter((rows, cols // self.group_size), self.dtype),
        )

    def level(self, q_weight: te.Tensor, row, col) -> tirx.PrimExpr:
        """The stored value of weight [row, col], unsigned (it stands for `level - max_q`)."""
        shift = ((col % self.values_per_word) * self.bits).astype("uint32")
        return (q_weight[row, col // self.values_per_word] >> shift) & tirx.const((1 << self.bits) - 1, "uint32")

    def dequantize_te(self, q_weight: te.Tensor, q_scale: te.Tensor, rows, cols: int) -> te.Tensor:
        def value(row, col):
            quantized = self.level(q_weight, row, col).astype(self.dtype) - tirx.const(self.max_q, self.dtype)
            return quantized * q_scale[row, col // self.group_size]

        return te.compute((rows, cols), value, name=DEQUANTIZE)

    def matmul_te(self, x: te.Tensor, q_weight: te.Tensor, q_scale: te.Tensor, rows: int, cols: int, out_dtype: str):
        """y[..., o] = sum_k x[..., k] * W[o, k]; a CPU's decode keeps the scales out of its loop
        over weights (factored_decode.py)."""
        layout = factored_decode.word_per_lane(self.values_per_word, self.group_size)
        if not factored_decode.applies(x, cols, layout, self.dtype):
            return matmul_transposed(x, self.dequantize_te(q_weight, q_scale, rows, cols), out_dtype)
        return factored_decode.factored_matmul(
            x,
            level=lambda row, col: self.level(q_weight, row, col),
            scale=lambda row, group: q_scale[row, group],
            offset=None,
            out_features=rows,
            layout=layout,
            zero=self.max_q,
        )


class GroupQuantLinear(nn.Module):
    def __init__(self, linear: Linear, fmt: GroupFormat):
        self.fmt = fmt
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.q_weight, self.q_scale = fmt.packed_parameters(self.out_features, self.in_features)
        self.bias = linear.bias

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        y = nn.op.tensor_expr_op(
            lambda x, w, s: self.fmt.matmul_te(x, w, s, self.out_features, self.in_features, x.dtype),
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
            rows = te.compute((ids.shape[0], w.shape[1]), lambda i, j: w[ids[i], j], name=GATHERED_ROWS)
            scales = te.compute((ids.shape[0], s.shape[1]), lambda i, j: s[ids[i], j], name=GATHERED_ROW_SCALES)
            return self.fmt.dequantize_te(rows, scales, ids.shape[0], self.hidden_size)

        return nn.op.tensor_expr_op(gather_rows, "dequantize_take", [self.q_weight, self.q_scale, token_ids])

    def project(self, x: nn.Tensor) -> nn.Tensor:
        return nn.op.tensor_expr_op(
            lambda x, w, s: self.fmt.matmul_te(x, w, s, self.vocab_size, self.hidden_size, "float32"),
            "dequantize_lm_head",
            [x, self.q_weight, self.q_scale],
        )


@dataclass(frozen=True)
class GroupQuantization:
    name: str
    model_dtype: str
    bits: int
    group_size: int = 32
    cpu_variants = ()
    factored_decode = True

    @property
    def describe(self) -> str:
        return f"{self.bits}-bit weights in groups of {self.group_size}, {self.model_dtype} activations"

    @property
    def group_format(self) -> GroupFormat:
        return GroupFormat(self.bits, self.group_size, self.model_dtype)

    def quantize_model(self, model: nn.Module, weights: SourceWeights) -> nn.Module:
        fmt = self.group_format

        class Rewriter(nn.Mutator):
            def visit_module(self, name: str, node: nn.Module):
                if isinstance(node, Linear):
                    return GroupQuantLinear(node, fmt) if fmt.fits(node.in_features) else node
                if isinstance(node, Embedding):
                    return GroupQuantEmbedding(node, fmt) if fmt.fits(node.hidden_size) else node
                return self.visit(name, node)

        return Rewriter().visit("", model)

    def pack(self, name: str, weights: SourceWeights, expected: set[str]) -> dict[str, Stored]:
        module = name.removesuffix(".weight")
        if f"{module}.q_weight" not in expected:
            return {name: Stored(weights.load(name).astype(self.model_dtype))}
        q_weight, q_scale = quantize_group(weights.load(name), self.group_format)
        return {f"{module}.q_weight": Stored(q_weight), f"{module}.q_scale": Stored(q_scale)}


# Where a scale candidate puts the group's largest-magnitude weight, in levels past the end of the
# range (ggml's make_qx_quants tries -0.9 … +0.9 around its end). On SmolLM2-135M's weights the
# best of -3.0 … +4.0 in steps of 0.1 is never above +1.6 and rarely below -2.0; these ten steps
# of 0.4 leave 0.1% more squared error than all seventy-one.
SCALE_CANDIDATES = np.linspace(-2.0, 1.6, 10, dtype=np.float32)
# Groups per pass: the search's temporaries stay ~256 KB of float32, in cache, however large the
# tensor (a 7B model's embedding is 0.5 GB in float32, and the search would hold several copies).
GROUPS_PER_PASS = 2048


def quantize_group(weight: np.ndarray, fmt: GroupFormat) -> tuple[np.ndarray, np.ndarray]:
    """Packed weights and scales, each group's scale chosen for the least squared error.

    Stored values run over [0, 2 max_q + 1], so with `scale > 0` a group reaches levels
    [-max_q, max_q + 1] and with `scale < 0` [-(max_q + 1), max_q]: each group points its extra
    level at its largest-magnitude weight (as ggml's Q4_0 does with `d = max / -8`). For each
    candidate end level the weights are rounded and the scale refit by least squares (ggml's
    `make_qx_quants`). Three scales then compete per group, each rounded to `fmt.dtype` first so
    the error compared is the stored scale's: the plain `max|w| / max_q` (so no group is worse
    than with it; it wins ties), `max / (max_q + 1)` toward the extreme (ggml's Q4_0), and the best
    refit. Weights on either of the first two grids come back exactly.
    SmolLM2-135M quantizes in ~4 s of CPU (the plain scale alone took ~2 s).
    """
    rows, cols = weight.shape
    packed = np.empty((rows, cols // fmt.values_per_word), np.uint32)
    scales = np.empty((rows, cols // fmt.group_size), np.float32)
    place_values = np.uint32(1) << (np.arange(fmt.values_per_word, dtype=np.uint32) * fmt.bits)
    # Whole rows at a time, packed as they are done: no copy of the whole matrix is made (Gemma 4
    # E2B's per-layer embedding is 9.4 GB in float32).
    rows_per_pass = max(1, GROUPS_PER_PASS * fmt.group_size // cols)
    for start in range(0, rows, rows_per_pass):
        block = np.asarray(weight[start : start + rows_per_pass], np.float32)
        scale, levels = quantize_groups(block.reshape(-1, fmt.group_size), fmt)
        words = (levels + fmt.max_q).astype(np.uint32).reshape(len(block), -1, fmt.values_per_word)
        # The bit fields do not overlap: their sum is their OR.
        packed[start : start + len(block)] = words @ place_values
        scales[start : start + len(block)] = scale.reshape(len(block), -1)
    return packed, scales.astype(fmt.dtype)


def quantize_groups(groups: np.ndarray, fmt: GroupFormat) -> tuple[np.ndarray, np.ndarray]:
    """Scales (float32 values of `fmt.dtype`) and levels in [-max_q, max_q + 1] of [n, group_size] weights."""
    top = fmt.max_q + 1
    high, low = groups.max(axis=1), groups.min(axis=1)
    orientation = np.where(-low > high, np.float32(-1), np.float32(1))
    oriented = groups * orientation[:, None]  # the largest magnitude is now positive
    magnitude = np.maximum(high, -low)
    per_magnitude = np.divide(1, magnitude, out=np.zeros_like(magnitude), where=magnitude > 0)
    unit = oriented * per_magnitude[:, None]  # in [-1, 1]

    best_fit = np.full(len(groups), -1, np.float32)
    best_scale = np.zeros(len(groups), np.float32)
    for end in SCALE_CANDIDATES:
        rounded = np.multiply(unit, top + end)
        np.clip(np.rint(rounded, out=rounded), -fmt.max_q, top, out=rounded)
        dot = np.einsum("gi,gi->g", rounded, oriented)
        norm = np.einsum("gi,gi->g", rounded, rounded)  # a sum of squared integers: 0 (all-zero group) or ≥ 1
        fit_scale = dot / np.maximum(norm, 1)
        fit = fit_scale * dot  # the squared error is |w|² - fit
        better = fit > best_fit
        np.copyto(best_fit, fit, where=better)
        np.copyto(best_scale, fit_scale, where=better)

    candidates = np.stack([magnitude / fmt.max_q, orientation * magnitude / top, orientation * best_scale])
    candidates = candidates.astype(fmt.dtype).astype(np.float32)
    errors = np.stack([squared_error(groups, scale, fmt) for scale in candidates])
    scale = candidates[np.argmin(errors, axis=0), np.arange(len(groups))]  # the first of equal errors
    return scale, nearest_levels(groups, scale, fmt)


def nearest_levels(groups: np.ndarray, scale: np.ndarray, fmt: GroupFormat) -> np.ndarray:
    """Each weight's nearest level in [-max_q, max_q + 1] with its group's scale (0 where the scale is 0)."""
    divisor = np.where(scale == 0, np.float32(np.inf), scale)[:, None]
    levels = np.divide(groups, divisor)
    return np.clip(np.rint(levels, out=levels), -fmt.max_q, fmt.max_q + 1, out=levels)


def squared_error(groups: np.ndarray, scale: np.ndarray, fmt: GroupFormat) -> np.ndarray:
    error = nearest_levels(groups, scale, fmt)
    error *= scale[:, None]
    error -= groups
    return np.einsum("gi,gi->g", error, error)


def dequantize_group(q_weight: np.ndarray, q_scale: np.ndarray, fmt: GroupFormat) -> np.ndarray:
    """The float32 weights a packed parameter stands for (what the kernels compute with)."""
    rows = q_weight.shape[0]
    shifts = (np.arange(fmt.values_per_word, dtype=np.uint32) * fmt.bits)[None, None, :]
    stored = (q_weight[..., None] >> shifts) & np.uint32((1 << fmt.bits) - 1)
    values = stored.reshape(rows, -1).astype(np.float32) - fmt.max_q
    return values * np.repeat(q_scale.astype(np.float32), fmt.group_size, axis=1)


SCHEMES = tuple(GroupQuantization(f"q{bits}f{width}_1", f"float{width}", bits) for bits in (4, 8) for width in (32, 16))
