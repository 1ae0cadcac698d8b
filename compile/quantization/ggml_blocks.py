"""llama.cpp's tensor types, read in place by Kiln's kernels.

A GGUF stores each row of a [rows, cols] weight as `cols / elements` blocks of `bytes` bytes
(F32, F16 and BF16 are blocks of one value). Kiln keeps those bytes unchanged: a row is stored
as little-endian uint32 words, zero-padded to a whole word when its byte count is not a multiple
of four. `BlockType.value` is the expression for one weight, written against `RowBytes`, so the
dequantization is part of whichever kernel reads the weight. The formulas are ggml's
`dequantize_row_*` (ggml-quants.c); gguf-py's `gguf.quants.dequantize` is the reference the tests
compare against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
from tvm import te, tirx
from tvm.ir.expr import ExprWithOp as PrimExpr




def u32(value: int) -> PrimExpr:
    return tirx.const(value, "uint32")


def f32(value: float) -> PrimExpr:
    return tirx.const(value, "float32")


class RowBytes:
    """The bytes of one stored row, read out of its uint32 words."""

    def __init__(self, words: te.Tensor, row: PrimExpr):
        self.words, self.row = words, row

    def _word(self, offset: PrimExpr) -> PrimExpr:
        return self.words[self.row, offset // 4]

    def u8(self, offset: PrimExpr) -> PrimExpr:
        return (self._word(offset) >> ((offset % 4) * 8).astype("uint32")) & u32(0xFF)

    def i8(self, offset: PrimExpr) -> PrimExpr:
        """A signed byte, as float32."""
        return (tirx.reinterpret("int32", self.u8(offset) << u32(24)) >> 24).astype("float32")

    def f16(self, offset: PrimExpr) -> PrimExpr:
        """An IEEE half at an even offset, as float32 (no float16 arithmetic needed on the target).
        Normal halves move their exponent and mantissa into a float32's fields and rebias the
        exponent by 127 - 15 (infinities and NaNs to float32's all-ones exponent); subnormal ones
        are mantissa × 2^-24, that factor given as its bits because TVM writes WGSL float literals
        to 7 digits (2^-24 would become 5.960464e-08)."""
        bits = (self._word(offset) >> ((offset % 4) * 8).astype("uint32")) & u32(0xFFFF)
        magnitude = bits & u32(0x7FFF)
        rebias = tirx.Select(magnitude < u32(0x7C00), u32(112 << 23), u32(224 << 23))
        normal = tirx.reinterpret("float32", (magnitude << u32(13)) + rebias)
        subnormal = magnitude.astype("float32") * tirx.reinterpret("float32", u32(103 << 23))
        value = tirx.Select(magnitude < u32(0x400), subnormal, normal)
        return tirx.Select((bits & u32(0x8000)) != u32(0), -value, value)

    def bf16(self, offset: PrimExpr) -> PrimExpr:
        bits = (self._word(offset) >> ((offset % 4) * 8).astype("uint32")) & u32(0xFFFF)
        return tirx.reinterpret("float32", bits << u32(16))

    def f32(self, offset: PrimExpr) -> PrimExpr:
        return tirx.reinterpret("float32", self._word(offset))


def nibble(byte: PrimExpr, high: PrimExpr) -> PrimExpr:
    """The low (high = 0) or high (high = 1) four bits of a byte."""
    return (byte >> (high * 4).astype("uint32")) & u32(0xF)


def bit(byte: PrimExpr, index: PrimExpr) -> PrimExpr:
    return (byte >> index.astype("uint32")) & u32(1)


def as_float(value: PrimExpr) -> PrimExpr:
    return value.astype("float32")


# Each reader gets the row's bytes, the offset of the block in the row, and the index of the
# weight in the block; it returns the weight as float32.


def read_f32(b: RowBytes, block: PrimExpr, j: PrimExpr) -> PrimExpr:
    return b.f32(block)


def read_f16(b: RowBytes, block: PrimExpr, j: PrimExpr) -> PrimExpr:
    return b.f16(block)


def read_bf16(b: RowBytes, block: PrimExpr, j: PrimExpr) -> PrimExpr:
    return b.bf16(block)


def q4_nibble(b: RowBytes, quants: PrimExpr, j: PrimExpr) -> PrimExpr:
    """Q4_0/Q4_1/Q5_x low bits: weight j < 16 is the low nibble of byte j, j ≥ 16 the high nibble of byte j - 16."""
    return nibble(b.u8(quants + j % 16), j // 16)


def read_q4_0(b: RowBytes, block: PrimExpr, j: PrimExpr) -> PrimExpr:  # d, qs[16]
    return b.f16(block) * (as_float(q4_nibble(b, block + 2, j)) - f32(8))


def read_q4_1(b: RowBytes, block: PrimExpr, j: PrimExpr) -> PrimExpr:  # d, m, qs[16]
    return b.f16(block) * as_float(q4_nibble(b, block + 4, j)) + b.f16(block + 2)


def q5_value(b: RowBytes, high_bits: PrimExpr, quants: PrimExpr, j: PrimExpr) -> PrimExpr:
    """Q5_0/Q5_1: the fifth bit of weight j is bit j of the 32-bit qh."""
    return q4_nibble(b, quants, j) | (bit(b.u8(high_bits + j // 8), j % 8) << u32(4))


def read_q5_0(b: RowBytes, block: PrimExpr, j: PrimExpr) -> PrimExpr:  # d, qh[4], qs[16]
    return b.f16(block) * (as_float(q5_value(b, block + 2, block + 6, j)) - f32(16))


def read_q5_1(b: RowBytes, block: PrimExpr, j: PrimExpr) -> PrimExpr:  # d, m, qh[4], qs[16]
    return b.f16(block) * as_float(q5_value(b, block + 4, block + 8, j)) + b.f16(block + 2)


def read_q8_0(b: RowBytes, block: PrimExpr, j: PrimExpr) -> PrimExpr:  # d, qs[32] (int8)
    return b.f16(block) * b.i8(block + 2 + j)


def k_scale_and_min(b: RowBytes, scales: PrimExpr, sub: PrimExpr) -> tuple[PrimExpr, PrimExpr]:
    """Q4_K/Q5_K: the 6-bit scale and min of sub-block `sub` (0..7), packed in 12 bytes
    (ggml's get_scale_min_k4)."""
    low = sub < 4
    first, second = b.u8(scales + sub % 4), b.u8(scales + 4 + sub % 4)
    sixth = b.u8(scales + 8 + sub % 4)
    scale = tirx.Select(low, first & u32(63), (sixth & u32(0xF)) | ((first >> u32(6)) << u32(4)))
    minimum = tirx.Select(low, second & u32(63), (sixth >> u32(4)) | ((second >> u32(6)) << u32(4)))
    return as_float(scale), as_float(minimum)


def k_quant(b: RowBytes, block: PrimExpr, j: PrimExpr, level: Callable[[PrimExpr, PrimExpr, PrimExpr], PrimExpr]) -> PrimExpr:
    """Q4_K/Q5_K: d, dmin, scales[12], then the quants. Weight j is in sub-block j // 32; each
    64 weights share 32 bytes of low bits, the first 32 in the low nibbles."""
    sub, lane = j // 32, j % 32
    scale, minimum = k_scale_and_min(b, block + 4, sub)
    return (b.f16(block) * scale) * as_float(level(sub, lane, (j // 64) * 32 + lane)) - b.f16(block + 2) * minimum


def read_q4_k(b: RowBytes, block: PrimExpr, j: PrimExpr) -> PrimExpr:  # d, dmin, scales[12], qs[128]
    return k_quant(b, block, j, lambda sub, lane, byte: nibble(b.u8(block + 16 + byte), sub % 2))


def read_q5_k(b: RowBytes, block: PrimExpr, j: PrimExpr) -> PrimExpr:  # d, dmin, scales[12], qh[32], qs[128]
    def level(sub, lane, byte):
        return nibble(b.u8(block + 48 + byte), sub % 2) | (bit(b.u8(block + 16 + lane), sub) << u32(4))

    return k_quant(b, block, j, level)


def read_q6_k(b: RowBytes, block: PrimExpr, j: PrimExpr) -> PrimExpr:  # ql[128], qh[64], scales[16] (int8), d
    """Each 128 weights: 64 bytes of low nibbles, 32 bytes of 2-bit high parts, 8 scales (one per 16)."""
    half, quarter, lane = j // 128, (j % 128) // 32, j % 32
    low = nibble(b.u8(block + half * 64 + (quarter % 2) * 32 + lane), quarter // 2)
    high = (b.u8(block + 128 + half * 32 + lane) >> (quarter * 2).astype("uint32")) & u32(3)
    scale = b.i8(block + 192 + half * 8 + lane // 16 + quarter * 2)
    return (b.f16(block + 208) * scale) * (as_float(low | (high << u32(4))) - f32(32))


@dataclass(frozen=True)
class BlockType:
    name: str  # ggml's, as gguf.GGMLQuantizationType names it
    elements: int
    bytes: int
    read: Callable[[RowBytes, PrimExpr, PrimExpr], PrimExpr]

    def row_words(self, cols: int) -> int:
        return -(-self.row_bytes(cols) // 4)

    def row_bytes(self, cols: int) -> int:
        return cols // self.elements * self.bytes

    def value(self, words: te.Tensor, row: PrimExpr, col: PrimExpr) -> PrimExpr:
        """Weight [row, col] of a matrix stored as `words` [rows, row_words], as float32."""
        return self.read(RowBytes(words, row), col // self.elements * self.bytes, col % self.elements)

    def words(self, rows: np.ndarray) -> np.ndarray:
        """A [rows, row_bytes] uint8 array of blocks as the stored uint32 words."""
        padding = -rows.shape[1] % 4
        padded = np.pad(rows, ((0, 0), (0, padding))) if padding else np.ascontiguousarray(rows)
        return padded.view("<u4").astype(np.uint32, copy=False)


BLOCK_TYPES: dict[str, BlockType] = {
    t.name: t
    for t in (
        BlockType("F32", 1, 4, read_f32),
        BlockType("F16", 1, 2, read_f16),
        BlockType("BF16", 1, 2, read_bf16),
        BlockType("Q4_0", 32, 18, read_q4_0),
        BlockType("Q4_1", 32, 20, read_q4_1),
        BlockType("Q5_0", 32, 22, read_q5_0),
        BlockType("Q5_1", 32, 24, read_q5_1),
        BlockType("Q8_0", 32, 34, read_q8_0),
        BlockType("Q4_K", 256, 144, read_q4_k),
        BlockType("Q5_K", 256, 176, read_q5_k),
        BlockType("Q6_K", 256, 210, read_q6_k),
    )
}
