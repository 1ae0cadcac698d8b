"""The steps Kiln's CPU attention kernels share (cpu_decode_attention.py, cpu_prefill_attention.py):
per (query row, head) pair, an online softmax over its keys in base 2, as TVM's kernels.

Each kernel gives the pairs to TVM's thread pool (a task a pair: pairs write disjoint outputs),
keeps its buffers on the task's stack, and meets the keys `KEYS_PER_BLOCK` at a time with
`attend_block`: the block's query·key dot products side by side, one step of the online softmax for
the whole block (one rescale, the keys' weights as one vector of `exp2`), and the output update as
vectors, each sum written as one expression. A step per key made every key wait on the last one's
two `exp2` and on stores to the task's buffers: 6 query rows over 1000 keys at SmolLM2's heads, one
thread, took 1320 µs and take 580 (SmolLM2 natively, 2 threads: a 1000-token prompt 346 → 473
tokens/s, a 6-row verify step's attention after 300 tokens 6.1 → 4.1–4.6 ms). Keys and values are
read through flat views of the kernel's buffers, at the offset of their row. The score statement is
the one TVM's kernels have (per key of the block), so that the soft-cap rewrite
(attention_softcap.py) still finds it.
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass
from typing import Callable

from tvm.script import tirx as T

VECTOR_LANES = 8
# Keys met per step of the online softmax: a block lies within one page of the cache (whose size
# is a multiple of it) and is one vector of weights.
KEYS_PER_BLOCK = 8
LOG2E = math.log2(math.e)
# The running softmax of a pair, in one local buffer: its maximum, the next maximum, its sum and
# the factor that rescales the output so far.
MAX, NEW_MAX, SUM, RESCALE = range(4)
SOFTMAX_SLOTS = 4
# The score of a key past the last one a row sees, in a block that holds both: its weight is 0.
MASKED_SCORE = -5e4


@dataclass(frozen=True)
class AttentionSteps:
    """A task's local buffers: q_local and o_local [dim], partial [KEYS_PER_BLOCK, lanes], S_val
    [KEYS_PER_BLOCK] and softmax [SOFTMAX_SLOTS]."""

    lanes: int  # of the dot products' partial sums
    start: Callable  # (q_local, o_local, softmax, q, row, head): load the query, empty the state
    # (q_local, o_local, partial, S_val, softmax, keys, key_at, values, value_at, key_stride, count, sm_scale):
    # the block of keys whose first is at key_at (its value at value_at), the next ones key_stride
    # further each, of which the first `count` (1 to KEYS_PER_BLOCK) are seen
    attend_block: Callable
    finish: Callable  # (o_local, softmax, output, lse, row, head): store the output and log-sum-exp


def summed(terms):
    return functools.reduce(operator.add, terms)


def blocks(seen):
    """How many blocks of keys cover `seen` keys."""
    return (seen + KEYS_PER_BLOCK - 1) // KEYS_PER_BLOCK


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
    and cannot be a vector of them. Below 2^-126 it gives 0 (a weight no sum notices)."""
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
    block = KEYS_PER_BLOCK

    @T.macro
    def start(q_local, o_local, softmax, q, row, head):
        softmax[MAX] = MASKED_SCORE
        softmax[SUM] = 1.0
        for d in T.vectorized(dim):
            q_local[d] = T.Cast("float32", q[row, head, d])
            o_local[d] = 0.0

    def seen_key(j, count):
        """Key j of the block as read: past `count`, the last one seen (in bounds, and finite where a
        slot of a page no token has written may hold anything); its weight is 0."""
        return T.min(j, count - 1)

    # The sums below are single expressions, not updates of a local buffer: LLVM keeps a buffer the
    # kernel allocates in memory, and a chain of updates through it waits on a store each step.
    def dot_lane(q_local, keys, at, lane):
        return summed(
            q_local[chunk * lanes + lane] * T.Cast("float32", keys[at + chunk * lanes + lane])
            for chunk in range(chunks)
        )

    def weighted_values(S_val, values, value_at, key_stride, count, d):
        return summed(
            S_val[j] * T.Cast("float32", values[value_at + seen_key(j, count) * key_stride + d]) for j in range(block)
        )

    def lanes_summed(partial, j):
        return summed(partial[j, lane] for lane in range(lanes))

    def block_summed(S_val):
        return summed(S_val[j] for j in range(block))

    def block_max(S_val, start):
        return functools.reduce(T.max, (S_val[j] for j in range(block)), start)

    @T.macro
    def attend_block(
        q_local, o_local, partial, S_val, softmax, keys, key_at, values, value_at, key_stride, count, sm_scale
    ):
        for j in T.unroll(block):
            for lane in T.vectorized(lanes):
                partial[j, lane] = dot_lane(q_local, keys, key_at + seen_key(j, count) * key_stride, lane)
            S_val[j] = lanes_summed(partial, j)
            S_val[j] = S_val[j] * (sm_scale * LOG2E)
            S_val[j] = T.if_then_else(j < count, S_val[j], T.float32(MASKED_SCORE))
        softmax[NEW_MAX] = block_max(S_val, softmax[MAX])
        softmax[RESCALE] = exp2(softmax[MAX] - softmax[NEW_MAX])
        softmax[MAX] = softmax[NEW_MAX]
        for j in T.vectorized(block):
            S_val[j] = exp2(S_val[j] - softmax[NEW_MAX])
        softmax[SUM] = softmax[SUM] * softmax[RESCALE] + block_summed(S_val)
        for d in T.vectorized(dim):
            o_local[d] = o_local[d] * softmax[RESCALE] + weighted_values(S_val, values, value_at, key_stride, count, d)

    @T.macro
    def finish(o_local, softmax, output, lse, row, head):
        for d in T.vectorized(dim):
            output[row, head, d] = T.Cast(dtype, o_local[d] / softmax[SUM])
        lse[row, head] = softmax[MAX] + T.log2(softmax[SUM])

    return AttentionSteps(lanes, start, attend_block, finish)


def page_slot_offset(kv_heads: int, page_size: int, dim: int) -> Callable:
    """(page, kv head, slot) → where that slot's key starts in a flat view of the cache's pages
    [page, key or value, kv head, slot, dim]; its value starts `kv_heads · page_size · dim` later.
    The slots of a page follow one another, `dim` apart, so a block of keys is read as a ragged
    cache's are, `dim` apart instead of `kv_heads · dim`."""
    assert page_size % KEYS_PER_BLOCK == 0, "a block of keys must lie within one page"

    def offset(page, head, slot):
        return ((page * 2 * kv_heads + head) * page_size + slot) * dim

    return offset
