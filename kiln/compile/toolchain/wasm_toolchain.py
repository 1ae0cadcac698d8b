"""The wasm toolchain: build TVM's web runtime from the installed wheels and link model libraries.

A model library for the browser is one `.wasm` holding the model's kernels, its Relax VM
executable and TVM's C++ runtime. The PyPI wheels ship the runtime's sources but no built
runtime, so Kiln compiles them once with emscripten into wasm object files, cached per
TVM version under `~/.cache/kiln/web-runtime/<version>/`, and links every model against them.

The CPU `wasm` library is threaded (docs/wasm-threads.md): its runtime is a second flavor,
compiled with atomics beside Kiln's thread pool (`kiln_threads.cc`), cached in `<version>-threads/`
and linked on shared, imported memory against emscripten's multi-threaded system libraries.
"""

from __future__ import annotations

import ctypes.util
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
from typing import Callable, Sequence

from kiln.errors import KilnError

HEADERS_DIR = Path(__file__).parent / "web_runtime_headers"
RUNTIME_SOURCES = ("wasm_runtime.cc", "tvmjs_support.cc", "webgpu_runtime.cc")
THREAD_POOL_SOURCE = Path(__file__).parent / "kiln_threads.cc"
BUILD_INFO = "build-info.json"

COMPILE_FLAGS = ["-O3", "-std=c++17", "-Wno-ignored-attributes"]
# TOTAL_MEMORY matches what tvm.support.emcc.create_tvmjs_wasm gives MLC/WebLLM model libraries.
LINK_FLAGS = [
    "-std=c++17",
    "--no-entry",
    "-s",
    "WASM_BIGINT=1",
    "-s",
    "ALLOW_MEMORY_GROWTH=1",
    "-s",
    "STANDALONE_WASM=1",
    "-s",
    "ERROR_ON_UNDEFINED_SYMBOLS=0",
    "-s",
    "TOTAL_MEMORY=160MB",
]
# -O1 links in ~2 s; -O3 runs binaryen's full optimizer (40-130 s here) for a 43% smaller
# file (3.6 vs 6.3 MB, 0.66 vs 0.85 MB gzipped) and no measurable speed gain: the runtime
# objects are already clang -O3 and the kernels LLVM -O3. Pass options=["-O3"] for a release.
LINK_OPT_LEVEL = "-O1"

EMSCRIPTEN_FIX = "apt-get install -y emscripten"
NODE_FIX = "apt-get install -y nodejs"
CHROMIUM_FIX = "apt-get install -y chromium"
CHROMIUM_PATHS = (Path("/usr/lib/chromium/chromium"), Path("/usr/bin/chromium"))
SWIFTSHADER_ICD = Path("/usr/lib/chromium/vk_swiftshader_icd.json")
VULKAN_ICD_DIRS = ("/usr/share/vulkan/icd.d", "/etc/vulkan/icd.d")
BUILD_RUNTIME_COMMAND = "kiln doctor --build-runtime"


@dataclass(frozen=True)
class SourcePatch:
    """One exact text replacement in the wheel's runtime sources, applied before compiling."""

    file: str  # under the source root
    old: str
    new: str


# TVM 0.27's paged KV cache gives each depth one page table on devices other than CUDA and CPU, and
# per-layer sliding windows (Gemma's local layers) copy their own page table into it after the full
# layers': on WebGPU the global layers then read only the window's pages. The merged auxiliary buffer
# CUDA and CPU use keeps every table apart, and every attention kernel takes its tables' offsets.
SOURCE_PATCHES = (
    SourcePatch(
        "src/runtime/vm/paged_kv_cache.cc",
        "    if (device_.device_type == DLDeviceType::kDLCUDA ||\n"
        "        device_.device_type == DLDeviceType::kDLCPU) {",
        "    if (device_.device_type == DLDeviceType::kDLCUDA ||\n"
        "        device_.device_type == DLDeviceType::kDLCPU ||\n"
        "        device_.device_type == DLDeviceType::kDLWebGPU) {",
    ),
    # That merged buffer is 32M int32 on the host and 32M on the device whatever the model: 256 MB of
    # a CPU library's wasm memory, 128 MB of it and 128 MB of GPU buffers on WebGPU. TVM's own sizing
    # (left unused upstream) counts every table once; twice that covers the per-layer window's copies,
    # a few KB to a few hundred for one sequence, and each copy is checked against it.
    SourcePatch(
        "src/runtime/vm/attn_utils.h",
        "    int64_t attn_aux_data_cache_size = 32 * 1024 * 1024;",
        "    int64_t attn_aux_data_cache_size =\n"
        "        2 * CalculateAttnAuxDataCacheSize(reserved_num_seqs, num_total_pages, prefill_chunk_size);",
    ),
    SourcePatch(
        "src/runtime/vm/attn_utils.h",
        "  Tensor CopyAttnAuxVecToCache(HostMemoryVector* data) {\n    int64_t n_elem = data->size();\n",
        "  Tensor CopyAttnAuxVecToCache(HostMemoryVector* data) {\n    int64_t n_elem = data->size();\n"
        "    TVM_FFI_ICHECK_LE(attn_aux_data_copy_offset_ + n_elem, merged_attn_aux_data_device_->shape[0])\n"
        '        << "the KV cache\'s auxiliary arrays outgrew their buffer";\n',
    ),
)


