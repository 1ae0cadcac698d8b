"""`kiln package`: app bundles from compiled models, one per platform (what MLC's `package` gives).

The config (`kiln-package.json`) names the platforms and the models; a model is a compiled model
folder (`kiln compile … --target android,iphone`), relative paths taken from the config's folder:

    {"platforms": ["android", "iphone"],
     "model_list": [{"model": "dist/SmolLM2-135M-Instruct-q4f16_1", "model_id": "SmolLM2-135M",
                     "bundle_weight": true, "estimated_vram_bytes": 300000000}]}

MLC's `"device": "iphone"` is read as a one-platform list. Each platform gets
`<output>/bundle-<platform>/`: the models' libraries in `lib/` (a system-library platform's objects
in one archive, `libmodel_<platform>.a`; arm64-linux's shared libraries beside Kiln's runtime
`libkiln.so`), `include/kiln.h` (Kiln's C API) with the platform's bindings (Java for Android, a Swift
module map for Apple), `mlc-app-config.json`, the weights of models with `bundle_weight` under
`<model_id>/`, and `BUNDLE.md` (what to link and how). Everything is checked before anything is
written; bundles are built in a temporary folder and renamed into place.
"""

from __future__ import annotations

import importlib.metadata
import json
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kiln.app_config import MODEL_FILES, CompiledModel, model_needs, read_compiled_model
from kiln.compile.pipeline import MODEL_ID
from kiln.compile.toolchain.mobile_runtime import (
    KILN_SOURCES_DIR,
    PUBLIC_HEADER,
    RUNTIME_PLATFORMS,
    ensure_mobile_runtime,
    runtime_files,
)
from kiln.compile.staging import staging_folder
from kiln.errors import KilnError
from kiln.model_folder import read_json
from kiln.compile.toolchain.system_lib import (
    LIBRARY_BIN_SYMBOL,
    OBJECT_FORMATS,
    defined_globals,
    model_lib,
    object_format,
    tar_objects,
    write_static_archive,
)
from kiln.targets import TARGETS

PLATFORMS = tuple(name for name, entry in TARGETS.items() if entry.system_lib or entry.mobile_runtime)
JAVA_SOURCES = Path(__file__).parent / "java"
# Swift imports kiln.h as the module `Kiln` (`import Kiln`) with this module map beside it.
MODULE_MAP = 'module Kiln {\n  header "kiln.h"\n  export *\n}\n'
ENTRY_KEYS = {"model", "model_id", "bundle_weight", "estimated_vram_bytes", "model_url"}
APP_CONFIG = "mlc-app-config.json"
# How an app links the archive: nothing calls into the objects, their static constructors register
# the models with the runtime, so the linker must keep every member.
LINK_LINES = {
    "arm64-linux": "clang --target=aarch64-linux-gnu -fuse-ld=lld app.c -Iinclude -Llib -lkiln "
    "-Wl,-rpath,'$ORIGIN/lib'",
    # In the app's CMakeLists.txt (Gradle's externalNativeBuild), beside `add_executable`/`add_library(app …)`.
    "android-cpu": "add_subdirectory(runtime kiln)\ntarget_link_libraries(app PRIVATE kiln "
    "-Wl,--whole-archive ${CMAKE_CURRENT_SOURCE_DIR}/lib/libmodel_android-cpu.a -Wl,--no-whole-archive m)",
    # In Xcode's "Other Linker Flags".
    "iphone-cpu": "-Wl,-force_load,lib/libmodel_iphone-cpu.a lib/libkiln.a -lc++",
    "android": "-Wl,--whole-archive lib/libmodel_android.a -Wl,--no-whole-archive libtvm_runtime.a -lOpenCL",
    "iphone": "-Wl,-force_load,lib/libmodel_iphone.a libtvm_runtime.a -framework Metal -framework Foundation",
    "metal": "-Wl,-force_load,lib/libmodel_metal.a libtvm_runtime.a -framework Metal -framework Foundation",
}
RUNTIME_BUILD = {
    "android": "USE_OPENCL=ON, for arm64-v8a with the Android NDK",
    "iphone": "USE_METAL=ON, for arm64 iOS",
    "metal": "USE_METAL=ON, for arm64 macOS",
}


