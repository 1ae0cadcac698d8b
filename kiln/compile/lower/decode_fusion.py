"""Kernels merged into the decode GEMVs next to them (the WebGPU libraries).

- Epilogues: TVM's operator fusion gives a SwiGLU MLP's silu(gate) · up a kernel of its own after
  the fused gate/up GEMV: it reads the GEMV's output at two places (gate[i] and up[i] =
  out[i + width]), which FuseOps does not fuse into a reduction. Computed in the GEMV instead, by
  a thread that sums both rows of its output, it costs no extra work.
- RMSNorms: norm(x) · W = (x ∘ w) · W / rms(x), so a GEMV can take the norm's input and weight and
  scale each output by 1/rms(x) at the end; each thread adds up the squares of x in the loop that
  reads x for its dot product (`gpu_schedule.scaled_by_norm`). That is a reduction no other thread
  needs to wait for, so the norm costs no kernel, no workgroup memory and no barrier.
Together they save three dispatches per layer of a Llama-style model. A merge is kept only where
one of the decode GEMV rules schedules the merged kernel; everywhere else the kernels stay.
"""

from __future__ import annotations

import collections
import math

import tvm
import tvm_ffi
from tvm import relax, s_tir, tirx
from tvm.s_tir import dlight as dl
from tvm.target import Target

from kiln.compile.lower.cpu_schedule import MATMUL_BLOCK_NAMES, block_names
from kiln.compile.lower.gpu_schedule import NORM_SCALE, NORMED_INPUT, SUM_OF_SQUARES, storing

CALL_TIR = tvm.ir.Op.get("relax.call_tir")


def called_kernel(expr) -> tvm.ir.GlobalVar | None:
    if isinstance(expr, relax.Call) and expr.op == CALL_TIR:
        return expr.args[0]
    return None


def merged_kernel(producer: tirx.PrimFunc, consumer: tirx.PrimFunc, position: int, calls: list) -> tirx.PrimFunc:
    """One kernel computing `consumer`, whose argument `position` is `producer`'s output, built by
    TVM's own FuseTIR from a Relax group of the two `calls`."""
    producer_args, consumer_args = (list(call.args[1].fields) for call in calls)
    bb = relax.BlockBuilder()
    producer_gv, consumer_gv = bb.add_func(producer, "producer"), bb.add_func(consumer, "consumer")
    params = [relax.Var(f"p{i}", a.ty) for i, a in enumerate(producer_args)]
    params += [relax.Var(f"c{i}", a.ty) for i, a in enumerate(consumer_args) if i != position]
    with bb.function("merged", params, {"Primitive": True}, private=True):
        with bb.dataflow():
            inner = bb.emit(relax.call_tir(producer_gv, params[: len(producer_args)], consumer_args[position].ty))
            rest = iter(params[len(producer_args) :])
            inputs = [inner if i == position else next(rest) for i in range(len(consumer_args))]
            out = bb.emit_output(relax.call_tir(consumer_gv, inputs, calls[1].ty))
        merged_gv = bb.emit_func_output(out)
    caller_params = [relax.Var(f"a{i}", p.ty) for i, p in enumerate(params)]
    with bb.function("caller", caller_params):  # FuseTIR fuses the groups that are called
        bb.emit_func_output(bb.emit(relax.Call(merged_gv, caller_params)))
    fused = relax.transform.FuseTIR()(bb.get())
    return fused[called_kernel(fused["caller"].body.blocks[0].bindings[0].value)]