@dataclass(frozen=True)
class RuntimeFlavor:
    """One build of the web runtime's objects, and how a library links against it."""

    suffix: str  # of the cache folder's name
    compile_flags: tuple[str, ...] = ()  # after COMPILE_FLAGS
    kiln_sources: tuple[Path, ...] = ()
    link_flags: Callable[[], list[str]] = list  # after LINK_FLAGS


PLAIN_RUNTIME = RuntimeFlavor("")
THREADED_RUNTIME = RuntimeFlavor(
    "-threads", ("-matomics", "-mbulk-memory"), (THREAD_POOL_SOURCE,), lambda: threaded_link_flags()
)
RUNTIME_FLAVORS = (PLAIN_RUNTIME, THREADED_RUNTIME)
# The pool's entry points for the engine, and the parallel runtime calls it takes over (--wrap
# sends TVM's kernels to __wrap_X; the pool calls __real_X on the thread that owns the VM).
THREAD_POOL_EXPORTS = (
    "kiln_threads_adopt_main_thread",
    "kiln_threads_reserve",
    "kiln_threads_helper_enter",
    "kiln_threads_helper_loop",
    "kiln_threads_stop",
    "kiln_threads_count",
)
THREAD_POOL_WRAPS = (
    "TVMBackendParallelLaunch",
    "TVMBackendParallelBarrier",
    "TVMBackendAllocWorkspace",
    "TVMBackendFreeWorkspace",
)
# emcc refuses STANDALONE_WASM with pthreads, so it would link the single-threaded system libraries,
# which wasm-ld refuses on shared memory: the threaded link names the "-mt" builds itself. The list
# is what emcc 3.1.6 links for STANDALONE_WASM, each with its multi-threaded build where one exists.
THREADED_SYSTEM_LIBRARIES = (
    "standalonewasm-memgrow",
    "stubs",
    "noexit",
    "c-mt",
    "dlmalloc-mt",
    "compiler_rt-mt",
    "c++-mt-noexcept",
    "c++abi-mt-noexcept",
    "sockets-mt",
)
# The most a page's shared memory can grow to: it is reserved up front, unlike unshared memory.
THREADED_MAXIMUM_MEMORY = "4GB"
# Debian's emscripten runs its JS tools with node and needs Debian's node modules (acorn).
DEBIAN_NODE_MODULES = "/usr/share/nodejs"
STDERR_TAIL_LINES = 25


@dataclass(frozen=True)
class ToolStatus:
    """One line of `kiln doctor`: a tool, whether it is usable, what was found, how to fix it."""

    name: str
    ok: bool
    detail: str
    fix: str | None = None
    optional: bool = False  # missing, it disables one check, not a build: `kiln doctor` still passes


def cache_dir() -> Path:
    return Path(os.environ.get("KILN_CACHE_DIR") or Path.home() / ".cache" / "kiln")


def tvm_version() -> str:
    return importlib.metadata.version("apache-tvm")


def web_runtime_dir(flavor: RuntimeFlavor = PLAIN_RUNTIME) -> Path:
    return cache_dir() / "web-runtime" / (tvm_version() + flavor.suffix)


