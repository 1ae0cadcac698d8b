"""Kiln's GPU schedules for decode matrix-vector products (one input row).

Two WebGPU libraries are built from a model (targets `webgpu` and `webgpu-subgroups`); they differ
in how a decode GEMV adds up a row:

- `webgpu`: `RowPerThreadGEMV(rows=64)`, each thread sums a whole row, reading one packed 4-bit
  word (8 weights) at a time; a workgroup computes 64 rows. No workgroup memory and no barrier,
  which is what adapters that run workgroups on the CPU pay for: on SwiftShader SmolLM2's decode
  GEMVs take 290 ms a step this way, against 580 ms when four lanes share a row and add their
  sums through workgroup memory (TVM's reduction, four barriers), 540 ms with one barrier, and
  several seconds with dlight's GEMV (a 64-thread workgroup per output, seven barriers).
  Neighbouring threads read rows apart, which a hardware GPU coalesces worse than neighbouring
  words; this library is the one for adapters without subgroups (and WebLLM's `model_lib`).
- `webgpu-subgroups`: `SubgroupGEMV(rows=16)`, four lanes share a row, reading neighbouring
  words, and add their sums with subgroup shuffles: contiguous reads and still no barrier (the
  same 290 ms on SwiftShader). The browser engine prefers it where the adapter has `subgroups`.

Both decline rows longer than 1536 weights (larger models than SmolLM2, where they were measured):
one or four threads would read such a row in long serial runs, on too few threads to keep a
hardware GPU's memory busy, so those keep dlight's GEMV, the one WebLLM ships.

- `WebGPUMatmul` (prefill) is dlight's tiled matmul with 32-deep k tiles (dlight's WebGPU
  default is 8): a quarter of the steps, each loading tiles into workgroup memory between two
  barriers. On SwiftShader SmolLM2's 16-token prefill spends 7.6–8.0 s in matmuls instead of
  13.2–14.7 s; 16-deep tiles measured no faster than 8-deep ones, so the step count alone does
  not explain it. The tiles take 8 KB of the 32 KB of workgroup memory Kiln allows.
- `ShortPrefillMatmul` runs prompts of up to 64 tokens (a chat turn) without tiles: a thread
  computes one output for 4 tokens at once, like the decode GEMV, with no barrier. SmolLM2's
  20-token prefill on SwiftShader (Node/Dawn) spent 22.0 s in matmuls with the tiles and 8.0–8.5 s
  this way (8 tokens a thread: 11.2 s, 2: 8.6 s), the whole prefill 29.5 s → 14.3 s. Longer
  prompts keep the tiled kernel, which reads each weight once per 32 tokens.
A decode GEMV merged with the RMSNorm before it (`decode_fusion`) adds up the squares of its
input in the loop of its dot product, each thread (or the lanes of a row) for itself, and scales
its output by 1/rms: `scaled_by_norm`.

- `SplitReductionGEMV()` (64 lanes, one output per workgroup, TVM's cross-thread reduction) is the
  fallback for the kernels dlight's GEMV declines: its analysis needs the weight indices to be
  affine in the loops, and a GGUF block type's are not (a weight's byte is at
  `col // 32 * 18 + 2 + col % 16`).
"""

from __future__ import annotations

import math

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir import dlight as dl
from tvm.target import Target

from kiln.compile.lower.cpu_schedule import block_names, kernel_of_blocks, one_matmul
from kiln.models.stage_names import ATTENTION_SCORES, MASKED_SCORES


