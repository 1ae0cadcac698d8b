"""Build targets as data: one row a target, naming its TVM target, the device that runs it, its
schedule family and export kind (kiln/compile/lower and kiln/compile/lower/library.py look those up), and
what its kernels can do, which the model and quantization code read instead of the target's kind."""

from __future__ import annotations

import platform
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Callable

import tvm

from kiln.errors import KilnError

WASM32 = {"kind": "llvm", "mtriple": "wasm32-unknown-unknown-wasm"}
# Wasm SIMD (every browser since 2023) lets the CPU schedules' vector loops stay vectors: +35%
# decode tokens/s for SmolLM2 in Chromium.
WASM32_SIMD = {**WASM32, "mattr": ["+simd128"]}

# The instruction sets a `cpu` library is built for, per `--cpu-tuning`. "portable" (the default)
# is x86-64-v3 (AVX2, FMA, F16C: every x86-64 CPU since 2013–2015; v2 decodes 2.5× slower) or
# ARMv8-A with NEON; "legacy" is x86-64-v2 (SSE4.2: every x86-64 CPU since 2009).
CPU_LEVELS = {
    "portable": {"x86_64": "x86-64-v3", "aarch64": "generic"},
    "legacy": {"x86_64": "x86-64-v2", "aarch64": "generic"},
}
CPU_TUNINGS = (*CPU_LEVELS, "host")


@dataclass(frozen=True)
class CpuVariant:
    """An instruction set a portable x86-64 `cpu` library is also built for, where a scheme's kernels
    have code for it (`Scheme.cpu_variants`): the native engine loads the first variant this
    machine's CPU runs, else the portable library (kiln/runtime.py)."""

    mcpu: str
    features: tuple[str, ...]  # LLVM's names, beyond the mcpu's

    def tvm_target(self) -> dict:
        return {"kind": "llvm", "mcpu": self.mcpu, "mattr": [f"+{feature}" for feature in self.features]}


# AVX-512 with VNNI and VBMI: Intel Ice Lake, Sapphire Rapids and later, AMD Zen 4 and later
# (int8_decode.py: `vpdpbusd`, `vpmultishiftqb`).
CPU_VARIANTS = {"avx512-vnni": CpuVariant("x86-64-v4", ("avx512vnni", "avx512vbmi"))}
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


def cuda_target() -> dict:
    return {
        "kind": "cuda",
        "arch": "sm_80",
        "max_shared_memory_per_block": 49152,
        "max_num_threads": 1024,
        "thread_warp_size": 32,
        "host": {"kind": "llvm"},
    }


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


def arm64_cpu_target(triple: str) -> dict:
    # ARMv8-A with NEON: every arm64 phone and board (`cpu`'s portable tuning on ARM).
    return {"kind": "llvm", "mtriple": triple, "mcpu": "generic"}


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


# What real WebGPU adapters grant a kernel (kiln/compile/lower/webgpu_limits.py checks every WebGPU
# build's kernels against them; kiln/models/kv_cache/gpu_wide_heads.py tiles attention within them).
MAX_INVOCATIONS_PER_WORKGROUP = 256
MAX_WORKGROUP_STORAGE_BYTES = 32 << 10
# WebGPU's default is 8; tvmjs requests 10, which desktop and mobile adapters grant.
MAX_STORAGE_BUFFERS_PER_STAGE = 10


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
    schedule_family: str  # kiln/compile/lower's SCHEDULES
    export: str  # kiln/compile/lower/library.py's EXPORTS
    extension: str
    kernel_check: str | None = None  # kiln/compile/lower/library.py's KERNEL_CHECKS, given the device source
    # A system library for an app to link: built under the model's prefix, written as the `.tar`
    # of objects plus a static archive `lib<model-id>-<target>.a` beside it. Build-only here: this
    # machine's TVM runtime has no OpenCL or Metal device.
    system_lib: bool = False
    # Also write the generated kernel source beside the library, with this extension (so that
    # kernels can be read and checked without a device: `kiln.compile.toolchain.opencl_check`).
    kernel_source: str | None = None
    # Loaded by Kiln's mobile runtime (libkiln) built for this platform of
    # kiln.compile.toolchain.mobile_runtime: `kiln package` bundles that runtime beside the libraries.
    mobile_runtime: str | None = None
    # Runs on the CPU of the machine that loads it: `--cpu-tuning` chooses the instruction set.
    tunes_cpu: bool = False
    # The TVM device the native engine runs the library on; None: not on this machine's runtime.
    device: str | None = None
    # The browser engine runs it, and the app config lists it.
    browser: bool = False
    # The most one allocation, and everything the model holds, may take (kiln/compile/lower/library.py checks).
    buffer_limit: MemoryLimit | None = None
    memory_limit: MemoryLimit | None = None
    # What its kernels can do. CPU code (LLVM): TVM's KV-cache kernels get Kiln's CPU fixes, a decode
    # GEMV its factored schedule, and float32 builds prefill in chunks past a layer's window.
    cpu_kernels: bool = False
    # float16 → float32 is an instruction (wasm and WGSL have none: GGUF blocks convert halves in code).
    converts_halves: bool = True
    # Loads single bytes (WGSL has no 8-bit type: its kernels read whole words and shift bytes out).
    loads_bytes: bool = True
    # TVM's decode attention in workgroups of 64 threads, more only for a group of query heads that
    # needs them: 256 ran SmolLM2's attention 2.6× slower on SwiftShader (kiln/models/kv_cache/gpu_decode_attention.py).
    narrow_decode_attention: bool = False

    def target(self) -> tvm.target.Target:
        return tvm.target.Target(self.tvm_target())

    def kernel_source_path(self, library: Path) -> Path:
        return library.with_suffix(f".{self.kernel_source}")

    def kernels_key(self) -> tuple[str, str | None]:
        """What tells its TVM target apart while kernels are built: the kind and the triple."""
        described = self.tvm_target()
        return described["kind"], described.get("mtriple")


