"""What a compiled model takes in memory once loaded: the one accounting behind the app config's
`vram_required_MB`, the browser engine's refusal of a model before its download, the compile
stage's limits and the benchmarks' reports.

A loaded model holds
- its weights (exact: tensor-cache.json);
- TVM's paged KV cache, allocated whole at load for the context window: a page more than the window
  needs (two more with a sliding window), and a layer more for a model whose layers all have a
  window (kiln/models/decoder.py's `cache_layer_kinds`);
- the KV cache's scratch for one prefill chunk (queries, keys, values, output, two LSE rows);
- a hybrid model's recurrent state: each recurrent layer's states for RECURRENT_HISTORY steps, and
  the engines' RECURRENT_SNAPSHOTS copies of one step's;
- the storage the library's memory plan gives embed, prefill and decode, planned at compile time for
  their longest input (`planned_storage` in kiln-build.json), so the same whatever the prompt.
Forced decoding (`prefill_all_logits`, parity checks) adds its own plan. The runtime itself is not
counted: 7 MiB of the CPU library's wasm memory, plus its helper threads' stacks and arenas and the
kernels' scratch, 10-30 MiB in all for the real-sized models measured (tests/parity/test_real_sizes.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Tokens per page of TVM's paged KV cache, as the engines create it.
PAGE_SIZE = 16
# Steps a hybrid model's recurrent state keeps, as the engines create it: the last
# RECURRENT_HISTORY - 1 single-token steps can be undone (a stop string's tokens, a reply's last
# token before the next turn); a step of more tokens cannot be.
RECURRENT_HISTORY = 8
# Copies of the recurrent state the engines keep, each as it was after a prompt's prefill, to come back
# to when a next prompt differs earlier than the history reaches (a regenerated reply, an edited
# message): the engine prefills from the latest one at or before the difference, not from the start.
RECURRENT_SNAPSHOTS = 2
F32_BYTES = 4
# The functions the engines run in a chat; each one's plan stays in the VM's pool once it has run.
CHAT_FUNCTIONS = ("embed", "prefill", "decode")
EMBEDDING_FUNCTION = "sentence_embeddings"  # an embedding model's (kiln/models/embedding.py)
MIB = 1 << 20


@dataclass(frozen=True)
class MemoryNeeds:
    """Bytes a loaded model holds on the device that runs it."""

    weights: int
    kv_cache: int  # with a hybrid model's recurrent state and its snapshots
    workspace: int  # the memory plans of CHAT_FUNCTIONS and the KV cache's scratch
    largest_buffer: int  # the largest single allocation (a WebGPU binding must hold it)

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.workspace

    def describe(self) -> str:
        return (
            f"{self.total / MIB:.0f} MiB (weights {self.weights / MIB:.0f}, KV cache {self.kv_cache / MIB:.0f}, "
            f"workspace {self.workspace / MIB:.0f})"
        )


def float_bytes(quantization: str) -> int:
    return 2 if "f16" in quantization else F32_BYTES


def head_dim(model_config: dict) -> int:
    """`head_dim`, which configs before Kiln wrote it leave to be derived."""
    return model_config.get("head_dim") or model_config["hidden_size"] // model_config["num_attention_heads"]


def kv_cache_bytes(model_config: dict, element_bytes: int) -> tuple[int, int]:
    """(the KV cache's bytes, one layer's: TVM allocates a buffer per layer)."""
    pages = -(-model_config["context_window_size"] // PAGE_SIZE) + 1 + 2 * bool(model_config.get("sliding_window_size"))
    layer = pages * 2 * model_config["num_key_value_heads"] * PAGE_SIZE * model_config["head_dim"] * element_bytes
    owners = cache_layers(model_config)
    all_windowed = set(model_config.get("windowed_layers") or []) >= owners
    return (len(owners) + all_windowed) * layer, layer


def cache_layers(model_config: dict) -> set[int]:
    """The layers that keep K/V in the cache: not those that read another's (Gemma 4's shared layers),
    nor those that keep a recurrent state instead (a hybrid model's)."""
    stateless = {*(model_config.get("kv_shared_layers") or []), *(model_config.get("recurrent_layers") or [])}
    return set(range(model_config["num_hidden_layers"])) - stateless


def recurrent_state_bytes(model_config: dict, element_bytes: int) -> tuple[int, int]:
    """(a hybrid model's recurrent state: each recurrent layer's states, float32 or in the model's dtype,
    RECURRENT_HISTORY steps of them; the largest storage: TVM allocates one per layer and state)."""
    layers, steps = recurrent_step_bytes(model_config, element_bytes)
    return layers * sum(steps) * RECURRENT_HISTORY, max(steps, default=0) * RECURRENT_HISTORY


def recurrent_snapshot_bytes(model_config: dict, element_bytes: int) -> int:
    """The engines' RECURRENT_SNAPSHOTS copies of one step's state (a buffer per layer and state)."""
    layers, steps = recurrent_step_bytes(model_config, element_bytes)
    return layers * sum(steps) * RECURRENT_SNAPSHOTS


def recurrent_step_bytes(model_config: dict, element_bytes: int) -> tuple[int, list[int]]:
    """(how many layers keep a recurrent state, the bytes of each of a layer's states for one step)."""
    steps = [
        math.prod(shape) * (F32_BYTES if dtype == "float32" else element_bytes)
        for shape, dtype in model_config.get("recurrent_state") or []
    ]
    return len(model_config.get("recurrent_layers") or []), steps


def cache_scratch_bytes(model_config: dict, chunk: int, element_bytes: int) -> int:
    """The KV cache's buffers for a prefill chunk of `chunk` tokens: queries, keys, values and output,
    two LSE rows."""
    head_dim = model_config["head_dim"]
    query_heads, kv_heads = model_config["num_attention_heads"], model_config["num_key_value_heads"]
    return chunk * (2 * query_heads + 2 * kv_heads) * head_dim * element_bytes + 2 * chunk * query_heads * F32_BYTES


def stored_weight_sizes(tensor_cache: dict) -> list[int]:
    return [record["nbytes"] for shard in tensor_cache["records"] for record in shard["records"]]


def memory_needs(chat_config: dict, tensor_cache: dict, planned_storage: dict[str, list[int]]) -> MemoryNeeds:
    """The needs of a model (its mlc-chat-config.json and tensor-cache.json) run by a library whose
    functions' memory plans are `planned_storage` (one library's entry of kiln-build.json)."""
    if "embedding" in chat_config:
        return embedding_memory_needs(tensor_cache, planned_storage)
    model_config = {"head_dim": head_dim(chat_config["model_config"]), **chat_config["model_config"]}
    element = float_bytes(chat_config["quantization"])
    weight_sizes = stored_weight_sizes(tensor_cache)
    kv_cache, kv_layer = kv_cache_bytes(model_config, element)
    states, state_storage = recurrent_state_bytes(model_config, element)
    snapshots = recurrent_snapshot_bytes(model_config, element)
    plans = [size for name in CHAT_FUNCTIONS for size in planned_storage.get(name, [])]
    return MemoryNeeds(
        weights=sum(weight_sizes),
        kv_cache=kv_cache + states + snapshots,
        workspace=sum(plans) + cache_scratch_bytes(model_config, chat_config["prefill_chunk_size"], element),
        largest_buffer=max([*weight_sizes, kv_layer, state_storage, *plans]),
    )


def embedding_memory_needs(tensor_cache: dict, planned_storage: dict[str, list[int]]) -> MemoryNeeds:
    """An embedding model holds its weights and the plan of its one function (no KV cache)."""
    weight_sizes = stored_weight_sizes(tensor_cache)
    plans = planned_storage.get(EMBEDDING_FUNCTION, [])
    return MemoryNeeds(
        weights=sum(weight_sizes), kv_cache=0, workspace=sum(plans), largest_buffer=max([*weight_sizes, *plans])
    )
