"""Decode GEMVs on 8-bit activations (`gguf_i8`), for x86-64 CPUs with AVX2.

With float activations a decode GEMV unpacks each weight, converts it to float32 and multiplies and
adds it: about one instruction per weight, bound by arithmetic rather than memory for 5-bit types
(issue 41). As llama.cpp does, `gguf_i8` quantizes the activation row instead, per block of 32
(`d = max|x| / 127`, `q = round(x / d)`), and takes each block's dot product on integers: AVX2's
`vpmaddubsw` multiplies 32 unsigned bytes by 32 signed ones and adds pairs, `vpmaddwd` adds those
pairs into 8 lanes of int32, and only then is the block's sum converted and scaled by its weight
scale times `d`. The integer sums are exact; the result differs from the float path by the
activations' rounding (the note of issue 41 states how much).

One kernel does both: it quantizes x (serially: a few microseconds for the widest rows), then runs
the rows in parallel. Weights become unsigned levels (a nibble, with its fifth bit for Q5): a type's
constant zero, or a Q4_1/Q5_1 block's offset, is taken out with the activation block's sum.
Q8_0's signed levels take llama.cpp's sign trick (`vpsignb`: |w| times x with w's sign). A row's
sums stay in registers through its blocks; rows go one at a time, which streams a matrix larger than
the caches best (four rows at a time interleave four streams: a 30 MB Q8_0 matrix ran 3.8× slower).
No value is bound to a name inside the loops: TVMScript would give it a buffer of its own, which
kept LLVM from holding the sums in registers (a Q8_0 GEMV 1.4× slower).
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx
from tvm.target import Target
from tvm.script import tirx as T

ACTIVATION_BLOCK = 32


@dataclass(frozen=True)
class LevelBytes:
    """Where a block type keeps its fields (byte offsets in its block) and how its 32 weights become bytes."""

    bytes: int
    d_at: int
    qs_at: int
    levels: str  # "nibbles": 4 bits; "nibbles5": 4 bits and a fifth in qh; "signed": int8
    qh_at: int | None = None
    m_at: int | None = None  # a Q4_1/Q5_1 block's offset
    zero: int = 0  # a Q4_0/Q5_0 level's constant zero


LEVEL_BYTES = {
    "Q4_0": LevelBytes(18, d_at=0, qs_at=2, levels="nibbles", zero=8),
    "Q4_1": LevelBytes(20, d_at=0, qs_at=4, levels="nibbles", m_at=2),
    "Q5_0": LevelBytes(22, d_at=0, qs_at=6, levels="nibbles5", qh_at=2, zero=16),
    "Q5_1": LevelBytes(24, d_at=0, qs_at=8, levels="nibbles5", qh_at=4, m_at=2),
    "Q8_0": LevelBytes(34, d_at=0, qs_at=2, levels="signed"),
}


def runs_on(target: Target | None) -> bool:
    """Whether `target` (a TVM target, None outside a build) runs this module's kernels: an x86-64 CPU with AVX2."""
    from tvm.target import codegen

    if target is None or target.kind.name != "llvm":
        return False
    triple = str(target.attrs.get("mtriple", "")) or codegen.llvm_get_system_triple()
    return triple.startswith("x86_64") and bool(codegen.llvm_cpu_has_features(["avx2"], target))


def one_row(shape) -> bool:
    """Whether an activation of `shape` [..., cols] is one static row (a decode step's)."""
    return all(isinstance(d, int) and d == 1 for d in shape[:-1])


def intrinsic(dtype: str, name: str, *args):
    return T.call_llvm_pure_intrin(dtype, f"llvm.x86.avx2.{name}", *args)


def u8s(value: int, lanes: int = 32):
    return T.broadcast(T.uint8(value), lanes)


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


def half(w, o, at):
    return T.Cast("float32", T.reinterpret("float16", T.reinterpret("uint16", w[o, T.ramp(at, 1, 2)])))


