"""Build targets: one table maps a target name to the TVM target, its schedules and its export step."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import tvm
from tvm import relax
from tvm.s_tir import dlight as dl

from kiln.errors import KilnError

from .cpu_schedule import RowNorm, RowParallelMatmul
from .webgpu_limits import check_webgpu_limits

WASM32 = {"kind": "llvm", "mtriple": "wasm32-unknown-unknown-wasm"}
# Wasm SIMD (every browser since 2023) lets the CPU schedules' vector loops stay vectors: +35%
# decode tokens/s for SmolLM2 in Chromium.
WASM32_SIMD = {**WASM32, "mattr": ["+simd128"]}


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


def gpu_schedules() -> tvm.transform.Pass:
    rules = (dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.LowBatchGEMV(), dl.gpu.Reduction(),
             dl.gpu.GeneralReduction(), dl.gpu.Fallback())
    return dl.ApplyDefaultSchedule(*[Declining(rule) for rule in rules])


def cpu_schedules() -> tvm.transform.Pass:
    return dl.ApplyDefaultSchedule(RowParallelMatmul(), RowNorm(), dl.cpu.Reduction())


def export_shared_library(executable, path: Path) -> None:
    executable.export_library(str(path))


def export_wasm(executable, path: Path) -> None:
    from .wasm_toolchain import link_tvmjs_wasm

    executable.export_library(str(path), fcompile=link_tvmjs_wasm)


def host_cpu_target() -> dict:
    # "native" is rejected by this LLVM for the conda triple it was built with: name the CPU.
    return {"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu()}


@dataclass(frozen=True)
class TargetEntry:
    name: str
    describe: str
    tvm_target: Callable[[], dict]
    schedules: Callable[[], tvm.transform.Pass]
    export: Callable[[object, Path], None]
    extension: str
    check_kernels: Callable[[str], object] | None = None  # given the generated device source

    def target(self) -> tvm.target.Target:
        return tvm.target.Target(self.tvm_target())


TARGETS: dict[str, TargetEntry] = {
    t.name: t
    for t in (
        TargetEntry("cpu", "this machine's CPU (shared library)", host_cpu_target, cpu_schedules,
                    export_shared_library, "so"),
        TargetEntry("cuda", "NVIDIA GPUs (shared library; kernels compiled at load by nvrtc/nvcc)",
                    lambda: {"kind": "cuda", "arch": "sm_80", "max_shared_memory_per_block": 49152,
                             "max_num_threads": 1024, "thread_warp_size": 32, "host": {"kind": "llvm"}},
                    gpu_schedules,
                    export_shared_library, "so"),
        TargetEntry("webgpu", "browsers with WebGPU (wasm + WGSL)",
                    lambda: {"kind": "webgpu", "host": WASM32}, gpu_schedules, export_wasm, "wasm",
                    check_webgpu_limits),
        TargetEntry("wasm", "browsers without WebGPU (CPU wasm)", lambda: WASM32_SIMD, cpu_schedules,
                    export_wasm, "wasm"),
    )
}


def target_named(name: str) -> TargetEntry:
    if name not in TARGETS:
        raise KilnError(f"unknown target {name!r} (supported: {', '.join(TARGETS)})")
    return TARGETS[name]


def kiln_pipeline(entry: TargetEntry) -> tvm.transform.Pass:
    """TVM's Relax lowering with Kiln's schedules between operator fusion and memory planning."""
    t = relax.transform
    return tvm.transform.Sequential([
        relax.backend.DispatchSampling(),
        relax.backend.DispatchSortScan(),
        t.LegalizeOps(),
        t.AnnotateTIROpPattern(),
        t.FoldConstant(),
        t.FuseOps(),
        t.FuseTIR(),
        t.DeadCodeElimination(),
        entry.schedules(),
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
    ])