def decode_matmul(func: tirx.PrimFunc, rows: int, run: int, max_row: int | None):
    """(schedule, block names, the matmul's name, its loops (batch…, out, reduce), the matmul rows
    per output) when `func` is a one-row matmul whose outputs split into `rows` and whose rows
    split into `run`s, at most `max_row` long; else None. The weights' producers (dequantize,
    gathered rows) are inlined. A kernel whose epilogue pairs rows (SwiGLU's silu(gate[i]) · up[i],
    gate and up one matmul) has fewer outputs than matmul rows; see `rows_by_output`."""
    if (found := one_matmul(func)) is None:
        return None
    sch, names, matmul = found
    *batch, out, reduce = loops = sch.get_loops(sch.get_sblock(matmul))
    if any(not isinstance(sch.get(loop).extent, tirx.IntImm) or sch.get(loop).extent.value != 1 for loop in batch):
        return None  # prefill: more than one input row
    matmul_rows, in_features = sch.get(out).extent, sch.get(reduce).extent
    outputs = math.prod(func.params[-1].shape)  # call_tir passes the output last
    if not all(isinstance(n, tirx.IntImm) for n in (matmul_rows, outputs, in_features)):
        return None
    if outputs.value % rows or matmul_rows.value % outputs.value or in_features.value % run:
        return None
    if max_row is not None and in_features.value > max_row:
        return None
    for name in names[: names.index(matmul)]:
        if name not in NORM_STAGES:
            sch.compute_inline(sch.get_sblock(name))
    return sch, names, matmul, loops, matmul_rows.value // outputs.value