WEBGPU = TargetEntry(
    "webgpu",
    "browsers with WebGPU (wasm + WGSL)",
    webgpu_target,
    "webgpu",
    "wasm",
    "wasm",
    "webgpu-limits",
    browser=True,
    buffer_limit=BROWSER_BUFFER,
    converts_halves=False,
    loads_bytes=False,
    narrow_decode_attention=True,
)

TARGETS: dict[str, TargetEntry] = {
    t.name: t
    for t in (
        TargetEntry(
            "cpu",
            "x86-64 and ARM CPUs (shared library; --cpu-tuning host for this machine's)",
            cpu_target,
            "cpu",
            "shared-library",
            "so",
            tunes_cpu=True,
            device="cpu",
            cpu_kernels=True,
        ),
        TargetEntry(
            "cuda",
            "NVIDIA GPUs (shared library; kernels compiled at load by nvrtc/nvcc)",
            cuda_target,
            "untensorized-gpu",
            "shared-library",
            "so",
            device="cuda",
        ),
        WEBGPU,
        replace(
            WEBGPU,
            name="webgpu-subgroups",
            describe="browsers whose GPU has WebGPU subgroups (decode kernels sum in subgroup shuffles; "
            "the browser engine prefers it to webgpu there)",
            schedule_family="webgpu-subgroups",
        ),
        TargetEntry(
            "wasm",
            "browsers without WebGPU (CPU wasm)",
            lambda: WASM32_SIMD,
            "cpu",
            "threaded-wasm",
            "wasm",
            browser=True,
            buffer_limit=BROWSER_BUFFER,
            memory_limit=WASM32_MEMORY,
            cpu_kernels=True,
            converts_halves=False,
        ),
        TargetEntry(
            "arm64-linux",
            "aarch64 Linux CPUs (shared library for Kiln's mobile runtime; run here under qemu-aarch64)",
            partial(arm64_cpu_target, "aarch64-linux-gnu"),
            "cpu",
            "arm64-linux-shared-library",
            "so",
            mobile_runtime="arm64-linux",
            cpu_kernels=True,
        ),
        TargetEntry(
            "android",
            "Android phones (OpenCL; static library for aarch64, build-only here)",
            android_target,
            "gpu",
            "system-library",
            "tar",
            system_lib=True,
            kernel_source="cl",
        ),
        TargetEntry(
            "android-cpu",
            "Android phones' CPUs (static library for arm64-v8a and Kiln's runtime, built by the app's NDK)",
            partial(arm64_cpu_target, "aarch64-linux-android"),
            "cpu",
            "system-library",
            "tar",
            system_lib=True,
            mobile_runtime="android",
            cpu_kernels=True,
        ),
        TargetEntry(
            "iphone-cpu",
            "iPhones' and iPads' CPUs (static library for arm64 iOS and Kiln's runtime)",
            partial(arm64_cpu_target, "arm64-apple-ios14.0"),
            "cpu",
            "system-library",
            "tar",
            system_lib=True,
            mobile_runtime="iphone",
            cpu_kernels=True,
        ),
        TargetEntry(
            "iphone",
            "iPhones and iPads (Metal; static library for arm64 iOS, build-only here)",
            lambda: metal_target("arm64-apple-ios14.0"),
            "untensorized-gpu",
            "system-library",
            "tar",
            system_lib=True,
        ),
        TargetEntry(
            "metal",
            "Macs with Apple silicon (Metal; static library for arm64 macOS, build-only here)",
            lambda: metal_target("arm64-apple-macosx11.0"),
            "untensorized-gpu",
            "system-library",
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


def cpu_variants_of(entry: TargetEntry, cpu_tuning: str, names: tuple[str, ...]) -> dict[str, TargetEntry]:
    """`entry` built for each of the variants `names` (a scheme's), where it is a portable x86-64 cpu
    library: another tuning is one instruction set by the user's choice."""
    if not (entry.tunes_cpu and cpu_tuning == "portable" and cpu_named(cpu_tuning).startswith("x86-64")):
        return {}
    return {name: replace(entry, tvm_target=CPU_VARIANTS[name].tvm_target) for name in names}


def llvm_triple(target: tvm.target.Target) -> str:
    """The triple an llvm target's code is for: its own, else this machine's."""
    return str(target.attrs.get("mtriple", "")) or tvm.target.codegen.llvm_get_system_triple()


def building() -> TargetEntry | None:
    """The row whose kernels are being built: the one of TVM's current target (rows that share a TVM
    target share what their kernels can do, which a test checks); None outside a target."""
    target = tvm.target.Target.current(allow_none=True)
    if target is None:
        return None
    key = (target.kind.name, target.attrs.get("mtriple"))
    return next((entry for entry in TARGETS.values() if entry.kernels_key() == key), None)
