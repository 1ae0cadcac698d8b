"""A fix for TVM 0.27's CPU kernel of prefill over cached tokens (paged prefill), which Kiln's CPU
and wasm libraries run.

For each query the kernel keeps a running maximum of its scores, but sets the next maximum
(`new_m`) only for the keys the query may see. When the first cached key is hidden from it (a
per-layer window that has moved past the key) the kernel reads `new_m` unset: NaN at random. It
also scales the output by `scale_O[d]`, one float read at every head index. The fix starts `new_m`
where the running maximum starts and reads `scale_O[0]`.
"""

from __future__ import annotations

import tvm_ffi
from tvm import tirx
from tvm.ir.expr import TensorLoad  # what tirx.BufferLoad makes

from kiln.errors import KilnError

from .cache_kernels import replace_cache_kernels

KERNELS = ("tir_attention_prefill_cpu", "tir_attention_prefill_cpu_sliding_window")


def fixed(kernel: tirx.PrimFunc, name: str) -> tirx.PrimFunc:
    buffers = {}

    def find(store: tirx.BufferStore) -> tirx.BufferStore:
        buffers.setdefault(store.buffer.name, store.buffer)
        return store

    tvm_ffi.structural_map(kernel, (tirx.BufferStore, find))
    if "new_m" not in buffers:
        raise KilnError(f"TVM's kernel {name} is not the one Kiln fixes (it has no new_m): another TVM version?")
    changes = []

    def start_new_max(store: tirx.BufferStore) -> tirx.Stmt:
        if store.buffer.name != "m_val" or not isinstance(store.value, tirx.FloatImm):
            return store
        changes.append("new_m")
        return tirx.SeqStmt([store, tirx.BufferStore(buffers["new_m"], store.value, store.indices)])

    def read_one_scale(load: TensorLoad) -> TensorLoad:
        if load.source.name != "scale_O" or str(load.indices[0]) == "0":
            return load
        changes.append("scale_O")
        return tirx.BufferLoad(load.source, [tirx.const(0, "int32")])

    rewritten = tvm_ffi.structural_map(kernel, [(tirx.BufferStore, start_new_max), (TensorLoad, read_one_scale)])
    if sorted(changes) != ["new_m", "scale_O"]:
        raise KilnError(f"TVM's kernel {name} is not the one Kiln fixes ({changes}): another TVM version?")
    return rewritten


def fix_paged_prefill_kernels() -> None:
    """Replace, in the module being built, the CPU paged prefill kernels the KV cache added."""
    replace_cache_kernels(lambda name, kernel: fixed(kernel, name) if name in KERNELS else None)
