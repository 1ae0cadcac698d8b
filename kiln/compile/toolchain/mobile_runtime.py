"""The mobile runtime: TVM's C++ runtime (Relax VM, paged KV cache, thread pool, CPU device, the
shared- and system-library loaders) with Kiln's engine and C API (kiln/mobile/runtime/), as `libkiln`.

The wheels ship the runtime's sources and no runtime built for an app's platform, so Kiln compiles
them for that platform once, cached per TVM version under `~/.cache/kiln/mobile-runtime/<version>/<platform>/`
(`include/kiln.h` with `lib/libkiln.a` and `lib/libkiln.so`, or for an app's own toolchain `source/`).
The sources are laid out and patched as for the web runtime (`wasm_toolchain.assemble_source_root`).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
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
from typing import Callable

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
from kiln.compile.toolchain.system_lib import write_static_archive
from kiln.errors import KilnError

KILN_SOURCES_DIR = Path(__file__).parents[2] / "mobile" / "runtime"
PUBLIC_HEADER = "kiln.h"
BUILD_INFO = "build-info.json"
CLANG_FIX = "apt-get install -y clang lld llvm"
ARM64_LINUX_FIX = "apt-get install -y --no-install-recommends libstdc++-12-dev-arm64-cross"
BUILD_COMMAND = "kiln doctor --build-mobile-runtime"
ZIG_FIX = "pip install 'kiln-llm[ios]'"
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
COMPILE_FLAGS = ("-O2", "-fPIC", "-std=c++17", "-ffp-contract=off")
DEFINES = ("TVM_FFI_USE_LIBBACKTRACE=0", "TVM_LOG_DEBUG=0")


@dataclass(frozen=True)
class RuntimePlatform:
    """One platform `libkiln` is made for, and how (`built_with`, a key of BUILDS):
    - `clang`: this machine's clang and lld build `lib/libkiln.a` and `lib/libkiln.so`;
    - `zig`: the clang of PyPI's `ziglang`, with the Darwin and libc++ headers it carries, compiles
      `lib/libkiln.a` (an Apple app's Xcode links it; an iOS dylib would need Apple's libc++ here);
    - `sources`: `source/` holds the runtime's sources and a CMakeLists.txt that the app's own
      toolchain builds (no Android NDK or bionic headers can be had here)."""

    name: str
    triple: str
    kiln_target: str  # the target whose model libraries it loads (kiln-build.json's, by default)
    built_with: str = "clang"
    needs: str | None = None  # a file of the cross toolchain the build needs, and the package that has it
    needs_fix: str | None = None
    instrumented: tuple[str, ...] = ()  # flags for compiling and linking (a sanitizer)

    def runtime_dir(self) -> Path:
        return cache_dir() / "mobile-runtime" / tvm_version() / self.name

    def missing_tool(self) -> str | None:
        """What this machine lacks to build it, if anything."""
        if self.built_with == "zig" and zig_path() is None:
            return "PyPI's ziglang is not installed"
        if self.needs is not None and not Path(self.needs).is_file():
            return f"{self.needs} is missing"
        return None

    def has_toolchain(self) -> bool:
        return self.missing_tool() is None

    def fix(self) -> str | None:
        return ZIG_FIX if self.built_with == "zig" else self.needs_fix


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
        RuntimePlatform("iphone", "aarch64-ios.14.0", "iphone-cpu", built_with="zig"),
        RuntimePlatform("android", "aarch64-linux-android", "android-cpu", built_with="sources"),
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
    """clang's flags for compiling and linking for a `clang` platform (and for an app of it)."""
    return [*([f"--target={platform.triple}"] if platform.triple else []), *platform.instrumented]


def zig_path() -> Path | None:
    spec = importlib.util.find_spec("ziglang")
    zig = Path(spec.origin).parent / "zig" if spec is not None and spec.origin else None
    return zig if zig is not None and zig.is_file() else None


def clang_command(platform: RuntimePlatform) -> list[str]:
    return [find_clang(), *platform_flags(platform)]


def zig_command(platform: RuntimePlatform, language: str = "c++") -> list[str]:
    """zig's clang (`language`: its `c++` or `cc` driver) for an Apple triple; its Darwin headers serve
    every Apple OS, so they are named for iOS too. `-g0`: zig's driver adds debug info by default (a 64 MB
    libkiln.a where clang's builds have none)."""
    zig = zig_path()
    darwin_headers = zig.parent / "lib" / "libc" / "include" / "any-darwin-any"
    return [str(zig), language, "-target", platform.triple, "-g0", "-isystem", str(darwin_headers)]


def _kiln_defines(platform: RuntimePlatform) -> list[str]:
    """What the engine checks a model folder against (kiln/runtime.py's check_build_versions)."""
    return [
        f'KILN_VERSION="{kiln.__version__}"',
        f'KILN_TVM_VERSION="{tvm_version()}"',
        f'KILN_TARGET="{platform.kiln_target}"',
    ]


