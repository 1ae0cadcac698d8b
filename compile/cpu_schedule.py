"""Kiln's CPU schedule for its matmul kernels (decode GEMV and prefill alike).

Every linear layer is `y[m, o] = sum_k x[m, k] * W[o, k]`, with W possibly dequantized on the
fly. The schedule walks weight rows in parallel and, for each row, runs the dot products of all
input rows against it with the reduction over k vectorized (rfactor into `VECTOR_LANES` partial
sums). A weight row is read from memory once per call and stays in L1 while the input rows
stream past, which is what a memory-bound decode step needs. dlight's CPU GEMV rule instead
vectorizes the output axis around the whole reduction, which LLVM scalarizes and unrolls into
bodies of thousands of instructions (minutes to compile, slow to run).
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir import dlight as dl
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.target import Target

MATMUL_BLOCK_NAMES = ("matmul",)
INLINED_PRODUCERS = ("dequantize", "rows", "row_scales")
VECTOR_LANES = 8


def _block_names(sch: s_tir.Schedule) -> list[str]:
    return [sch.get(b).name_hint for b in sch.get_child_blocks(get_root_block(sch))]


def _vectorize_elementwise(sch: s_tir.Schedule, name: str) -> None:
    """An injective epilogue (e.g. a fused residual add): parallel outer, vector inner."""
    block = sch.get_sblock(name)
    fused = sch.fuse(*sch.get_loops(block))
    outer, inner = sch.split(fused, [None, VECTOR_LANES])
    sch.parallel(outer)
    sch.vectorize(inner)


class RowParallelMatmul(dl.ScheduleRule):
    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool):
        if not isinstance(func, tirx.PrimFunc) or not isinstance(func.body, s_tir.SBlockRealize):
            return None
        sch = s_tir.Schedule(func)
        names = _block_names(sch)
        matmuls = [n for n in names if n in MATMUL_BLOCK_NAMES]
        if len(matmuls) != 1:
            return None
        for name in names:
            if name in INLINED_PRODUCERS:
                sch.compute_inline(sch.get_sblock(name))
        block = sch.get_sblock(matmuls[0])
        *batch, out, reduce = sch.get_loops(block)
        rows = sch.fuse(*batch) if batch else None
        if rows is not None:
            sch.reorder(out, rows)
        sch.parallel(out)
        _, lanes = sch.split(reduce, [None, VECTOR_LANES])
        partial = sch.rfactor(lanes, factor_axis=0)
        sch.vectorize(sch.get_loops(partial)[-1])
        for name in _block_names(sch):
            if name not in (matmuls[0], sch.get(partial).name_hint):
                _vectorize_elementwise(sch, name)
        return sch
