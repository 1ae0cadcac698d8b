"""TVM's WebGPU decode attention kernels, generated for 64-thread workgroups instead of 256.

TVM sizes its decode kernel's workgroup by the target's thread limit: for SmolLM2 (head dim 64,
3 query heads per KV head) 256 threads give 32 lanes × 3 heads × 2 slices of the KV tiles, merged
through workgroup memory; 64 give 32 lanes × 2 slices and a workgroup per query head. On
SwiftShader SmolLM2's decode attention took 64 ms a step instead of 166 (32 threads: 70 ms, 128:
85 ms), decode 2.2 → 2.7 tokens/s. The kernels are TVM's own, so they compute what they did.

Where 64 threads cannot hold a KV head's whole group of query heads, TVM halves the heads a workgroup
takes until they fit and runs group ÷ heads workgroups: for Qwen2.5 0.5B (head dim 64, 7 query heads
per KV head) 3 heads a workgroup and 2 workgroups, so the 7th head of each group was never computed
(every decode step off by up to 2 in its logits; prefill, TVM's other kernel, was right). Such a
group gets the fewest threads, of 64, 128 and 256, whose halving keeps whole heads.
"""

from __future__ import annotations

import tvm
from tvm.relax.frontend.nn.llm._decode_kernels import _attention_decode

from kiln.errors import KilnError
from kiln.targets import building

from .cache_kernels import replace_cache_kernels

WORKGROUP_THREADS = (64, 128, 256)  # the narrowest that keeps whole query heads
# TVM's decode kernel reads 4 values of a head per thread (`VEC_SIZE`, for every head dim it takes).
HEAD_VALUES_PER_THREAD = 4
# kernel name → whether it is the sliding-window one
DECODE_KERNELS = {"tir_attention_decode": False, "tir_attention_decode_sliding_window": True}


def narrow_webgpu_decode_kernels(num_kv_heads: int, num_qo_heads: int, head_dim: int, dtype: str, rope_scaling: dict):
    """Replace the module's WebGPU decode attention kernels with TVM's for 64-thread workgroups."""
    if not building().narrow_decode_attention:
        return
    target = tvm.target.Target.current()
    threads = workgroup_threads(num_qo_heads // num_kv_heads, head_dim)
    narrow = tvm.target.Target({**target.export(), "max_num_threads": threads})
    replace_cache_kernels(
        lambda name, _: (
            _attention_decode(num_kv_heads, num_qo_heads, head_dim, dtype, DECODE_KERNELS[name], rope_scaling, narrow)
            if name in DECODE_KERNELS
            else None
        )
    )


def workgroup_threads(group_size: int, head_dim: int) -> int:
    """The fewest of WORKGROUP_THREADS with which TVM's kernel computes every query head: it gives a
    workgroup `group_size` heads, halved until they fit the threads, and runs group_size // heads
    workgroups per KV head."""
    lanes = head_dim // HEAD_VALUES_PER_THREAD
    for threads in WORKGROUP_THREADS:
        heads = group_size
        while lanes * heads > threads and heads > 1:
            heads //= 2
        if group_size % heads == 0 and lanes * heads <= threads:  # a head wider than the threads: more of them
            return threads
    raise KilnError(f"TVM's WebGPU decode attention cannot run {group_size} query heads per KV head of {head_dim}")