def _compile_flags(platform: RuntimePlatform) -> list[str]:
    """The flags after the platform's compiler command."""
    return [*COMPILE_FLAGS, *(f"-D{define}" for define in (*DEFINES, *_kiln_defines(platform)))]


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
    digest.update(repr((SOURCE_PATCHES, TVM_RUNTIME_SOURCES, CMAKE_LISTS)).encode())
    return digest.hexdigest()[:16]


def _compiler_version(platform: RuntimePlatform) -> str:
    build = BUILDS[platform.built_with]
    if build.compiler is None:
        return "the app's"
    # In a folder of its own: zig's driver writes an empty `a.o` even for --version.
    with tempfile.TemporaryDirectory() as scratch:
        command = [*build.compiler(platform), "--version"]
        result = subprocess.run(command, capture_output=True, text=True, check=False, cwd=scratch)
    return result.stdout.splitlines()[0] if result.stdout else "unknown"


def _platform_flags_in_use(platform: RuntimePlatform) -> list[str]:
    """What the platform's compiler command adds to the compile flags (the triple for the app's)."""
    compiler = BUILDS[platform.built_with].compiler
    return compiler(platform)[1:] if compiler else [platform.triple]


def runtime_fingerprint(platform: RuntimePlatform) -> dict:
    """What a cached runtime was made from; one with another fingerprint is made again."""
    return {
        "tvm": tvm_version(),
        "tvm_ffi": importlib.metadata.version("apache-tvm-ffi"),
        "compiler": _compiler_version(platform),
        "platform": _platform_flags_in_use(platform),
        "compile_flags": _compile_flags(platform),
        "sources": _sources_digest(),
    }


