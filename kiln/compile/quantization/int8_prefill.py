"""Prefill matmuls on 8-bit activations (`gguf_i8`): x86-64 with AVX2 or AVX-512 VNNI, and wasm.

A prefill multiplies many activation rows by each weight. With float activations every weight is
unpacked into a tile of floats and meets each row in a multiply-add of 16 lanes at best, which bounds a
128-token prefill by the CPU's float arithmetic (issue 41: Qwen2.5-0.5B's Q4_K_M mix prefilled at
103 tokens/s on one Zen 4 thread, llama.cpp at 129). Here, as in int8_decode.py, the activations are
quantized per block of 32 (`d = max|x| / 127`, the same rounding) and each block's dot products are
taken on integers: one AVX-512 `vpdpbusd` makes 64 products.

A vector's 16 int32 lanes are 16 activation rows. `xa` keeps each row's bytes 4 at a time beside the
same 4 of the 15 rows after it, moved up by 128 to unsigned bytes; 4 levels of one weight (signed,
less their type's zero) are broadcast to the 16 lanes, so that one instruction adds 4 products to
each of 16 rows' sums. A register tile takes `weight_rows` weights by `row_vectors` vectors of rows.
Its integer sums run over one scale block (a weight block's 32 weights; Q6_K's sub-blocks of 16),
started from −128 × the block's levels' sum (what the activations' 128 adds); then they are
converted and scaled by the weights' scale times each row's `d` into the rows' float totals, block
after block in the same order on every instruction set (so the AVX2 and AVX-512 libraries give the
same bits). A block's float offset (Q4_1's and Q5_1's m, the K-quants' mins) adds m times the
row's sum of quantized activations times its `d`. Each parallel tile of `TILE_ROWS` weights is
unpacked once into signed bytes, then meets every activation row.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as T

from kiln.compile.quantization.int8_decode import (
    ACTIVATION_BLOCK,
    KERNEL_BLOCKS,
    UNPACKED_LANES,
    Avx2,
    Avx512Vnni,
    InstructionSet,
    KQuant4or5,
    KQuant6,
    Row,
    WasmSimd,
    added_halves,
    lanes_of,
    made_once,
    quantized,
    side_by_side,
    to_eight,
    u8s,
)

LANES = 16  # activation rows in a vector of int32 sums
TILE_ROWS = 16  # weights unpacked at a time, in one parallel iteration


@dataclass(frozen=True)
class RegisterTile:
    """`weight_rows` weights by `row_vectors` vectors of rows, their sums and totals in registers:
    AVX-512 has 32 of 16 lanes, AVX2 16 of 8 (a vector of rows is two), wasm 16 of 4."""

    weight_rows: int
    row_vectors: int

    @property
    def pairs(self) -> int:
        return self.weight_rows * self.row_vectors


REGISTER_TILES = {
    Avx512Vnni.name: RegisterTile(4, 2),
    Avx2.name: RegisterTile(1, 1),
    WasmSimd.name: RegisterTile(2, 1),
}


def stores_signed_levels(blocks) -> bool:
    """Whether the block type stores its levels as signed bytes (Q8_0)."""
    return getattr(blocks, "levels", None) == "signed"


def signed_activations(blocks, isa: InstructionSet) -> bool:
    """Whether the activations meet the levels signed: Q8_0's on AVX2, whose `vpmaddubsw` would
    saturate pairs of unsigned activations times its levels (up to 2 × 255 × 128); |w| then meets
    x with w's sign, as llama.cpp does."""
    return stores_signed_levels(blocks) and isa.name == Avx2.name


def quads(isa: InstructionSet, signed: bool, xa, w, sums):
    """`sums` plus, in each of 16 lanes, the 4 activations of that lane (64 bytes of `xa`, unsigned)
    times 4 levels `w` (4 signed bytes broadcast to 64)."""
    if isa.name == WasmSimd.name:
        return sums + wasm_quads(xa, w)
    if signed:
        return sums + isa.signed_dot(w, T.reinterpret("int8x64", xa ^ u8s(128, 64)))
    return isa.dot(xa, w, sums)


