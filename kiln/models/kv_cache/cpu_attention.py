"""The steps Kiln's CPU attention kernels share (cpu_decode_attention.py, cpu_prefill_attention.py):
per (query row, head) pair, an online softmax over its keys in base 2, as TVM's kernels.

Each kernel gives pairs to TVM's thread pool (a task one pair, or a decode task the query heads of
a key head: pairs write disjoint outputs), keeps its buffers on the task's stack, one slot a pair,
and meets each key with `attend_key`: the query·key dot product in vectors of
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
    """Each step takes `slot`: which of the task's pairs it works on, the first index of every
    local buffer (a decode task interleaves the query heads of a key head; a prefill task has one)."""

    lanes: int  # of the dot product's partial sums
    start: Callable  # (q_local, o_local, softmax, q, row, head, slot): load the query, empty the state
    # (q_local, o_local, partial, S_val, softmax, keys, key_at, values, value_at, sm_scale, slot)
    attend_key: Callable
    finish: Callable  # (o_local, softmax, output, lse, row, head, slot): store the output and log-sum-exp


# Cephes' exp2f: 2^f for |f| ≤ 1/2 as 1 + f · P(f) (relative error below 2e-7 in float32).
EXP2_POLYNOMIAL = (
    1.535336188319500e-4,
    1.339887440266574e-3,
    9.618437357674640e-3,
    5.550332471162809e-2,
    2.402264791363012e-1,
    6.931472028550421e-1,
)


def exp2(x):
    """2^x for x ≤ 0 (a softmax's exponents), written out: libm's exp2f is a call per key and head,
    most of a decode step's attention. Below 2^-126 it gives 0 (a weight no sum notices)."""
    clamped = T.max(x, T.float32(-127))
    whole = T.floor(clamped + T.float32(0.5))
    f = clamped - whole
    p = T.float32(EXP2_POLYNOMIAL[0])
    for coefficient in EXP2_POLYNOMIAL[1:]:
        p = p * f + T.float32(coefficient)
    power = T.reinterpret("float32", T.Cast("int32", T.max(whole + T.float32(127), T.float32(0))) << 23)
    return (T.float32(1) + f * p) * power


def attention_steps(dim: int, dtype: str) -> AttentionSteps:
    lanes = VECTOR_LANES if dim % VECTOR_LANES == 0 else 1
    chunks = dim // lanes

    @T.macro
    def start(q_local, o_local, softmax, q, row, head, slot):
        softmax[slot, MAX] = -5e4
        softmax[slot, SUM] = 1.0
        for d in T.vectorized(dim):
            q_local[slot, d] = T.Cast("float32", q[row, head, d])
            o_local[slot, d] = 0.0

    @T.macro
    def attend_key(q_local, o_local, partial, S_val, softmax, keys, key_at, values, value_at, sm_scale, slot):
        for lane in T.vectorized(lanes):
            partial[slot, lane] = 0.0
        for chunk in T.serial(chunks):
            for lane in T.vectorized(lanes):
                partial[slot, lane] = partial[slot, lane] + q_local[slot, chunk * lanes + lane] * T.Cast(
                    "float32", keys[key_at + chunk * lanes + lane]
                )
        S_val[slot] = 0.0
        for lane in T.serial(lanes):
            S_val[slot] = S_val[slot] + partial[slot, lane]
        S_val[slot] = S_val[slot] * (sm_scale * LOG2E)
        softmax[slot, NEW_MAX] = T.max(softmax[slot, MAX], S_val[slot])
        softmax[slot, RESCALE] = exp2(softmax[slot, MAX] - softmax[slot, NEW_MAX])
        softmax[slot, WEIGHT] = exp2(S_val[slot] - softmax[slot, NEW_MAX])
        softmax[slot, SUM] = softmax[slot, SUM] * softmax[slot, RESCALE] + softmax[slot, WEIGHT]
        softmax[slot, MAX] = softmax[slot, NEW_MAX]
        for d in T.vectorized(dim):
            o_local[slot, d] = (
                o_local[slot, d] * softmax[slot, RESCALE]
                + T.Cast("float32", values[value_at + d]) * softmax[slot, WEIGHT]
            )

    @T.macro
    def finish(o_local, softmax, output, lse, row, head, slot):
        for d in T.vectorized(dim):
            output[row, head, d] = T.Cast(dtype, o_local[slot, d] / softmax[slot, SUM])
        lse[row, head] = softmax[slot, MAX] + T.log2(softmax[slot, SUM])

    return AttentionSteps(lanes, start, attend_key, finish)


def page_slot_offset(kv_heads: int, page_size: int, dim: int) -> Callable:
    """(page, kv head, slot) → where that slot's key starts in a flat view of the cache's pages
    [page, key or value, kv head, slot, dim]; its value starts `kv_heads · page_size · dim` later."""

    def offset(page, head, slot):
        return ((page * 2 * kv_heads + head) * page_size + slot) * dim

    return offset
