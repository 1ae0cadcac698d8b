"""TVM's WebGPU prefill attention kernels for heads wider than its tiling takes (Gemma 4's 512).

TVM 0.27 tiles its GPU prefill kernel by the head size and fixes WebGPU's at 64 threads (2 groups
of 32) and 8 keys a tile: for a 512-wide head in float32 that leaves 4 query rows a tile, 32
(row, key) pairs for 64 threads, which its schedule cannot share out ("Prefill tile is incompatible
with the scheduler's thread factorization"). No tiling of 32-thread groups fits WebGPU's 32 KB of
workgroup memory there either (a tile's queries, keys and values: 4 rows and 8 keys take 40 KB).
While the cache's kernels are made, `wide_head_prefill_tiles` gives such heads the largest tiling
that TVM's schedule can share out and that fits (narrower thread groups); the kernels are TVM's own
otherwise, so they compute what they did.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Iterator

from tvm.relax.frontend.nn.llm import _prefill_kernels
from tvm.relax.frontend.nn.llm._kernel_common import _is_prefill_kernel_config_legal
from tvm.runtime import DataType

from kiln.targets import MAX_WORKGROUP_STORAGE_BYTES
from kiln.errors import KilnError

TVM_CONFIG = _prefill_kernels._get_prefill_kernel_config
THREAD_GROUPS = (32, 16, 8)  # threads of one group (TVM's "bdx")
GROUPS = (4, 2, 1)  # groups of a workgroup (TVM's "num_warps")
TILES = (16, 8, 4, 2)  # query rows and keys of a tile


def workgroup_bytes(tile_rows: int, tile_keys: int, head_dim: int, dtype: str) -> int:
    """What TVM's prefill kernel keeps in workgroup memory: the tile's queries, keys and values, its
    scores (float32), and a few float32 values per row of softmax state."""
    element = DataType(dtype).bits // 8
    return (tile_rows + 2 * tile_keys) * head_dim * element + tile_rows * tile_keys * 4 + 4 * tile_rows * 4


def wide_head_config(h_kv, h_q, d, dtype, target, *, d_v=None, merged_kv=False):
    """TVM's config where it holds; else, on WebGPU, the tiling with the most (row, key) pairs a
    workgroup that TVM's schedule shares out and that fits WebGPU's workgroup memory."""
    try:
        return TVM_CONFIG(h_kv, h_q, d, dtype, target, d_v=d_v, merged_kv=merged_kv)
    except ValueError:
        if target.kind.name != "webgpu":
            raise
    num_blocks, load_vec, group_size, *_ = TVM_CONFIG(h_kv, h_q, 128, dtype, target)
    candidates = [
        (rows * keys, threads * groups, threads, groups, rows, keys)
        for threads in THREAD_GROUPS
        for groups in GROUPS
        for rows in TILES
        for keys in TILES
        if workgroup_bytes(rows, keys, d, dtype) <= MAX_WORKGROUP_STORAGE_BYTES
        and _is_prefill_kernel_config_legal(rows, d, keys, d_v or d, load_vec, threads, groups, merged_kv)
    ]
    if not candidates:
        raise KilnError(f"no WebGPU prefill attention tiling holds heads of {d} in {dtype}")
    *_, threads, groups, rows, keys = max(candidates)
    return num_blocks, load_vec, group_size, threads, groups, rows, d, keys


# The modules of TVM's kernels that tile prefill (tree attention too: the cache makes its kernels,
# which Kiln's build then leaves out).
TILED_KERNEL_MODULES = (_prefill_kernels, importlib.import_module("tvm.relax.frontend.nn.llm.tree_attn"))


@contextlib.contextmanager
def wide_head_prefill_tiles() -> Iterator[None]:
    """While TVM makes the KV cache's kernels, prefill kernels take `wide_head_config`."""
    for module in TILED_KERNEL_MODULES:
        module._get_prefill_kernel_config = wide_head_config
    try:
        yield
    finally:
        for module in TILED_KERNEL_MODULES:
            module._get_prefill_kernel_config = TVM_CONFIG