def wasm_quads(xa, w):
    """Wasm's `i32x4.dot_i16x8_s` sums pairs of 16-bit products; adjacent pairs are added into quads."""
    wide_xa, wide_w = T.Cast("int16x64", xa), T.Cast("int16x64", w)
    pairs = [
        T.call_llvm_pure_intrin("int32x4", "llvm.wasm.dot", lanes_of(wide_xa, 8 * i, 8), lanes_of(wide_w, 8 * i, 8))
        for i in range(8)
    ]
    halves = [(pairs[2 * i], pairs[2 * i + 1]) for i in range(4)]
    return side_by_side([T.Shuffle(list(h), [0, 2, 4, 6]) + T.Shuffle(list(h), [1, 3, 5, 7]) for h in halves])


def takes(rows: int) -> bool:
    """Whether `gemm` takes `rows` weights: whole tiles of them."""
    return rows % TILE_ROWS == 0


class TileRow(Row):
    """Row o of the weights, its unpacked scales kept at row `i` of its tile's buffer."""

    def __init__(self, w, o, unpacked, i):
        super().__init__(w, o, unpacked)
        self.i = i

    def unpacked(self, first, count: int):
        at = self.i * UNPACKED_LANES + first
        return self.unpacked_lanes[at] if count == 1 else self.unpacked_lanes[T.ramp(at, 1, count)]


def scale_block(blocks) -> int:
    """The weights one scale covers: a Q6_K sub-block's 16, else an activation block's 32."""
    return 16 if isinstance(blocks, KQuant6) else ACTIVATION_BLOCK


def signed_levels(blocks, isa: InstructionSet, w, o, base, j):
    """Activation block j of the stored block at `base` as 32 signed bytes: its levels less their zero."""
    if stores_signed_levels(blocks):
        return T.reinterpret("int8x32", w[o, T.ramp(base + blocks.qs_at, 1, 32)])
    zero = blocks.levels_zero(isa)
    return T.reinterpret("int8x32", blocks.levels_of(w, o, base, j, isa) - u8s(zero))


def started_sums(levels, h: int, subs: int, signed: bool):
    """Where sub-block h's sums start (of `subs` in 32 signed bytes): −128 × its levels' sum, which
    the activations' 128 adds (0 for activations that meet the levels signed)."""
    if signed:
        return T.int32(0)
    lanes = ACTIVATION_BLOCK // subs
    return added_halves(T.Cast(f"int32x{lanes}", lanes_of(levels, h * lanes, lanes)), lanes) * T.int32(-128)


def block_scale(blocks, row: Row, base, j, h: int):
    """The scale of sub-block h of activation block j's weights (Q6_K's lanes 4 to 7 are its second)."""
    return T.Shuffle([blocks.scales(row, base, j)], [4 * h])


def block_offset(blocks, row: Row, base, j):
    """Activation block j's float offset: m (Q4_1, Q5_1), −dmin × min (Q4_K, Q5_K)."""
    if isinstance(blocks, KQuant4or5):
        return row.unpacked(8 + j, 1)
    return row.f16(base + blocks.m_at)


def activation_block(x, r, b):
    return x[0, r, T.ramp(b * ACTIVATION_BLOCK, 1, ACTIVATION_BLOCK)]


def quantized_row_block(xq, r):
    """Row r's quantized block as `xq` holds it (moved up by 128), back as int8."""
    return T.reinterpret("int8x32", xq[T.ramp(r * ACTIVATION_BLOCK, 1, ACTIVATION_BLOCK)] ^ u8s(128))


def greatest(vector8):
    """The largest of 8 lanes."""
    for width in (4, 2, 1):
        vector8 = T.max(lanes_of(vector8, 0, width), lanes_of(vector8, width, width))
    return vector8


