"""Decode GEMVs on 8-bit activations (`gguf_i8`), for x86-64 CPUs with AVX2 or AVX-512 VNNI, and wasm.

With float activations a decode GEMV unpacks each weight, converts it to float32 and multiplies and
adds it: about one instruction per weight, bound by arithmetic rather than memory for 5-bit types
(issue 41). As llama.cpp does, `gguf_i8` quantizes the activation row instead, per block of 32
(`d = max|x| / 127`, `q = round(x / d)`), and takes each block's dot product on integers: AVX2's
`vpmaddubsw` multiplies 32 unsigned bytes by 32 signed ones and adds pairs, `vpmaddwd` adds those
pairs into 8 lanes of int32 (AVX-512 VNNI's `vpdpbusd` does both, and adds to a vector it is
given; wasm widens the bytes to 16 bits for `i32x4.dot_i16x8_s`), and only then is the block's sum
converted and scaled by its weight scale times `d`. The integer sums are exact; the result differs
from the float path by the activations' rounding (the note of issue 41 states how much). A step
takes two blocks, 64 bytes (one AVX-512 register), their sums in 16 lanes: the same lanes in the
same order for every instruction set, so the AVX2 and AVX-512 libraries give the same bits.

One kernel does both: it quantizes x (serially: a few microseconds for the widest rows), then runs
the rows in parallel. Weights become unsigned levels (a nibble; a fifth bit for Q5_0, Q5_1 and Q5_K;
two high bits for Q6_K). A type's constant zero (Q4_0 8, Q5_0 16, Q6_K 32) comes off in the integer
sums: each block starts from −zero times its activations' sums, per lane; a block's float offset
(Q4_1's and Q5_1's m, the K-quants' mins) is added apart, times the activations' sum. A K-quant's
32-weight blocks are unrolled across its stored block, so where their bits lie is a constant, and
its packed scales and mins are unpacked once per stored block, all eight (or sixteen) side by side
(Zen 5, AVX-512 VNNI, in cache: Q4_K 30.6 -> 48.9 Gweights/s, Q6_K 29.9 -> 53.6). Q8_0's signed levels take llama.cpp's
sign trick on AVX2 (`vpsignb`: |w| times x with w's sign: unsigned levels would overflow
`vpmaddubsw`'s pairs); `vpdpbusd`, which does not saturate, takes them moved up by 128, a zero like
the others. A row's sums stay in registers through its blocks; rows go one at a time, which streams
a matrix larger than the caches best (four rows at a time interleave four streams: a 30 MB Q8_0
matrix ran 3.8× slower), and one chain of sums a row is faster than two or four (Zen 5: Q5_0 26.0
Gweights/s in cache, 25.2 with two, 22.4 with four). No value is bound to a name inside the loops:
TVMScript would give it a buffer of its own, which kept LLVM from holding the sums in registers (a
Q8_0 GEMV 1.4× slower); for the same reason every load keeps its alias information (Row.f16).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from tvm import DataType, tirx
from tvm.script import tirx as T
from tvm.target import Target, codegen

from kiln.compile.lower import cpu_prefetch
from kiln.compile.quantization.ggml_blocks import half_by_scaling, target_converts_halves
from kiln.targets import llvm_triple


ACTIVATION_BLOCK = 32
# Activation blocks a row's step takes: 64 bytes, an AVX-512 register. Every instruction set sums
# them in the same lanes in the same order, so every library of a build gives the same bits.
STEP_BLOCKS = 2
UNPACKED_LANES = 16  # a K-quant's scales and mins, unpacked once per stored block


class Row:
    """Row o of a GEMV's weights: its bytes, and the scales (and mins) it has unpacked for the stored
    block at hand into its 16 lanes of `unpacked`."""

    def __init__(self, w, o, unpacked):
        self.w, self.o, self.unpacked_lanes = w, o, unpacked

    def bytes(self, offset, count: int):
        return self.w[self.o, T.ramp(offset, 1, count)]

    def f16(self, offset):
        """A half as float32 (as RowBytes.f16 converts it), loaded as the 2 bytes it is: RowBytes'
        two byte loads, which LLVM joins into one, lose their alias information, and the sums were
        then stored back to memory on every step (the parallel loop's body could not tell the
        weights from the sums)."""
        bits = T.reinterpret("uint16", self.bytes(offset, 2))
        if target_converts_halves():
            return T.Cast("float32", T.reinterpret("float16", bits))
        return half_by_scaling(T.Cast("uint32", bits))

    def unpacked(self, first, count: int):
        at = self.o * UNPACKED_LANES + first
        return self.unpacked_lanes[at] if count == 1 else self.unpacked_lanes[T.ramp(at, 1, count)]


@dataclass(frozen=True)
class SmallBlocks:
    """A type of 32-weight blocks: where it keeps its fields (byte offsets in its block) and how its
    weights become bytes."""

    bytes: int
    d_at: int
    qs_at: int
    levels: str  # "nibbles": 4 bits; "nibbles5": 4 bits and a fifth in qh; "signed": int8
    qh_at: int | None = None
    m_at: int | None = None  # a Q4_1/Q5_1 block's offset
    zero: int = 0  # a Q4_0/Q5_0 level's constant zero
    elements: int = ACTIVATION_BLOCK

    def signed_levels(self, isa: InstructionSet) -> bool:
        """Whether the levels stay signed (Q8_0's, where the instruction set does not move them)."""
        return self.levels == "signed" and not isa.moves_signed_levels

    def levels_zero(self, isa: InstructionSet) -> int:
        """The constant taken off every unsigned level: 128 for Q8_0's levels moved up by it."""
        return 128 if self.levels == "signed" and isa.moves_signed_levels else self.zero

    def levels_of(self, w, o, base, j, isa: InstructionSet):
        if self.levels == "signed":
            levels = w[o, T.ramp(base + self.qs_at, 1, 32)]
            return levels ^ u8s(128) if isa.moves_signed_levels else T.reinterpret("int8x32", levels)
        nibbles = isa.low_and_high_nibbles(w[o, T.ramp(base + self.qs_at, 1, 16)])
        if self.levels == "nibbles":
            return nibbles
        return nibbles | (isa.spread_bits(w[o, T.ramp(base + self.qh_at, 1, 4)]) & u8s(16))

    unpacks = False
    offset_lanes = 1

    def scales(self, row: Row, base, j):
        return T.broadcast(row.f16(base + self.d_at), 8)

    @property
    def has_offset(self) -> bool:
        return self.m_at is not None

    def offsets(self, row: Row, base, sx):
        """What the block's float offset adds: m times its activations' sum `sx`."""
        return row.f16(base + self.m_at) * sx


@dataclass(frozen=True)
class KQuant4or5:
    """Q4_K / Q5_K: 256 weights in 8 sub-blocks of 32, each with a 6-bit scale and min (ggml_blocks
    k_scale_and_min); each 64 weights share 32 bytes of nibbles, and Q5_K's fifth bits are bit
    (weight / 32) of qh[weight % 32]."""

    bytes: int
    qs_at: int
    qh_at: int | None = None
    elements: int = 256

    def signed_levels(self, isa: InstructionSet) -> bool:
        return False

    def levels_zero(self, isa: InstructionSet) -> int:
        return 0

    def levels_of(self, w, o, base, j, isa: InstructionSet):
        packed = w[o, T.ramp(base + self.qs_at + (j // 2) * 32, 1, 32)]
        levels = (packed >> u8s(4 * (j % 2))) & u8s(15)
        if self.qh_at is None:
            return levels
        return levels | (((w[o, T.ramp(base + self.qh_at, 1, 32)] >> u8s(j)) & u8s(1)) << u8s(4))

    unpacks = True
    has_offset = True
    offset_lanes = 8

    def unpack(self, row: Row, base):
        """The 8 sub-blocks' scales times d, then their mins times −dmin: float32x16, taken from
        the 12 packed bytes at once (ggml_blocks.k_scale_and_min's fields, lane by lane)."""
        packed = row.bytes(base + 4, 16)
        low_half = T.ramp(0, 1, 8) < T.broadcast(4, 8)

        def six_bits(first: list[int], high_bits_from: list[int], shift_high: int):
            bits, top = lanes_at(packed, first), lanes_at(packed, high_bits_from)
            high = ((bits >> u8s(shift_high, 8)) & u8s(15, 8)) | ((top >> u8s(6, 8)) << u8s(4, 8))
            return T.Cast("float32x8", T.Select(low_half, bits & u8s(63, 8), high))

        scales = six_bits([0, 1, 2, 3, 8, 9, 10, 11], [0, 1, 2, 3, 0, 1, 2, 3], 0)
        mins = six_bits([4, 5, 6, 7, 8, 9, 10, 11], [4, 5, 6, 7, 4, 5, 6, 7], 4)
        d, dmin = T.broadcast(row.f16(base), 8), T.broadcast(row.f16(base + 2), 8)
        return side_by_side([d * scales, -(dmin * mins)])

    def scales(self, row: Row, base, j):
        return T.broadcast(row.unpacked(j, 1), 8)

    def offsets(self, row: Row, base, sx):
        """The sub-blocks' mins against their activations' sums `sx` (8 lanes)."""
        return row.unpacked(8, 8) * sx


@dataclass(frozen=True)
class KQuant6:
    """Q6_K: 256 weights in 16 sub-blocks of 16 with int8 scales; each 128 weights keep 64 bytes of
    low nibbles and 32 of 2-bit high parts (ggml_blocks q6_k_level); levels 0..63 around 32. An
    activation block meets two sub-blocks: lanes 0–3 of its sums are the first's, 4–7 the second's."""

    bytes: int = 210
    elements: int = 256
    has_offset = False
    unpacks = True
    offset_lanes = 1

    def signed_levels(self, isa: InstructionSet) -> bool:
        return False

    def levels_zero(self, isa: InstructionSet) -> int:
        return 32

    def levels_of(self, w, o, base, j, isa: InstructionSet):
        half, quarter = j // 4, j % 4
        low = (w[o, T.ramp(base + half * 64 + (quarter % 2) * 32, 1, 32)] >> u8s(4 * (quarter // 2))) & u8s(15)
        high = (w[o, T.ramp(base + 128 + half * 32, 1, 32)] >> u8s(2 * quarter)) & u8s(3)
        return low | (high << u8s(4))

    def unpack(self, row: Row, base):
        """The 16 sub-blocks' scales times d: float32x16."""
        scales = T.Cast("float32x16", T.reinterpret("int8x16", row.bytes(base + 192, 16)))
        return scales * T.broadcast(row.f16(base + 208), 16)

    def scales(self, row: Row, base, j):
        # Both scales in one load, spread 4 and 4 (two scalar loads, which LLVM joins, lose their
        # alias information: see Row.f16).
        pair = row.unpacked(2 * j, 2)
        return T.Shuffle([pair] * 4, [0, 2, 4, 6, 1, 3, 5, 7])


KERNEL_BLOCKS = {
    "Q4_0": SmallBlocks(18, d_at=0, qs_at=2, levels="nibbles", zero=8),
    "Q4_1": SmallBlocks(20, d_at=0, qs_at=4, levels="nibbles", m_at=2),
    "Q5_0": SmallBlocks(22, d_at=0, qs_at=6, levels="nibbles5", qh_at=2, zero=16),
    "Q5_1": SmallBlocks(24, d_at=0, qs_at=8, levels="nibbles5", qh_at=4, m_at=2),
    "Q8_0": SmallBlocks(34, d_at=0, qs_at=2, levels="signed"),
    "Q4_K": KQuant4or5(144, qs_at=16),
    "Q5_K": KQuant4or5(176, qs_at=48, qh_at=16),
    "Q6_K": KQuant6(),
}


def runs_on(target: Target | None) -> bool:
    """Whether `target` (a TVM target, None outside a build) runs this module's kernels: an x86-64
    CPU with AVX2, or wasm with SIMD."""
    if target is None or target.kind.name != "llvm":
        return False
    triple = llvm_triple(target)
    if triple.startswith("wasm32"):
        return bool(codegen.llvm_cpu_has_features(["simd128"], target))
    return triple.startswith("x86_64") and bool(codegen.llvm_cpu_has_features(["avx2"], target))


class Avx2:
    """The instructions a kernel's inner loop takes on x86-64 with AVX2. Every instruction set gives
    the same integer sums, and so the same outputs up to the float epilogue's rounding."""

    name = "avx2"
    activations = "int8"  # how the quantized activations are kept
    prefetches = True  # asks for weights ahead (kiln/compile/lower/cpu_prefetch.py); wasm has no prefetch
    # Whether Q8_0's signed levels are moved up by 128 to unsigned ones (else kept signed, and
    # multiplied by `signed_dot`): `vpmaddubsw` would saturate their pairs.
    moves_signed_levels = False

    def dot(self, levels, x, correction):
        """int32x8 of sums of levels times x (unsigned bytes by signed ones), plus correction[i] where
        there is one: lane i sums bytes 4i … 4i + 3 (wasm groups them otherwise, lanes 0–3 still in
        the first 16 bytes and 4–7 in the last 16); 64 bytes give 16 lanes, the two halves'."""
        if lanes_in(levels) == 64:
            return in_halves(lambda half: self.dot(*half), levels, x, correction)
        pairs = avx2("int16x16", "pmadd.ub.sw", levels, x)
        quads = avx2("int32x8", "pmadd.wd", pairs, T.broadcast(T.int16(1), 16))
        return quads + correction if correction is not None else quads

    def signed_dot(self, levels, x):
        """As `dot`, for signed levels: |w| times x with w's sign, as llama.cpp does."""
        if lanes_in(levels) == 64:
            return in_halves(lambda half: self.signed_dot(*half), levels, x)
        magnitudes = T.reinterpret("uint8x32", avx2("int8x32", "psign.b", levels, levels))
        return self.dot(magnitudes, avx2("int8x32", "psign.b", x, levels), None)

    def spread_bits(self, packed):
        """32 bits (4 bytes) as 32 bytes, byte i holding bit i of them at bit 4 (16), other bits unspecified."""
        return lane_bits_set(avx2("uint8x32", "pshuf.b", four_bytes_eight_times(packed), SPREAD_BYTES))

    def low_and_high_nibbles(self, packed):
        """16 bytes as 32 levels: their low nibbles, then their high ones (ggml's order within a
        block). The bytes are loaded into both halves and the upper half's shifted by 4 per 64 bits
        (vpsrlvq), not shifted in one half and joined to the other: no shuffle."""
        twice = T.reinterpret("uint64x4", T.Shuffle([packed, packed], list(range(32))))
        shifts = T.Shuffle([T.broadcast(T.uint64(0), 2), T.broadcast(T.uint64(4), 2)], list(range(4)))
        return T.reinterpret("uint8x32", twice >> shifts) & u8s(15)


class Avx512Vnni(Avx2):
    """AVX-512 with VL, BW, VNNI and VBMI (Ice Lake, Sapphire Rapids, Zen 4 and later)."""

    name = "avx512-vnni"
    moves_signed_levels = True  # `vpdpbusd` does not saturate

    def dot(self, levels, x, correction):
        lanes = lanes_in(levels) // 4
        start = correction if correction is not None else T.broadcast(T.int32(0), lanes)
        return T.call_llvm_pure_intrin(
            f"int32x{lanes}",
            f"llvm.x86.avx512.vpdpbusd.{lanes * 32}",
            start,
            T.reinterpret(f"int8x{lanes * 4}", levels),
            x,
        )

    def spread_bits(self, packed):
        # vpmultishiftqb: byte i takes the 8 bits of its quadword from bit i − 4 (mod 64) on; each
        # quadword holds the 32 bits twice.
        twice = T.reinterpret("int8x32", four_bytes_eight_times(packed))
        starts = T.ramp(T.int8(-4), T.int8(1), 32) & T.broadcast(T.int8(63), 32)
        return T.reinterpret(
            "uint8x32", T.call_llvm_pure_intrin("int8x32", "llvm.x86.avx512.pmultishift.qb.256", starts, twice)
        )


class WasmSimd:
    """Wasm's 128-bit SIMD, which multiplies bytes only after widening them: 16-bit lanes, whose
    pairs `i32x4.dot_i16x8_s` multiplies and adds (signed levels need no trick there)."""

    name = "wasm-simd128"
    moves_signed_levels = False
    prefetches = False
    activations = "int16"  # widened once, not per row

    def dot(self, levels, x, correction):
        sums = self.signed_dot(levels, x)  # unsigned levels widen as they are
        return sums + correction if correction is not None else sums

    def signed_dot(self, levels, x):
        if lanes_in(levels) == 64:
            return in_halves(lambda half: self.signed_dot(*half), levels, x)
        # Lanes 0–3 sum the first 16 bytes' products (the dot products of bytes 0–7 and 8–15 added),
        # lanes 4–7 the last 16's: another grouping than x86's, with no shuffle, which keeps Q6_K's
        # sub-blocks apart as its scales need; corrections are summed by this same `dot`.
        wide_levels = T.Cast("int16x32", levels)
        pairs = [
            T.call_llvm_pure_intrin(
                "int32x4", "llvm.wasm.dot", lanes_of(wide_levels, 8 * part, 8), lanes_of(x, 8 * part, 8)
            )
            for part in range(4)
        ]
        return T.Shuffle([pairs[0] + pairs[1], pairs[2] + pairs[3]], list(range(8)))

    def spread_bits(self, packed):
        return lane_bits_set(T.Shuffle([four_bytes_eight_times(packed)], [lane // 8 for lane in range(32)]))

    def low_and_high_nibbles(self, packed):
        return T.Shuffle([packed & u8s(15, 16), packed >> u8s(4, 16)], list(range(32)))


def in_halves(dot, *vectors):
    """`dot` of 64 bytes as two of 32, its halves side by side (a vector that is None stays None)."""
    halves = [
        [None if v is None else lanes_of(v, h * lanes_in(v) // 2, lanes_in(v) // 2) for v in vectors] for h in range(2)
    ]
    return side_by_side([dot(half) for half in halves])


def lanes_of(vector, first: int, count: int):
    return lanes_at(vector, list(range(first, first + count)))


def lanes_at(vector, lanes: list[int]):
    return T.Shuffle([vector], lanes)


InstructionSet = Avx2 | WasmSimd


def instruction_set(target: Target) -> InstructionSet:
    """The instruction set of `target` (one that `runs_on`) that its kernels take."""
    if llvm_triple(target).startswith("wasm32"):
        return WasmSimd()
    if codegen.llvm_cpu_has_features(list(VNNI_FEATURES), target):
        return Avx512Vnni()
    return Avx2()


# What Avx512Vnni needs of the CPU (LLVM's names).
VNNI_FEATURES = ("avx512vnni", "avx512vbmi", "avx512vl", "avx512bw")


def one_row(shape) -> bool:
    """Whether an activation of `shape` [..., cols] is one static row (a decode step's)."""
    return all(isinstance(d, int) and d == 1 for d in shape[:-1])


def avx2(dtype: str, name: str, *args):
    return T.call_llvm_pure_intrin(dtype, f"llvm.x86.avx2.{name}", *args)


def u8s(value: int, lanes: int = 32):
    return T.broadcast(T.uint8(value), lanes)


# Byte i of 32 spread from byte i // 8 of 4, and the bit (i % 8) it keeps.
SPREAD_BYTES = T.Shuffle([u8s(0, 8), u8s(1, 8), u8s(2, 8), u8s(3, 8)], list(range(32)))
LANE_BITS = u8s(1) << T.Cast("uint8x32", T.ramp(0, 1, 32) % T.broadcast(8, 32))


def four_bytes_eight_times(packed):
    """4 bytes as 32: them, 8 times over."""
    return T.reinterpret("uint8x32", T.broadcast(T.reinterpret("uint32", packed), 8))


def lane_bits_set(spread):
    """32 bytes, each byte i of `spread` that has bit i % 8 set as 255, the others 0."""
    return T.Select((spread & LANE_BITS) == LANE_BITS, u8s(255), u8s(0))


# ---- the activations: int8 per block of 32, its scale `dx` (max|x| / 127) and `sx` (dx · Σ xq) ----


def activation_block(x, b):
    return x[0, 0, T.ramp(b * ACTIVATION_BLOCK, 1, ACTIVATION_BLOCK)]


def to_eight(vector, combine):
    """32 lanes combined pairwise into 8 (halves against halves)."""
    for width in (16, 8):
        low, high = T.Shuffle([vector], list(range(width))), T.Shuffle([vector], list(range(width, 2 * width)))
        vector = combine(low, high)
    return vector


def eight_lanes(buffer, combine):
    total = buffer[0]
    for lane in range(1, 8):
        total = combine(total, buffer[lane])
    return total


def quantized(block, largest):
    """A block of 32 activations as int8, `largest` its max|x|: x · 127 / max|x| to the nearest
    integer (ties to even, as llama.cpp's AVX2 rounds them), 0 for a block of zeros."""
    scale = T.if_then_else(largest > T.float32(0), T.float32(127) / largest, T.float32(0))
    return T.Cast("int8x32", T.Cast("int32x32", T.nearbyint(block * T.broadcast(scale, 32))))


# ---- the weights ----


@dataclass(frozen=True)
class Step:
    """What one step of a row's loop takes: `blocks` activation blocks side by side (STEP_BLOCKS, or
    one where a row has an odd number of them), which lie in `stored` consecutive stored blocks (two
    of a 32-weight type) or in one (a K-quant's 256)."""

    blocks: int
    per_stored: int  # activation blocks in a stored block

    @property
    def stored(self) -> int:
        return max(1, self.blocks // self.per_stored)

    @property
    def in_one_stored(self) -> int:
        return min(self.blocks, self.per_stored)

    def where(self, s, j, i):
        """The stored block and its activation block that block i of step (s, j) is."""
        return s * self.stored + i // self.in_one_stored, j * self.in_one_stored + i % self.in_one_stored


def lanes_in(vector) -> int:
    return DataType(str(vector.ty.dtype)).lanes


def side_by_side(parts):
    return parts[0] if len(parts) == 1 else T.Shuffle(parts, list(range(sum(lanes_in(p) for p in parts))))


class Activations:
    """The quantized activation row: per block b, its bytes, its scale spread over the 8 lanes its
    sums take, its sum times that scale (`sx`) and −zero · Σ xq per lane (`correction`)."""

    def __init__(self, xq, scales, sx, correction):
        self.xq, self.scales, self.sx, self.correction = xq, scales, sx, correction

    def bytes(self, b, count):
        return self.xq[T.ramp(b * ACTIVATION_BLOCK, 1, ACTIVATION_BLOCK * count)]

    def lanes(self, buffer, b, count):
        return buffer[T.ramp(b * 8, 1, 8 * count)]

    def sums(self, b, count: int):
        """`sx` of blocks b … b + count − 1."""
        return self.sx[b] if count == 1 else self.sx[T.ramp(b, 1, count)]


def step_sum(blocks, isa, step: Step, row: Row, acts: Activations, s, j):
    """Step (s, j) of a row: the lane sums of weight levels times activations (less
    the levels' zero, which the correction holds), times the weights' and the activations' scales:
    float32x(8 · step.blocks)."""
    where = [step.where(s, j, i) for i in range(step.blocks)]
    levels = side_by_side([blocks.levels_of(row.w, row.o, stored * blocks.bytes, jj, isa) for stored, jj in where])
    scales = side_by_side([blocks.scales(row, stored * blocks.bytes, jj) for stored, jj in where])
    first = where[0][0] * step.per_stored + where[0][1]
    x = acts.bytes(first, step.blocks)
    if blocks.signed_levels(isa):
        dot = isa.signed_dot(levels, x)
    else:
        correction = acts.lanes(acts.correction, first, step.blocks) if blocks.levels_zero(isa) else None
        dot = isa.dot(levels, x, correction)
    lanes = 8 * step.blocks
    return T.Cast(f"float32x{lanes}", dot) * (scales * acts.lanes(acts.scales, first, step.blocks))


def stored_offsets(blocks, step: Step, row: Row, acts: Activations, s):
    """What the float offsets of the stored blocks of step s (Q4_1's and Q5_1's m, the K-quants'
    mins) add: each offset times its activations' sum."""
    total = None
    for i in range(step.stored):
        stored = s * step.stored + i
        offset = blocks.offsets(row, stored * blocks.bytes, acts.sums(stored * step.per_stored, blocks.offset_lanes))
        total = offset if total is None else total + offset
    return total


def zeros(lanes: int):
    return T.float32(0) if lanes == 1 else T.broadcast(T.float32(0), lanes)


def added_halves(vector, lanes: int):
    while lanes > 1:
        lanes //= 2
        vector = lanes_of(vector, 0, lanes) + lanes_of(vector, lanes, lanes)
    return vector


def made_once(kernel):
    """`kernel(*shape, isa)` made once per shape, instruction set and the target's half conversion: a
    model asks for the same kernel in every layer of every function, and each TVMScript parse took
    about 0.1 s (Qwen2.5-0.5B's Q4_K_M mix as gguf_i8 asked for 1116: it built in 82 s, 28 s so)."""
    kernels = {}

    @functools.wraps(kernel)
    def once(*args):
        *shape, isa = args
        key = (*shape, type(isa), target_converts_halves())
        if key not in kernels:
            kernels[key] = kernel(*args)
        return kernels[key]

    return once


@made_once
def gemv(block_type_name: str, rows: int, cols: int, row_bytes: int, isa: InstructionSet) -> tirx.PrimFunc:
    """y[0, 0, o] = Σ_k x[0, 0, k] W[o, k] for one activation row x [1, 1, cols], quantized here,
    and W's blocks as [rows, row_bytes] bytes."""
    blocks = KERNEL_BLOCKS[block_type_name]
    activation_blocks, per_stored = cols // ACTIVATION_BLOCK, blocks.elements // ACTIVATION_BLOCK
    step = Step(STEP_BLOCKS if activation_blocks % STEP_BLOCKS == 0 else 1, per_stored)
    lanes, offset_lanes = 8 * step.blocks, blocks.offset_lanes
    zero = blocks.levels_zero(isa)
    step_bytes = step.stored * blocks.bytes

    def lanes_from(index, count: int):
        """The `count` lanes of entry `index` of a buffer of such entries."""
        return index if count == 1 else T.ramp(index * count, 1, count)

    @T.prim_func(private=True, check_well_formed=False)
    def kernel(
        x: T.Buffer((1, 1, cols), "float32"),
        w: T.Buffer((rows, row_bytes), "uint8"),
        y: T.Buffer((1, 1, rows), "float32"),
    ):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        with T.sblock("root"):
            xq = T.alloc_buffer((cols,), isa.activations)
            scales = T.alloc_buffer((activation_blocks * 8,), "float32")  # dx, per lane
            sx = T.alloc_buffer((activation_blocks,), "float32")  # dx · Σ xq over the block
            correction = T.alloc_buffer((activation_blocks * 8,), "int32")  # −zero · Σ xq, per lane
            largest = T.alloc_buffer((activation_blocks,), "float32")
            halves = T.alloc_buffer((8,), "float32")
            counts = T.alloc_buffer((8,), "int32")
            sums = T.alloc_buffer((rows * lanes,), "float32")
            offsets = T.alloc_buffer((rows * offset_lanes,), "float32")
            unpacked = T.alloc_buffer(((rows if blocks.unpacks else 1) * UNPACKED_LANES,), "float32")
            for b in range(activation_blocks):
                halves[T.ramp(0, 1, 8)] = to_eight(T.fabs(activation_block(x, b)), T.max)
                largest[b] = eight_lanes(halves, T.max)
                scales[T.ramp(b * 8, 1, 8)] = T.broadcast(largest[b] / T.float32(127), 8)
                xq[T.ramp(b * ACTIVATION_BLOCK, 1, ACTIVATION_BLOCK)] = T.Cast(
                    f"{isa.activations}x32", quantized(activation_block(x, b), largest[b])
                )
                counts[T.ramp(0, 1, 8)] = isa.dot(u8s(1), xq[T.ramp(b * ACTIVATION_BLOCK, 1, ACTIVATION_BLOCK)], None)
                sx[b] = T.Cast("float32", eight_lanes(counts, lambda a, c: a + c)) * (largest[b] / T.float32(127))
                correction[T.ramp(b * 8, 1, 8)] = counts[T.ramp(0, 1, 8)] * T.broadcast(T.int32(-zero), 8)
            for o in T.parallel(rows):
                sums[lanes_from(o, lanes)] = zeros(lanes)
                offsets[lanes_from(o, offset_lanes)] = zeros(offset_lanes)
                for s in range(cols // blocks.elements // step.stored):
                    if isa.prefetches:
                        for line in T.unroll((step_bytes + cpu_prefetch.CACHE_LINE - 1) // cpu_prefetch.CACHE_LINE):
                            T.evaluate(
                                cpu_prefetch.prefetch(
                                    w, o, s * step_bytes + line * cpu_prefetch.CACHE_LINE + cpu_prefetch.AHEAD
                                )
                            )
                    if blocks.unpacks:
                        unpacked[T.ramp(o * UNPACKED_LANES, 1, UNPACKED_LANES)] = blocks.unpack(
                            Row(w, o, unpacked), s * blocks.bytes
                        )
                    for j in T.unroll(per_stored // step.in_one_stored):
                        sums[lanes_from(o, lanes)] = sums[lanes_from(o, lanes)] + step_sum(
                            blocks,
                            isa,
                            step,
                            Row(w, o, unpacked),
                            Activations(xq, scales, sx, correction),
                            s,
                            j,
                        )
                    if blocks.has_offset:
                        offsets[lanes_from(o, offset_lanes)] = offsets[lanes_from(o, offset_lanes)] + stored_offsets(
                            blocks, step, Row(w, o, unpacked), Activations(xq, scales, sx, correction), s
                        )
                y[0, 0, o] = added_halves(offsets[lanes_from(o, offset_lanes)], offset_lanes) + added_halves(
                    sums[lanes_from(o, lanes)], lanes
                )

    return kernel