def merge_into_decode_gemvs(rules: tuple[dl.ScheduleRule, ...]) -> tvm.transform.Pass:
    """Each kernel that alone reads a decode GEMV's output, then each RMSNorm whose output only a
    decode GEMV reads, becomes part of that GEMV's kernel when one of `rules` schedules the two as
    one (which it does for the kernels it expects); the schedules are applied after, with the
    other kernels'."""

    @tvm.transform.module_pass(opt_level=0, name="MergeIntoDecodeGEMVs")
    def merge(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        target = Target.current()

        def schedulable(func: tirx.PrimFunc) -> bool:
            return any(rule.apply(func, target, False) is not None for rule in rules)

        def epilogue(mod, calls, position) -> tirx.PrimFunc | None:
            gemv, epilogue = (mod[called_kernel(call)] for call in calls)
            if not pairs_rows(*calls) or not schedulable(gemv) or schedulable(epilogue):
                # never into a GEMV that reads it: silu · mul in the down projection would take a
                # sigmoid per weight (on SwiftShader that kernel took 190 ms a step, against 85-110)
                return None
            merged = merged_kernel(gemv, epilogue, position, calls)
            return merged if schedulable(merged) else None

        def norm(mod, calls, position) -> tirx.PrimFunc | None:
            norm, gemv = (mod[called_kernel(call)] for call in calls)
            if not is_rms_norm(norm) or not norm_pays(*calls) or not schedulable(gemv):
                return None
            merged = with_norm_scale_deferred(merged_kernel(norm, gemv, position, calls))
            return merged if merged is not None and schedulable(merged) else None

        for merged_pair in (epilogue, norm):  # the norm into the gate/up GEMV that has silu · mul
            mod = with_merged_pairs(mod, merged_pair)
        return mod

    return merge


def with_merged_pairs(mod: tvm.IRModule, merged_pair) -> tvm.IRModule:
    """`mod` with each pair of calls for which `merged_pair(mod, (producer, consumer), position)`
    gives a kernel replaced by a call of that kernel."""
    builder = relax.BlockBuilder(mod)
    merged: dict[tuple, tvm.ir.GlobalVar | None] = {}  # the same kernels repeat in every layer

    def merged_kernel_of(calls: tuple[relax.Call, relax.Call], position: int) -> tvm.ir.GlobalVar | None:
        names = [called_kernel(call) for call in calls]
        key = (*names, position)
        if key not in merged:
            kernel = merged_pair(mod, calls, position)
            name = "_".join(gv.name_hint for gv in names)
            merged[key] = None if kernel is None else builder.add_func(kernel, name)
        return merged[key]

    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            builder.update_func(gv, with_merged_calls(func, merged_kernel_of))
    return relax.transform.DeadCodeElimination()(builder.get())


# The blocks of TVM's RMSNorm (`R.nn.rms_norm` legalized): the input cast, its squares, their sum,
# 1/rms, the weight cast, the normalized input and its cast back.
RMS_NORM_BLOCKS = {"T_cast", "T_multiply", SUM_OF_SQUARES, NORM_SCALE, "T_cast_1", NORMED_INPUT, "T_cast_2"}


def is_rms_norm(func: tirx.PrimFunc) -> bool:
    return isinstance(func.body, s_tir.SBlockRealize) and set(block_names(s_tir.Schedule(func))) == RMS_NORM_BLOCKS


# Every row of a norm-merged GEMV adds up the input's squares and multiplies it by the norm's
# weight again: a vocabulary head (SmolLM2's 49152 rows of 576 inputs) keeps its norm kernel, one
# dispatch a step, where merged it took 134-145 ms a step on SwiftShader instead of 81-87. A layer's
# GEMVs have 1.7-12 rows per input (SmolLM2, Qwen2.5, Gemma 3 270M), heads 50-410.
MOST_ROWS_PER_INPUT = 32


def norm_pays(norm: relax.Call, gemv: relax.Call) -> bool:
    """Whether `norm`'s kernel is worth merging into `gemv`: a float32 norm (a float16 GEMV would
    sum the unnormalized inputs in float16, which large activations overflow), into a GEMV with at
    most `MOST_ROWS_PER_INPUT` outputs per input."""
    if not all(isinstance(call.ty, relax.TensorType) for call in (norm, gemv)) or norm.ty.dtype != "float32":
        return False
    sizes = [math.prod(call.ty.shape.values) for call in (norm, gemv)]
    return all(isinstance(n, tirx.IntImm) for n in sizes) and sizes[1].value <= MOST_ROWS_PER_INPUT * sizes[0].value


def with_norm_scale_deferred(func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    """A GEMV merged with the RMSNorm before it, with the norm's 1/rms factor taken out of the
    normalized input (x ∘ w remains) and the matmul's output copied by a block of its own, which
    the schedule scales by 1/rms once the threads are laid out (`gpu_schedule.scaled_by_norm`);
    None if the normalized input is not a product with 1/rms as a factor."""
    sch = s_tir.Schedule(func)
    scale = sch.get(sch.get_sblock(NORM_SCALE)).writes[0].source
    (matmul,) = [name for name in block_names(sch) if name in MATMUL_BLOCK_NAMES]
    sch.cache_write(sch.get_sblock(matmul), 0, "global")

    def without_scale(expr: tvm.ir.PrimExpr) -> tvm.ir.PrimExpr:
        if isinstance(expr, tirx.Mul):
            for factor, rest in ((expr.a, expr.b), (expr.b, expr.a)):
                if isinstance(factor, tvm.ir.expr.TensorLoad) and factor.source.same_as(scale):
                    return rest
            return tirx.Mul(without_scale(expr.a), without_scale(expr.b))
        return expr

    normed = sch.get(sch.get_sblock(NORMED_INPUT))
    value = without_scale(normed.body.value)
    if tvm_ffi.structural_equal(value, normed.body.value):
        return None
    unscaled = storing(normed, value, [region for region in normed.reads if not region.source.same_as(scale)])
    return tvm_ffi.structural_map(sch.mod["main"], (s_tir.SBlock, lambda b: unscaled if b.same_as(normed) else b))


def pairs_rows(gemv: relax.Call, epilogue: relax.Call) -> bool:
    """Whether `epilogue` has fewer outputs than `gemv` (it combines several of the GEMV's rows
    into each of its outputs); other single-use epilogues, such as reshapes, cost no dispatch."""
    if not all(isinstance(call.ty, relax.TensorType) for call in (gemv, epilogue)):
        return False  # a kernel of several outputs
    sizes = [math.prod(call.ty.shape.values) for call in (gemv, epilogue)]
    return all(isinstance(n, tirx.IntImm) for n in sizes) and sizes[1].value < sizes[0].value


def with_merged_calls(func: relax.Function, merged_kernel_of) -> relax.Function:
    """`func` with each call whose argument is the single use of another call's output replaced by
    a call of the two calls' merged kernel, where `merged_kernel_of` gives one."""
    bound = {b.var: b.value for block in func.body.blocks for b in block.bindings}
    uses = collections.Counter()
    relax.analysis.post_order_visit(func.body, lambda e: isinstance(e, relax.Var) and uses.update([e]))

    @relax.expr_functor.mutator
    class Merger(relax.PyExprMutator):
        def visit_call_(self, call: relax.Call) -> relax.Expr:
            call = super().visit_call_(call)
            if called_kernel(call) is None:
                return call
            args = list(call.args[1].fields)
            for position, arg in enumerate(args):
                producer = bound.get(arg)
                if called_kernel(producer) is None or uses[arg] != 1:
                    continue
                if (gv := merged_kernel_of((producer, call), position)) is not None:
                    rest = [a for i, a in enumerate(args) if i != position]
                    return relax.call_tir(gv, list(producer.args[1].fields) + rest, call.ty)
            return call

    return Merger().visit_expr(func)
