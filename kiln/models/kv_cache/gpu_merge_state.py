"""The GPU kernel that merges two partial attention results, one thread per token and head.

A step that attends both to the tokens it appends and to the cached ones (a prefill after a cached
prefix, a decode step with a sliding window) gets two partial softmax results, (V, S) and
(V_other, S_other), S being the log2 of each row's softmax sum, and TVM's `merge_state_inplace`
folds the second into the first in place. TVM's kernel gives a row's head_dim / 4 threads a
slice of V each, and every one of them reads S and then writes the merged S back: once a row has
more threads than run in lockstep (SwiftShader runs 4, so a head_dim of 32 or more), the later ones
read the S an earlier one already merged and scale their slice wrongly. Here one thread merges a
whole row (a few hundred numbers), reading S before it writes it.
"""

from __future__ import annotations

import tvm
from tvm.script import tirx as T

from kiln.targets import building

from .cache_kernels import replace_cache_kernels

MERGE_KERNEL = "tir_attention_merge_state"
WORKGROUP_THREADS = 64


def merge_state_kernel(dtype: str) -> tvm.tirx.PrimFunc:
    # fmt: off
    @T.prim_func(s_tir=True)
    def merge_state_inplace(v: T.handle, s: T.handle, v_other: T.handle, s_other: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        N, H, D = T.int32(), T.int32(), T.int32()
        V = T.match_buffer(v, (N, H, D), dtype)
        S = T.match_buffer(s, (N, H), "float32")
        V_other = T.match_buffer(v_other, (N, H, D), dtype)
        S_other = T.match_buffer(s_other, (N, H), "float32")
        for bx in T.thread_binding(T.ceildiv(N * H, WORKGROUP_THREADS), thread="blockIdx.x"):
            for tx in T.thread_binding(WORKGROUP_THREADS, thread="threadIdx.x"):
                with T.sblock("merge"):
                    T.reads()
                    T.writes()
                    row = bx * WORKGROUP_THREADS + tx
                    if row < N * H:
                        n = row // H
                        h = row % H
                        s_max = T.max(S[n, h], S_other[n, h])
                        weight = T.exp2(S[n, h] - s_max)
                        other_weight = T.exp2(S_other[n, h] - s_max)
                        scale = weight / (weight + other_weight)
                        other_scale = other_weight / (weight + other_weight)
                        for d in T.serial(D):
                            ours = T.Cast("float32", V[n, h, d]) * scale
                            V[n, h, d] = T.Cast(dtype, ours + T.Cast("float32", V_other[n, h, d]) * other_scale)
                        S[n, h] = T.log2(weight + other_weight) + s_max
    # fmt: on
    return merge_state_inplace


def replace_gpu_merge_state_kernel(dtype: str) -> None:
    """Give a GPU build's KV cache the merge kernel above instead of TVM's."""
    if building().cpu_kernels:
        return
    replace_cache_kernels(
        lambda name, kernel: merge_state_kernel(dtype).with_attrs(kernel.attrs) if name == MERGE_KERNEL else None
    )
