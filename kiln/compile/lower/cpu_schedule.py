"""Kiln's CPU schedule for its matmul kernels.

Every linear layer is `y[m, o] = sum_k x[m, k] * W[o, k]`, with W possibly dequantized on the
fly; the reduction over k is vectorized by splitting it into `VECTOR_LANES` partial sums (rfactor).
- decode (one input row): weight rows in parallel, each read from memory exactly once; a
  quantized float32 weight's decode is written with its scales factored out
  (quantization/factored_decode.py) and scheduled by `FactoredDecodeGEMV`, which asks for a row's
  weights ahead of the loop that reads them (cpu_prefetch.py);
- prefill (a symbolic number of rows): tiles of up to 12 weight rows in parallel, kept in L1
  while every input row streams past them; an input row's partial sums against the whole tile
  stay in registers, so each vector of inputs is loaded once per tile, not once per weight row
  (SmolLM2's 128-token prefill on 2 threads: 158 -> 310 tokens/s natively, 134 -> 152 in
  Chromium's wasm, against one weight row at a time). Packed weights are unpacked once per
  tile, into a buffer of their own, not once per input row. On x86-64 with AVX2 or AVX-512,
  float32 sums take register tiles instead: 6 input rows by 2 vectors of weight rows, the tile's
  weights unpacked transposed so a column of them is one vector load (Qwen2.5-0.5B's gate/up
  projection, 128 rows, one Zen 5 thread: 103 -> 133 GFLOP/s with AVX2, 259 with AVX-512).
dlight's CPU GEMV rule instead vectorizes the output axis around the whole reduction, which LLVM
scalarizes and unrolls into bodies of thousands of instructions (minutes to compile, slow to run).
"""

from __future__ import annotations

import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir import dlight as dl
from tvm.s_tir.dlight.analysis import get_root_block, normalize_prim_func
from tvm.s_tir.dlight.base import try_inline_contiguous_spatial
from tvm.target import Target, codegen

from kiln.compile.lower import cpu_prefetch
from kiln.models.stage_names import (
    ATTENTION_SCORES,
    ATTENTION_VALUES,
    DEQUANTIZE,
    GATHERED_ROW_SCALES,
    GATHERED_ROWS,
    GROUP_STAGES,
    LANE_DOTS,
    MASKED_SCORES,
    MATMUL,
)
from kiln.targets import llvm_triple

MATMUL_BLOCK_NAMES = (MATMUL,)
INLINED_PRODUCERS = (GATHERED_ROWS, GATHERED_ROW_SCALES)  # an embedding's gathered rows
VECTOR_LANES = 8
ACCUMULATORS = 2
OUTPUTS_PER_STEP = 2
# The reduction is split in steps of whole 32-weight groups when the width allows: the index of a
# weight's group (its scale, its block) is then a loop variable, not a division of a vector of
# lanes, and the weights of one step are one vector load (GGUF blocks, MLC groups).
ALIGNED_WEIGHTS = 32
# A prefill tile takes one vector of partial sums per weight row, beside the input's vector and a
# weight vector: 12 of them fill x86-64's 16 registers of 8 floats (AVX2). Wasm SIMD's registers
# hold 4 floats, so a browser's JIT has room for half as many: in Chromium 4-row tiles prefilled
# fastest (8 rows: 1% slower, 12: 7%).
MOST_WEIGHT_ROWS_PER_TILE = {"native": 12, "wasm": 4}
# A tile's float32 weights beyond this size, about an L1 cache and a half, are streamed from L2 for
# every input row; a wider tile meets the inputs a span of columns at a time, the input rows'
# partial sums kept in memory between spans (Qwen2.5 0.5B's down projection, 896 × 4864: tiles
# of 8 rows, 155 KB, prefilled at 47 GFLOP/s on one thread; in spans of 608 columns, 83).
TILE_BYTES = 48 << 10


# On x86-64 a prefill tile is `REGISTER_ROWS` input rows by `REGISTER_VECTORS` vectors of outputs:
# 12 vectors of sums, beside two of weights and a broadcast input, in AVX2's 16 registers (AVX-512
# has 32; 8 rows ran no faster). Qwen2.5-0.5B's gate/up projection, 128 rows, one Zen 5 thread:
# 103 GFLOP/s with the tiles above, 133 with these (AVX2), 259 (AVX-512).
REGISTER_ROWS = 6
REGISTER_VECTORS = 2
WEIGHTS_PER_WORD = 8  # MLC's 4-bit words; a GGUF block's bytes are read in runs of these too
# Products summed in registers before they join an output's total, as the other tiles' 8 lane
# sums do: one sum along the whole width was further from float64's (4864 columns, Qwen2.5-0.5B's
# down projection: 7.1e-7 of the largest output, 3.5e-7 in chunks of 128 at the same speed; 64
# columns: 1.8× the lane sums' mean error, the same in chunks of 8).
SUMMED_COLUMNS = 128
FEWEST_CHUNKS = 7


