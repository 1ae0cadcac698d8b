"""The app config: a WebLLM-style `model_list` describing the compiled models of a dist folder.

WebLLM reads `model` (the model folder's URL; it appends `resolve/main/`), `model_id`,
`model_lib` (the WebGPU library), `vram_required_MB`, `low_resource_required`,
`required_features`, `buffer_size_required_bytes` and `overrides`. Kiln's browser engine also
reads `kiln`: the model's `family` (variants built from the same source share it, so the engine
can pick the f16 or f32 variant), its quantization, its browser libraries by target and the memory
each needs (`memory_bytes`, kiln/model_memory.py: `vram_required_MB` is the WebGPU library's).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import KilnError, one_line
from kiln.model_folder import read_json
from kiln.model_memory import MIB, MemoryNeeds, float_bytes, memory_needs
from kiln.targets import BROWSER_TARGETS

log = logging.getLogger(__name__)
BUILD_RECORD = "kiln-build.json"
MODEL_FILES = (BUILD_RECORD, "mlc-chat-config.json", "tensor-cache.json")
# What reading a field of the wrong shape raises (a list where an object belongs, a missing key, a
# library path the OS refuses, ...).
FIELD_ERRORS = (KeyError, IndexError, TypeError, ValueError, AttributeError, OSError)
# A GPU budget most phones and integrated GPUs grant a tab; WebLLM's low-resource models fit it.
LOW_RESOURCE_MB = 2048


@dataclass(frozen=True)
class CompiledModel:
    """A model folder under a dist folder, with what the app config and the server need to know."""

    model_id: str
    path: Path
    build: dict
    chat_config: dict
    tensor_cache: dict

    @property
    def libraries(self) -> dict[str, str]:
        """Built targets → library path relative to the model folder (only files that exist)."""
        return {
            target: entry["library"]
            for target, entry in self.build.get("targets", {}).items()
            if (self.path / entry["library"]).is_file()
        }


def read_object(path: Path) -> dict:
    """A JSON file that holds an object."""
    try:
        value = read_json(path)
    except (OSError, UnicodeDecodeError) as e:
        raise KilnError(f"unreadable: {one_line(e)}", path) from None
    if not isinstance(value, dict):
        raise KilnError("should hold a JSON object", path)
    return value


def read_compiled_model(folder: Path) -> CompiledModel:
    """The model folder `folder` (its MODEL_FILES must exist), with every field the app config reads."""
    build, chat_config, tensor_cache = (read_object(folder / name) for name in MODEL_FILES)
    model = CompiledModel(folder.name, folder, build, chat_config, tensor_cache)
    try:
        model_record(model, "")  # reads every field the server does
    except FIELD_ERRORS as e:
        problem = f"a field of its JSON files is missing or malformed ({type(e).__name__}: {one_line(e)})"
        raise KilnError(problem, folder) from None
    return model


# The broken folders warned of, with the state of their files: the server reads them on every request.
WARNED_STATES: set[tuple] = set()
WARNED_LOCK = threading.Lock()


def warn_once(folder: Path, error: KilnError) -> None:
    """Warn of a broken model folder once per state of its files (a change to them warns again)."""
    state = (folder, *(file_state(folder / name) for name in MODEL_FILES))
    with WARNED_LOCK:
        if state in WARNED_STATES:
            return
        WARNED_STATES.add(state)
    log.warning("skipping a broken model folder: %s", error)


def file_state(path: Path) -> tuple[int, int] | None:
    try:
        status = path.stat()
    except OSError:
        return None
    return status.st_mtime_ns, status.st_size


def compiled_models(dist: Path) -> list[CompiledModel]:
    """Every model folder directly under `dist` (hidden build folders are skipped), by model id.
    A broken one is left out with a warning, so it never takes the others down with it."""
    if not dist.is_dir():
        raise KilnError("not a folder of compiled models", dist)
    models = []
    for folder in sorted(dist.iterdir()):
        if folder.name.startswith(".") or not folder.is_dir():
            continue
        if all((folder / name).is_file() for name in MODEL_FILES):
            try:
                models.append(read_compiled_model(folder))
            except KilnError as e:
                warn_once(folder, e)
    return models


def model_needs(model: CompiledModel, target: str | None = None) -> MemoryNeeds:
    """The memory `model` takes run by its `target` library (kiln/model_memory.py); without a target,
    run by the built library whose functions plan the most. A build that recorded no plan (before
    `planned_storage`) counts none."""
    built = model.build.get("targets", {})
    entries = [built[target]] if target else list(built.values())
    plans = [entry.get("planned_storage", {}) for entry in entries] or [{}]
    return max((memory_needs(model.chat_config, model.tensor_cache, plan) for plan in plans), key=lambda n: n.total)


WEBLLM_EMBEDDING_MODEL = 1  # WebLLM's ModelType.embedding (0: LLM, 2: VLM)


def model_record(model: CompiledModel, models_url: str) -> dict | None:
    """The app-config entry of `model`, with URLs under `models_url`; None without a browser library."""
    built = model.libraries
    browser_libraries = {target: built[target] for target in BROWSER_TARGETS if target in built}
    if not browser_libraries:
        return None
    folder_url = f"{models_url}{model.model_id}/"
    quantization = model.chat_config["quantization"]
    embedding = "embedding" in model.chat_config
    needs = {target: model_needs(model, target) for target in browser_libraries}
    model_lib = next(iter(browser_libraries))  # WebLLM's: webgpu, unless only the subgroup one was built
    vram_mb = round(needs[model_lib].total / MIB, 1)
    required_features = ["shader-f16"] if float_bytes(quantization) == 2 else []
    if model_lib == "webgpu-subgroups":
        required_features.append("subgroups")
    return {
        "model": folder_url,
        "model_id": model.model_id,
        "model_lib": folder_url + browser_libraries[model_lib],
        "vram_required_MB": vram_mb,
        "low_resource_required": vram_mb <= LOW_RESOURCE_MB,
        "required_features": required_features,
        "buffer_size_required_bytes": max(n.largest_buffer for n in needs.values()),
        "overrides": {
            key: model.chat_config[key]
            for key in ("context_window_size", "prefill_chunk_size")
            if key in model.chat_config
        },
        **({"model_type": WEBLLM_EMBEDDING_MODEL} if embedding else {}),
        "kiln": {
            "kind": "embedding" if embedding else "chat",
            "family": model.build.get("source_hash", model.model_id)[:16],
            "quantization": quantization,
            "libraries": {target: folder_url + path for target, path in browser_libraries.items()},
            # what each library needs: the CPU one must fit in wasm32's memory
            "memory_bytes": {target: n.total for target, n in needs.items()},
        },
    }


def app_config(models: list[CompiledModel], models_url: str) -> dict:
    """The app config for `models`, their folders served under `models_url` (ends with '/')."""
    return {"model_list": [r for r in (model_record(m, models_url) for m in models) if r is not None]}