def rows_by_output(sch: s_tir.Schedule, names: list[str], matmul: str, rows_per_output: int) -> None:
    """For a kernel whose outputs each combine several matmul rows (`decode_matmul`): the matmul's
    rows laid out and iterated as (row of the output, output), so that an output's rows (`out[i]`,
    `out[i + width]`, …) are one region to compute where the output is; the epilogue's stages
    inlined into the block that writes the output."""
    block = sch.get_sblock(matmul)
    width = sch.get(sch.get_loops(block)[-2]).extent.value // rows_per_output
    by_output = tirx.IndexMap.from_func(
        lambda *i: (*i[:-2], i[-2] // width, i[-2] % width, i[-1]), ndim=len(sch.get(block).iter_vars)
    )
    by_output_rows = lambda *i: (*i[:-1], i[-1] // width, i[-1] % width)  # noqa: E731
    sch.transform_block_layout(block, by_output)
    stages = [block]
    if (copy := normed_output(names, matmul)) is not None:  # a copy of the matmul rows, laid out as they are
        stages.append(sch.get_sblock(copy))
        ndim = len(sch.get(stages[1]).iter_vars)
        sch.transform_block_layout(stages[1], tirx.IndexMap.from_func(by_output_rows, ndim=ndim))
    for stage in stages:  # each block's layout first: its accesses then simplify
        sch.transform_layout(stage, ("write", 0), by_output_rows)
    for name in names[names.index(matmul) + 1 : -1]:
        if name != copy:
            sch.compute_inline(sch.get_sblock(name))


def output_rows(sch: s_tir.Schedule, names: list[str], matmul: str, rows: int, *stages: s_tir.SBlockRV) -> tuple:
    """The outputs split into workgroups of `rows`, each computing `stages` (its matmul rows, in
    registers) before its output; returns the workgroup and row loops."""
    workgroup, row = sch.split(sch.fuse(*sch.get_loops(sch.get_sblock(names[-1]))), [None, rows])
    if (copy := normed_output(names, matmul)) is not None:
        stages = (sch.get_sblock(copy), *stages)
    for stage in stages:
        sch.compute_at(stage, row)
        sch.set_scope(stage, 0, "local")
    return workgroup, row


def epilogue_at(sch: s_tir.Schedule, names: list[str], matmul: str, row) -> s_tir.SBlockRV:
    """Compute the matmul's epilogue (e.g. a fused residual add) at `row`, every value before the
    output in registers; returns the block that writes the output."""
    stages = [matmul, *names[names.index(matmul) + 1 :]]
    for name in stages[1:]:
        sch.reverse_compute_at(sch.get_sblock(name), row)
    for name in stages[:-1]:
        sch.set_scope(sch.get_sblock(name), 0, "local")
    return sch.get_sblock(stages[-1])


# The blocks of TVM's RMSNorm that a GEMV merged with the norm before it keeps (decode_fusion): the
# sum of squares and 1/rms from it; the normalized input, x ∘ w without 1/rms, is inlined.
SUM_OF_SQUARES, NORM_SCALE, NORMED_INPUT = "T_multiply_red", "rsqrt", "T_rms_norm"
NORM_STAGES = (SUM_OF_SQUARES, NORM_SCALE)


def normed_output(names: list[str], matmul: str) -> str | None:
    """The block that copies a norm-merged GEMV's matmul rows (the one `scaled_by_norm` scales)."""
    return names[names.index(matmul) + 1] if NORM_SCALE in names else None


def scaled_by_norm(sch: s_tir.Schedule, names: list[str], matmul: str, run: int, lanes: int = 1) -> s_tir.Schedule:
    """For a GEMV merged with the RMSNorm before it, once its rows are laid out: the copy of the
    matmul rows scaled by 1/rms, which each row's thread (or `lanes` threads) computes from the
    sum of squares of the input, read `run` at a time, in registers, before the row's output.
    The caller merges the sum's loop over the runs (the second-to-last) with its dot product's."""
    copy = normed_output(names, matmul)
    scale = sch.get(sch.get_sblock(NORM_SCALE)).writes[0].source
    sch = s_tir.Schedule(with_output_scaled(sch.mod["main"], copy, scale))
    squares = sch.get_sblock(SUM_OF_SQUARES)
    stages = [sch.get_sblock(NORM_SCALE), squares]
    if lanes > 1:
        _, lane, _ = sch.split(sch.get_loops(squares)[-1], [None, lanes, run])
        stages.append(sch.rfactor(lane, factor_axis=0))
    row = sch.get_loops(sch.get_sblock(copy))[1]
    for stage in stages:
        sch.compute_at(stage, row)
        sch.set_scope(stage, 0, "local")
    if lanes == 1:
        sch.split(sch.get_loops(squares)[-1], [None, run])
    sch.unroll(sch.get_loops(stages[-1])[-1])
    sch.compute_inline(stages[0])
    if copy != names[-1]:  # scaled where the epilogue reads it, under the epilogue's lane guard
        sch.compute_inline(sch.get_sblock(copy))
    return sch


def with_output_scaled(func: tirx.PrimFunc, block_name: str, scale: tirx.Buffer) -> tirx.PrimFunc:
    """`func` with the block `block_name` storing its value times `scale` (indexed by the store's
    leading indices: one scale per row of the matmul's input)."""

    def scaled(block: s_tir.SBlock) -> s_tir.SBlock:
        if block.name_hint != block_name:
            return block
        indices = block.body.indices[: len(scale.shape)]
        read = tirx.BufferRegion(scale, [tvm.ir.Range.from_min_extent(i, 1) for i in indices])
        return storing(block, block.body.value * tirx.BufferLoad(scale, indices), [*block.reads, read])

    return tvm_ffi.structural_map(func, (s_tir.SBlock, scaled))


def storing(block: s_tir.SBlock, value: tvm.ir.PrimExpr, reads: list) -> s_tir.SBlock:
    """`block` (a single store) storing `value` where it stored before, reading `reads`."""
    store = tirx.BufferStore(block.body.buffer, value, block.body.indices)
    attrs = (block.init, block.alloc_buffers, block.match_buffers, block.annotations)
    return s_tir.SBlock(block.iter_vars, reads, block.writes, block.name_hint, store, *attrs)


class RowPerThreadGEMV(dl.ScheduleRule):
    """A workgroup computes `rows` outputs, a thread each, reading `lane_width` weights at a time."""

    def __init__(self, rows: int, lane_width: int, max_row: int | None = None):
        self.rows, self.lane_width, self.max_row = rows, lane_width, max_row

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool):
        if (found := decode_matmul(func, self.rows, self.lane_width, self.max_row)) is None:
            return None
        sch, names, matmul, (*batch, out, reduce), rows_per_output = found
        block = sch.get_sblock(matmul)
        if rows_per_output > 1:
            rows_by_output(sch, names, matmul, rows_per_output)
            workgroup, row = output_rows(sch, names, matmul, self.rows, block)
            *_, paired, reduce = sch.get_loops(block)
        else:
            workgroup, row = sch.split(sch.fuse(*batch, out), [None, self.rows])
        words, weights = sch.split(reduce, [None, self.lane_width])
        sch.unroll(weights)
        if rows_per_output > 1:
            sch.reorder(words, paired)  # the rows read each word's inputs together
            sch.unroll(paired)
        sch.bind(workgroup, "blockIdx.x")
        sch.bind(row, "threadIdx.x")
        if rows_per_output == 1 and sch.get(epilogue_at(sch, names, matmul, row)).same_as(sch.get(block)):
            sch.reverse_compute_at(sch.cache_write(block, 0, "local"), row)  # sum in a register
        if NORM_SCALE in names:
            sch = scaled_by_norm(sch, names, matmul, self.lane_width)
            squares = sch.get_loops(sch.get_sblock(SUM_OF_SQUARES))[-2]
            sch.merge(squares, sch.get_loops(sch.get_sblock(matmul))[2])  # one loop reads x for both
        return sch


class SplitReductionGEMV(dl.ScheduleRule):
    """A workgroup computes `rows` outputs, each with `lanes` threads. A thread reads `lane_width`
    consecutive weights at a time, every `lanes`-th such run of the row (at most `max_steps` runs),
    keeping its partial sum in a register; TVM's cross-thread reduction adds the lanes' sums (a
    tree of steps through workgroup memory, a barrier each)."""

    def __init__(self, lanes: int = 64, rows: int = 1, lane_width: int = 1, max_steps: int | None = None):
        self.lanes, self.rows, self.lane_width, self.max_steps = lanes, rows, lane_width, max_steps

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool):
        run = self.lanes * self.lane_width
        max_row = None if self.max_steps is None else self.max_steps * run
        if (found := decode_matmul(func, self.rows, run, max_row)) is None:
            return None
        sch, names, matmul, (*batch, out, reduce), rows_per_output = found
        if rows_per_output > 1:
            return self.paired_rows(sch, names, matmul, rows_per_output, target)
        block = sch.get_sblock(matmul)
        _, row = sch.split(sch.fuse(*batch, out), [None, self.rows])
        _, lane, run = sch.split(reduce, [None, self.lanes, self.lane_width])
        partial = sch.rfactor(lane, factor_axis=0)
        _, row, steps, lane, run = sch.get_loops(partial)
        sch.reorder(lane, steps)
        sch.unroll(run)
        sch.set_scope(partial, 0, "local")
        sch.reverse_compute_at(block, row)
        epilogue_at(sch, names, matmul, row)
        return self.lanes_bound(sch, names, matmul, target)

    def paired_rows(self, sch, names, matmul, rows_per_output, target) -> s_tir.Schedule:
        """The lanes sum each of an output's matmul rows, then add their sums up row after row."""
        block = sch.get_sblock(matmul)
        rows_by_output(sch, names, matmul, rows_per_output)
        _, lane, run = sch.split(sch.get_loops(block)[-1], [None, self.lanes, self.lane_width])
        partial = sch.rfactor(lane, factor_axis=0)
        output_rows(sch, names, matmul, self.rows, block, partial)
        lane, paired, steps, run = sch.get_loops(partial)[-4:]
        sch.reorder(steps, paired)  # the rows read each run of inputs together
        sch.unroll(paired)
        sch.unroll(run)
        lane, paired = sch.get_loops(block)[-2:]
        sch.reorder(paired, lane)
        sch.unroll(paired)
        return self.lanes_bound(sch, names, matmul, target)

    def lanes_bound(self, sch: s_tir.Schedule, names: list[str], matmul: str, target: Target) -> s_tir.Schedule:
        """The workgroups, rows and lanes bound to threads, once the loops are laid out: a GEMV
        merged with the RMSNorm before it first gets the sum of squares, which the lanes of a row
        split as they split its dot product, in the same loop (`scaled_by_norm`)."""
        if NORM_SCALE in names:
            sch = scaled_by_norm(sch, names, matmul, self.lane_width, self.lanes)
            squares = sch.get_loops(sch.get_sblock(f"{SUM_OF_SQUARES}_rf"))[-2]
            sch.merge(squares, sch.get_loops(sch.get_sblock(f"{matmul}_rf"))[3])
            sch.bind(sch.get_loops(sch.get_sblock(SUM_OF_SQUARES))[-1], "threadIdx.x")
        partial = sch.get_sblock(f"{matmul}_rf")
        workgroup, row, lane = sch.get_loops(partial)[:3]
        sch.bind(workgroup, "blockIdx.x")
        sch.bind(row, "threadIdx.y")
        sch.bind(lane, "threadIdx.x")
        sch.bind(sch.get_loops(sch.get_sblock(matmul))[-1], "threadIdx.x")
        return self.lane_sums_lowered(sch, target)

    def lane_sums_lowered(self, sch: s_tir.Schedule, target: Target) -> s_tir.Schedule:
        return sch  # TVM lowers the cross-thread reduction itself