def register_lanes(target: Target) -> int | None:
    """The float32 lanes of an x86-64 target's vectors (AVX-512: 16, AVX2: 8); None where prefill
    keeps the tiles of `schedule_many_rows` (wasm, arm64, x86-64 without AVX2)."""
    if not llvm_triple(target).startswith("x86_64"):
        return None
    for features, lanes in ((["avx512f"], 16), (["avx2", "fma"], 8)):
        if codegen.llvm_cpu_has_features(features, target):
            return lanes
    return None


def register_tile(target: Target, out_features: int, dtype: str = "float32") -> tuple[int, int] | None:
    """A register tile's outputs as (vectors, lanes): `REGISTER_VECTORS` of the target's widest, or
    fewer or narrower ones for a width they divide; None where the target or the width takes the
    other tiles, and for sums in float16 (a register tile adds an output's products up in one
    chain, not in a vector of partial sums: Gemma 4's q4f16_1 logits moved 0.11 from float32's)."""
    if dtype != "float32" or (widest := register_lanes(target)) is None:
        return None
    shapes = [(vectors, lanes) for lanes in sorted({widest, 8}, reverse=True) for vectors in (REGISTER_VECTORS, 1)]
    return next((shape for shape in shapes if out_features % (shape[0] * shape[1]) == 0), None)


