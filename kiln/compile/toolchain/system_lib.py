"""System-library builds for apps (Android, iOS, macOS): object files an app links statically.

A system library registers its functions in the TVM runtime's process-wide table under a prefix
when the app starts; the app finds a model by that prefix (`<model_lib>_`, as MLC's apps do).
Kiln writes each build twice: `libs/<model-id>-<target>.tar` (the objects, MLC's format) and
`libs/lib<model-id>-<target>.a` (a static archive with a symbol table for the platform's linker).

TVM names a model's host functions `__tvm_ffi_<kernel>` and emits its own half-float helpers, the
same names in every model; two models in one app would collide at link time. So every defined
global symbol of a model's objects gets the model's prefix too (references inside the object
follow; the runtime finds functions through the registration table, not by symbol name).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import KilnError

# The symbol an app's runtime looks up to find a model: `<prefix>__tvm_ffi__library_bin`.
LIBRARY_BIN_SYMBOL = "__tvm_ffi__library_bin"


@dataclass(frozen=True)
class ObjectFormat:
    archive_format: str  # llvm-ar --format: the symbol index the platform's linker reads
    symbol_prefix: str  # what the format puts before a C name


OBJECT_FORMATS = {"elf": ObjectFormat("gnu", ""), "macho": ObjectFormat("darwin", "_")}


def object_format(obj: Path) -> str:
    with open(obj, "rb") as f:
        magic = f.read(4)
    if magic == b"\x7fELF":
        return "elf"
    if magic == b"\xcf\xfa\xed\xfe":
        return "macho"
    raise KilnError("not an ELF or 64-bit Mach-O object", obj)


def system_lib_prefix(model_id: str) -> str:
    """`<model_lib>_`: the model id as a C identifier (MLC turns '-' into '_' the same way)."""
    return re.sub(r"[^A-Za-z0-9_]", "_", model_id) + "_"


def model_lib(prefix: str) -> str:
    """The name an app config gives a library (`model_lib`): its prefix without the last '_'."""
    return prefix[:-1]


def static_archive_path(library: Path) -> Path:
    """`libs/<model-id>-<target>.tar` → `libs/lib<model-id>-<target>.a`."""
    return library.with_name(f"lib{library.stem}.a")


def llvm_tool(name: str, package: str = "llvm") -> str:
    """An LLVM tool (`llvm-ar`, `llvm-nm`, `llvm-objcopy`, `ld.lld`), unversioned or the newest
    versioned one: they read ELF and Mach-O objects of any architecture, unlike GNU binutils."""
    found = shutil.which(name) or next(
        (shutil.which(f"{name}-{v}") for v in range(30, 13, -1) if shutil.which(f"{name}-{v}")), None
    )
    if not found:
        raise KilnError(f"{name} is missing (it handles objects for phones); fix: apt-get install -y {package}")
    return found


def llvm_tool_version(name: str) -> str:
    """The tool's version line (`LLVM version 14.0.6`), for the build record."""
    lines = run_tool([llvm_tool(name), "--version"]).splitlines()
    return next((line.strip() for line in lines if "version" in line), lines[0].strip())


def run_tool(command: list[str]) -> str:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise KilnError(f"{Path(command[0]).name} failed: {result.stderr.strip()}")
    return result.stdout


def defined_globals(obj: Path) -> list[str]:
    """Names of the global symbols `obj` defines (as the object spells them)."""
    out = run_tool([llvm_tool("llvm-nm"), "--defined-only", "--extern-only", "--format=just-symbols", str(obj)])
    return [line for line in out.splitlines() if line]


def namespace_symbols(obj: Path, prefix: str) -> None:
    """Rename every defined global of `obj` not yet under `prefix` to `prefix + name`."""
    symbol_prefix = OBJECT_FORMATS[object_format(obj)].symbol_prefix
    renames = []
    for symbol in defined_globals(obj):
        name = symbol[len(symbol_prefix) :] if symbol.startswith(symbol_prefix) else symbol
        if not name.startswith(prefix):
            renames.append(f"{symbol} {symbol_prefix}{prefix}{name}\n")
    if renames:
        with tempfile.NamedTemporaryFile("w", suffix=".txt") as table:
            table.writelines(renames)
            table.flush()
            run_tool([llvm_tool("llvm-objcopy"), f"--redefine-syms={table.name}", str(obj)])


def write_static_archive(path: Path, objects: list[Path]) -> None:
    """An `ar` archive with a symbol index in the layout the objects' linker expects."""
    archive_format = OBJECT_FORMATS[object_format(objects[0])].archive_format
    partial = path.with_name(path.name + ".partial")
    partial.unlink(missing_ok=True)
    run_tool([llvm_tool("llvm-ar"), f"--format={archive_format}", "rcsD", str(partial), *map(str, objects)])
    partial.rename(path)


def write_object_tar(path: Path, objects: list[Path]) -> None:
    with tarfile.open(path, "w") as tar:
        for obj in objects:
            tar.add(obj, arcname=obj.name)


def tar_objects(tar_path: Path, into: Path) -> list[Path]:
    """Unpack a library's `.tar` into `into`; the object files, in archive order."""
    with tarfile.open(tar_path) as tar:
        members = [m for m in tar.getmembers() if m.isfile() and m.name.endswith(".o") and "/" not in m.name]
        tar.extractall(into, members=members, filter="data")
    return [into / m.name for m in members]


def host_system_lib_prefix(executable) -> str:
    (host,) = [m for m in executable.mod._collect_dso_modules() if m.kind == "llvm"]
    return str(host.get_function("__tvm_get_system_lib_prefix")())


def export_system_library(executable, path: Path) -> None:
    """Write `path` (.tar of objects) and its static archive; object names and global symbols
    carry the system-lib prefix so that several models link into one app."""
    prefix = host_system_lib_prefix(executable)

    def write_tar_and_archive(_output: str, files: list[str]) -> None:
        objects = []
        for file in map(Path, files):
            obj = file if file.name.startswith(prefix) else file.rename(file.with_name(prefix + file.name))
            namespace_symbols(obj, prefix)
            objects.append(obj)
        write_object_tar(path, objects)
        write_static_archive(static_archive_path(path), objects)

    write_tar_and_archive.object_format = "o"
    executable.export_library(str(path), fcompile=write_tar_and_archive)


def toolchain_status() -> list:
    """`kiln doctor` lines for the mobile targets: the LLVM tools that archive their objects, and
    what this machine can do with the result (build and check, not run)."""
    from kiln.compile.toolchain.wasm_toolchain import ToolStatus

    statuses = []
    for name in ("llvm-ar", "llvm-nm", "llvm-objcopy"):
        try:
            statuses.append(ToolStatus(name, True, llvm_tool(name)))
        except KilnError:
            statuses.append(ToolStatus(name, False, "not found on PATH", "apt-get install -y llvm"))
    statuses.append(
        ToolStatus(
            "mobile targets",
            True,
            "android, iphone and metal build here; the TVM runtime here has no OpenCL or Metal "
            "device, so their libraries are checked, not run (android-cpu's run on arm64 under qemu)",
        )
    )
    return statuses
