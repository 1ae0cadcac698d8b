"""Decode GEMVs on 8-bit activations (`gguf_i8`), for x86-64 CPUs with AVX2 or AVX-512 VNNI, and wasm.

With float activations a decode GEMV unpacks each weight, converts it to float32 and multiplies and
adds it: about one instruction per weight, bound by arithmetic rather than memory for 5-bit types
(issue 41). As llama.cpp does, `gguf_i8` quantizes the activation row instead, per block of 32
(`d = max|x| / 127`, `q = round(x / d)`), and takes each block's dot product on integers: AVX2's
`vpmaddubsw` multiplies 32 unsigned bytes by 32 signed ones and adds pairs, `vpmaddwd` adds those
pairs into 8 lanes of int32 (AVX-512 VNNI's `vpdpbusd` does both, and adds to a vector it is
given; wasm widens the bytes to 16 bits for `i32x4.dot_i16x8_s`), and only then is the block's sum
converted and scaled by its weight scale times `d`. The
integer sums are exact; the result differs from the float path by the activations' rounding (the
note of issue 41 states how much).

One kernel does both: it quantizes x (serially: a few microseconds for the widest rows), then runs
the rows in parallel. Weights become unsigned levels (a nibble; a fifth bit for Q5_0, Q5_1 and Q5_K;
two high bits for Q6_K). A type's constant zero (Q4_0 8, Q5_0 16, Q6_K 32) comes off in the integer
sums: each block starts from −zero times its activations' sums, per lane; a block's float offset
(Q4_1's and Q5_1's m, the K-quants' mins) is added apart, times the activations' sum. A K-quant's
32-weight blocks are unrolled across its stored block, so where their bits and packed scales lie is
a constant. Q8_0's signed levels take llama.cpp's sign trick on AVX2 (`vpsignb`: |w| times x with
w's sign: unsigned levels would overflow `vpmaddubsw`'s pairs); `vpdpbusd`, which does not
saturate, takes them moved up by 128, a zero like the others. A row's sums stay in registers
through its blocks; rows go one at a time, which streams a matrix larger than the caches best (four
rows at a time interleave four streams: a 30 MB Q8_0 matrix ran 3.8× slower), and one chain of sums
a row is faster than two or four (Zen 5: Q5_0 26.0 Gweights/s in cache, 25.2 with two, 22.4 with
four). No value is bound to a name inside the loops: TVMScript would give it a buffer of its own,
which kept LLVM from holding the sums in registers (a Q8_0 GEMV 1.4× slower).
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as T
from tvm.target import Target, codegen

from kiln.compile.quantization.ggml_blocks import RowBytes, k_scale_and_min

ACTIVATION_BLOCK = 32


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

    def scales(self, row: RowBytes, base, j, dx):
        return T.broadcast(row.f16(base + self.d_at) * dx, 8)

    @property
    def has_offset(self) -> bool:
        return self.m_at is not None

    def offset(self, row: RowBytes, base, j, sx):
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

    def scales(self, row: RowBytes, base, j, dx):
        scale, _ = k_scale_and_min(row, base, j)
        return T.broadcast(row.f16(base) * scale * dx, 8)

    has_offset = True

    def offset(self, row: RowBytes, base, j, sx):
        _, minimum = k_scale_and_min(row, base, j)
        return -(row.f16(base + 2) * minimum) * sx


@dataclass(frozen=True)
class KQuant6:
    """Q6_K: 256 weights in 16 sub-blocks of 16 with int8 scales; each 128 weights keep 64 bytes of
    low nibbles and 32 of 2-bit high parts (ggml_blocks q6_k_level); levels 0..63 around 32. An
    activation block meets two sub-blocks: lanes 0–3 of its sums are the first's, 4–7 the second's."""

    bytes: int = 210
    elements: int = 256
    has_offset = False

    def signed_levels(self, isa: InstructionSet) -> bool:
        return False

    def levels_zero(self, isa: InstructionSet) -> int:
        return 32

    def levels_of(self, w, o, base, j, isa: InstructionSet):
        half, quarter = j // 4, j % 4
        low = (w[o, T.ramp(base + half * 64 + (quarter % 2) * 32, 1, 32)] >> u8s(4 * (quarter // 2))) & u8s(15)
        high = (w[o, T.ramp(base + 128 + half * 32, 1, 32)] >> u8s(2 * quarter)) & u8s(3)
        return low | (high << u8s(4))

    def scales(self, row: RowBytes, base, j, dx):
        d = row.f16(base + 208) * dx
        first, second = row.i8(base + 192 + 2 * j), row.i8(base + 192 + 2 * j + 1)
        return T.Shuffle([T.broadcast(d * first, 4), T.broadcast(d * second, 4)], list(range(8)))


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
    triple = str(target.attrs.get("mtriple", "")) or codegen.llvm_get_system_triple()
    if triple.startswith("wasm32"):
        return bool(codegen.llvm_cpu_has_features(["simd128"], target))
    return triple.startswith("x86_64") and bool(codegen.llvm_cpu_has_features(["avx2"], target))


class Avx2:
    """The instructions a kernel's inner loop takes on x86-64 with AVX2. Every instruction set gives
    the same integer sums, and so the same outputs up to the float epilogue's rounding."""

    name = "avx2"
    activations = "int8"  # how the quantized activations are kept
    # Whether Q8_0's signed levels are moved up by 128 to unsigned ones (else kept signed, and
    # multiplied by `signed_dot`): `vpmaddubsw` would saturate their pairs.
    moves_signed_levels = False

    def dot(self, levels, x, correction):
        """int32x8 of sums of levels times x (unsigned bytes by signed ones), plus correction[i] where
        there is one: lane i sums bytes 4i … 4i + 3 (wasm groups them otherwise, lanes 0–3 still in
        the first 16 bytes and 4–7 in the last 16)."""
        pairs = avx2("int16x16", "pmadd.ub.sw", levels, x)
        quads = avx2("int32x8", "pmadd.wd", pairs, T.broadcast(T.int16(1), 16))
        return quads + correction if correction is not None else quads

    def signed_dot(self, levels, x):
        """As `dot`, for signed levels: |w| times x with w's sign, as llama.cpp does."""
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
        start = correction if correction is not None else T.broadcast(T.int32(0), 8)
        return T.call_llvm_pure_intrin(
            "int32x8", "llvm.x86.avx512.vpdpbusd.256", start, T.reinterpret("int8x32", levels), x
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
    activations = "int16"  # widened once, not per row

    def dot(self, levels, x, correction):
        sums = self.signed_dot(levels, x)  # unsigned levels widen as they are
        return sums + correction if correction is not None else sums

    def signed_dot(self, levels, x):
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


def lanes_of(vector, first: int, count: int):
    return T.Shuffle([vector], list(range(first, first + count)))


InstructionSet = Avx2 | WasmSimd


def instruction_set(target: Target) -> InstructionSet:
    """The instruction set of `target` (one that `runs_on`) that its kernels take."""
    if str(target.attrs.get("mtriple", "")).startswith("wasm32"):
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


def quantized(x, largest, b):
    """A block of activations as int8: x · 127 / max|x| to the nearest integer (ties to even, as
    llama.cpp's AVX2 rounds them), 0 for a block of zeros."""
    scale = T.if_then_else(largest[b] > T.float32(0), T.float32(127) / largest[b], T.float32(0))
    return T.Cast("int8x32", T.Cast("int32x32", T.nearbyint(activation_block(x, b) * T.broadcast(scale, 32))))


# ---- the weights ----


def activation_block_of(blocks, s, j):
    """The activation block that block j of stored block s meets."""
    return s * (blocks.elements // ACTIVATION_BLOCK) + j


def block_sum(blocks, isa, w, xq, dx, correction, o, s, j):
    """Block j of stored block s: its 8 lane sums of weight levels times activations (less the
    levels' zero, which `correction` holds as −zero · Σ xq per lane), scaled by the weights' and the
    activations' scales: float32x8."""
    b, base = activation_block_of(blocks, s, j), s * blocks.bytes
    levels, x = blocks.levels_of(w, o, base, j, isa), xq[T.ramp(b * ACTIVATION_BLOCK, 1, ACTIVATION_BLOCK)]
    if blocks.signed_levels(isa):
        dot = isa.signed_dot(levels, x)
    else:
        dot = isa.dot(levels, x, correction[T.ramp(b * 8, 1, 8)] if blocks.levels_zero(isa) else None)
    return T.Cast("float32x8", dot) * blocks.scales(RowBytes(w, o), base, j, dx[b])


def block_offset(blocks, w, sx, o, s, j):
    """What the block's float offset (Q4_1's and Q5_1's m, the K-quants' mins) adds: the offset
    times the activations' sum."""
    return blocks.offset(RowBytes(w, o), s * blocks.bytes, j, sx[activation_block_of(blocks, s, j)])


def row_total(sums, offsets, o):
    total = offsets[o]
    for lane in range(8):
        total = total + sums[o * 8 + lane]
    return total


def gemv(block_type_name: str, rows: int, cols: int, row_bytes: int, isa: InstructionSet) -> tirx.PrimFunc:
    """y[0, 0, o] = Σ_k x[0, 0, k] W[o, k] for one activation row x [1, 1, cols], quantized here,
    and W's blocks as [rows, row_bytes] bytes."""
    blocks = KERNEL_BLOCKS[block_type_name]
    activation_blocks, per_stored = cols // ACTIVATION_BLOCK, blocks.elements // ACTIVATION_BLOCK
    zero = blocks.levels_zero(isa)

    @T.prim_func(private=True, check_well_formed=False)
    def kernel(
        x: T.Buffer((1, 1, cols), "float32"),
        w: T.Buffer((rows, row_bytes), "uint8"),
        y: T.Buffer((1, 1, rows), "float32"),
    ):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        with T.sblock("root"):
            xq = T.alloc_buffer((cols,), isa.activations)
            dx = T.alloc_buffer((activation_blocks,), "float32")
            sx = T.alloc_buffer((activation_blocks,), "float32")  # dx · Σ xq over the block
            correction = T.alloc_buffer((activation_blocks * 8,), "int32")  # −zero · Σ xq, per lane
            largest = T.alloc_buffer((activation_blocks,), "float32")
            lanes = T.alloc_buffer((8,), "float32")
            counts = T.alloc_buffer((8,), "int32")
            sums = T.alloc_buffer((rows * 8,), "float32")
            offsets = T.alloc_buffer((rows,), "float32")
            for b in range(activation_blocks):
                lanes[T.ramp(0, 1, 8)] = to_eight(T.fabs(activation_block(x, b)), T.max)
                largest[b] = eight_lanes(lanes, T.max)
                dx[b] = largest[b] / T.float32(127)
                xq[T.ramp(b * ACTIVATION_BLOCK, 1, ACTIVATION_BLOCK)] = T.Cast(
                    f"{isa.activations}x32", quantized(x, largest, b)
                )
                counts[T.ramp(0, 1, 8)] = isa.dot(u8s(1), xq[T.ramp(b * ACTIVATION_BLOCK, 1, ACTIVATION_BLOCK)], None)
                sx[b] = T.Cast("float32", eight_lanes(counts, lambda a, c: a + c)) * dx[b]
                correction[T.ramp(b * 8, 1, 8)] = counts[T.ramp(0, 1, 8)] * T.broadcast(T.int32(-zero), 8)
            for o in T.parallel(rows):
                sums[T.ramp(o * 8, 1, 8)] = T.broadcast(T.float32(0), 8)
                offsets[o] = T.float32(0)
                for s in range(cols // blocks.elements):
                    for j in T.unroll(per_stored):
                        sums[T.ramp(o * 8, 1, 8)] = sums[T.ramp(o * 8, 1, 8)] + block_sum(
                            blocks, isa, w, xq, dx, correction, o, s, j
                        )
                        if blocks.has_offset:
                            offsets[o] = offsets[o] + block_offset(blocks, w, sx, o, s, j)
                y[0, 0, o] = row_total(sums, offsets, o)

    return kernel
