"""The mobile runtime: TVM's C++ runtime (Relax VM, paged KV cache, thread pool, CPU device, the
shared- and system-library loaders) with Kiln's engine and C API (kiln/mobile/runtime/), as `libkiln`.

The wheels ship the runtime's sources and no runtime built for an app's platform, so Kiln compiles
them with clang for that platform once, cached per TVM version under
`~/.cache/kiln/mobile-runtime/<version>/<platform>/` (`include/kiln.h`, `lib/libkiln.a`, `lib/libkiln.so`).
The sources are laid out and patched as for the web runtime (`wasm_toolchain.assemble_source_root`).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import kiln
from kiln.compile.toolchain.wasm_toolchain import (
    HEADERS_DIR,
    SOURCE_PATCHES,
    ToolStatus,
    assemble_source_root,
    cache_dir,
    include_flags,
    replace_dir,
    tvm_version,
)
from kiln.errors import KilnError

KILN_SOURCES_DIR = Path(__file__).parents[2] / "mobile" / "runtime"
PUBLIC_HEADER = "kiln.h"
BUILD_INFO = "build-info.json"
CLANG_FIX = "apt-get install -y clang lld llvm"
ARM64_LINUX_FIX = "apt-get install -y --no-install-recommends libstdc++-12-dev-arm64-cross"
BUILD_COMMAND = "kiln doctor --build-mobile-runtime"
STDERR_TAIL_LINES = 25

# What a CPU runtime needs of the wheels' sources (the web runtime's list without its RPC and web
# parts, with the thread pool and the dynamic-library loader).
TVM_RUNTIME_SOURCES = (
    "src/runtime/cpu_device_api.cc",
    "src/runtime/device_api.cc",
    "src/runtime/extra/contrib/sort/sort.cc",
    "src/runtime/file_utils.cc",
    "src/runtime/logging.cc",
    "src/runtime/memory/memory_manager.cc",
    "src/runtime/module.cc",
    "src/runtime/tensor.cc",
    "src/runtime/thread_pool.cc",
    "src/runtime/threading_backend.cc",
    "src/runtime/timer.cc",
    "src/runtime/workspace_pool.cc",
    "src/runtime/vm/attn_backend.cc",
    "src/runtime/vm/builtin.cc",
    "src/runtime/vm/bytecode.cc",
    "src/runtime/vm/executable.cc",
    "src/runtime/vm/kv_state.cc",
    "src/runtime/vm/lm_support.cc",
    "src/runtime/vm/paged_kv_cache.cc",
    "src/runtime/vm/rnn_state.cc",
    "src/runtime/vm/tensor_cache_support.cc",
    "src/runtime/vm/vm.cc",
    "3rdparty/tvm-ffi/src/ffi/backtrace.cc",
    "3rdparty/tvm-ffi/src/ffi/container.cc",
    "3rdparty/tvm-ffi/src/ffi/dtype.cc",
    "3rdparty/tvm-ffi/src/ffi/error.cc",
    "3rdparty/tvm-ffi/src/ffi/function.cc",
    "3rdparty/tvm-ffi/src/ffi/init_once.cc",
    "3rdparty/tvm-ffi/src/ffi/object.cc",
    "3rdparty/tvm-ffi/src/ffi/tensor.cc",
    "3rdparty/tvm-ffi/src/ffi/extra/env_c_api.cc",
    "3rdparty/tvm-ffi/src/ffi/extra/env_context.cc",
    "3rdparty/tvm-ffi/src/ffi/extra/json_parser.cc",
    "3rdparty/tvm-ffi/src/ffi/extra/json_writer.cc",
    "3rdparty/tvm-ffi/src/ffi/extra/library_module.cc",
    "3rdparty/tvm-ffi/src/ffi/extra/library_module_dynamic_lib.cc",
    "3rdparty/tvm-ffi/src/ffi/extra/library_module_system_lib.cc",
    "3rdparty/tvm-ffi/src/ffi/extra/module.cc",
)
# -ffp-contract=off: each floating-point operation rounds on its own (no fused multiply-adds on ARM), as
# in numpy and JavaScript, so the sampler's weights equal the other engines' bit for bit.
COMPILE_FLAGS = (
    "-O2",
    "-fPIC",
    "-std=c++17",
    "-ffp-contract=off",
    "-DTVM_FFI_USE_LIBBACKTRACE=0",
    "-DTVM_LOG_DEBUG=0",
)


@dataclass(frozen=True)
class RuntimePlatform:
    """One platform `libkiln` is built for (`lib/libkiln.a` and `lib/libkiln.so`, linked here with lld):
    clang's target triple and what the build needs there."""

    name: str
    triple: str
    kiln_target: str  # the target whose model libraries it loads (kiln-build.json's, by default)
    needs: str | None = None  # a file of the cross toolchain the build needs, and the package that has it
    needs_fix: str | None = None
    instrumented: tuple[str, ...] = ()  # flags for compiling and linking (a sanitizer)

    def runtime_dir(self) -> Path:
        return cache_dir() / "mobile-runtime" / tvm_version() / self.name

    def has_toolchain(self) -> bool:
        return self.needs is None or Path(self.needs).is_file()