def runtime_is_built(platform: RuntimePlatform, fingerprint: dict | None = None) -> bool:
    runtime_dir = platform.runtime_dir()
    if not all(path.is_file() for path in runtime_files(platform, runtime_dir).values()):
        return False
    try:
        recorded = json.loads((runtime_dir / BUILD_INFO).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    fingerprint = fingerprint or runtime_fingerprint(platform)
    return {key: recorded.get(key) for key in fingerprint} == fingerprint


RUNTIME_FILES = {
    "header": Path("include") / PUBLIC_HEADER,
    "archive": Path("lib") / "libkiln.a",
    "shared_library": Path("lib") / "libkiln.so",
    "cmake_lists": Path("source") / "CMakeLists.txt",
}


def runtime_files(platform: RuntimePlatform, runtime_dir: Path) -> dict[str, Path]:
    """The platform's files in a runtime folder, by RUNTIME_FILES' names."""
    return {name: runtime_dir / RUNTIME_FILES[name] for name in BUILDS[platform.built_with].outputs}


def check_cross_toolchain(platform: RuntimePlatform) -> None:
    missing = platform.missing_tool()
    if missing is not None:
        raise KilnError(
            f"the {platform.name} runtime cannot be built here: {missing}; install it with `{platform.fix()}`",
            path=platform.needs,
        )


def ensure_mobile_runtime(platform_name: str, progress: bool = True) -> Path:
    """The cached runtime's folder for a platform, made first when missing or stale (~1–2 min a
    platform on 2 cores). Made in a scratch folder beside the cache entry and renamed into place."""
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
            BUILDS[platform.built_with].make(platform, root, staging, progress)
        header = staging / RUNTIME_FILES["header"]
        header.parent.mkdir(parents=True)
        shutil.copyfile(KILN_SOURCES_DIR / PUBLIC_HEADER, header)
        info = dict(fingerprint, build_seconds=round(time.monotonic() - started, 1))
        (staging / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n")
        replace_dir(staging, runtime_dir, lambda: runtime_is_built(platform))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return runtime_dir


def build_libraries(platform: RuntimePlatform, root: Path, staging: Path, progress: bool) -> None:
    """`lib/libkiln.a`, and `lib/libkiln.so` where the platform's outputs have it."""
    objects = _compile_sources(platform, root, staging / "obj", progress)
    files = runtime_files(platform, staging)
    files["archive"].parent.mkdir(parents=True)
    write_static_archive(files["archive"], objects)
    if "shared_library" in files:
        _link_shared_library(platform, objects, files["shared_library"])
    shutil.rmtree(staging / "obj")


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
    compiler = BUILDS[platform.built_with].compiler(platform)
    flags = [*compiler, *_compile_flags(platform), *include_flags(root), f"-I{KILN_SOURCES_DIR}"]
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
            pool.submit(_run_clang, [*flags, "-c", str(source), "-o", str(obj)], source)
            for source, obj in zip(sources, objects)
        ]
        for compiled in compiles:
            compiled.result()
            bar.update()
    return objects


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


# The runtime for an app's own toolchain (the Android NDK's, through Gradle's externalNativeBuild):
# the same sources and flags as the builds here, as a CMake project.
CMAKE_LISTS = """cmake_minimum_required(VERSION 3.18)
project(kiln LANGUAGES CXX)
# Kiln's runtime and C API (include/kiln.h) for {platform}: TVM {tvm}'s runtime with Kiln's engine.
# From an app's CMakeLists.txt: add_subdirectory(<this folder> kiln), then link `kiln` and the
# models' archive whole (-Wl,--whole-archive ... -Wl,--no-whole-archive).
add_library(kiln
{sources})
set_target_properties(kiln PROPERTIES CXX_STANDARD 17 CXX_STANDARD_REQUIRED ON POSITION_INDEPENDENT_CODE ON)
target_include_directories(kiln PUBLIC include PRIVATE kiln {include_dirs})
target_compile_options(kiln PRIVATE {options})
target_compile_definitions(kiln PRIVATE {defines})
find_package(Threads REQUIRED)
target_link_libraries(kiln PRIVATE Threads::Threads ${{CMAKE_DL_LIBS}})
"""


# TVM's sources as two unity files (as built here on two cores): each parses TVM's headers once.
SOURCE_TREE_UNITY_FILES = 2


def cmake_quoted(argument: str) -> str:
    return '"' + argument.replace('"', r"\"") + '"'


def write_source_tree(platform: RuntimePlatform, root: Path, staging: Path, progress: bool) -> None:
    """`source/`: TVM's runtime sources the build compiles (with every header), Kiln's, and CMakeLists.txt."""
    source = staging / RUNTIME_FILES["cmake_lists"].parent
    compiled = set(TVM_RUNTIME_SOURCES)

    def unused(folder: str, names: list[str]) -> list[str]:
        relative = Path(folder).relative_to(root)
        return [n for n in names if n.endswith(".cc") and (relative / n).as_posix() not in compiled]

    for sub in ("include", "src", "3rdparty"):
        shutil.copytree(root / sub, source / "tvm" / sub, ignore=unused)
    shutil.copytree(KILN_SOURCES_DIR, source / "kiln", ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    (source / "include").mkdir()
    shutil.copyfile(KILN_SOURCES_DIR / PUBLIC_HEADER, source / "include" / PUBLIC_HEADER)
    unity = unity_sources(source / "tvm", SOURCE_TREE_UNITY_FILES)
    sources = [f"tvm/{path.name}" for path in unity] + [f"kiln/{path.name}" for path in kiln_sources()]
    include_dirs = [(Path("tvm") / flag[2:]).as_posix() for flag in include_flags(Path("."))]
    text = CMAKE_LISTS.format(
        platform=platform.name,
        tvm=tvm_version(),
        sources="".join(f"  {name}\n" for name in sources),
        include_dirs=" ".join(include_dirs),
        options=" ".join(flag for flag in COMPILE_FLAGS if not flag.startswith(("-std", "-fPIC"))),
        defines=" ".join(cmake_quoted(define) for define in (*DEFINES, *_kiln_defines(platform))),
    )
    (source / "CMakeLists.txt").write_text(text)


@dataclass(frozen=True)
class RuntimeBuild:
    """How a platform's runtime is made: what comes out (RUNTIME_FILES' names), the step that makes
    it from the assembled sources, and the compiler it runs (None: the app's)."""

    outputs: tuple[str, ...]
    make: Callable[[RuntimePlatform, Path, Path, bool], None]
    compiler: Callable[[RuntimePlatform], list[str]] | None


BUILDS = {
    "clang": RuntimeBuild(("header", "archive", "shared_library"), build_libraries, clang_command),
    "zig": RuntimeBuild(("header", "archive"), build_libraries, zig_command),
    "sources": RuntimeBuild(("header", "cmake_lists"), write_source_tree, None),
}


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
    """`kiln doctor`'s lines for the mobile runtime: the cross toolchains and the cached builds. Optional:
    without them, only apps' runtimes cannot be built (models still compile for every target)."""
    statuses = []
    for platform in RUNTIME_PLATFORMS.values():
        missing = platform.missing_tool()
        if missing is not None:
            statuses.append(ToolStatus(f"{platform.name} toolchain", False, missing, platform.fix(), True))
            continue
        try:
            built = runtime_is_built(platform)
        except KilnError:  # no clang++: the runtime cannot be checked, let alone built
            built = False
        detail = f"built in {platform.runtime_dir()}" if built else f"not built for TVM {tvm_version()}"
        fix = None if built else BUILD_COMMAND
        statuses.append(ToolStatus(f"Kiln runtime ({platform.name})", built, detail, fix, optional=True))
    return statuses