@made_once
def gemm(block_type_name: str, rows: int, cols: int, row_bytes: int, isa: InstructionSet) -> tirx.PrimFunc:
    """y[0, r, o] = Σ_k x[0, r, k] W[o, k] for activation rows x [1, n, cols], quantized here, and W's
    blocks as [rows, row_bytes] bytes."""
    blocks = KERNEL_BLOCKS[block_type_name]
    tile = REGISTER_TILES[isa.name]
    signed = signed_activations(blocks, isa)
    per_stored = blocks.elements // ACTIVATION_BLOCK
    activation_blocks, words = cols // ACTIVATION_BLOCK, cols // 4
    sub = scale_block(blocks)
    scale_blocks, subs = cols // sub, ACTIVATION_BLOCK // sub
    group, pairs = LANES * tile.row_vectors, tile.pairs
    has_offset = blocks.has_offset

    def padded(n):
        """The activation rows, padded to whole register tiles."""
        return (n + group - 1) // group * group

    def xa_at(r, word):
        """Where row r's 4 bytes of word `word` lie in `xa`."""
        return ((r // LANES * words + word) * LANES + r % LANES) * 4

    def lanes_at(r, b):
        """Where row r's entry for activation block b lies in `dx` and `sx`."""
        return (r // LANES * activation_blocks + b) * LANES + r % LANES

    def row_vector(g, p):
        return g * tile.row_vectors + p % tile.row_vectors

    def weight_row(q, p):
        return q * tile.weight_rows + p // tile.row_vectors

    def vector(buffer, p):
        return buffer[T.ramp(p * LANES, 1, LANES)]

    def four_levels(wq, q, p, k, c):
        """Levels 4c … 4c + 3 of scale block k of pair p's weight, broadcast to 64 bytes."""
        at = weight_row(q, p) * cols + k * sub + 4 * c
        return T.reinterpret("int8x64", T.broadcast(T.reinterpret("int32", wq[T.ramp(at, 1, 4)]), LANES))

    def activation_quads(xa, g, p, k, c):
        """Activations 4c … 4c + 3 of scale block k of pair p's 16 rows: 64 bytes."""
        return xa[T.ramp(xa_at(row_vector(g, p) * LANES, k * (sub // 4) + c), 1, 4 * LANES)]

    @T.prim_func(private=True, check_well_formed=False)
    def kernel(var_x: T.handle, w: T.Buffer((rows, row_bytes), "uint8"), var_y: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        n = T.int64()
        x = T.match_buffer(var_x, (1, n, cols), "float32")
        y = T.match_buffer(var_y, (1, n, rows), "float32")
        with T.sblock("root"):
            xa = T.alloc_buffer((padded(n) * cols,), "uint8")
            dx = T.alloc_buffer((padded(n) * activation_blocks,), "float32")
            sx = T.alloc_buffer((padded(n) * activation_blocks,), "float32")
            largest = T.alloc_buffer((padded(n),), "float32")
            xq = T.alloc_buffer((padded(n) * ACTIVATION_BLOCK,), "uint8")
            for r in T.parallel(padded(n)):
                for b in range(activation_blocks):
                    if r < n:
                        largest[r] = greatest(to_eight(T.fabs(activation_block(x, r, b)), T.max))
                        dx[lanes_at(r, b)] = largest[r] / T.float32(127)
                        xq[T.ramp(r * 32, 1, 32)] = T.reinterpret(
                            "uint8x32", quantized(activation_block(x, r, b), largest[r])
                        ) ^ u8s(128)
                        sx[lanes_at(r, b)] = (
                            T.Cast("float32", added_halves(T.Cast("int32x32", quantized_row_block(xq, r)), 32))
                            * dx[lanes_at(r, b)]
                        )
                        for c in T.unroll(8):
                            xa[T.ramp(xa_at(r, b * 8 + c), 1, 4)] = xq[T.ramp(r * 32 + 4 * c, 1, 4)]
                    else:
                        dx[lanes_at(r, b)] = T.float32(0)
                        sx[lanes_at(r, b)] = T.float32(0)
                        for c in T.unroll(8):
                            xa[T.ramp(xa_at(r, b * 8 + c), 1, 4)] = u8s(128, 4)
            for t in T.parallel(rows // TILE_ROWS):
                with T.sblock("tile"):
                    wq = T.alloc_buffer((TILE_ROWS * cols,), "int8")
                    start = T.alloc_buffer((TILE_ROWS * scale_blocks,), "int32")
                    dw = T.alloc_buffer((TILE_ROWS * scale_blocks,), "float32")
                    offsets = T.alloc_buffer((TILE_ROWS * activation_blocks,), "float32")
                    unpacked = T.alloc_buffer((TILE_ROWS * UNPACKED_LANES,), "float32")
                    sums = T.alloc_buffer((pairs * LANES,), "int32")
                    totals = T.alloc_buffer((pairs * LANES,), "float32")
                    for i in range(TILE_ROWS):
                        for s in range(cols // blocks.elements):
                            if blocks.unpacks:
                                unpacked[T.ramp(i * UNPACKED_LANES, 1, UNPACKED_LANES)] = blocks.unpack(
                                    TileRow(w, t * TILE_ROWS + i, unpacked, i), s * blocks.bytes
                                )
                            for j in T.unroll(per_stored):
                                wq[T.ramp(i * cols + (s * per_stored + j) * 32, 1, 32)] = signed_levels(
                                    blocks, isa, w, t * TILE_ROWS + i, s * blocks.bytes, j
                                )
                                start[i * scale_blocks + (s * per_stored + j) * subs] = started_sums(
                                    wq[T.ramp(i * cols + (s * per_stored + j) * 32, 1, 32)], 0, subs, signed
                                )
                                dw[i * scale_blocks + (s * per_stored + j) * subs] = block_scale(
                                    blocks, TileRow(w, t * TILE_ROWS + i, unpacked, i), s * blocks.bytes, j, 0
                                )
                                if subs == 2:
                                    start[i * scale_blocks + (s * per_stored + j) * subs + 1] = started_sums(
                                        wq[T.ramp(i * cols + (s * per_stored + j) * 32, 1, 32)], 1, subs, signed
                                    )
                                    dw[i * scale_blocks + (s * per_stored + j) * subs + 1] = block_scale(
                                        blocks, TileRow(w, t * TILE_ROWS + i, unpacked, i), s * blocks.bytes, j, 1
                                    )
                                if has_offset:
                                    offsets[i * activation_blocks + s * per_stored + j] = block_offset(
                                        blocks, TileRow(w, t * TILE_ROWS + i, unpacked, i), s * blocks.bytes, j
                                    )
                    for g in range(padded(n) // group):
                        for q in range(TILE_ROWS // tile.weight_rows):
                            for p in T.unroll(pairs):
                                totals[T.ramp(p * LANES, 1, LANES)] = T.broadcast(T.float32(0), LANES)
                            for k in range(scale_blocks):
                                for p in T.unroll(pairs):
                                    sums[T.ramp(p * LANES, 1, LANES)] = T.broadcast(
                                        start[weight_row(q, p) * scale_blocks + k], LANES
                                    )
                                for c in T.unroll(sub // 4):
                                    for p in T.unroll(pairs):
                                        sums[T.ramp(p * LANES, 1, LANES)] = quads(
                                            isa,
                                            signed,
                                            activation_quads(xa, g, p, k, c),
                                            four_levels(wq, q, p, k, c),
                                            vector(sums, p),
                                        )
                                for p in T.unroll(pairs):
                                    totals[T.ramp(p * LANES, 1, LANES)] = vector(totals, p) + T.Cast(
                                        "float32x16", vector(sums, p)
                                    ) * (
                                        dx[T.ramp(lanes_at(row_vector(g, p) * LANES, k // subs), 1, LANES)]
                                        * T.broadcast(dw[weight_row(q, p) * scale_blocks + k], LANES)
                                    )
                                    if has_offset:
                                        totals[T.ramp(p * LANES, 1, LANES)] = vector(totals, p) + sx[
                                            T.ramp(lanes_at(row_vector(g, p) * LANES, k), 1, LANES)
                                        ] * T.broadcast(offsets[weight_row(q, p) * activation_blocks + k], LANES)
                            for p in T.unroll(pairs):
                                for lane in range(LANES):
                                    if row_vector(g, p) * LANES + lane < n:
                                        y[0, row_vector(g, p) * LANES + lane, t * TILE_ROWS + weight_row(q, p)] = (
                                            totals[p * LANES + lane]
                                        )

    return kernel