RUNTIME_PLATFORMS = {
    platform.name: platform
    for platform in (
        RuntimePlatform(
            "arm64-linux",
            "aarch64-linux-gnu",
            "arm64-linux",
            needs="/usr/aarch64-linux-gnu/lib/libstdc++.so.6",
            needs_fix=ARM64_LINUX_FIX,
        ),
        # This machine's own builds: the Java binding's tests load the first, the C API's tests under
        # AddressSanitizer the second (an app built with -fsanitize=address links it).
        RuntimePlatform("host", "", "cpu"),
        RuntimePlatform("host-asan", "", "cpu", instrumented=("-fsanitize=address", "-fno-omit-frame-pointer")),
    )
}


def runtime_platform(name: str) -> RuntimePlatform:
    if name not in RUNTIME_PLATFORMS:
        raise KilnError(f"no mobile runtime for {name!r} (platforms: {', '.join(RUNTIME_PLATFORMS)})")
    return RUNTIME_PLATFORMS[name]


def kiln_sources() -> list[Path]:
    return sorted(KILN_SOURCES_DIR.glob("*.cc"))


def platform_flags(platform: RuntimePlatform) -> list[str]:
    """clang's flags for compiling and linking for the platform (and for an app of it)."""
    return [*([f"--target={platform.triple}"] if platform.triple else []), *platform.instrumented]


def _kiln_defines(platform: RuntimePlatform) -> list[str]:
    """What the engine checks a model folder against (kiln/runtime.py's check_build_versions)."""
    return [
        f'-DKILN_VERSION="{kiln.__version__}"',
        f'-DKILN_TVM_VERSION="{tvm_version()}"',
        f'-DKILN_TARGET="{platform.kiln_target}"',
    ]


def _compile_flags(platform: RuntimePlatform) -> list[str]:
    return [*platform_flags(platform), *COMPILE_FLAGS, *_kiln_defines(platform)]


def find_clang() -> str:
    clang = shutil.which("clang++")
    if clang is None:
        raise KilnError(f"clang++ is not installed; install it with `{CLANG_FIX}`")
    return clang


def _sources_digest() -> str:
    """Kiln's runtime sources and headers, the stand-in TVM headers and the source patches."""
    digest = hashlib.sha256()
    for path in sorted([*HEADERS_DIR.rglob("*.h"), *KILN_SOURCES_DIR.glob("*.h"), *kiln_sources()]):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    digest.update(repr((SOURCE_PATCHES, TVM_RUNTIME_SOURCES)).encode())
    return digest.hexdigest()[:16]


def runtime_fingerprint(platform: RuntimePlatform) -> dict:
    """What a cached runtime was built from; one with another fingerprint is rebuilt."""
    clang_version = subprocess.run([find_clang(), "--version"], capture_output=True, text=True, check=False)
    return {
        "tvm": tvm_version(),
        "tvm_ffi": importlib.metadata.version("apache-tvm-ffi"),
        "clang": clang_version.stdout.splitlines()[0] if clang_version.stdout else "unknown",
        "compile_flags": _compile_flags(platform),
        "sources": _sources_digest(),
    }