def _runtime_sources(root: Path, flavor: RuntimeFlavor) -> list[Path]:
    return [root / "web" / "emcc" / name for name in RUNTIME_SOURCES] + list(flavor.kiln_sources)


def web_runtime_objects(runtime_dir: Path | None = None, flavor: RuntimeFlavor = PLAIN_RUNTIME) -> list[Path]:
    runtime_dir = runtime_dir or web_runtime_dir(flavor)
    return [runtime_dir / source.with_suffix(".o").name for source in _runtime_sources(Path(), flavor)]


def emcc_environment() -> dict[str, str]:
    env = dict(os.environ)
    if Path(DEBIAN_NODE_MODULES).is_dir():
        paths = [p for p in env.get("NODE_PATH", "").split(os.pathsep) if p]
        if DEBIAN_NODE_MODULES not in paths:
            env["NODE_PATH"] = os.pathsep.join(paths + [DEBIAN_NODE_MODULES])
    return env


def find_emcc() -> str:
    emcc = shutil.which("emcc")
    if emcc is None:
        raise KilnError(f"emcc (emscripten) is not installed; install it with `{EMSCRIPTEN_FIX}`")
    return emcc


def emcc_version() -> str:
    return _first_line_of([find_emcc(), "--version"], emcc_environment()) or "unknown"


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise KilnError(f"Python package {name!r} is not installed (pip install apache-tvm)")
    return Path(next(iter(spec.submodule_search_locations)))


def _headers_digest(flavor: RuntimeFlavor) -> str:
    """Kiln's headers, source patches and, for a flavor that has them, Kiln's own sources."""
    digest = hashlib.sha256()
    for header in sorted(HEADERS_DIR.rglob("*.h")):
        digest.update(header.relative_to(HEADERS_DIR).as_posix().encode())
        digest.update(header.read_bytes())
    digest.update(repr(SOURCE_PATCHES).encode())
    for source in flavor.kiln_sources:
        digest.update(source.read_bytes())
    return digest.hexdigest()[:16]


def _compile_flags(flavor: RuntimeFlavor) -> list[str]:
    return [*COMPILE_FLAGS, *flavor.compile_flags]


def runtime_fingerprint(flavor: RuntimeFlavor = PLAIN_RUNTIME) -> dict:
    """What the cached objects were built from; a cache with a different fingerprint is rebuilt."""
    return {
        "tvm": tvm_version(),
        "tvm_ffi": importlib.metadata.version("apache-tvm-ffi"),
        "emcc": emcc_version(),
        "compile_flags": _compile_flags(flavor),
        "headers": _headers_digest(flavor),
    }


def web_runtime_is_built(
    runtime_dir: Path | None = None, fingerprint: dict | None = None, flavor: RuntimeFlavor = PLAIN_RUNTIME
) -> bool:
    runtime_dir = runtime_dir or web_runtime_dir(flavor)
    info_path = runtime_dir / BUILD_INFO
    if not info_path.is_file() or not all(p.is_file() for p in web_runtime_objects(runtime_dir, flavor)):
        return False
    try:
        recorded = json.loads(info_path.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    fingerprint = fingerprint or runtime_fingerprint(flavor)
    return {key: recorded.get(key) for key in fingerprint} == fingerprint


def assemble_source_root(root: Path) -> Path:
    """Lay out the wheels' runtime sources the way TVM's repository does, plus Kiln's headers.

    Copies, not symlinks: the sources include each other by relative paths ("../../src/...")
    that resolve against the real location of a symlinked folder.
    """
    tvm_dir, ffi_dir = _package_dir("tvm"), _package_dir("tvm_ffi")
    layout = {
        tvm_dir / "web" / "emcc": root / "web" / "emcc",
        tvm_dir / "src" / "runtime": root / "src" / "runtime",
        tvm_dir / "include": root / "include",
        ffi_dir / "src": root / "3rdparty" / "tvm-ffi" / "src",
        ffi_dir / "include": root / "3rdparty" / "tvm-ffi" / "include",
        ffi_dir / "3rdparty" / "dlpack": root / "3rdparty" / "tvm-ffi" / "3rdparty" / "dlpack",
    }
    for source, destination in layout.items():
        if not source.is_dir():
            raise KilnError("the installed TVM wheel lacks the web runtime sources expected here", path=source)
        shutil.copytree(source, destination, ignore=shutil.ignore_patterns("__pycache__"))
    for header in HEADERS_DIR.rglob("*.h"):
        destination = root / header.relative_to(HEADERS_DIR)
        if not destination.exists():  # a wheel that ships the header knows it better
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(header, destination)
    for patch in SOURCE_PATCHES:
        source = root / patch.file
        text = source.read_text()
        if text.count(patch.old) != 1:
            raise KilnError("the installed TVM wheel's runtime source differs from the one Kiln patches", path=source)
        source.write_text(text.replace(patch.old, patch.new))
    return root


def include_flags(root: Path) -> list[str]:
    return [
        f"-I{root / sub}"
        for sub in (
            ".",
            "include",
            "3rdparty/tvm-ffi/include",
            "3rdparty/tvm-ffi/3rdparty/dlpack/include",
            "3rdparty/compiler-rt",
        )
    ]


def _run_emcc(command: list[str], what: str, path: Path) -> None:
    result = subprocess.run(command, capture_output=True, text=True, env=emcc_environment(), check=False)
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-STDERR_TAIL_LINES:])
        raise KilnError(
            f"emcc failed {what} (exit {result.returncode}).\ncommand: {subprocess.list2cmdline(command)}\n{tail}",
            path=path,
        )


