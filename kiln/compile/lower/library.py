"""The compile stage: a quantized model module → a Relax VM library for one target."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import tvm
from tvm import relax
from tvm.relax.frontend import nn

from kiln.compile.library_cache import LibraryCache
from kiln.compile.lower import kiln_pipeline
from kiln.compile.lower.tvmscript_frames import frames_without_source_lines
from kiln.compile.lower.vm_functions import attach_metadata, attach_vm_functions
from kiln.compile.lower.webgpu_limits import check_webgpu_limits
from kiln.compile.quantization import quantization_named
from kiln.compile.toolchain.mobile_runtime import link_arm64_linux_library
from kiln.compile.toolchain.system_lib import export_system_library, system_lib_prefix
from kiln.compile.toolchain.wasm_toolchain import (
    PLAIN_RUNTIME,
    RUNTIME_FLAVORS,
    THREADED_RUNTIME,
    build_web_runtimes,
    link_threaded_wasm,
    link_tvmjs_wasm,
)
from kiln.errors import KilnError
from kiln.model_memory import MIB, MemoryNeeds
from kiln.models import DecoderConfig, DecoderModel, EncoderModel, encoder_export_spec, export_spec
from kiln.targets import TargetEntry


# One `prefill_all_logits` call's logits (positions × vocabulary floats) stay within this.
ALL_LOGITS_BYTES = 64 << 20
# The rows of the verify functions a float32 CPU or wasm library of factored decode matmuls gets
# (speculative decoding's passes: the last token and up to 4 proposed, which start at 4 and halve to
# 2 and 1). Their matmuls run decode's kernels with the rows inside (factored_decode.py): SmolLM2
# q4f32_1 after 300 tokens, 2 threads, in decode steps a pass, 2 rows 1.13, 3 1.32, 4 1.54, 5 1.76,
# 6 2.58 (against 3.2-3.5 for prefill_all_logits' kernels). Each function adds its own kernels: with
# 2, 3, 4 and 5 SmolLM2's cpu library compiled in 19.7 s, not 11.9; two of them keep the cost of a
# build down.
VERIFY_ROWS = (3, 5)
F32_BYTES = 4
ALLOC_STORAGE_OPS = ("relax.memory.alloc_storage", "relax.vm.alloc_storage")

# A row's `export`: how its executable becomes the library file.
EXPORTS = {
    "shared-library": lambda executable, path: executable.export_library(str(path)),
    "wasm": lambda executable, path: executable.export_library(str(path), fcompile=link_tvmjs_wasm),
    "threaded-wasm": lambda executable, path: executable.export_library(str(path), fcompile=link_threaded_wasm),
    "system-library": export_system_library,
    "arm64-linux-shared-library": lambda executable, path: executable.export_library(
        str(path), fcompile=link_arm64_linux_library
    ),
}
# The web runtime a row's export links against. Compile processes that build side by side share the
# cache: a build has it ready first (`prepare_toolchains`), or each process would build it (minutes).
EXPORT_WEB_RUNTIMES = {"wasm": PLAIN_RUNTIME, "threaded-wasm": THREADED_RUNTIME}


def prepare_toolchains(entries: list[TargetEntry]) -> None:
    """Build what the rows' exports link against and the cache lacks, before they compile side by side."""
    flavors = {EXPORT_WEB_RUNTIMES[entry.export] for entry in entries if entry.export in EXPORT_WEB_RUNTIMES}
    build_web_runtimes(flavors=[flavor for flavor in RUNTIME_FLAVORS if flavor in flavors])


# A row's `kernel_check`, given the generated device source.
KERNEL_CHECKS = {"webgpu-limits": check_webgpu_limits}


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str


def param_specs(model: DecoderModel) -> list[ParamSpec]:
    """The parameters the library expects, in the order its functions take them (TVM's exporter
    takes them in the module's `named_parameters` order)."""
    return [ParamSpec(name, tuple(int(d) for d in p.shape), str(p.dtype)) for name, p in model.named_parameters()]


def kv_cache_window(config: DecoderConfig) -> int:
    """The KV cache's sliding window: how many past tokens it keeps besides the current one (the
    model's window minus one: TVM lets a token see its kept window and itself); -1 for none."""
    return config.sliding_window_size - 1 if config.sliding_window_size else -1


