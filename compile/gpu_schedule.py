"""Kiln's GPU schedule for the matrix-vector products dlight's GEMV rule declines.

dlight's GEMV needs the weight indices of a kernel to be affine in its loops; a GGUF block type's
are not (a weight's byte is at `col // 32 * 18 + 2 + col % 16`), and without this rule such a
decode matmul falls to dlight's Fallback: one thread per output running the whole dot product.
Here a workgroup of `THREADS` threads computes one output, each thread summing every
`THREADS`-th product, then the threads' sums are added in a cross-thread reduction.
"""

from __future__ import annotations

from tvm import tirx
from tvm.s_tir import dlight as dl
from tvm.target import Target

from .cpu_schedule import one_matmul

THREADS = 64


class SplitReductionGEMV(dl.ScheduleRule):
    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool):
        if (found := one_matmul(func)) is None:
            return None
        sch, names, matmul = found
        block = sch.get_sblock(matmul)
        *batch, out, reduce = sch.get_loops(block)
        if any(not isinstance(sch.get(loop).extent, tirx.IntImm) or sch.get(loop).extent.value != 1 for loop in batch):
            return None  # prefill: more than one input row
        for name in names[: names.index(matmul)]:  # the weights' producers: dequantize, gathered rows
            sch.compute_inline(sch.get_sblock(name))
        _, threads = sch.split(reduce, [None, THREADS])
        partial = sch.rfactor(threads, factor_axis=len(batch) + 1)
        output = sch.fuse(*sch.get_loops(partial)[: len(batch) + 1])
        _, steps, thread = sch.get_loops(partial)
        sch.reorder(thread, steps)
        sch.set_scope(partial, 0, "local")
        sch.bind(output, "blockIdx.x")
        sch.bind(thread, "threadIdx.x")
        sch.reverse_compute_at(block, output)
        sch.bind(sch.get_loops(block)[-1], "threadIdx.x")
        epilogue = names[names.index(matmul) + 1 :]  # a fused residual add
        for name in epilogue:
            sch.reverse_compute_at(sch.get_sblock(name), output)
        if epilogue:  # the output before the epilogue: one value per workgroup, which every thread holds
            sch.set_scope(block, 0, "local")
        return sch
