"""The app config: a WebLLM-style `model_list` describing the compiled models of a dist folder.

WebLLM reads `model` (the model folder's URL; it appends `resolve/main/`), `model_id`,
`model_lib` (the WebGPU library), `vram_required_MB`, `low_resource_required`,
`required_features`, `buffer_size_required_bytes` and `overrides`. Kiln's browser engine also
reads `kiln`: the model's `family` (variants built from the same source share it, so the engine
can pick the f16 or f32 variant), its quantization and its browser libraries by target.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path

from kiln.compile.targets import BROWSER_TARGETS
from kiln.errors import KilnError, one_line
from kiln.runtime import PAGE_SIZE, read_json

log = logging.getLogger(__name__)
BUILD_RECORD = "kiln-build.json"
MODEL_FILES = (BUILD_RECORD, "mlc-chat-config.json", "tensor-cache.json")
# What reading a field of the wrong shape raises (a list where an object belongs, a missing key, a
# library path the OS refuses, ...).
FIELD_ERRORS = (KeyError, IndexError, TypeError, ValueError, AttributeError, OSError)
F32_BYTES = 4
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


def float_bytes(quantization: str) -> int:
    return 2 if "f16" in quantization else F32_BYTES


def memory_needs(model: CompiledModel) -> tuple[int, int]:
    """(bytes the model needs on the GPU, the largest single buffer a kernel binds), estimated
    for chatting: prefill keeps only the last position's logits.

    Weights are exact; the KV cache is TVM's paged cache for the whole context window; the
    activations are those of one prefill chunk, dominated by the MLP's gate and up projections.
    (Forced decoding through `prefill_all_logits` needs rows × vocab × 4 bytes more; the browser
    engine splits it into calls that fit the device.)
    """
    config = model.chat_config
    layers = config["model_config"]
    hidden, intermediate = layers["hidden_size"], layers["intermediate_size"]
    head_dim = layers.get("head_dim") or hidden // layers["num_attention_heads"]
    kv_heads = layers.get("num_key_value_heads") or layers["num_attention_heads"]
    element = float_bytes(config["quantization"])
    # Kiln's engines size the cache to the model's context window, which a sliding-window model's
    # chat config leaves at -1 for WebLLM (model_config keeps it).
    pages = -(-layers["context_window_size"] // PAGE_SIZE)
    kv_layer_bytes = pages * 2 * kv_heads * PAGE_SIZE * head_dim * element
    mlp_bytes = config["prefill_chunk_size"] * 2 * intermediate * element
    logits_bytes = config["vocab_size"] * F32_BYTES
    records = [r for shard in model.tensor_cache["records"] for r in shard["records"]]
    weight_bytes = sum(r["nbytes"] for r in records)
    largest_weight = max((r["nbytes"] for r in records), default=0)
    # A model whose layers all have a window has one more layer in its cache (models/decoder.py's
    # cache_layer_kinds).
    layer_count = layers["num_hidden_layers"]
    cache_layers = layer_count + (len(layers.get("windowed_layers") or []) == layer_count)
    total = weight_bytes + cache_layers * kv_layer_bytes + mlp_bytes + logits_bytes
    return total, max(largest_weight, kv_layer_bytes, mlp_bytes, logits_bytes)


def model_record(model: CompiledModel, models_url: str) -> dict | None:
    """The app-config entry of `model`, with URLs under `models_url`; None without a browser library."""
    built = model.libraries
    browser_libraries = {target: built[target] for target in BROWSER_TARGETS if target in built}
    if not browser_libraries:
        return None
    folder_url = f"{models_url}{model.model_id}/"
    quantization = model.chat_config["quantization"]
    total_bytes, largest_buffer = memory_needs(model)
    vram_mb = round(total_bytes / 2**20, 1)
    model_lib = next(iter(browser_libraries))  # WebLLM's: webgpu, unless only the subgroup one was built
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
        "buffer_size_required_bytes": largest_buffer,
        "overrides": {key: model.chat_config[key] for key in ("context_window_size", "prefill_chunk_size")},
        "kiln": {
            "family": model.build.get("source_hash", model.model_id)[:16],
            "quantization": quantization,
            "libraries": {target: folder_url + path for target, path in browser_libraries.items()},
        },
    }


def app_config(models: list[CompiledModel], models_url: str) -> dict:
    """The app config for `models`, their folders served under `models_url` (ends with '/')."""
    return {"model_list": [r for r in (model_record(m, models_url) for m in models) if r is not None]}