def all_logits_chunk_size(config: DecoderConfig) -> int:
    """How many positions one `prefill_all_logits` call takes (the engines split longer inputs)."""
    return max(1, min(config.prefill_chunk_size, ALL_LOGITS_BYTES // (config.vocab_size * F32_BYTES)))


def with_planned_memory(mod: tvm.IRModule, upper_bounds: Callable[[str], dict[str, int]]) -> tvm.IRModule:
    """`mod` with every function's memory planned for its longest input (TVM's static planning with
    `tir_var_upper_bound`, outputs included: `upper_bounds(function name)`), so that every call reuses
    the same blocks. Planned for each call's own length, each new prompt length took new blocks that
    the VM's pool kept: a chat's wasm memory grew by some 0.3 MB for each token of each new length,
    without end."""
    for global_var, function in list(mod.functions.items()):
        if isinstance(function, relax.Function):
            mod[global_var] = function.with_attrs(
                {
                    "tir_var_upper_bound": upper_bounds(global_var.name_hint),
                    "relax.memory_plan_dynamic_func_output": True,
                }
            )
    return mod


def decoder_upper_bounds(config: DecoderConfig) -> Callable[[str], dict[str, int]]:
    return lambda function: {
        "seq_len": all_logits_chunk_size(config) if function == "prefill_all_logits" else config.prefill_chunk_size
    }


def planned_storage(mod: tvm.IRModule) -> dict[str, list[int]]:
    """The sizes of the storage blocks each function's memory plan allocates (functions that allocate any)."""
    planned = {}
    for global_var, function in mod.functions.items():
        if not isinstance(function, relax.Function):
            continue
        sizes = []

        def visit(expr, sizes=sizes):
            if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name in ALLOC_STORAGE_OPS:
                size = expr.args[0]
                # a size known only when the function runs (the sampling helpers') is left out
                if isinstance(size, relax.ShapeExpr) and isinstance(size.values[0], tvm.tirx.IntImm):
                    sizes.append(int(size.values[0]))

        relax.analysis.post_order_visit(function.body, visit)
        if sizes:
            planned[global_var.name_hint] = sorted(sizes, reverse=True)
    return planned


def library_metadata(model: nn.Module, quantization: str, params: list[ParamSpec]) -> dict:
    """What `_metadata` returns; WebLLM fetches weights by `params[].name`."""
    return library_kind(model).metadata(model, quantization, params)


def params_metadata(params: list[ParamSpec]) -> list[dict]:
    return [{"name": p.name, "shape": list(p.shape), "dtype": p.dtype} for p in params]


def decoder_metadata(model: DecoderModel, quantization: str, params: list[ParamSpec]) -> dict:
    config = model.config
    return {
        "model_type": type(model).__name__,
        "quantization": quantization,
        "context_window_size": config.context_window_size,
        "prefill_chunk_size": config.prefill_chunk_size,
        # Kiln's: the most positions one `prefill_all_logits` call takes.
        "all_logits_chunk_size": all_logits_chunk_size(config),
        "sliding_window_size": kv_cache_window(config),
        "attention_sink_size": 0 if config.sliding_window_size else -1,
        # Kiln's: the window of the layers that have one (Gemma's local layers); -1 for none.
        "layer_sliding_window_size": config.layer_window_size or -1,
        "tensor_parallel_shards": 1,
        # "hybrid": the step functions take a recurrent state after the KV cache (create_rnn_state).
        "kv_state_kind": "hybrid" if model.recurrent_states() else "kv_cache",
        "params": params_metadata(params),
    }


def encoder_metadata(model: EncoderModel, quantization: str, params: list[ParamSpec]) -> dict:
    """An embedding model's: no KV cache; inputs of up to `max_sequence_length` tokens (special tokens
    included), at most `max_batch_size` of them a call."""
    config = model.config
    return {
        "model_type": type(model).__name__,
        "quantization": quantization,
        "kv_state_kind": "none",
        "max_sequence_length": config.max_sequence_length,
        "max_batch_size": config.max_batch_size,
        "hidden_size": config.hidden_size,
        "params": params_metadata(params),
    }


@dataclass(frozen=True)
class LibraryKind:
    """What a kind of model's library holds: its exported functions, `_metadata`, the bounds its memory
    is planned for, and the VM functions added beside them."""

    export_spec: Callable[[nn.Module, dict], dict[str, dict]]  # for a library whose `_metadata` is the dict
    metadata: Callable[[nn.Module, str, list[ParamSpec]], dict]
    upper_bounds: Callable[[nn.Module], Callable[[str], dict[str, int]]]
    vm_functions: Callable[[tvm.IRModule, dict, tvm.target.Target, nn.Module], tvm.IRModule]


LIBRARY_KINDS: dict[type, LibraryKind] = {
    DecoderModel: LibraryKind(
        export_spec=lambda model, metadata: export_spec(model, metadata.get("verify_rows", ())),
        metadata=decoder_metadata,
        upper_bounds=lambda model: decoder_upper_bounds(model.config),
        vm_functions=lambda mod, metadata, target, model: attach_vm_functions(
            mod, metadata, target, model.config.vocab_size
        ),
    ),
    EncoderModel: LibraryKind(
        export_spec=lambda model, metadata: encoder_export_spec(model),
        metadata=encoder_metadata,
        upper_bounds=lambda model: (
            lambda _: {
                "batch": model.config.max_batch_size,
                "seq_len": model.config.max_sequence_length,
            }
        ),
        vm_functions=lambda mod, metadata, target, model: attach_metadata(mod, metadata),
    ),
}


def library_kind(model: nn.Module) -> LibraryKind:
    return next(kind for base, kind in LIBRARY_KINDS.items() if isinstance(model, base))


def target_metadata(model: DecoderModel, metadata: dict, entry: TargetEntry) -> dict:
    """`_metadata` for one target. Kiln fixes TVM's CPU kernel of prefill over cached tokens
    (kiln/models/kv_cache/paged_prefill_fix.py), so float32 CPU and wasm libraries prefill in chunks past a
    per-layer window. Elsewhere the engines prefill one token at a time past it: TVM's GPU kernels
    still go wrong there (a WebGPU build diverged at the window), and in float16 chunks widened the
    tiny Gemma 3's error against float32 arithmetic from 0.09 to 0.14 (its check allows 0.1).
    The same libraries of a decoder without a recurrent state get verify functions (`VERIFY_ROWS`)
    where its quantization factors decode's matmuls: elsewhere (float weights, 8-bit activations) a
    few rows take prefill's matmuls, as prefill_all_logits does, and a verify function would only
    add its kernels to the build."""
    chunked = model.dtype == "float32" and entry.cpu_kernels
    speculates = isinstance(model, DecoderModel) and not model.recurrent_states()
    factored = quantization_named(metadata["quantization"]).factored_decode
    verify = list(VERIFY_ROWS) if chunked and speculates and factored else []
    return {**metadata, "layer_window_chunked_prefill": chunked, "verify_rows": verify}


def exported_module(model: DecoderModel, entry: TargetEntry, metadata: dict) -> tvm.IRModule:
    """The model's Relax functions and kernels for `entry`, with the VM's functions, before scheduling."""
    target = entry.target()
    # Exporting under the target makes TVM pick that target's attention kernels.
    kind = library_kind(model)
    with target:
        mod, _ = model.export_tvm(spec=kind.export_spec(model, metadata))
    return kind.vm_functions(with_planned_memory(mod, kind.upper_bounds(model)), metadata, target, model)


def scheduled_module(model: DecoderModel, entry: TargetEntry, metadata: dict) -> tvm.IRModule:
    """The model's Relax functions and scheduled kernels for `entry`, ready for code generation."""
    return schedule(exported_module(model, entry, metadata), entry)


def schedule(mod: tvm.IRModule, entry: TargetEntry) -> tvm.IRModule:
    with entry.target():
        return kiln_pipeline(entry)(mod)


def compile_library(
    model: DecoderModel,
    entry: TargetEntry,
    metadata: dict,
    path: Path,
    model_id: str,
    cache: LibraryCache | None = None,
) -> tuple[dict[str, list[int]], bool]:
    """Write the library for `entry` to `path`; returns its functions' `planned_storage`, and whether
    `cache` had the library."""
    target = entry.target()
    with frames_without_source_lines():
        mod = exported_module(model, entry, metadata)
    prefix = system_lib_prefix(model_id) if entry.system_lib else None
    key = cache.key(mod, entry, prefix) if cache else None
    if cache and (planned := cache.fetch(key, entry, path)) is not None:
        return planned, True
    with frames_without_source_lines():
        mod = schedule(mod, entry)
    planned = planned_storage(mod)
    if prefix:
        mod = mod.with_attr("system_lib_prefix", prefix)
    executable = tvm.compile(mod, target, relax_pipeline=None)
    if entry.kernel_check:
        KERNEL_CHECKS[entry.kernel_check](device_source(executable.mod, target.kind.name))
    if entry.kernel_source:
        entry.kernel_source_path(path).write_text(device_source(executable.mod, target.kind.name))
    EXPORTS[entry.export](executable, path)
    if cache:
        cache.store(key, entry, path, planned)
    return planned, False


def check_memory_limits(entry: TargetEntry, needs: MemoryNeeds) -> None:
    """Refuse a library that could never hold the model (WebGPU's buffers, wasm32's memory)."""
    for limit, used, what in (
        (entry.buffer_limit, needs.largest_buffer, "its largest buffer takes"),
        (entry.memory_limit, needs.total, "it takes"),
    ):
        if limit and used > limit.bytes:
            raise KilnError(
                f"the model cannot run from a {entry.name} library: {what} {used / MIB:.0f} MiB, more than "
                f"{limit.bytes / MIB:.0f} MiB ({limit.reason}); the model takes {needs.describe()}. A shorter "
                "--context-window-size, a smaller --prefill-chunk-size or a 4-bit quantization needs less"
            )


def device_source(module: tvm.runtime.Module, kind: str) -> str:
    """The generated kernel source (WGSL, CUDA, ...) among a library's imported modules."""
    if module.kind == kind:
        return module.inspect_source()
    return "".join(device_source(imported, kind) for imported in module.imports)
