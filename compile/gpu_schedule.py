"""Kiln's GPU schedules for decode matrix-vector products (one input row).

`SplitReductionGEMV(lanes, rows, lane_width, max_steps)`: a workgroup computes `rows` outputs,
each with `lanes` threads. A thread reads `lane_width` consecutive weights at a time (8: one
packed 4-bit word), every `lanes`-th such run of the row (at most `max_steps` runs, else the rule
declines), and the lanes' sums are added in a cross-thread reduction.

- `WEBGPU_DECODE_GEMV` (16 rows × 4 lanes, one packed word at a time) replaces dlight's GEMV on
  WebGPU. dlight gives each output its own 64-thread workgroup and adds the 64 sums in seven
  barrier-separated steps; adapters that run workgroups on the CPU (SwiftShader) pay dearly for
  every barrier-separated phase and every workgroup. On SwiftShader a 1536×576 q4f32_1 product
  takes 11 ms this way, 99 ms with dlight's. Four lanes reading neighbouring words keep the
  weight reads of a row contiguous for hardware GPUs. Rows longer than 1536 weights (larger
  models than SmolLM2, where the layout was measured) keep dlight's GEMV: four lanes would read
  them in long serial runs on too few threads to keep a hardware GPU's memory busy, and dlight's
  is the one WebLLM ships. (Giving them 8 lanes instead made SmolLM2's 1536-wide down projection
  1.5x slower on SwiftShader: twice the workgroups.)
- `WebGPUMatmul` (prefill) is dlight's tiled matmul with 32-deep k tiles (dlight's WebGPU
  default is 8): a quarter of the steps, each loading tiles into workgroup memory between two
  barriers. On SwiftShader SmolLM2's 16-token prefill spends 7.6–8.0 s in matmuls instead of
  13.2–14.7 s; 16-deep tiles measured no faster than 8-deep ones, so the step count alone does
  not explain it. The tiles take 8 KB of the 32 KB of workgroup memory Kiln allows.
- `SplitReductionGEMV()` (64 lanes, one output per workgroup) is the fallback for the kernels
  dlight's GEMV declines: its analysis needs the weight indices to be affine in the loops, and a
  GGUF block type's are not (a weight's byte is at `col // 32 * 18 + 2 + col % 16`).
"""

from __future__ import annotations

from tvm import tirx
from tvm.s_tir import dlight as dl
from tvm.target import Target

from .cpu_schedule import one_matmul


class SplitReductionGEMV(dl.ScheduleRule):
    def __init__(self, lanes: int = 64, rows: int = 1, lane_width: int = 1, max_steps: int | None = None):
        self.lanes, self.rows, self.lane_width, self.max_steps = lanes, rows, lane_width, max_steps

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool):
        if (found := one_matmul(func)) is None:
            return None
        sch, names, matmul = found
        block = sch.get_sblock(matmul)
        *batch, out, reduce = sch.get_loops(block)
        if any(not isinstance(sch.get(loop).extent, tirx.IntImm) or sch.get(loop).extent.value != 1 for loop in batch):
            return None  # prefill: more than one input row
        out_features, in_features = sch.get(out).extent, sch.get(reduce).extent
        if not isinstance(out_features, tirx.IntImm) or out_features.value % self.rows:
            return None
        if not isinstance(in_features, tirx.IntImm) or in_features.value % (self.lanes * self.lane_width):
            return None
        if self.max_steps is not None and in_features.value > self.max_steps * self.lanes * self.lane_width:
            return None
        for name in names[: names.index(matmul)]:  # the weights' producers: dequantize, gathered rows
            sch.compute_inline(sch.get_sblock(name))
        _, row = sch.split(sch.fuse(*batch, out), [None, self.rows])
        _, lane, run = sch.split(reduce, [None, self.lanes, self.lane_width])
        partial = sch.rfactor(lane, factor_axis=0)
        workgroup, row, steps, lane, run = sch.get_loops(partial)
        sch.reorder(lane, steps)
        sch.unroll(run)
        sch.set_scope(partial, 0, "local")
        sch.bind(workgroup, "blockIdx.x")
        sch.bind(row, "threadIdx.y")
        sch.bind(lane, "threadIdx.x")
        sch.reverse_compute_at(block, row)
        sch.bind(sch.get_loops(block)[-1], "threadIdx.x")
        epilogue = names[names.index(matmul) + 1 :]  # e.g. a fused residual add
        for name in epilogue:
            sch.reverse_compute_at(sch.get_sblock(name), row)
        for name in [matmul, *epilogue][:-1]:  # values before the last stage: one per row, held by each lane
            sch.set_scope(sch.get_sblock(name), 0, "local")
        return sch


class WebGPUMatmul(dl.gpu.Matmul):
    def get_configs(self, target: Target) -> dl.gpu.Matmul.Config:
        return dl.gpu.Matmul.Config(micro_size_k=32)


WEBGPU_DECODE_GEMV = SplitReductionGEMV(lanes=4, rows=16, lane_width=8, max_steps=48)