def summed_columns(width: int) -> int:
    """The columns whose products a register tile sums before adding them to its totals: the most
    whole vectors, up to `SUMMED_COLUMNS`, that divide the width into `FEWEST_CHUNKS` or more;
    else the width. (LLVM unrolls a loop of fewer chunks, keeps the totals in registers beside the
    sums, and the sums spill: MiniLM's 1536 × 384 in 6 chunks ran at 57 GFLOP/s on AVX2, in 8 at 131.)"""
    fitting = (n for n in range(SUMMED_COLUMNS, 0, -VECTOR_LANES) if width % n == 0 and width // n >= FEWEST_CHUNKS)
    return next(fitting, width)


def _weights_read(sch: s_tir.Schedule, block) -> int:
    """The index among a matmul block's reads of its weights: the matrix whose rows are its outputs."""
    stmt = sch.get(block)
    output = stmt.iter_vars[-2].var
    return next(i for i, read in enumerate(stmt.reads) if read.region[0].min.same_as(output))


def _static_extent(sch: s_tir.Schedule, loop: s_tir.LoopRV) -> int | None:
    extent = sch.get(loop).extent
    return extent.value if isinstance(extent, tirx.IntImm) else None


def reduction_span(tile_rows: int, width: int) -> int:
    """The columns of a prefill tile that meet every input row before the next ones do: all of
    them while the tile's weights fit `TILE_BYTES`; else the widest whole steps of
    `ALIGNED_WEIGHTS` that divide the width and fit half of it."""
    if tile_rows * width * 4 <= TILE_BYTES or width % ALIGNED_WEIGHTS:
        return width
    steps = width // ALIGNED_WEIGHTS
    return ALIGNED_WEIGHTS * max(
        d for d in range(1, steps + 1) if steps % d == 0 and tile_rows * d * ALIGNED_WEIGHTS * 4 <= TILE_BYTES // 2
    )


def weight_rows_per_tile(target: Target, width: int) -> int:
    """The most weight rows a prefill tile of `target` takes that divide `width` (no ragged last tile)."""
    kind = "wasm" if llvm_triple(target).startswith("wasm") else "native"
    return next(rows for rows in range(MOST_WEIGHT_ROWS_PER_TILE[kind], 0, -1) if width % rows == 0)


def block_names(sch: s_tir.Schedule) -> list[str]:
    return [sch.get(b).name_hint for b in sch.get_child_blocks(get_root_block(sch))]


def kernel_of_blocks(func: tirx.PrimFunc, names: list[str]) -> s_tir.Schedule | None:
    """A schedule of `func` where it is a kernel of these blocks, in this order, and no others."""
    if not isinstance(func, tirx.PrimFunc) or not isinstance(func.body, s_tir.SBlockRealize):
        return None
    sch = s_tir.Schedule(func)
    return sch if block_names(sch) == names else None


def one_matmul(func: tirx.PrimFunc) -> tuple[s_tir.Schedule, list[str], str] | None:
    """A schedule of a kernel with exactly one matmul block, its blocks' names and the matmul's."""
    if not isinstance(func, tirx.PrimFunc) or not isinstance(func.body, s_tir.SBlockRealize):
        return None
    sch = s_tir.Schedule(func)
    names = block_names(sch)
    matmuls = [n for n in names if n in MATMUL_BLOCK_NAMES]
    return (sch, names, matmuls[0]) if len(matmuls) == 1 else None


def _vectorize_elementwise(sch: s_tir.Schedule, name: str) -> None:
    """An injective epilogue (e.g. a fused residual add): rows in parallel, each row's elements in
    vectors when its width is static (a batch's rows have two symbolic extents, whose division per
    lane of a fused index LLVM scalarizes: MiniLM's GELU epilogue ran 3× slower), else all fused."""
    block = sch.get_sblock(name)
    *rows, width = sch.get_loops(block)
    extent = sch.get(width).extent
    if rows and isinstance(extent, tirx.IntImm) and extent.value % VECTOR_LANES == 0:
        _, inner = sch.split(width, [None, VECTOR_LANES])
        sch.parallel(sch.fuse(*rows))
    else:
        outer, inner = sch.split(sch.fuse(*rows, width), [None, VECTOR_LANES])
        sch.parallel(outer)
    sch.vectorize(inner)


class RowParallelMatmul(dl.ScheduleRule):
    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool):
        if (found := one_matmul(func)) is None:
            return None
        sch, names, matmul = found
        for name in names:
            if name in INLINED_PRODUCERS:
                sch.compute_inline(sch.get_sblock(name))
        block = sch.get_sblock(matmul)
        *batch, out, reduce = sch.get_loops(block)
        single_row = all(_static_extent(sch, loop) == 1 for loop in batch)
        if single_row:
            if DEQUANTIZE in names:
                sch.compute_inline(sch.get_sblock(DEQUANTIZE))
            rows = sch.fuse(*batch) if batch else None
            weights_at = self.schedule_single_row(sch, block, rows, out, reduce, lanes_axis=len(batch) + 1)
        elif tile := register_tile(target, sch.get(out).extent.value, sch.get(block).body.buffer.dtype):
            weights = (
                sch.get_sblock(DEQUANTIZE)
                if DEQUANTIZE in names
                else sch.cache_read(block, _weights_read(sch, block), "global")
            )
            weights_at = self.schedule_register_tiles(sch, block, *tile)
            self.unpack_transposed(sch, weights, weights_at)
        else:
            weights_at = self.schedule_many_rows(sch, target, block, sch.fuse(*batch), out, reduce)
            if DEQUANTIZE in names:
                self.unpack_once_per_span(sch, sch.get_sblock(DEQUANTIZE), weights_at)
        for name in GROUP_STAGES:  # a GGUF block type's scales and offsets: once per group of weights
            if name in names:
                sch.compute_at(sch.get_sblock(name), weights_at)
        if single_row:
            return sch
        epilogue = names[names.index(matmul) + 1 :]
        for name in epilogue[:-1]:  # a chain (bias, activation) computed in one pass over the output
            sch.compute_inline(sch.get_sblock(name))
        if epilogue:
            _vectorize_elementwise(sch, epilogue[-1])
        return sch

    @staticmethod
    def schedule_register_tiles(sch: s_tir.Schedule, block, vectors: int, lanes: int) -> s_tir.LoopRV:
        """Tiles of `vectors` × `lanes` weight rows in parallel; within one, `REGISTER_ROWS` input rows at a
        time meet its weights column by column, their sums in registers: per column a vector load
        of the tile's weights (unpacked transposed, `unpack_transposed`), one broadcast input per
        row, a multiply-add per row and vector. The sums of a chunk of columns (`summed_columns`)
        are added to the rows' totals, so no sum runs along the whole width. The input rows are padded
        to a multiple of `REGISTER_ROWS` (a tail would put a test in the inner loop, and the sums
        in memory). Returns the loop over tiles, where the weights are unpacked."""
        *batch, _, _ = sch.get_loops(block)
        unpadded = {sch.get(producer).name_hint for producer in sch.get_producers(block)}
        sch.pad_einsum(block, [1] * (len(batch) - 1) + [REGISTER_ROWS, 1, 1])
        padded_input = next(p for p in sch.get_producers(block) if sch.get(p).name_hint not in unpadded)
        padded_output = sch.get_consumers(block)[0]
        *batch, rows, out, reduce = sch.get_loops(block)
        tiles, outputs = sch.split(out, [None, vectors * lanes])
        row_steps, row = sch.split(rows, [None, REGISTER_ROWS])
        chunks, column = sch.split(reduce, [None, summed_columns(sch.get(reduce).extent.value)])
        sch.reorder(tiles, *batch, row_steps, chunks, column, row, outputs)
        chunk_sums = sch.rfactor(chunks, factor_axis=0)
        tiles, *_, row_steps, chunks, column, row, outputs = sch.get_loops(chunk_sums)
        sch.set_scope(chunk_sums, 0, "local")
        sch.reverse_compute_at(block, chunks)
        totals = sch.cache_write(block, 0, "local")
        sch.reverse_compute_at(totals, row_steps)
        sch.parallel(tiles)
        sch.reverse_compute_inline(padded_output)
        for rows_loop, outputs_loop in ((row, outputs), sch.get_loops(block)[-2:]):
            output_vectors, output_lanes = sch.split(outputs_loop, [vectors, lanes])
            sch.unroll(rows_loop)
            sch.unroll(output_vectors)
            sch.vectorize(output_lanes)
        sch.decompose_reduction(chunk_sums, column)
        sch.decompose_reduction(block, sch.get_loops(block)[-4])
        sch.vectorize(sch.get_loops(totals)[-1])
        _vectorize_elementwise(sch, sch.get(padded_input).name_hint)
        return tiles

    @staticmethod
    def unpack_transposed(sch: s_tir.Schedule, weights, tiles) -> None:
        """A tile's weights unpacked (or copied, when stored as floats) into a buffer of their own,
        column by column, so that a column's weights are one vector load; a packed word's
        `WEIGHTS_PER_WORD` weights unrolled together, so the word is read once per tile row."""
        sch.compute_at(weights, tiles)
        sch.transform_layout(weights, ("write", 0), lambda row, column: (column, row))
        rows, columns = sch.get_loops(weights)[-2:]
        if sch.get(columns).extent.value % WEIGHTS_PER_WORD == 0:
            words, column = sch.split(columns, [None, WEIGHTS_PER_WORD])
            sch.reorder(words, rows, column)
            sch.unroll(column)
        else:
            sch.reorder(columns, rows)
        sch.vectorize(rows)

    @staticmethod
    def schedule_single_row(sch: s_tir.Schedule, block, rows, out, reduce, lanes_axis: int) -> s_tir.LoopRV:
        """Decode: `OUTPUTS_PER_STEP` weight rows at a time in parallel, each dot product in
        `ACCUMULATORS` vectors of partial sums held in registers (one vector would make every
        multiply-add wait for the previous one); the lane sum and any epilogue (a fused residual
        add) run in the same parallel loop, so the kernel is one parallel region."""
        out_outer, out_inner = sch.split(out, [None, OUTPUTS_PER_STEP])
        if rows is not None:
            sch.reorder(out_outer, rows, out_inner)
        step = ACCUMULATORS * VECTOR_LANES
        if sch.get(reduce).extent.value % step:
            # Too narrow for whole vectors of partial sums (Gemma 4's 8-wide per-layer inputs in the
            # tests): rfactor would leave the lanes past the width unset. One plain sum per output.
            sch.parallel(out_outer)
            for name in block_names(sch):
                if name not in (sch.get(block).name_hint, *GROUP_STAGES):
                    sch.reverse_compute_at(sch.get_sblock(name), out_outer)
            return out_outer
        steps = ALIGNED_WEIGHTS // step if sch.get(reduce).extent.value % ALIGNED_WEIGHTS == 0 else 1
        *_, lanes = sch.split(reduce, [None, steps, step])
        partial = sch.rfactor(lanes, factor_axis=lanes_axis)
        *outer_loops, chunks, chunk_steps, partial_lanes = sch.get_loops(partial)
        outer, *unit_rows, inner = outer_loops
        accumulator, vector = sch.split(partial_lanes, [ACCUMULATORS, VECTOR_LANES])
        sch.reorder(outer, *unit_rows, chunks, chunk_steps, inner, accumulator, vector)
        sch.parallel(outer)
        sch.unroll(chunk_steps)
        sch.unroll(inner)
        sch.unroll(accumulator)
        sch.vectorize(vector)
        sch.reverse_compute_at(block, outer)
        for name in block_names(sch):
            if name not in (sch.get(block).name_hint, sch.get(partial).name_hint, *GROUP_STAGES):
                sch.reverse_compute_at(sch.get_sblock(name), outer)
        return outer

    @staticmethod
    def unpack_once_per_span(sch: s_tir.Schedule, dequantize, spans) -> None:
        """A tile's span of weights unpacked into a buffer before the input rows stream past them,
        a vector of them at a time (in steps of whole groups, as in decode)."""
        sch.compute_at(dequantize, spans)
        weights = sch.get_loops(dequantize)[-1]
        if sch.get(weights).extent.value % ALIGNED_WEIGHTS == 0:
            *_, vector = sch.split(weights, [None, ALIGNED_WEIGHTS // VECTOR_LANES, VECTOR_LANES])
            sch.vectorize(vector)

    @staticmethod
    def schedule_many_rows(sch: s_tir.Schedule, target: Target, block, rows, out, reduce) -> s_tir.LoopRV:
        """Each input row meets a span of the tile's columns at once (`reduction_span`: all of them
        for a tile that fits): per step of `VECTOR_LANES` inputs it is loaded once and multiplied
        into one vector of partial sums per weight row, all of them held in registers for the
        length of the span. Returns the loop over a tile's spans, where its weights are unpacked."""
        tile = weight_rows_per_tile(target, sch.get(out).extent.value)
        tiles, tile_rows = sch.split(out, [None, tile])
        width = sch.get(reduce).extent.value
        span = reduction_span(tile, width)
        spans, chunks, lanes = sch.split(reduce, [None, span // VECTOR_LANES, VECTOR_LANES])
        sch.reorder(tiles, spans, rows, chunks, tile_rows, lanes)
        partial = sch.rfactor(lanes, factor_axis=-1)
        tiles, spans, rows, chunks, tile_rows, lanes = sch.get_loops(partial)[-6:]
        if span == width:  # one span: the partial sums stay in registers
            sch.set_scope(partial, 0, "local")
            sch.reverse_compute_at(block, rows)
        else:  # kept in memory from one span to the next, the lanes summed once the tile is done
            sch.reverse_compute_at(block, tiles)
        sch.parallel(tiles)
        sch.unroll(tile_rows)
        sch.vectorize(lanes)
        sch.decompose_reduction(partial, spans)
        return spans


class FactoredDecodeGEMV(dl.ScheduleRule):
    """A decode matmul written with its scales factored out (quantization/factored_decode.py):
    weight rows in parallel, one at a time; per block of columns, the row's lane dots in one
    vector register (the steps unrolled), then scaled into the row's vector of partial sums. The
    input's lanes and their sums are computed once before the rows; scales and offsets are read
    where they are used, the groups of a K-quant's stored block in one unrolled body (so their bit
    positions are constants). One row at a time reads each thread's rows as one ascending stream,
    which the hardware prefetcher follows; two rows interleaved read two streams a row apart, which
    it did not follow (with GGUF scales read in place, a Q8_0 matrix streamed from memory 3× slower).
    SmolLM2 decode on 2 threads against two rows a step: GGUF 138 -> 164 tok/s, q4f32_1 153 -> 180."""

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool):
        if not isinstance(func, tirx.PrimFunc) or not isinstance(func.body, s_tir.SBlockRealize):
            return None
        sch = s_tir.Schedule(func)
        if LANE_DOTS not in (names := block_names(sch)):
            return None
        matmul = sch.get_sblock(MATMUL)
        rows_axis = sum(v.iter_type == tirx.IterVar.DataPar for v in sch.get(matmul).iter_vars) - 1
        partial = sch.rfactor(sch.get_loops(matmul)[-1], factor_axis=rows_axis)
        loops = sch.get_loops(partial)
        inputs, rows, (blocks, *unrolled_blocks), lanes = (
            loops[:rows_axis],
            loops[rows_axis],
            loops[rows_axis + 1 : -1],
            loops[-1],
        )
        # A block's weights meet every input row: the rows go inside the block, once the lane sums
        # (the other branch under them) are moved out.
        sch.reorder(rows, *inputs)
        sch.reverse_compute_at(matmul, rows)
        sch.reorder(blocks, *unrolled_blocks, *inputs)
        sch.parallel(rows)
        sch.vectorize(lanes)
        for loop in unrolled_blocks:  # a K-quant's groups of one stored block (factored_decode.LaneLayout)
            sch.unroll(loop)
        for loop in inputs:
            if _static_extent(sch, loop) != 1:
                sch.unroll(loop)
        dots = sch.get_sblock(LANE_DOTS)
        sch.compute_at(dots, (unrolled_blocks or [blocks])[-1])
        *_, lane, step = sch.get_loops(dots)
        input_rows = sch.get_loops(dots)[2 + len(unrolled_blocks) : -2]  # those under the block, not of extent 1
        sch.reorder(step, *input_rows, lane)  # each step's vector of weights unpacked once for every row
        sch.unroll(step)
        for loop in input_rows:
            sch.unroll(loop)
        sch.vectorize(lane)
        sch.decompose_reduction(dots, step)
        for name in names[names.index(MATMUL) + 1 :]:  # a fused residual add
            sch.reverse_compute_at(sch.get_sblock(name), rows)
        sch.decompose_reduction(partial, blocks)
        if not cpu_prefetch.prefetches(target):
            return sch
        return s_tir.Schedule(weights_asked_ahead(sch.mod["main"], sch.get(rows), sch.get(blocks)))


def weights_asked_ahead(func: tirx.PrimFunc, rows: tirx.For, blocks: tirx.For) -> tirx.PrimFunc:
    """`func` whose loop over a row's blocks first asks for the row's weights (every matrix of the
    GEMV's rows: packed weights, scales) `cpu_prefetch.AHEAD` bytes of packed weights ahead, one
    prefetch per cache line an iteration takes."""
    matrices = [b for b in func.params if len(b.shape) == 2 and int(b.shape[0]) == int(rows.extent)]
    if not matrices:
        return func
    widest = max(int(b.shape[1]) * b.dtype.bits // 8 for b in matrices)
    iterations = int(blocks.extent)
    ahead = -(-cpu_prefetch.AHEAD * iterations // widest)  # in iterations
    hints = []
    for matrix in matrices:
        per_iteration = int(matrix.shape[1]) // iterations  # elements
        line = cpu_prefetch.CACHE_LINE * 8 // matrix.dtype.bits
        for first in range(0, per_iteration, line):
            column = (blocks.loop_var + ahead) * per_iteration + first
            hints.append(tirx.Evaluate(cpu_prefetch.prefetch(matrix, rows.loop_var, column)))

    def asked_ahead(loop: tirx.For) -> tirx.For:
        if not loop.loop_var.same_as(blocks.loop_var):
            return loop
        return tirx.For(
            loop.loop_var,
            loop.min,
            loop.extent,
            loop.kind,
            tirx.SeqStmt([*hints, loop.body]),
            loop.thread_binding,
            loop.annotations,
        )

    return tvm_ffi.structural_map(func, (tirx.For, asked_ahead))


class RowNorm(dl.ScheduleRule):
    """A reduction over the last axis feeding an elementwise output of the same rows (rms_norm):
    rows in parallel, the reduction once per row, the output vectorized. dlight's CPU Reduction
    rule nests the whole reduction inside the output's element loop when the row count is static
    (decode), computing the sum of squares once per element instead of once per row."""

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool):
        if not isinstance(func, tirx.PrimFunc) or not isinstance(func.body, s_tir.SBlockRealize):
            return None
        sch = s_tir.Schedule(func)
        blocks = try_inline_contiguous_spatial(sch, normalize_prim_func(sch))
        if blocks is None or len(blocks) != 2 or not blocks[0].is_reduction() or not blocks[1].is_injective():
            return None
        reduction, output = blocks
        *row_loops, inner = sch.get_loops(output.block_rv)
        _, vector = sch.split(inner, [None, VECTOR_LANES])
        sch.vectorize(vector)
        if row_loops:  # a static single row has none left after normalization: the reduction runs once
            rows = sch.fuse(*row_loops)
            sch.parallel(rows)
            sch.compute_at(reduction.block_rv, rows)
        return sch


class PrefillElementwise(dl.ScheduleRule):
    """Elementwise work over a symbolic number of rows (a prefill's SwiGLU: the split's halves, SiLU
    and their product): the producers inlined (the halves were copied out row by row), rows in
    parallel, a row's elements in vectors. dlight left the kernel serial: Qwen2.5-0.5B's
    128-token prefill on 2 threads spent 16 ms of 380 in it, 4.4 now. A decode step's (static) kernels stay
    as they are: a row of a few thousand elements is not worth a parallel launch."""

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool):
        if not isinstance(func, tirx.PrimFunc) or not isinstance(func.body, s_tir.SBlockRealize):
            return None
        sch = s_tir.Schedule(func)
        blocks = try_inline_contiguous_spatial(sch, normalize_prim_func(sch))
        if blocks is None or len(blocks) != 1 or not blocks[0].is_injective():
            return None
        if all(_static_extent(sch, loop) is not None for loop in sch.get_loops(blocks[0].block_rv)):
            return None
        _vectorize_elementwise(sch, sch.get(blocks[0].block_rv).name_hint)
        return sch


class EncoderAttentionScores(dl.ScheduleRule):
    """The query × key products of an encoder's attention and their mask (kiln/models/embedding.py
    masked_scores): (input, head, query) rows in parallel; a score's sum over the head's elements in
    VECTOR_LANES partial sums, one vector product a step, added up and masked straight after. dlight's
    Reduction rule summed each score one element at a time into memory: MiniLM's scores for 10 inputs
    of 56 tokens took 1.4-1.7 ms a layer on 2 threads, 0.53 ms so."""

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool):
        sch = kernel_of_blocks(func, [ATTENTION_SCORES, MASKED_SCORES])
        if sch is None:
            return None
        scores = sch.get_sblock(ATTENTION_SCORES)
        batch, head, query, _, element = sch.get_loops(scores)
        sch.parallel(sch.fuse(batch, head, query))
        _, lanes = sch.split(element, [None, VECTOR_LANES])
        partial = sch.rfactor(lanes, 0)
        _, key, steps, lane = sch.get_loops(partial)
        sch.vectorize(lane)
        init = sch.decompose_reduction(partial, steps)
        sch.vectorize(sch.get_loops(init)[-1])
        sch.reverse_compute_at(scores, key)
        sch.reverse_compute_at(sch.get_sblock(MASKED_SCORES), key)
        return sch


# TOPI's softmax, as Relax legalizes it
SOFTMAX_BLOCKS = ["T_softmax_maxelem", "T_softmax_exp", "T_softmax_expsum", "T_softmax_norm"]


class RowSoftmax(dl.ScheduleRule):
    """A softmax over the last axis of a symbolic number of rows (an encoder's attention
    probabilities): rows in parallel, a row's four passes one after another in plain loops, which
    LLVM vectorizes itself. Split into vectors, a loop of the symbolic row length keeps a predicate
    that makes TVM scalarize the lanes, as dlight's Reduction rule left the exponentials: MiniLM's
    softmax for 10 inputs of 56 tokens took 1.0 ms a layer on 2 threads, 0.43 ms so. The maximum and
    the sum still run in order: the same bits as before."""

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool):
        sch = kernel_of_blocks(func, SOFTMAX_BLOCKS)
        if sch is None:
            return None
        maxelem, exp, expsum, norm = (sch.get_sblock(name) for name in SOFTMAX_BLOCKS)
        *rows, _ = sch.get_loops(norm)
        if all(_static_extent(sch, loop) is not None for loop in rows):
            return None
        row = sch.fuse(*rows)
        sch.parallel(row)
        for block in (expsum, exp, maxelem):
            sch.compute_at(block, row)
        return sch


class EncoderAttentionValues(dl.ScheduleRule):
    """The probabilities × values product of an encoder's attention (kiln/models/embedding.py):
    (input, query, head) rows in parallel, a row's head elements accumulated one key at a time, an
    inner loop over contiguous elements that LLVM vectorizes (dlight's rules leave the kernel serial)."""

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool):
        sch = kernel_of_blocks(func, [ATTENTION_VALUES])
        if sch is None:
            return None
        block = sch.get_sblock(ATTENTION_VALUES)
        batch, query, head, element, key = sch.get_loops(block)
        rows = sch.fuse(batch, query, head)
        sch.reorder(rows, key, element)
        sch.parallel(rows)
        init = sch.decompose_reduction(block, key)
        sch.vectorize(sch.get_loops(init)[-1])
        return sch