def build_web_runtimes(progress: bool = True, flavors: Sequence[RuntimeFlavor] = RUNTIME_FLAVORS) -> list[Path]:
    """The flavors of the web runtime (each unless cached), built side by side: emcc compiles one file
    on one core, and a flavor is mostly one file (wasm_runtime.cc, 3 minutes on this project's CI machines)."""
    if not flavors:
        return []
    with ThreadPoolExecutor(max_workers=len(flavors)) as pool:
        builds = [
            pool.submit(build_web_runtime, progress=progress, flavor=flavor, position=position)
            for position, flavor in enumerate(flavors)
        ]
        return [build.result() for build in builds]


def build_web_runtime(
    force: bool = False, progress: bool = True, flavor: RuntimeFlavor = PLAIN_RUNTIME, position: int = 0
) -> Path:
    """Compile TVM's web runtime (~1.5–3 min a flavor) to wasm objects; return their folder.

    The objects are built in a scratch folder next to the cache entry and renamed into place,
    so an interrupted build leaves no half-filled cache.
    """
    runtime_dir = web_runtime_dir(flavor)
    emcc = find_emcc()
    fingerprint = runtime_fingerprint(flavor)
    if not force and web_runtime_is_built(runtime_dir, fingerprint, flavor):
        return runtime_dir
    runtime_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{runtime_dir.name}-building-", dir=runtime_dir.parent))
    staging.chmod(0o755)
    try:
        with tempfile.TemporaryDirectory(prefix="kiln-web-runtime-src-") as scratch:
            root = assemble_source_root(Path(scratch))
            timings = _compile_runtime_sources(emcc, root, staging, progress, flavor, position)
        info = dict(fingerprint, link_flags=LINK_FLAGS, compile_seconds=timings)
        (staging / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n")
        replace_dir(staging, runtime_dir, lambda: web_runtime_is_built(runtime_dir, flavor=flavor))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return runtime_dir


def _compile_runtime_sources(
    emcc: str, root: Path, out_dir: Path, progress: bool, flavor: RuntimeFlavor, position: int
) -> dict:
    from tqdm import tqdm

    timings = {}
    description = "TVM web runtime" + (f" ({flavor.suffix.lstrip('-')})" if flavor.suffix else "")
    bar = tqdm(
        _runtime_sources(root, flavor),
        desc=description,
        unit="file",
        disable=not progress,
        file=sys.stderr,
        position=position,
    )
    for source in bar:
        bar.set_postfix_str(f"emcc {source.name}")
        started = time.monotonic()
        _run_emcc(
            [
                emcc,
                *_compile_flags(flavor),
                *include_flags(root),
                "-c",
                str(source),
                "-o",
                str(out_dir / source.with_suffix(".o").name),
            ],
            f"compiling {source.name}",
            source,
        )
        timings[source.name] = round(time.monotonic() - started, 1)
    bar.close()
    return timings


def replace_dir(new: Path, target: Path, is_built: Callable[[], bool]) -> None:
    """Move the cache entry `new` to `target`, replacing a stale `target` (rename is atomic; rmtree
    comes after). When another process installed a build first (`is_built()`), theirs is as good."""
    stale = None
    if target.exists():
        stale = Path(tempfile.mkdtemp(prefix=f".{target.name}-stale-", dir=target.parent))
        target.rename(stale / target.name)
    try:
        new.rename(target)
    except OSError:
        if not is_built():
            raise
    if stale is not None:
        shutil.rmtree(stale, ignore_errors=True)


def ensure_web_runtime(progress: bool = True, flavor: RuntimeFlavor = PLAIN_RUNTIME) -> Path:
    """The cached web runtime's folder, building it first when missing or stale."""
    return build_web_runtime(force=False, progress=progress, flavor=flavor)


def emscripten_system_library_dir() -> Path:
    cache = _first_line_of([shutil.which("em-config") or "em-config", "CACHE"], emcc_environment())
    if not cache:
        raise KilnError(f"em-config CACHE failed: emscripten is not usable; reinstall it with `{EMSCRIPTEN_FIX}`")
    return Path(cache) / "sysroot" / "lib" / "wasm32-emscripten"


def threaded_link_flags() -> list[str]:
    """Shared, imported memory, the pool's wraps and exports, and the multi-threaded system libraries."""
    library_dir = emscripten_system_library_dir()
    required = [library_dir / "crt1_reactor.o", *(library_dir / f"lib{name}.a" for name in THREADED_SYSTEM_LIBRARIES)]
    missing = [path.name for path in required if not path.is_file()]
    if missing:
        raise KilnError(f"emscripten's system libraries lack {', '.join(missing)}", path=library_dir)
    return [
        "-Wl,--shared-memory",
        "-Wl,--import-memory",
        "-s",
        f"MAXIMUM_MEMORY={THREADED_MAXIMUM_MEMORY}",
        *(f"-Wl,--wrap={name}" for name in THREAD_POOL_WRAPS),
        "-s",
        "EXPORTED_FUNCTIONS=" + ",".join(f"_{name}" for name in THREAD_POOL_EXPORTS),
        "-nostdlib",
        str(required[0]),
        *(f"-l{name}" for name in THREADED_SYSTEM_LIBRARIES),
    ]


def _link_wasm(
    output: str | Path, objects: Sequence[str | Path], options: Sequence[str] | str | None, flavor: RuntimeFlavor
) -> None:
    output = Path(output)
    emcc = find_emcc()
    runtime_objects = web_runtime_objects(ensure_web_runtime(flavor=flavor), flavor)
    if isinstance(options, str):
        options = [options]
    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".kiln-link-", dir=output.parent) as scratch:
        partial = Path(scratch) / output.name
        command = [
            emcc,
            LINK_OPT_LEVEL,
            *LINK_FLAGS,
            *flavor.link_flags(),
            "-o",
            str(partial),
            *map(str, runtime_objects),
            *map(str, objects),
            *(options or []),
        ]
        _run_emcc(command, "linking the model library", output)
        os.replace(partial, output)


