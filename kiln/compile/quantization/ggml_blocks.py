"""llama.cpp's tensor types, read in place by Kiln's kernels.

A GGUF stores each row of a [rows, cols] weight as `cols / elements` blocks of `bytes` bytes
(F32, F16 and BF16 are blocks of one value). Kiln keeps those bytes unchanged: a row is stored
as little-endian uint32 words, zero-padded to a whole word when its byte count is not a multiple
of four. Kernels read those words as bytes (a uint8 view of the same memory; F16 and BF16 as
uint16 halves, F32 as floats), except on WebGPU, whose shaders have no 8-bit type and shift bytes
out of the words. `BlockType.dequantize_te` is
the weights as a tensor expression written against `RowBytes`, so the dequantization is part of
whichever kernel reads the weights. The formulas are ggml's
`dequantize_row_*` (ggml-quants.c); gguf-py's `gguf.quants.dequantize` is the reference the tests
compare against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
from tvm import te, tirx
from tvm.ir.expr import ExprWithOp as PrimExpr

from kiln.compile.quantization import factored_decode
from kiln.compile.quantization.factored_decode import GroupValue, f32
from kiln.models.layers import matmul_transposed
from kiln.models.stage_names import DEQUANTIZE, GROUP_STAGES
from kiln.targets import building


def u32(value: int) -> PrimExpr:
    return tirx.const(value, "uint32")


def target_converts_halves() -> bool:
    """Whether the target being built (any, outside a build) converts a half to float32 itself."""
    entry = building()
    return entry is None or entry.converts_halves


class RowBytes:
    """The bytes of one stored row: `stored` is [rows, row units] of the block type's unit
    (`BlockType.unit`: bytes, or a float type's values) where the target reads units, or the
    [rows, row words] uint32 words themselves (WGSL has no 8-bit type)."""

    def __init__(self, stored: te.Tensor, row: PrimExpr):
        self.stored, self.row = stored, row
        self.in_words = stored.dtype == "uint32"
        self.in_halves, self.in_floats = stored.dtype == "uint16", stored.dtype == "float32"
        self.converts_halves = not self.in_words and target_converts_halves()

    def _bits(self, offset: PrimExpr, mask: int) -> PrimExpr:
        """The bits of `mask` (0xFF, 0xFFFF) at a byte offset within one word."""
        word = self.stored[self.row, offset // 4]
        return (word >> ((offset % 4) * 8).astype("uint32")) & u32(mask)

    def u8(self, offset: PrimExpr) -> PrimExpr:
        if self.in_words:
            return self._bits(offset, 0xFF)
        return self.stored[self.row, offset].astype("uint32")

    def u16(self, offset: PrimExpr) -> PrimExpr:
        """Little-endian, at an even offset."""
        if self.in_words:
            return self._bits(offset, 0xFFFF)
        if self.in_halves:
            return self.stored[self.row, offset // 2].astype("uint32")
        return self.u8(offset) | (self.u8(offset + 1) << u32(8))

    def u32(self, offset: PrimExpr) -> PrimExpr:
        """Little-endian, at a multiple of 4 (of 2 where the target reads bytes)."""
        if self.in_words:
            return self.stored[self.row, offset // 4]
        return self.u16(offset) | (self.u16(offset + 2) << u32(16))

    def bit(self, offset: PrimExpr, index: PrimExpr) -> PrimExpr:
        """Bit `index` (0..31) of the 32 little-endian bits at an even `offset`. Where the target
        reads bytes they are one load, and a vector of consecutive bits is that word masked by a
        constant vector (per byte, each step would load, move and broadcast a byte of its own; a
        shift by a different count per lane is one instruction on AVX2 but four lanes taken
        apart in wasm SIMD)."""
        if self.in_words:
            return bit(self.u8(offset + index // 8), index % 8)
        return (self.u32(offset) & (u32(1) << index.astype("uint32")) != u32(0)).astype("uint32")

    def i8(self, offset: PrimExpr) -> PrimExpr:
        """A signed byte, as float32."""
        return (tirx.reinterpret("int32", self.u8(offset) << u32(24)) >> 24).astype("float32")

    def f16(self, offset: PrimExpr) -> PrimExpr:
        """An IEEE half at an even offset, as float32: one instruction where the target has it,
        else by hand (WebGPU has float16 only with an optional feature; wasm would call a library
        function for each half). Normal halves move their exponent and mantissa into a float32's fields and rebias the
        exponent by 127 - 15 (infinities and NaNs to float32's all-ones exponent); subnormal ones
        are mantissa × 2^-24, that factor given as its bits because TVM writes WGSL float literals
        to 7 digits (2^-24 would become 5.960464e-08)."""
        bits = self.u16(offset)
        if self.converts_halves:
            return tirx.reinterpret("float16", bits.astype("uint16")).astype("float32")
        if not self.in_words:
            return half_by_scaling(bits)
        # Branch-free (a GPU shader would get every operand of a select spelled out twice).
        magnitude = bits & u32(0x7FFF)
        special = (magnitude >= u32(0x7C00)).astype("uint32")
        normal = tirx.reinterpret("float32", (magnitude << u32(13)) + u32(112 << 23) * (u32(1) + special))
        subnormal = magnitude.astype("float32") * tirx.reinterpret("float32", u32(103 << 23))
        is_normal = (magnitude >= u32(0x400)).astype("float32")
        value = normal * is_normal + subnormal * (f32(1) - is_normal)
        return value * (f32(1) - (bits >> u32(15)).astype("float32") * f32(2))

    def bf16(self, offset: PrimExpr) -> PrimExpr:
        return tirx.reinterpret("float32", self.u16(offset) << u32(16))

    def f32(self, offset: PrimExpr) -> PrimExpr:
        if self.in_floats:
            return self.stored[self.row, offset // 4]
        return tirx.reinterpret("float32", self.u32(offset))


def half_by_scaling(bits: PrimExpr) -> PrimExpr:
    """An IEEE half's bits as float32, where float32 arithmetic keeps subnormals (wasm; a GPU may
    flush them): its magnitude bits in a float32's place, times 2^(127 − 15), are the half's value,
    subnormals included; infinities and NaNs then get the all-ones exponent, and the sign its bit
    (half the operations of the formula a GPU needs: SmolLM2's Q4_1 decode in Chromium's wasm,
    one thread, 17.8 → 20.8 tokens/s)."""
    magnitude = bits & u32(0x7FFF)
    scaled = tirx.reinterpret("float32", magnitude << u32(13)) * tirx.reinterpret("float32", u32((127 + 112) << 23))
    special = (magnitude >= u32(0x7C00)).astype("uint32") * u32(0x7F800000 - 0x47800000)
    sign = (bits & u32(0x8000)) << u32(16)
    return tirx.reinterpret("float32", (tirx.reinterpret("uint32", scaled) + special) | sign)


def nibble(byte: PrimExpr, high: PrimExpr) -> PrimExpr:
    """The low (high = 0) or high (high = 1) four bits of a byte."""
    return (byte >> (high * 4).astype("uint32")) & u32(0xF)


def bit(byte: PrimExpr, index: PrimExpr) -> PrimExpr:
    return (byte >> index.astype("uint32")) & u32(1)


def as_float(value: PrimExpr) -> PrimExpr:
    return value.astype("float32")


# Readers get the row's bytes, the offset of the block in the row, and the index of a weight (or
# of a group of weights) in the block; they return float32.
Reader = Callable[[RowBytes, PrimExpr, PrimExpr], PrimExpr]


def read_f32(b: RowBytes, block: PrimExpr, j: PrimExpr) -> PrimExpr:
    return b.f32(block)


def read_f16(b: RowBytes, block: PrimExpr, j: PrimExpr) -> PrimExpr:
    return b.f16(block)


def read_bf16(b: RowBytes, block: PrimExpr, j: PrimExpr) -> PrimExpr:
    return b.bf16(block)


def d_at(offset: int) -> Reader:
    """A block's float16 field at `offset` (d, m), shared by the whole block."""
    return lambda b, block, group: b.f16(block + offset)


def q4_nibble(b: RowBytes, quants: PrimExpr, j: PrimExpr) -> PrimExpr:
    """Q4_0/Q4_1/Q5_x low bits: weight j < 16 is the low nibble of byte j, j ≥ 16 the high nibble of byte j - 16."""
    return nibble(b.u8(quants + j % 16), j // 16)


def q5_bits(b: RowBytes, high_bits: PrimExpr, quants: PrimExpr, j: PrimExpr) -> PrimExpr:
    """Q5_0/Q5_1: the fifth bit of weight j is bit j of the 32-bit qh."""
    return q4_nibble(b, quants, j) | (b.bit(high_bits, j) << u32(4))


def q4_0_level(b: RowBytes, block: PrimExpr, j: PrimExpr) -> PrimExpr:  # d, qs[16]
    return as_float(q4_nibble(b, block + 2, j))


def q4_1_level(b: RowBytes, block: PrimExpr, j: PrimExpr) -> PrimExpr:  # d, m, qs[16]
    return as_float(q4_nibble(b, block + 4, j))


def q5_0_level(b: RowBytes, block: PrimExpr, j: PrimExpr) -> PrimExpr:  # d, qh[4], qs[16]
    return as_float(q5_bits(b, block + 2, block + 6, j))


def q5_1_level(b: RowBytes, block: PrimExpr, j: PrimExpr) -> PrimExpr:  # d, m, qh[4], qs[16]
    return as_float(q5_bits(b, block + 4, block + 8, j))


def q8_0_level(b: RowBytes, block: PrimExpr, j: PrimExpr) -> PrimExpr:  # d, qs[32] (int8)
    return b.i8(block + 2 + j)


def k_scale_and_min(b: RowBytes, block: PrimExpr, sub: PrimExpr) -> tuple[PrimExpr, PrimExpr]:
    """Q4_K/Q5_K (d, dmin, scales[12], ...): the 6-bit scale and min of sub-block `sub` (0..7),
    packed in 12 bytes (ggml's get_scale_min_k4)."""
    scales = block + 4
    first, second = b.u8(scales + sub % 4), b.u8(scales + 4 + sub % 4)
    sixth = b.u8(scales + 8 + sub % 4)
    high = (sub >= 4).astype("uint32")  # sub-blocks 4..7 add 4 low bits from the last 4 bytes
    scale = (first & u32(63)) * (u32(1) - high) + ((sixth & u32(0xF)) | ((first >> u32(6)) << u32(4))) * high
    minimum = (second & u32(63)) * (u32(1) - high) + ((sixth >> u32(4)) | ((second >> u32(6)) << u32(4))) * high
    return as_float(scale), as_float(minimum)


def k_scale(b: RowBytes, block: PrimExpr, sub: PrimExpr) -> PrimExpr:
    return b.f16(block) * k_scale_and_min(b, block, sub)[0]


def k_offset(b: RowBytes, block: PrimExpr, sub: PrimExpr) -> PrimExpr:
    return -(b.f16(block + 2) * k_scale_and_min(b, block, sub)[1])


def k_low_bits(b: RowBytes, quants: PrimExpr, j: PrimExpr) -> PrimExpr:
    """Q4_K/Q5_K: each 64 weights share 32 bytes of low bits, the first 32 in the low nibbles."""
    return nibble(b.u8(quants + (j // 64) * 32 + j % 32), (j // 32) % 2)


def q4_k_level(b: RowBytes, block: PrimExpr, j: PrimExpr) -> PrimExpr:  # d, dmin, scales[12], qs[128]
    return as_float(k_low_bits(b, block + 16, j))


def q5_k_level(b: RowBytes, block: PrimExpr, j: PrimExpr) -> PrimExpr:  # d, dmin, scales[12], qh[32], qs[128]
    return as_float(k_low_bits(b, block + 48, j) | (bit(b.u8(block + 16 + j % 32), j // 32) << u32(4)))


def q6_k_level(b: RowBytes, block: PrimExpr, j: PrimExpr) -> PrimExpr:  # ql[128], qh[64], scales[16] (int8), d
    """Each 128 weights: 64 bytes of low nibbles, 32 bytes of 2-bit high parts."""
    half, quarter, lane = j // 128, (j % 128) // 32, j % 32
    low = nibble(b.u8(block + half * 64 + (quarter % 2) * 32 + lane), quarter // 2)
    high = (b.u8(block + 128 + half * 32 + lane) >> (quarter * 2).astype("uint32")) & u32(3)
    return as_float(low | (high << u32(4)))


def q6_k_scale(b: RowBytes, block: PrimExpr, group: PrimExpr) -> PrimExpr:
    return b.f16(block + 208) * b.i8(block + 192 + group)


@dataclass(frozen=True)
class Levels:
    """A quantized type: weight = (level − zero) × scale (+ offset), with the level from the
    weight's own bits, `zero` a constant of the type, and the scale and offset shared by `group`
    consecutive weights (computed in the order ggml computes them, so the products round the same).
    A decode takes `zero` out of its loop over weights (factored_decode.factored_matmul)."""

    group: int
    level: Reader
    scale: Reader
    offset: Reader | None = None
    zero: float = 0.0


@dataclass(frozen=True)
class BlockType:
    name: str  # ggml's, as gguf.GGMLQuantizationType names it
    elements: int
    bytes: int
    read: Reader | Levels  # a float type's value, or a quantized type's levels
    # What a target that does not read words reads a row as: bytes, or a float type's values
    # (a vector of halves is one load and one conversion, where halves read as byte pairs
    # decoded F16 at 3.4 Gweights/s on one thread).
    unit: str = "uint8"
    # The weights a decode unrolls as one body, if not a whole block (factored_decode.LaneLayout):
    # a Q6_K block's halves each keep their own low and high bits, so a half's bit positions are
    # constants too, and a half's groups fit the vector registers (a whole block's spilled:
    # a Q6_K GEMV 7.1 → 8.3 Gweights/s on one thread).
    unrolled_weights: int | None = None

    def row_words(self, cols: int) -> int:
        return -(-self.row_bytes(cols) // 4)

    def row_bytes(self, cols: int) -> int:
        return cols // self.elements * self.bytes

    def block(self, col: PrimExpr) -> PrimExpr:
        """The byte offset in its row of the block holding column `col`."""
        return col // self.elements * self.bytes

    def group_stages(self, stored: te.Tensor, rows, cols: int) -> tuple[te.Tensor, te.Tensor | None]:
        """A quantized type's scales and offsets, [rows, groups]: stages of their own
        (`group_scale`, `group_offset`), which a schedule can compute once per group or inline."""
        levels = self.read
        size = levels.group

        def per_group(reader: Reader, name: str) -> te.Tensor:
            return te.compute(
                (rows, cols // size),
                lambda r, g: reader(RowBytes(stored, r), self.block(g * size), (g * size) % self.elements // size),
                name=name,
            )

        offset = per_group(levels.offset, GROUP_STAGES[1]) if levels.offset else None
        return per_group(levels.scale, GROUP_STAGES[0]), offset

    def group_values(self, stored: te.Tensor) -> tuple[GroupValue, GroupValue | None]:
        """(row, group) → a quantized type's scale and offset, read from the block's own fields
        where they are used: a vector of weights needs one broadcast value, and a decode unrolls
        a stored block's groups (factored_decode.LaneLayout), so a K-quant's packed 6-bit scales
        are unpacked from constant offsets in registers."""
        levels, size = self.read, self.read.group

        def field(reader: Reader) -> GroupValue:
            return lambda row, group: reader(
                RowBytes(stored, row), self.block(group * size), (group * size) % self.elements // size
            )

        return field(levels.scale), None if levels.offset is None else field(levels.offset)

    def level(self, stored: te.Tensor, row: PrimExpr, col: PrimExpr) -> PrimExpr:
        return self.read.level(RowBytes(stored, row), self.block(col), col % self.elements)

    def centered_level(self, stored: te.Tensor, row: PrimExpr, col: PrimExpr) -> PrimExpr:
        level = self.level(stored, row, col)
        return level - f32(self.read.zero) if self.read.zero else level

    def dequantize_te(self, stored: te.Tensor, rows, cols: int, dtype: str) -> te.Tensor:
        """The [rows, cols] weights of a matrix `stored` as RowBytes reads it."""
        if not isinstance(self.read, Levels):
            return te.compute(
                (rows, cols),
                lambda r, c: self.read(RowBytes(stored, r), self.block(c), c % self.elements).astype(dtype),
                name=DEQUANTIZE,
            )
        size = self.read.group
        scale, offset = self.group_stages(stored, rows, cols)

        def value(r, c):
            scaled = self.centered_level(stored, r, c) * scale[r, c // size]
            return (scaled if offset is None else scaled + offset[r, c // size]).astype(dtype)

        return te.compute((rows, cols), value, name=DEQUANTIZE)

    def matmul_te(self, x: te.Tensor, stored: te.Tensor, rows: int, cols: int, dtype: str, out_dtype: str):
        """y[..., o] = sum_k x[..., k] * W[o, k]; a CPU's decode of a quantized type keeps the
        scales and offsets out of its loop over weights (factored_decode.py)."""
        if isinstance(self.read, Levels):
            layout = factored_decode.consecutive_lanes(self.read.group, self.unrolled_weights or self.elements)
            if factored_decode.applies(x, cols, layout, dtype):
                scale, offset = self.group_values(stored)
                return factored_decode.factored_matmul(
                    x,
                    level=lambda row, col: self.level(stored, row, col),
                    scale=scale,
                    offset=offset,
                    out_features=rows,
                    layout=layout,
                    zero=self.read.zero,
                )
        return matmul_transposed(x, self.dequantize_te(stored, rows, cols, dtype), out_dtype)

    def words(self, rows: np.ndarray) -> np.ndarray:
        """A [rows, row_bytes] uint8 array of blocks as the stored uint32 words."""
        padding = -rows.shape[1] % 4
        padded = np.pad(rows, ((0, 0), (0, padding))) if padding else np.ascontiguousarray(rows)
        return padded.view("<u4").astype(np.uint32, copy=False)


BLOCK_TYPES: dict[str, BlockType] = {
    t.name: t
    for t in (
        BlockType("F32", 1, 4, read_f32, unit="float32"),
        BlockType("F16", 1, 2, read_f16, unit="uint16"),
        BlockType("BF16", 1, 2, read_bf16, unit="uint16"),
        BlockType("Q4_0", 32, 18, Levels(32, q4_0_level, d_at(0), zero=8)),
        BlockType("Q4_1", 32, 20, Levels(32, q4_1_level, d_at(0), d_at(2))),
        BlockType("Q5_0", 32, 22, Levels(32, q5_0_level, d_at(0), zero=16)),
        BlockType("Q5_1", 32, 24, Levels(32, q5_1_level, d_at(0), d_at(2))),
        BlockType("Q8_0", 32, 34, Levels(32, q8_0_level, d_at(0))),
        BlockType("Q4_K", 256, 144, Levels(32, q4_k_level, k_scale, k_offset)),
        BlockType("Q5_K", 256, 176, Levels(32, q5_k_level, k_scale, k_offset)),
        BlockType("Q6_K", 256, 210, Levels(16, q6_k_level, q6_k_scale, zero=32), unrolled_weights=128),
    )
}
