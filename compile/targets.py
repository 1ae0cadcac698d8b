"""Build targets: one table maps a target name to the TVM target, its schedules and its export step."""

from __future__ import annotations

import platform
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Callable

import tvm
from tvm import relax, s_tir
from tvm.s_tir import dlight as dl

from kiln.errors import KilnError

from .system_lib import export_system_library
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
    from .cpu_schedule import block_names
    from .quantization.ggml_blocks import GROUP_STAGES

    if not isinstance(func.body, s_tir.SBlockRealize):
        return func
    sch = s_tir.Schedule(func)
    stages = [n for n in block_names(sch) if n in GROUP_STAGES]
    for name in stages:
        sch.compute_inline(sch.get_sblock(name))
    return sch.mod["main"] if stages else func


# The schedules are imported by the functions that build with them: the engine reads this table
# (which device runs a target), and the quantization package the schedules import needs the engine.
def gpu_schedules(matmul: dl.ScheduleRule | None = None, decode_gemv: tuple = ()) -> tvm.transform.Pass:
    from .decode_fusion import merge_into_decode_gemvs
    from .gpu_schedule import SplitReductionGEMV
    from .gpu_trigonometry import precise_sin_cos

    rules = (
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
    from .gpu_schedule import WEBGPU_DECODE_GEMV, WEBGPU_PREFILL_MATMUL

    return gpu_schedules(WEBGPU_PREFILL_MATMUL, decode_gemv=(WEBGPU_DECODE_GEMV,))


def webgpu_subgroup_schedules() -> tvm.transform.Pass:
    from .gpu_schedule import WEBGPU_DECODE_GEMV, WEBGPU_PREFILL_MATMUL, WEBGPU_SUBGROUP_DECODE_GEMV

    return gpu_schedules(WEBGPU_PREFILL_MATMUL, decode_gemv=(WEBGPU_SUBGROUP_DECODE_GEMV, WEBGPU_DECODE_GEMV))


def cpu_schedules() -> tvm.transform.Pass:
    from .cpu_schedule import FactoredDecodeGEMV, RowNorm, RowParallelMatmul

    return dl.ApplyDefaultSchedule(FactoredDecodeGEMV(), RowParallelMatmul(), RowNorm(), dl.cpu.Reduction())


def export_shared_library(executable, path: Path) -> None:
    executable.export_library(str(path))


def export_wasm(executable, path: Path) -> None:
    from .wasm_toolchain import link_tvmjs_wasm

    executable.export_library(str(path), fcompile=link_tvmjs_wasm)


def export_threaded_wasm(executable, path: Path) -> None:
    from .wasm_toolchain import link_threaded_wasm

    executable.export_library(str(path), fcompile=link_threaded_wasm)


# The instruction sets a `cpu` library is built for, per `--cpu-tuning`. "portable" (the default)
# is x86-64-v3 (AVX2, FMA, F16C: every x86-64 CPU since 2013–2015; v2 decodes 2.5× slower) or
# ARMv8-A with NEON; "legacy" is x86-64-v2 (SSE4.2: every x86-64 CPU since 2009).
CPU_LEVELS = {
    "portable": {"x86_64": "x86-64-v3", "aarch64": "generic"},
    "legacy": {"x86_64": "x86-64-v2", "aarch64": "generic"},
}
CPU_TUNINGS = (*CPU_LEVELS, "host")
MACHINES = {"AMD64": "x86_64", "arm64": "aarch64"}


def cpu_named(tuning: str) -> str:
    if tuning == "host":
        # "native" is rejected by this LLVM for the conda triple it was built with: name the CPU.
        return tvm.target.codegen.llvm_get_system_cpu()
    if tuning not in CPU_LEVELS:
        raise KilnError(f"unknown CPU tuning {tuning!r} ({', '.join(CPU_TUNINGS)})")
    machine = platform.machine()
    return CPU_LEVELS[tuning].get(MACHINES.get(machine, machine), "generic")


def cpu_target(tuning: str = "portable") -> dict:
    return {"kind": "llvm", "mcpu": cpu_named(tuning)}


def webgpu_target() -> dict:
    return {"kind": "webgpu", "host": WASM32}


def metal_target(host_triple: str) -> dict:
    # Apple GPUs: 32 KB threadgroup memory; 256 threads fits every A- and M-series GPU. Warp size 1
    # (no simdgroup shuffles), as MLC builds for iPhones: nothing here can compile Metal to check more.
    return {
        "kind": "metal",
        "max_num_threads": 256,
        "max_threads_per_block": 256,
        "max_shared_memory_per_block": 32768,
        "thread_warp_size": 1,
        "host": {"kind": "llvm", "mtriple": host_triple},
    }


def android_target() -> dict:
    # 256 work-items and 16 KB of local memory per work-group: within what Adreno and Mali GPUs
    # allow (MLC's generic Android target leaves these to TVM's OpenCL defaults, the same numbers).
    return {
        "kind": "opencl",
        "max_num_threads": 256,
        "max_threads_per_block": 256,
        "max_shared_memory_per_block": 16384,
        "thread_warp_size": 1,
        "host": {"kind": "llvm", "mtriple": "aarch64-linux-android"},
    }


@dataclass(frozen=True)
class MemoryLimit:
    """The most a target's library can hold (`bytes`), and what sets that limit."""

    bytes: int
    reason: str


# A browser library's allocation: tvmjs reads a WebGPU buffer's size, and emscripten's sbrk the wasm
# memory a CPU one grows by, as a signed 32-bit number.
BROWSER_BUFFER = MemoryLimit(2**31 - 1, "a browser library's allocation size is a signed 32-bit number")
WASM32_MEMORY = MemoryLimit(2**32, "wasm32 addresses 4 GiB, the CPU library's whole memory")


@dataclass(frozen=True)
class TargetEntry:
    name: str
    describe: str
    tvm_target: Callable[[], dict]
    schedules: Callable[[], tvm.transform.Pass]
    export: Callable[[object, Path], None]
    extension: str
    check_kernels: Callable[[str], object] | None = None  # given the generated device source
    # A system library for an app to link: built under the model's prefix, written as the `.tar`
    # of objects plus a static archive `lib<model-id>-<target>.a` beside it. Build-only here: this
    # machine's TVM runtime has no OpenCL or Metal device.
    system_lib: bool = False
    # Also write the generated kernel source beside the library, with this extension (so that
    # kernels can be read and checked without a device: `kiln.compile.opencl_check`).
    kernel_source: str | None = None
    # Runs on the CPU of the machine that loads it: `--cpu-tuning` chooses the instruction set.
    tunes_cpu: bool = False
    # The TVM device the native engine runs the library on; None: not on this machine's runtime.
    device: str | None = None
    # The browser engine runs it, and the app config lists it.
    browser: bool = False
    # The most one allocation, and everything the model holds, may take (compile/library.py checks).
    buffer_limit: MemoryLimit | None = None
    memory_limit: MemoryLimit | None = None

    def target(self) -> tvm.target.Target:
        return tvm.target.Target(self.tvm_target())

    def kernel_source_path(self, library: Path) -> Path:
        return library.with_suffix(f".{self.kernel_source}")


TARGETS: dict[str, TargetEntry] = {
    t.name: t
    for t in (
        TargetEntry(
            "cpu",
            "x86-64 and ARM CPUs (shared library; --cpu-tuning host for this machine's)",
            cpu_target,
            cpu_schedules,
            export_shared_library,
            "so",
            tunes_cpu=True,
            device="cpu",
        ),
        TargetEntry(
            "cuda",
            "NVIDIA GPUs (shared library; kernels compiled at load by nvrtc/nvcc)",
            lambda: {
                "kind": "cuda",
                "arch": "sm_80",
                "max_shared_memory_per_block": 49152,
                "max_num_threads": 1024,
                "thread_warp_size": 32,
                "host": {"kind": "llvm"},
            },
            untensorized_gpu_schedules,
            export_shared_library,
            "so",
            device="cuda",
        ),
        TargetEntry(
            "webgpu",
            "browsers with WebGPU (wasm + WGSL)",
            webgpu_target,
            webgpu_schedules,
            export_wasm,
            "wasm",
            check_webgpu_limits,
            browser=True,
            buffer_limit=BROWSER_BUFFER,
        ),
        TargetEntry(
            "webgpu-subgroups",
            "browsers whose GPU has WebGPU subgroups (decode kernels sum in subgroup shuffles; "
            "the browser engine prefers it to webgpu there)",
            webgpu_target,
            webgpu_subgroup_schedules,
            export_wasm,
            "wasm",
            check_webgpu_limits,
            browser=True,
            buffer_limit=BROWSER_BUFFER,
        ),
        TargetEntry(
            "wasm",
            "browsers without WebGPU (CPU wasm)",
            lambda: WASM32_SIMD,
            cpu_schedules,
            export_threaded_wasm,
            "wasm",
            browser=True,
            buffer_limit=BROWSER_BUFFER,
            memory_limit=WASM32_MEMORY,
        ),
        TargetEntry(
            "android",
            "Android phones (OpenCL; static library for aarch64, build-only here)",
            android_target,
            gpu_schedules,
            export_system_library,
            "tar",
            system_lib=True,
            kernel_source="cl",
        ),
        TargetEntry(
            "iphone",
            "iPhones and iPads (Metal; static library for arm64 iOS, build-only here)",
            lambda: metal_target("arm64-apple-ios14.0"),
            untensorized_gpu_schedules,
            export_system_library,
            "tar",
            system_lib=True,
        ),
        TargetEntry(
            "metal",
            "Macs with Apple silicon (Metal; static library for arm64 macOS, build-only here)",
            lambda: metal_target("arm64-apple-macosx11.0"),
            untensorized_gpu_schedules,
            export_system_library,
            "tar",
            system_lib=True,
        ),
    )
}

# In the registry's order, which is the order of preference (the app config's `model_lib` is the
# first browser library built).
NATIVE_TARGETS = tuple(name for name, entry in TARGETS.items() if entry.device)
BROWSER_TARGETS = tuple(name for name, entry in TARGETS.items() if entry.browser)


def target_named(name: str, cpu_tuning: str = "portable") -> TargetEntry:
    if name not in TARGETS:
        raise KilnError(f"unknown target {name!r} (supported: {', '.join(TARGETS)})")
    entry = TARGETS[name]
    return replace(entry, tvm_target=partial(cpu_target, cpu_tuning)) if entry.tunes_cpu else entry


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
        ]
    )