def levels(layout: LevelBytes, w, o, base):
    """A block's 32 weights as bytes: unsigned levels, or for `signed` the int8 ones."""
    if layout.levels == "signed":
        return T.reinterpret("int8x32", w[o, T.ramp(base + layout.qs_at, 1, 32)])
    packed = w[o, T.ramp(base + layout.qs_at, 1, 16)]
    nibbles = T.Shuffle([packed & u8s(15, 16), packed >> u8s(4, 16)], list(range(32)))
    if layout.levels == "nibbles":
        return nibbles
    # Weight j's fifth bit is bit j of the 32-bit qh: each byte of qh is spread over 8 lanes, which
    # keep the bit of their own index.
    qh = T.reinterpret("uint32", w[o, T.ramp(base + layout.qh_at, 1, 4)])
    spread_bytes = T.Shuffle([u8s(0, 8), u8s(1, 8), u8s(2, 8), u8s(3, 8)], list(range(32)))
    spread = intrinsic("uint8x32", "pshuf.b", T.reinterpret("uint8x32", T.broadcast(qh, 8)), spread_bytes)
    bit = u8s(1) << T.Cast("uint8x32", T.ramp(0, 1, 32) % T.broadcast(8, 32))
    return nibbles | T.Select((spread & bit) == bit, u8s(16), u8s(0))


def block_dot(layout: LevelBytes, w, xq, dx, o, b):
    """A block's 8 lane sums of weight levels times activations, scaled by both scales: float32x8."""
    base = b * layout.bytes
    weights, x = levels(layout, w, o, base), xq[T.ramp(b * ACTIVATION_BLOCK, 1, ACTIVATION_BLOCK)]
    if layout.levels == "signed":
        magnitudes = T.reinterpret("uint8x32", intrinsic("int8x32", "psign.b", weights, weights))
        pairs = intrinsic("int16x16", "pmadd.ub.sw", magnitudes, intrinsic("int8x32", "psign.b", x, weights))
    else:
        pairs = intrinsic("int16x16", "pmadd.ub.sw", weights, x)
    quads = intrinsic("int32x8", "pmadd.wd", pairs, T.broadcast(T.int16(1), 16))
    return T.Cast("float32x8", quads) * T.broadcast(half(w, o, base + layout.d_at) * dx[b], 8)


def block_offset(layout: LevelBytes, w, sx, o, b):
    """What a block's offset (or its levels' zero) adds: times the activation block's sum."""
    base = b * layout.bytes
    if layout.m_at is not None:
        return half(w, o, base + layout.m_at) * sx[b]
    return T.float32(-layout.zero) * half(w, o, base + layout.d_at) * sx[b]


def row_total(sums, offsets, o):
    total = offsets[o]
    for lane in range(8):
        total = total + sums[o * 8 + lane]
    return total


def gemv(block_type_name: str, rows: int, cols: int, row_bytes: int) -> tirx.PrimFunc:
    """y[0, 0, o] = Σ_k x[0, 0, k] W[o, k] for one activation row x [1, 1, cols], quantized here,
    and W's blocks as [rows, row_bytes] bytes."""
    layout = LEVEL_BYTES[block_type_name]
    blocks = cols // ACTIVATION_BLOCK

    @T.prim_func(private=True, check_well_formed=False)
    def kernel(
        x: T.Buffer((1, 1, cols), "float32"),
        w: T.Buffer((rows, row_bytes), "uint8"),
        y: T.Buffer((1, 1, rows), "float32"),
    ):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        with T.sblock("root"):
            xq = T.alloc_buffer((cols,), "int8")
            dx = T.alloc_buffer((blocks,), "float32")
            sx = T.alloc_buffer((blocks,), "float32")
            largest = T.alloc_buffer((blocks,), "float32")
            lanes = T.alloc_buffer((8,), "float32")
            counts = T.alloc_buffer((8,), "int32")
            sums = T.alloc_buffer((rows * 8,), "float32")
            offsets = T.alloc_buffer((rows,), "float32")
            for b in range(blocks):
                lanes[T.ramp(0, 1, 8)] = to_eight(T.fabs(activation_block(x, b)), T.max)
                largest[b] = eight_lanes(lanes, T.max)
                dx[b] = largest[b] / T.float32(127)
                xq[T.ramp(b * ACTIVATION_BLOCK, 1, ACTIVATION_BLOCK)] = quantized(x, largest, b)
                counts[T.ramp(0, 1, 8)] = to_eight(T.Cast("int32x32", quantized(x, largest, b)), lambda a, c: a + c)
                sx[b] = T.Cast("float32", eight_lanes(counts, lambda a, c: a + c)) * dx[b]
            for o in T.parallel(rows):
                sums[T.ramp(o * 8, 1, 8)] = T.broadcast(T.float32(0), 8)
                offsets[o] = T.float32(0)
                for b in range(blocks):
                    sums[T.ramp(o * 8, 1, 8)] = sums[T.ramp(o * 8, 1, 8)] + block_dot(layout, w, xq, dx, o, b)
                    offsets[o] = offsets[o] + block_offset(layout, w, sx, o, b)
                y[0, 0, o] = row_total(sums, offsets, o)

    return kernel