# WebGPU guarantees at least this many invocations per subgroup (subgroupMinSize).
SUBGROUP_MIN_SIZE = 4


class SubgroupGEMV(SplitReductionGEMV):
    """The lanes add their sums with `subgroupShuffleDown`: no workgroup memory, no barrier.

    TVM's own subgroup lowering is not used: a target with `supports_subgroups` gives every kernel a
    warp of 32 and broadcasts the sum from an absolute lane, which is wrong wherever the subgroup has
    another size (SwiftShader's has 4), in the norms and attention as much as here. These kernels
    need no broadcast (lane 0 alone writes the row's output) and shift by at most lanes / 2, so
    they are right on every subgroup size WebGPU allows, given that a workgroup's invocations fill
    its subgroups in order (`local_invocation_index`), as they do on Dawn's backends. Only these
    kernels are compiled for a target with subgroups, which is what makes their WGSL
    `enable subgroups;`."""

    def __init__(self, rows: int, lane_width: int, max_steps: int | None = None, lanes: int = SUBGROUP_MIN_SIZE):
        if lanes > SUBGROUP_MIN_SIZE or lanes & (lanes - 1):
            raise ValueError(f"subgroup lanes must be a power of two up to {SUBGROUP_MIN_SIZE}, not {lanes}")
        super().__init__(lanes, rows, lane_width, max_steps)

    def lane_sums_lowered(self, sch, target):
        lowered = s_tir.transform.LowerCrossThreadReduction()(sch.mod)["main"]
        subgroups = Target({**target.export(), "supports_subgroups": True})
        return s_tir.Schedule(shuffled_lane_sums(lowered, self.lanes).with_attr("target", subgroups))