def runtime_is_built(platform: RuntimePlatform, fingerprint: dict | None = None) -> bool:
    runtime_dir = platform.runtime_dir()
    if not all(path.is_file() for path in runtime_files(runtime_dir).values()):
        return False
    try:
        recorded = json.loads((runtime_dir / BUILD_INFO).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    fingerprint = fingerprint or runtime_fingerprint(platform)
    return {key: recorded.get(key) for key in fingerprint} == fingerprint


def runtime_files(runtime_dir: Path) -> dict[str, Path]:
    return {
        "header": runtime_dir / "include" / PUBLIC_HEADER,
        "archive": runtime_dir / "lib" / "libkiln.a",
        "shared_library": runtime_dir / "lib" / "libkiln.so",
    }


def check_cross_toolchain(platform: RuntimePlatform) -> None:
    if not platform.has_toolchain():
        raise KilnError(
            f"the {platform.name} runtime needs the {platform.triple} C++ library; install it with "
            f"`{platform.needs_fix}`",
            path=platform.needs,
        )


def ensure_mobile_runtime(platform_name: str, progress: bool = True) -> Path:
    """The cached runtime's folder for a platform, built first when missing or stale (~2 min a
    platform on 2 cores). Built in a scratch folder beside the cache entry and renamed into place."""
    platform = runtime_platform(platform_name)
    check_cross_toolchain(platform)
    fingerprint = runtime_fingerprint(platform)
    runtime_dir = platform.runtime_dir()
    if runtime_is_built(platform, fingerprint):
        return runtime_dir
    runtime_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{platform.name}-building-", dir=runtime_dir.parent))
    staging.chmod(0o755)
    try:
        with tempfile.TemporaryDirectory(prefix="kiln-mobile-runtime-src-") as scratch:
            root = assemble_source_root(Path(scratch))
            started = time.monotonic()
            objects = _compile_sources(platform, root, staging / "obj", progress)
            files = runtime_files(staging)
            _archive(objects, files["archive"])
            _link_shared_library(platform, objects, files["shared_library"])
        files["header"].parent.mkdir(parents=True)
        shutil.copyfile(KILN_SOURCES_DIR / PUBLIC_HEADER, files["header"])
        shutil.rmtree(staging / "obj")
        info = dict(fingerprint, build_seconds=round(time.monotonic() - started, 1))
        (staging / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n")
        replace_dir(staging, runtime_dir, lambda: runtime_is_built(platform))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return runtime_dir


def unity_sources(root: Path, groups: int) -> list[Path]:
    """TVM's sources as `groups` files that include them (as the web runtime's wasm_runtime.cc does):
    its headers are most of the work, parsed once a group instead of once a file. Round robin, so
    that the large VM sources spread over the groups."""
    unity = []
    for group in range(groups):
        path = root / f"kiln_unity_{group}.cc"
        path.write_text("".join(f'#include "{name}"\n' for name in TVM_RUNTIME_SOURCES[group::groups]))
        unity.append(path)
    return unity


def _compile_sources(platform: RuntimePlatform, root: Path, out_dir: Path, progress: bool) -> list[Path]:
    """TVM's sources in one unity file per core, then Kiln's, each file on a core of its own."""
    from tqdm import tqdm

    out_dir.mkdir(parents=True)
    cores = os.cpu_count() or 1
    sources = unity_sources(root, min(cores, len(TVM_RUNTIME_SOURCES))) + kiln_sources()
    objects = [out_dir / f"{index:02d}-{source.stem}.o" for index, source in enumerate(sources)]
    flags = [*_compile_flags(platform), *include_flags(root), f"-I{KILN_SOURCES_DIR}"]
    with (
        tqdm(
            total=len(sources),
            desc=f"Kiln runtime ({platform.name})",
            unit="file",
            disable=not progress,
            file=sys.stderr,
        ) as bar,
        ThreadPoolExecutor(max_workers=cores) as pool,
    ):
        compiles = [
            pool.submit(_run_clang, [find_clang(), *flags, "-c", str(source), "-o", str(obj)], source)
            for source, obj in zip(sources, objects)
        ]
        for compiled in compiles:
            compiled.result()
            bar.update()
    return objects


def _archive(objects: list[Path], archive: Path) -> None:
    archive.parent.mkdir(parents=True, exist_ok=True)
    llvm_ar = shutil.which("llvm-ar")
    if llvm_ar is None:
        raise KilnError(f"llvm-ar is not installed; install it with `{CLANG_FIX}`")
    _run_clang([llvm_ar, "rcs", "--format=gnu", str(archive), *map(str, objects)], archive)


def _link_shared_library(platform: RuntimePlatform, objects: list[Path], library: Path) -> None:
    command = [
        find_clang(),
        *platform_flags(platform),
        "-fuse-ld=lld",
        "-shared",
        "-o",
        str(library),
        *map(str, objects),
        "-lpthread",
        "-ldl",
    ]
    _run_clang(command, library)


def link_arm64_linux_library(output: str | Path, objects: list[str], options: list[str] | None = None) -> None:
    """`fcompile` for TVM's `export_library`: a model's objects as an aarch64 Linux shared library,
    which resolves TVM's runtime symbols from the `libkiln.so` of the app that loads it."""
    command = [find_clang(), *platform_flags(RUNTIME_PLATFORMS["arm64-linux"]), "-fuse-ld=lld", "-shared"]
    _run_clang([*command, "-o", str(output), *map(str, objects), *(options or [])], Path(output))


link_arm64_linux_library.object_format = "o"


def _run_clang(command: list[str], path: Path) -> None:
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-STDERR_TAIL_LINES:])
        raise KilnError(
            f"building the mobile runtime failed (exit {result.returncode}).\n"
            f"command: {subprocess.list2cmdline(command)}\n{tail}",
            path=path,
        )


def build_mobile_runtimes(progress: bool = True) -> list[Path]:
    """The runtime of every platform whose cross toolchain this machine has."""
    return [
        ensure_mobile_runtime(platform.name, progress)
        for platform in RUNTIME_PLATFORMS.values()
        if platform.has_toolchain()
    ]


def toolchain_status() -> list[ToolStatus]:
    """`kiln doctor`'s lines for the mobile runtime: the cross toolchain and the cached builds. Optional:
    without them, only apps' runtimes cannot be built (models still compile for every target)."""
    statuses = []
    for platform in RUNTIME_PLATFORMS.values():
        if not platform.has_toolchain():
            problem = f"{platform.needs} is missing"
            statuses.append(ToolStatus(f"{platform.name} C++ library", False, problem, platform.needs_fix, True))
            continue
        built = shutil.which("clang++") is not None and runtime_is_built(platform)
        detail = f"built in {platform.runtime_dir()}" if built else f"not built for TVM {tvm_version()}"
        fix = None if built else BUILD_COMMAND
        statuses.append(ToolStatus(f"Kiln runtime ({platform.name})", built, detail, fix, optional=True))
    return statuses
