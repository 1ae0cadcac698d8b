"""TVM's WebGPU decode attention kernels, generated for 64-thread workgroups instead of 256.

TVM sizes its decode kernel's workgroup by the target's thread limit: for SmolLM2 (head dim 64,
3 query heads per KV head) 256 threads give 32 lanes × 3 heads × 2 slices of the KV tiles, merged
through workgroup memory; 64 give 32 lanes × 2 slices and a workgroup per query head. On
SwiftShader SmolLM2's decode attention took 64 ms a step instead of 166 (32 threads: 70 ms, 128:
85 ms), decode 2.2 → 2.7 tokens/s. The kernels are TVM's own, so they compute what they did.
"""

from __future__ import annotations

import tvm
from tvm.relax.frontend.nn.llm._decode_kernels import _attention_decode

from .cache_kernels import replace_cache_kernels

WORKGROUP_THREADS = 64
# kernel name → whether it is the sliding-window one
DECODE_KERNELS = {"tir_attention_decode": False, "tir_attention_decode_sliding_window": True}


def narrow_webgpu_decode_kernels(num_kv_heads: int, num_qo_heads: int, head_dim: int, dtype: str, rope_scaling: dict):
    """Replace the module's WebGPU decode attention kernels with TVM's for 64-thread workgroups."""
    target = tvm.target.Target.current()
    if target.kind.name != "webgpu":
        return
    narrow = tvm.target.Target({**target.export(), "max_num_threads": WORKGROUP_THREADS})
    replace_cache_kernels(
        lambda name, _: (
            _attention_decode(num_kv_heads, num_qo_heads, head_dim, dtype, DECODE_KERNELS[name], rope_scaling, narrow)
            if name in DECODE_KERNELS
            else None
        )
    )