def shuffled_lane_sums(func: tirx.PrimFunc, lanes: int) -> tirx.PrimFunc:
    """`func` with each cross-lane sum (TVM's `tvm_thread_allreduce`) done by shifting the partial
    sums down the subgroup: halving shifts leave lane 0 of every `lanes` the total."""

    def shuffled(attr: tirx.AttrStmt) -> tirx.Stmt:
        call = attr.body.value if isinstance(attr.body, tirx.Evaluate) else None
        if attr.attr_key != "reduce_scope" or getattr(call, "op", None) != THREAD_ALLREDUCE:
            return attr
        value_count, value, _, total, _ = call.args  # one value, always reduced, over one thread axis
        assert int(value_count) == 1, "a GEMV sums one value"
        steps = [tirx.BufferStore(total.source, value, total.indices)]
        shift = lanes // 2
        while shift:
            below = tirx.call_intrin(total.ty, SHUFFLE_DOWN, total, tirx.const(shift, "uint32"))
            steps.append(tirx.BufferStore(total.source, total + below, total.indices))
            shift //= 2
        return tirx.SeqStmt(steps)

    return tvm_ffi.structural_map(func, (tirx.AttrStmt, shuffled))


THREAD_ALLREDUCE = tvm.ir.Op.get("tirx.tvm_thread_allreduce")
SHUFFLE_DOWN = "tirx.webgpu.subgroup_shuffle_down"