@dataclass(frozen=True)
class PackagedModel:
    model_id: str
    compiled: CompiledModel
    bundle_weight: bool
    estimated_vram_bytes: int
    model_url: str | None

    def library(self, platform: str) -> tuple[Path, str | None]:
        """The platform's library (a system library's `.tar` of objects) and its system-lib prefix."""
        record = self.compiled.build["targets"][platform]
        return self.compiled.path / record["library"], record.get("system_lib_prefix")

    def model_lib(self, platform: str) -> str:
        """What the app config names the library by: a system library's prefix, or its path in the bundle."""
        path, prefix = self.library(platform)
        return model_lib(prefix) if prefix else f"lib/{self.model_id}-{platform}{path.suffix}"


@dataclass(frozen=True)
class PackageConfig:
    path: Path
    platforms: list[str]
    models: list[PackagedModel]


def load_compiled_model(folder: Path, config_path: Path) -> CompiledModel:
    missing = [name for name in MODEL_FILES if not (folder / name).is_file()]
    if missing:
        raise KilnError(f"model {str(folder)!r} is not a compiled model folder (no {', '.join(missing)})", config_path)
    return read_compiled_model(folder)


def parse_entry(entry, config_path: Path) -> PackagedModel:
    if not isinstance(entry, dict) or not isinstance(entry.get("model"), str):
        raise KilnError(f'every "model_list" entry needs "model" (a compiled model folder): got {entry!r}', config_path)
    unknown = sorted(set(entry) - ENTRY_KEYS)
    if unknown:
        raise KilnError(
            f"model {entry['model']!r}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(ENTRY_KEYS))})",
            config_path,
        )
    folder = (config_path.parent / entry["model"]).resolve()
    compiled = load_compiled_model(folder, config_path)
    model_id = entry.get("model_id", compiled.model_id)
    if not isinstance(model_id, str) or not MODEL_ID.fullmatch(model_id):
        raise KilnError(
            f"model {entry['model']!r}: model_id {model_id!r} must be letters, digits, '.', '_' or '-'", config_path
        )
    bundle_weight = entry.get("bundle_weight", False)
    model_url = entry.get("model_url")
    if not isinstance(bundle_weight, bool):
        raise KilnError(f"model {model_id!r}: bundle_weight must be true or false", config_path)
    if not bundle_weight and not isinstance(model_url, str):
        raise KilnError(
            f'model {model_id!r}: without bundle_weight the app downloads the weights, so give "model_url"', config_path
        )
    vram = entry.get("estimated_vram_bytes", model_needs(compiled).total)
    if not isinstance(vram, int) or isinstance(vram, bool) or vram <= 0:
        raise KilnError(f"model {model_id!r}: estimated_vram_bytes must be a positive integer", config_path)
    return PackagedModel(model_id, compiled, bundle_weight, vram, model_url)


