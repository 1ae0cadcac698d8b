"""The steps Kiln's CPU attention kernels share (cpu_decode_attention.py, cpu_prefill_attention.py):
one (query row, head) pair at a time, an online softmax over its keys in base 2, as TVM's kernels.

Each kernel gives a pair to TVM's thread pool (pairs write disjoint outputs), keeps its buffers on
the task's stack, and meets each key with `attend_key`: the query·key dot product in vectors of
partial sums and the output update as vectors. Keys and values are read through flat views of the
kernel's buffers, at the offset of their row. The score statement is the one TVM's kernels have,
so that the soft-cap rewrite (attention_softcap.py) still finds it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from tvm.script import tirx as T

VECTOR_LANES = 8
LOG2E = math.log2(math.e)
# The running softmax of a pair, in one local buffer: its maximum, the next maximum, its sum, the
# factor that rescales the output so far, and the new key's weight.
MAX, NEW_MAX, SUM, RESCALE, WEIGHT = range(5)
SOFTMAX_SLOTS = 5


@dataclass(frozen=True)
class AttentionSteps:
    lanes: int  # of the dot product's partial sums
    start: Callable  # (q_local, o_local, softmax, q, row, head): load the query, empty the state
    attend_key: Callable  # (q_local, o_local, partial, S_val, softmax, keys, key_at, values, value_at, sm_scale)
    finish: Callable  # (o_local, softmax, output, lse, row, head): store the output and log-sum-exp


def attention_steps(dim: int, dtype: str) -> AttentionSteps:
    lanes = VECTOR_LANES if dim % VECTOR_LANES == 0 else 1
    chunks = dim // lanes

    @T.macro
    def start(q_local, o_local, softmax, q, row, head):
        softmax[MAX] = -5e4
        softmax[SUM] = 1.0
        for d in T.vectorized(dim):
            q_local[d] = T.Cast("float32", q[row, head, d])
            o_local[d] = 0.0

    @T.macro
    def attend_key(q_local, o_local, partial, S_val, softmax, keys, key_at, values, value_at, sm_scale):
        for lane in T.vectorized(lanes):
            partial[lane] = 0.0
        for chunk in T.serial(chunks):
            for lane in T.vectorized(lanes):
                partial[lane] = partial[lane] + q_local[chunk * lanes + lane] * T.Cast(
                    "float32", keys[key_at + chunk * lanes + lane]
                )
        S_val[0] = 0.0
        for lane in T.serial(lanes):
            S_val[0] = S_val[0] + partial[lane]
        S_val[0] = S_val[0] * (sm_scale * LOG2E)
        softmax[NEW_MAX] = T.max(softmax[MAX], S_val[0])
        softmax[RESCALE] = T.exp2(softmax[MAX] - softmax[NEW_MAX])
        softmax[WEIGHT] = T.exp2(S_val[0] - softmax[NEW_MAX])
        softmax[SUM] = softmax[SUM] * softmax[RESCALE] + softmax[WEIGHT]
        softmax[MAX] = softmax[NEW_MAX]
        for d in T.vectorized(dim):
            o_local[d] = o_local[d] * softmax[RESCALE] + T.Cast("float32", values[value_at + d]) * softmax[WEIGHT]

    @T.macro
    def finish(o_local, softmax, output, lse, row, head):
        for d in T.vectorized(dim):
            output[row, head, d] = T.Cast(dtype, o_local[d] / softmax[SUM])
        lse[row, head] = softmax[MAX] + T.log2(softmax[SUM])

    return AttentionSteps(lanes, start, attend_key, finish)


def page_slot_offset(kv_heads: int, page_size: int, dim: int) -> Callable:
    """(page, kv head, slot) → where that slot's key starts in a flat view of the cache's pages
    [page, key or value, kv head, slot, dim]; its value starts `kv_heads · page_size · dim` later."""

    def offset(page, head, slot):
        return ((page * 2 * kv_heads + head) * page_size + slot) * dim

    return offset
