"""Epilogues merged into the decode GEMVs that compute their inputs (the WebGPU libraries).

TVM's operator fusion gives a SwiGLU MLP's silu(gate) · up a kernel of its own after the fused
gate/up GEMV: it reads the GEMV's output at two places (gate[i] and up[i] = out[i + width]), which
FuseOps does not fuse into a reduction. Computed in the GEMV instead, by a thread that sums both
rows of its output, it costs no extra work and saves a dispatch per layer. A merge is kept only
where one of the decode GEMV rules schedules the merged kernel; everywhere else the kernels stay.
"""

from __future__ import annotations

import collections
import functools
import math

import tvm
from tvm import relax, tirx
from tvm.s_tir import dlight as dl
from tvm.target import Target

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


def merge_epilogues_into_decode_gemvs(rules: tuple[dl.ScheduleRule, ...]) -> tvm.transform.Pass:
    """Each kernel that alone reads a decode GEMV's output becomes part of that GEMV's kernel when
    one of `rules` schedules the two as one (which it does for the kernels it expects)."""

    @tvm.transform.module_pass(opt_level=0, name="MergeEpiloguesIntoDecodeGEMVs")
    def merge(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        target = Target.current()
        builder = relax.BlockBuilder(mod)

        def scheduled(func: tirx.PrimFunc) -> tirx.PrimFunc | None:
            for rule in rules:
                if (sch := rule.apply(func, target, False)) is not None:
                    return sch.mod["main"].with_attr("tir.is_scheduled", True)
            return None

        @functools.cache
        def is_gemv(gv: tvm.ir.GlobalVar) -> bool:
            return scheduled(mod[gv]) is not None

        merged: dict[tuple, tvm.ir.GlobalVar | None] = {}  # the same kernels repeat in every layer

        def merged_gemv(calls: tuple[relax.Call, relax.Call], position: int) -> tvm.ir.GlobalVar | None:
            gemv_gv, epilogue_gv = (called_kernel(call) for call in calls)
            key = (gemv_gv, epilogue_gv, position)
            if key in merged:
                return merged[key]
            merged[key] = None
            if pairs_rows(*calls) and is_gemv(gemv_gv) and not is_gemv(epilogue_gv):
                # never into a GEMV that reads it: silu · mul in the down projection would take a
                # sigmoid per weight (on SwiftShader that kernel took 190 ms a step, against 85-110)
                kernel = scheduled(merged_kernel(mod[gemv_gv], mod[epilogue_gv], position, calls))
                if kernel is not None:
                    merged[key] = builder.add_func(kernel, f"{gemv_gv.name_hint}_{epilogue_gv.name_hint}")
            return merged[key]

        for gv, func in list(mod.functions.items()):
            if isinstance(func, relax.Function):
                builder.update_func(gv, with_merged_calls(func, merged_gemv))
        return relax.transform.DeadCodeElimination()(builder.get())

    return merge


def pairs_rows(gemv: relax.Call, epilogue: relax.Call) -> bool:
    """Whether `epilogue` has fewer outputs than `gemv` (it combines several of the GEMV's rows
    into each of its outputs); other single-use epilogues, such as reshapes, cost no dispatch."""
    if not all(isinstance(call.ty, relax.TensorType) for call in (gemv, epilogue)):
        return False  # a kernel of several outputs
    sizes = [math.prod(call.ty.shape.values) for call in (gemv, epilogue)]
    return all(isinstance(n, tirx.IntImm) for n in sizes) and sizes[1].value < sizes[0].value


def with_merged_calls(func: relax.Function, merged_gemv) -> relax.Function:
    """`func` with each call whose argument is the single use of another call's output replaced by
    a call of the two calls' merged kernel, where `merged_gemv` gives one."""
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
                if (gv := merged_gemv((producer, call), position)) is not None:
                    rest = [a for i, a in enumerate(args) if i != position]
                    return relax.call_tir(gv, list(producer.args[1].fields) + rest, call.ty)
            return call

    return Merger().visit_expr(func)