class WebGPUMatmul(dl.gpu.Matmul):
    def get_configs(self, target: Target) -> dl.gpu.Matmul.Config:
        return dl.gpu.Matmul.Config(micro_size_k=32)


class ShortPrefillMatmul(dl.ScheduleRule):
    """A prefill matmul as two kernels, of which a call launches one: up to `max_tokens` input rows,
    each thread computes one output for `tokens` rows at once (a weight is read and dequantized once
    for all of them, the sums stay in registers, no workgroup memory, no barrier); longer inputs run
    `long`'s tiled kernel. The host picks the kernel by the input's row count.
    """

    def __init__(self, long: dl.ScheduleRule, max_tokens: int, tokens: int, rows: int, lane_width: int):
        self.long, self.max_tokens, self.tokens, self.rows, self.lane_width = long, max_tokens, tokens, rows, lane_width

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool):
        if (found := self.short_kernel(func)) is None:
            return None
        short, token_count = found
        long = self.long.apply(func, target, tunable)
        if not isinstance(long, s_tir.Schedule):
            return None
        return s_tir.Schedule(either_kernel(token_count <= self.max_tokens, short.mod["main"], long.mod["main"]))

    def short_kernel(self, func: tirx.PrimFunc) -> tuple[s_tir.Schedule, tirx.PrimExpr] | None:
        """The schedule of the kernel for short inputs and the input's row count, or None when `func`
        is not a matmul of a symbolic number of rows with a row a whole number of `lane_width`s."""
        if (found := one_matmul(func)) is None:
            return None
        sch, names, matmul = found
        block = sch.get_sblock(matmul)
        *batch, tokens, out, reduce = sch.get_loops(block)
        extents = [sch.get(loop).extent for loop in (*batch, tokens, out, reduce)]
        if any(not isinstance(e, tirx.IntImm) or e.value != 1 for e in extents[: len(batch)]):
            return None
        token_count, in_features = extents[-3], extents[-1]
        if isinstance(token_count, tirx.IntImm) or not isinstance(in_features, tirx.IntImm):
            return None
        if in_features.value % self.lane_width:
            return None
        weights = weight_producer(sch, block)
        sch.pad_einsum(block, [1] * len(batch) + [self.tokens, 1, 1])  # registers of a known size
        padded = [name for name in block_names(sch) if name not in names]
        names = [name for name in block_names(sch) if name != padded[0]]
        sch = s_tir.Schedule(last_row_repeated(sch.mod["main"], padded[0]))
        block = sch.get_sblock(matmul)
        sch.compute_inline(sch.get_sblock(padded[0]))
        if names[-1] != padded[1]:
            sch.compute_inline(sch.get_sblock(padded[1]))  # the copy out of the padded output
            names.remove(padded[1])
        for name in names[: names.index(matmul)]:
            if name != weights:
                sch.compute_inline(sch.get_sblock(name))
        *batch, tokens, out, reduce = sch.get_loops(block)
        tiles, token = sch.split(tokens, [None, self.tokens])
        workgroup, row = sch.split(out, [None, self.rows])
        words, lane = sch.split(reduce, [None, self.lane_width])
        sch.reorder(tiles, workgroup, row, words, lane, token)
        sch.bind(sch.fuse(*batch, tiles), "blockIdx.y")
        sch.bind(workgroup, "blockIdx.x")
        sch.bind(row, "threadIdx.x")
        sch.unroll(lane)
        sch.unroll(token)
        if weights is not None:  # dequantized once for the tile's tokens
            sch.compute_at(sch.get_sblock(weights), lane)
            sch.set_scope(sch.get_sblock(weights), 0, "local")
        if sch.get(epilogue_at(sch, names, matmul, row)).same_as(sch.get(block)):
            sch.reverse_compute_at(sch.cache_write(block, 0, "local"), row)
        sch.decompose_reduction(block, words)
        return sch, token_count