def read_package_config(path: Path) -> PackageConfig:
    """The config, checked against the compiled models it names."""
    if not path.is_file():
        raise KilnError("package config not found", path)
    config = read_json(path)
    if not isinstance(config, dict):
        raise KilnError('expected an object with "platforms" and "model_list"', path)
    platforms = config.get("platforms", [config["device"]] if "device" in config else None)
    if not isinstance(platforms, list) or not platforms:
        raise KilnError('"platforms" must list at least one of ' + ", ".join(PLATFORMS), path)
    for platform in platforms:
        if platform not in PLATFORMS:
            raise KilnError(f"unknown platform {platform!r} (supported: {', '.join(PLATFORMS)})", path)
    entries = config.get("model_list")
    if not isinstance(entries, list) or not entries:
        raise KilnError('"model_list" must list at least one model', path)
    models = [parse_entry(entry, path) for entry in entries]
    for what, values in (
        ("model_id", [m.model_id for m in models]),
        ("compiled model", [str(m.compiled.path) for m in models]),
    ):
        repeated = sorted(v for v, n in Counter(values).items() if n > 1)
        if repeated:
            raise KilnError(f"duplicate {what} {', '.join(map(repr, repeated))} (each model once per bundle)", path)
    for model in models:
        for platform in platforms:
            if platform not in model.compiled.libraries:
                raise KilnError(
                    f"model {model.model_id!r} has no {platform} library in {model.compiled.path}; "
                    f"build it with kiln compile … --target {platform} "
                    f"--model-id {model.compiled.model_id}",
                    path,
                )
    for platform in (platform for platform in platforms if TARGETS[platform].system_lib):
        prefixes = Counter(model.library(platform)[1] for model in models)
        clashing = sorted(p for p, n in prefixes.items() if n > 1)
        if clashing:
            raise KilnError(
                f"{platform}: models share the system-lib prefix {', '.join(clashing)}; compile them "
                "with model ids that differ in more than punctuation",
                path,
            )
    return PackageConfig(path, platforms, models)


def tvm_runtime_version() -> str:
    return importlib.metadata.version("apache-tvm")


def merged_archive(models: list[PackagedModel], platform: str, lib_dir: Path, work: Path) -> Path:
    """One archive of every model's objects, checked like an app's linker would: each model's
    library symbol is there, and no global is defined twice."""
    objects = []
    for model in models:
        tar, _ = model.library(platform)
        objects += tar_objects(tar, work / model.model_id)
    definitions = Counter(symbol for obj in objects for symbol in defined_globals(obj))
    twice = sorted(s for s, n in definitions.items() if n > 1)
    if twice:
        raise KilnError(f"{platform}: symbols defined by more than one model: {', '.join(twice[:5])}")
    symbol_prefix = OBJECT_FORMATS[object_format(objects[0])].symbol_prefix
    for model in models:
        prefix = model.library(platform)[1]
        if f"{symbol_prefix}{prefix}{LIBRARY_BIN_SYMBOL}" not in definitions:
            raise KilnError(
                f"{platform}: the library of {model.model_id!r} does not define {prefix}{LIBRARY_BIN_SYMBOL}"
            )
    archive = lib_dir / f"libmodel_{platform}.a"
    write_static_archive(archive, objects)
    return archive


def app_config_entry(model: PackagedModel, platform: str) -> dict:
    entry = {
        "model_id": model.model_id,
        "model_lib": model.model_lib(platform),
        "estimated_vram_bytes": model.estimated_vram_bytes,
    }
    if model.bundle_weight:
        entry["model_path"] = model.model_id
    if model.model_url:
        entry["model_url"] = model.model_url
    return entry


def bundle_readme(config: PackageConfig, platform: str) -> str:
    entry = TARGETS[platform]
    models = system_lib_section(config, platform) if entry.system_lib else shared_library_section(config, platform)
    return f"""# Kiln bundle for {platform}

Built by Kiln from `{config.path.name}`.

{models}
## Link line

```
{LINK_LINES[platform]}
```

{engine_section(platform)}"""


def system_lib_section(config: PackageConfig, platform: str) -> str:
    rows = "\n".join(
        f"| `{m.model_id}` | `{m.model_lib(platform)}` | `{m.library(platform)[1]}{LIBRARY_BIN_SYMBOL}` | "
        f"{m.compiled.chat_config['quantization']} | {'bundled' if m.bundle_weight else m.model_url} |"
        for m in config.models
    )
    return f"""| model_id | model_lib | symbol | quantization | weights |
|---|---|---|---|---|
{rows}

- `lib/libmodel_{platform}.a`: the models' kernels and Relax VM code, as system libraries.
- `{APP_CONFIG}`: the app's model list (MLC's format); `model_path` is a folder of this bundle.

{system_lib_runtime(platform)} The app loads a model through the runtime's
system library of prefix `<model_lib>_`. The whole archive must be linked (`--whole-archive` /
`-force_load`): nothing in the app calls into it, and the models register themselves with the
runtime from static constructors.
"""


