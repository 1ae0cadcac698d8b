"""Lowering: TVM's Relax passes with Kiln's schedules, chosen by a target row's schedule family."""

from __future__ import annotations

import tvm
from tvm import relax, s_tir
from tvm.s_tir import dlight as dl

from kiln.compile.lower.cpu_schedule import (
    EncoderAttentionScores,
    EncoderAttentionValues,
    FactoredDecodeGEMV,
    PrefillElementwise,
    RowNorm,
    RowParallelMatmul,
    RowSoftmax,
    block_names,
)
from kiln.compile.lower.cpu_exponential import written_out_exp
from kiln.compile.lower.decode_fusion import merge_into_decode_gemvs
from kiln.models.stage_names import GROUP_STAGES
from kiln.targets import TargetEntry
from kiln.compile.lower.gpu_schedule import (
    SplitReductionGEMV,
    ThreadPerScore,
    WEBGPU_DECODE_GEMV,
    WEBGPU_PREFILL_MATMUL,
    WEBGPU_SUBGROUP_DECODE_GEMV,
)
from kiln.compile.lower.gpu_trigonometry import precise_sin_cos


class Declining(dl.ScheduleRule):
    """A dlight rule that declines (returns None) instead of failing the build when its own
    analysis breaks on a kernel it does not expect — dlight's GEMV analysis asserts on some
    fused reductions (those of the top-p sampler); the next rule then schedules them."""

    def __init__(self, rule: dl.ScheduleRule):
        self.rule = rule

    def apply(self, func, target, tunable):
        try:
            return self.rule.apply(func, target, tunable)
        except AssertionError:
            return None


class MatmulWithoutTensorization(dl.ScheduleRule):
    """dlight's Matmul without its tensorized paths: Metal's simdgroup and CUDA's float16 tensor
    core tensorization crash this TVM (a segfault in Tensorize, which no try/except catches; on
    CUDA every q4f16_1 or gguf_f16 build). Giving the rule a generic GPU target takes the tiled
    schedule dlight itself falls back to when tensorization declines."""

    def apply(self, func, target, tunable):
        generic = tvm.target.Target(
            {
                "kind": "opencl",
                "max_num_threads": int(target.attrs["max_num_threads"]),
                "max_shared_memory_per_block": int(target.attrs["max_shared_memory_per_block"]),
            }
        )
        return dl.gpu.Matmul().apply(func, generic, tunable)


@tvm.tirx.transform.prim_func_pass(opt_level=0)
def inline_group_parameters(func: tvm.tirx.PrimFunc, mod, ctx) -> tvm.tirx.PrimFunc:
    """GGUF blocks' per-group scales and offsets inlined into the weights that use them: dlight's
    GPU rules expect the weights as one producer (each thread then reads its group's parameters
    itself; the CPU schedule instead computes them once per group)."""
    if not isinstance(func.body, s_tir.SBlockRealize):
        return func
    sch = s_tir.Schedule(func)
    stages = [n for n in block_names(sch) if n in GROUP_STAGES]
    for name in stages:
        sch.compute_inline(sch.get_sblock(name))
    return sch.mod["main"] if stages else func


def gpu_schedules(matmul: dl.ScheduleRule | None = None, decode_gemv: tuple = ()) -> tvm.transform.Pass:
    rules = (
        ThreadPerScore(),
        matmul or dl.gpu.Matmul(),
        *decode_gemv,
        dl.gpu.GEMV(),
        dl.gpu.LowBatchGEMV(),
        SplitReductionGEMV(),
        dl.gpu.Reduction(),
        dl.gpu.GeneralReduction(),
        dl.gpu.Fallback(),
    )
    return tvm.transform.Sequential(
        [
            precise_sin_cos,
            inline_group_parameters,
            *([merge_into_decode_gemvs(decode_gemv)] if decode_gemv else []),
            dl.ApplyDefaultSchedule(*[Declining(rule) for rule in rules]),
        ]
    )


def untensorized_gpu_schedules() -> tvm.transform.Pass:
    return gpu_schedules(MatmulWithoutTensorization())


def webgpu_schedules() -> tvm.transform.Pass:
    return gpu_schedules(WEBGPU_PREFILL_MATMUL, decode_gemv=(WEBGPU_DECODE_GEMV,))


def webgpu_subgroup_schedules() -> tvm.transform.Pass:
    return gpu_schedules(WEBGPU_PREFILL_MATMUL, decode_gemv=(WEBGPU_SUBGROUP_DECODE_GEMV, WEBGPU_DECODE_GEMV))


def cpu_schedules() -> tvm.transform.Pass:
    return tvm.transform.Sequential(
        [
            written_out_exp,
            dl.ApplyDefaultSchedule(
                FactoredDecodeGEMV(),
                RowParallelMatmul(),
                EncoderAttentionScores(),
                EncoderAttentionValues(),
                RowSoftmax(),
                RowNorm(),
                PrefillElementwise(),
                dl.cpu.Reduction(),
            ),
        ]
    )


SCHEDULES = {
    "cpu": cpu_schedules,
    "gpu": gpu_schedules,
    "untensorized-gpu": untensorized_gpu_schedules,
    "webgpu": webgpu_schedules,
    "webgpu-subgroups": webgpu_subgroup_schedules,
}


def schedules_for(entry: TargetEntry) -> tvm.transform.Pass:
    return SCHEDULES[entry.schedule_family]()


def kiln_pipeline(entry: TargetEntry) -> tvm.transform.Pass:
    """TVM's Relax lowering with Kiln's schedules between operator fusion and memory planning."""
    t = relax.transform
    return tvm.transform.Sequential(
        [
            relax.backend.DispatchSampling(),
            relax.backend.DispatchSortScan(),
            t.LegalizeOps(),
            t.AnnotateTIROpPattern(),
            t.FoldConstant(),
            t.FuseOps(),
            t.FuseTIR(),
            t.DeadCodeElimination(),
            schedules_for(entry),
            t.RewriteDataflowReshape(),
            t.ToNonDataflow(),
            t.RemovePurityChecking(),
            t.CallTIRRewrite(),
            t.StaticPlanBlockMemory(),
            t.LowerAllocTensor(),
            t.KillAfterLastUse(),
            t.LowerRuntimeBuiltin(),
            t.ComputePrimValue(),
            t.VMShapeLower(),
            t.AttachGlobalSymbol(),
        ]
    )