def link_tvmjs_wasm(
    output: str | Path, objects: Sequence[str | Path], options: Sequence[str] | str | None = None
) -> None:
    """`fcompile` for TVM's `export_library`: link model objects with the web runtime into a .wasm.

    `object_format = "o"` makes TVM write wasm object files: its default, LLVM 22 bitcode,
    is rejected by emscripten's wasm-ld 14. `options` are extra emcc flags, placed last so
    they win: `export_library(path, fcompile=link_tvmjs_wasm, options=["-O3"])` gives the
    smaller release file. The first link builds the web runtime if it is not cached.
    """
    _link_wasm(output, objects, options, PLAIN_RUNTIME)


def link_threaded_wasm(
    output: str | Path, objects: Sequence[str | Path], options: Sequence[str] | str | None = None
) -> None:
    """`link_tvmjs_wasm` for the CPU library: the threaded runtime, on shared imported memory.

    The engine runs it on as many Web Workers as the page allows, or on one thread when the page
    is not cross-origin isolated (web/src/wasm-threads.js).
    """
    _link_wasm(output, objects, options, THREADED_RUNTIME)


for _fcompile in (link_tvmjs_wasm, link_threaded_wasm):
    _fcompile.object_format = "o"
    _fcompile.need_system_lib = True


def dawn_node_environment() -> dict[str, str]:
    """The environment in which Node's WebGPU (npm `webgpu`, Dawn) finds a Vulkan device.

    Without a GPU driver it uses Chromium's SwiftShader; Debian's chromium ships the Vulkan
    loader too, which Dawn loads when the system has no libvulkan1.
    """
    env = dict(os.environ)
    if "XDG_RUNTIME_DIR" not in env:
        runtime_dir = cache_dir() / "xdg-runtime"
        runtime_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        env["XDG_RUNTIME_DIR"] = str(runtime_dir)
    has_driver = any(Path(d).is_dir() and any(Path(d).glob("*.json")) for d in VULKAN_ICD_DIRS)
    if "VK_ICD_FILENAMES" not in env and not has_driver and SWIFTSHADER_ICD.is_file():
        env["VK_ICD_FILENAMES"] = str(SWIFTSHADER_ICD)
    chromium_dir = SWIFTSHADER_ICD.parent
    if ctypes.util.find_library("vulkan") is None and (chromium_dir / "libvulkan.so.1").is_file():
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (env.get("LD_LIBRARY_PATH"), str(chromium_dir)) if p)
    return env