def system_lib_runtime(platform: str) -> str:
    """Which runtime a system library needs, and what Kiln could check of it."""
    version = tvm_runtime_version()
    if TARGETS[platform].mobile_runtime:
        return (
            f"The libraries were compiled by Apache TVM **{version}** for Kiln's runtime, which this bundle "
            "carries (its engine finds a model's prefix in the model's `kiln-build.json`, so `model_lib` may be "
            "left out)."
        )
    return (
        f"The libraries were compiled by Apache TVM **{version}** and need the TVM runtime of exactly that "
        f"version ({RUNTIME_BUILD[platform]}). Kiln could not run these libraries where it built them (its TVM "
        "runtime has no OpenCL or Metal device): they are checked by their objects and symbols."
    )


def shared_library_section(config: PackageConfig, platform: str) -> str:
    rows = "\n".join(
        f"| `{m.model_id}` | `{m.model_lib(platform)}` | {m.compiled.chat_config['quantization']} | "
        f"{'bundled' if m.bundle_weight else m.model_url} |"
        for m in config.models
    )
    return f"""| model_id | model_lib | quantization | weights |
|---|---|---|---|
{rows}

- `lib/libkiln.so` (and `lib/libkiln.a`): Kiln's runtime, Apache TVM **{tvm_runtime_version()}**'s runtime with
  Kiln's engine, for {platform}; `include/kiln.h`, its C API.
- `lib/<model_id>-{platform}.so`: each model's kernels and Relax VM code, loaded by the runtime.
- `{APP_CONFIG}`: the app's model list; `model_path` is a folder of this bundle.

An app creates an engine with `kiln_engine_create("{{\"model\": \"<model_path>\", \"model_lib\":
\"<bundle>/<model_lib>\"}}")`. Kiln ran these libraries where it built them, under qemu-aarch64.
"""


def platform_triple(platform: str) -> str:
    """The triple of the code an app of the platform runs on its CPU (a GPU target's host)."""
    described = TARGETS[platform].tvm_target()
    return described.get("host", described).get("mtriple", "")


@dataclass(frozen=True)
class Binding:
    """What an app of an OS gets to call kiln.h from its own language: BUNDLE.md's line and the files."""

    describe: str
    write: Callable[[Path], object]


# By the word of the platform's triple that names its OS.
BINDINGS = {
    "android": Binding(
        "`java/`: `ai.kiln.KilnEngine` (Java/Kotlin) and its JNI side `kiln_jni.c`, to build with the "
        "app's NDK against kiln.h and libkiln.",
        lambda folder: shutil.copytree(JAVA_SOURCES, folder / "java"),
    ),
    "apple": Binding(
        "`include/module.modulemap`: Swift imports kiln.h as `import Kiln`.",
        lambda folder: (folder / "include" / "module.modulemap").write_text(MODULE_MAP),
    ),
}


def platform_binding(platform: str) -> Binding | None:
    triple = platform_triple(platform)
    return next((binding for os_word, binding in BINDINGS.items() if os_word in triple), None)


def engine_section(platform: str) -> str:
    """kiln.h, the runtime, and what else an app of the platform gets to call it."""
    binding = platform_binding(platform)
    runtime = TARGETS[platform].mobile_runtime
    built_with = RUNTIME_PLATFORMS[runtime].built_with if runtime else None
    return f"""## Kiln's engine (kiln.h)

`include/kiln.h` is Kiln's C API: an engine per model, OpenAI chat-completion JSON in, streamed
`chat.completion.chunk` JSON out, the browser engine's error codes. {RUNTIME_NOTES[built_with]}
{binding.describe if binding else ""}
"""