def last_row_repeated(func: tirx.PrimFunc, padding: str) -> tirx.PrimFunc:
    """`func` with the block `padding` (pad_einsum's copy of the input, zero past its rows) reading
    the last row again instead: the padded rows' sums are never written, and loads without a branch
    keep SwiftShader's shader compiler small (with a branch per load, 64 a word, it outgrew 24 GB)."""

    def repeated(call: tvm.ir.Call) -> tvm.ir.Expr:
        if getattr(call.op, "name", None) != "prim.if_then_else":
            return call
        (rows, load, _) = call.args
        indices = [tirx.Min(i, rows.b - 1) if i.same_as(rows.a) else i for i in load.indices]
        return tirx.BufferLoad(load.source, indices)

    def in_padding(block: s_tir.SBlock) -> s_tir.SBlock:
        return tvm_ffi.structural_map(block, (tvm.ir.Call, repeated)) if block.name_hint == padding else block

    return tvm_ffi.structural_map(func, (s_tir.SBlock, in_padding))


def weight_producer(sch: s_tir.Schedule, matmul: s_tir.SBlockRV) -> str | None:
    """The name of the block that writes the matmul's weights (e.g. dequantizes them), if any."""
    weights = sch.get(matmul).reads[1].source
    for producer in sch.get_producers(matmul):
        if any(region.source.same_as(weights) for region in sch.get(producer).writes):
            return sch.get(producer).name_hint
    return None


def either_kernel(condition: tirx.PrimExpr, then: tirx.PrimFunc, otherwise: tirx.PrimFunc) -> tirx.PrimFunc:
    """One function launching the kernel of `then` or of `otherwise`, two schedules of one function.
    The condition is marked the same for every thread: TVM refuses barriers under other conditions."""
    roots = then.body.block, otherwise.body.block
    choice = tirx.IfThenElse(tirx.op.tvm_thread_invariant(condition), roots[0].body, roots[1].body)
    root = s_tir.SBlock([], [], [], "root", choice, alloc_buffers=[b for root in roots for b in root.alloc_buffers])
    return then.with_body(s_tir.SBlockRealize([], True, root))


MAX_DECODE_ROW = 1536
WEBGPU_DECODE_GEMV = RowPerThreadGEMV(rows=64, lane_width=8, max_row=MAX_DECODE_ROW)
WEBGPU_SUBGROUP_DECODE_GEMV = SubgroupGEMV(rows=16, lane_width=8, max_steps=MAX_DECODE_ROW // (SUBGROUP_MIN_SIZE * 8))
WEBGPU_PREFILL_MATMUL = ShortPrefillMatmul(WebGPUMatmul(), max_tokens=64, tokens=4, rows=64, lane_width=8)


class ThreadPerScore(dl.ScheduleRule):
    """An encoder's attention scores (kiln/models/embedding.py): a thread per score, its head_dim-long dot
    product summed in a register, masked in place; workgroups of `keys` keys, over (input · head) and
    (query, key tile), so that no index is split out of one fused over symbolic extents. dlight's
    reduction rules gave each score a workgroup of 64 threads for a sum of 32 products (minutes for a
    batch on SwiftShader), and its fallback a shader whose index arithmetic SwiftShader took three
    minutes to compile."""

    def __init__(self, keys: int = 64):
        self.keys = keys

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool):
        sch = kernel_of_blocks(func, [ATTENTION_SCORES, MASKED_SCORES])
        if sch is None:
            return None
        scores = sch.get_sblock(ATTENTION_SCORES)
        batch, head, query, key, element = sch.get_loops(scores)
        key_tile, key = sch.split(key, [None, self.keys])
        sch.bind(sch.fuse(batch, head), "blockIdx.y")
        sch.bind(sch.fuse(query, key_tile), "blockIdx.x")
        sch.bind(key, "threadIdx.x")
        sch.reverse_compute_at(sch.get_sblock(MASKED_SCORES), key)
        sch.set_scope(scores, 0, "local")
        sch.decompose_reduction(scores, element)
        return sch