def find_chromium() -> Path | None:
    return next((p for p in CHROMIUM_PATHS if p.is_file() and os.access(p, os.X_OK)), None)


def _first_line_of(command: list[str], env: dict | None = None) -> str | None:
    """The first line a `--version` style command prints, or None when it does not run."""
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = (result.stdout or result.stderr).strip().splitlines()
    return lines[0].strip() if result.returncode == 0 and lines else None


def _status(name: str, ok: bool, detail: str, fix: str) -> ToolStatus:
    return ToolStatus(name, ok, detail, None if ok else fix)


def _tvm_status() -> ToolStatus:
    try:
        versions = f"apache-tvm {tvm_version()}, apache-tvm-ffi {importlib.metadata.version('apache-tvm-ffi')}"
    except importlib.metadata.PackageNotFoundError as missing:
        return _status("TVM", False, f"{missing} is not installed", "pip install apache-tvm==0.27.0.post1")
    return _status("TVM", True, versions, "")


def _command_status(name: str, program: str, fix: str, env: dict | None = None) -> ToolStatus:
    path = shutil.which(program)
    version = path and _first_line_of([path, "--version"], env)
    if not version:
        return _status(name, False, f"{program} not found on PATH" if not path else f"{path} --version failed", fix)
    return _status(name, True, f"{version} ({path})", fix)


def _chromium_status() -> ToolStatus:
    chromium = find_chromium()
    if chromium is None:
        return _status("Chromium", False, "not found at " + " or ".join(map(str, CHROMIUM_PATHS)), CHROMIUM_FIX)
    version = _first_line_of([str(chromium), "--version"]) or "version unknown"
    return _status("Chromium", True, f"{version} ({chromium})", CHROMIUM_FIX)


def _web_runtime_status(tvm_ok: bool, emcc_ok: bool) -> ToolStatus:
    if not (tvm_ok and emcc_ok):
        return _status("TVM web runtime", False, "needs TVM and emcc first", BUILD_RUNTIME_COMMAND)
    stale = [web_runtime_dir(flavor) for flavor in RUNTIME_FLAVORS if not web_runtime_is_built(flavor=flavor)]
    if not stale:
        return _status("TVM web runtime", True, f"built in {web_runtime_dir().parent}", BUILD_RUNTIME_COMMAND)
    return _status(
        "TVM web runtime",
        False,
        f"not built for TVM {tvm_version()} with this emcc and Kiln's sources (cache: {', '.join(map(str, stale))})",
        BUILD_RUNTIME_COMMAND,
    )


def toolchain_status() -> list[ToolStatus]:
    """The state of every tool a browser build needs, for `kiln doctor`."""
    tvm = _tvm_status()
    emcc = _command_status("emcc", "emcc", EMSCRIPTEN_FIX, emcc_environment())
    node = _command_status("node", "node", NODE_FIX)
    return [tvm, emcc, node, _chromium_status(), _web_runtime_status(tvm.ok, emcc.ok)]