RUNTIME_NOTES = {
    "clang": "`lib/libkiln.so` (and `lib/libkiln.a`) is that runtime, built by Kiln for this platform.",
    "zig": "`lib/libkiln.a` is that runtime, compiled by Kiln for arm64 iOS with the clang and the Darwin "
    "and libc++ headers of PyPI's `ziglang`; the app's Xcode links it (with `-lc++`). Kiln checked that "
    "every symbol it needs is iOS's libSystem's or libc++'s; it was not linked or run on iOS.",
    "sources": "`runtime/` is that runtime as sources with a `CMakeLists.txt` for the app's NDK (the link line "
    "above). Kiln built that project for aarch64 Linux and ran it with this platform's model library "
    "under qemu-aarch64; it could not build it with the NDK (there is none where Kiln runs), so bionic "
    "and the NDK's libc++ were not tried.",
    None: "Kiln's runtime for this platform (TVM's runtime with Kiln's engine, built from Kiln's "
    "`kiln/mobile/runtime` sources) is not in this bundle: its GPU device code needs a TVM runtime "
    "with OpenCL or Metal, which Kiln does not build yet. Nothing here was linked for the platform.",
}


def write_models(config: PackageConfig, platform: str, folder: Path) -> None:
    """The models' libraries in `lib/`: system libraries merged into one archive, shared ones as they are."""
    if TARGETS[platform].system_lib:
        work = folder.parent / f"objects-{platform}"
        merged_archive(config.models, platform, folder / "lib", work)
        shutil.rmtree(work)
        return
    for model in config.models:
        shutil.copyfile(model.library(platform)[0], folder / model.model_lib(platform))


def write_engine_files(platform: str, folder: Path) -> None:
    """kiln.h, the runtime where Kiln makes one for the platform, and the bindings of its apps."""
    (folder / "include").mkdir()
    shutil.copyfile(KILN_SOURCES_DIR / PUBLIC_HEADER, folder / "include" / PUBLIC_HEADER)
    binding = platform_binding(platform)
    if binding is not None:
        binding.write(folder)
    runtime = TARGETS[platform].mobile_runtime
    if runtime is None:
        return
    made = ensure_mobile_runtime(runtime)
    for name, path in runtime_files(RUNTIME_PLATFORMS[runtime], made).items():
        if name == "cmake_lists":
            shutil.copytree(path.parent, folder / "runtime")
        elif name != "header":
            shutil.copyfile(path, folder / "lib" / path.name)


def write_bundle(config: PackageConfig, platform: str, folder: Path) -> None:
    (folder / "lib").mkdir(parents=True)
    write_models(config, platform, folder)
    write_engine_files(platform, folder)
    for model in config.models:
        if model.bundle_weight:
            shutil.copytree(model.compiled.path, folder / model.model_id, ignore=shutil.ignore_patterns("libs"))
    app_config = {"model_list": [app_config_entry(m, platform) for m in config.models]}
    (folder / APP_CONFIG).write_text(json.dumps(app_config, indent=2) + "\n")
    (folder / "BUNDLE.md").write_text(bundle_readme(config, platform))


def package(config_path: Path, output: Path) -> dict[str, Path]:
    """Build `<output>/bundle-<platform>/` for every platform of the config; returns them by platform."""
    config = read_package_config(config_path)
    output.mkdir(parents=True, exist_ok=True)
    bundles = {platform: output / f"bundle-{platform}" for platform in config.platforms}
    with staging_folder(output, ".kiln-package-") as tmp:
        for platform in config.platforms:
            write_bundle(config, platform, tmp / platform / "bundle")
        for platform, bundle in bundles.items():
            if bundle.exists():
                bundle.rename(tmp / platform / "previous")
            (tmp / platform / "bundle").rename(bundle)
    return bundles
