"""The gated delta rule of Qwen3.5's Gated DeltaNet layers, for one step of any number of tokens.

Per value head h, with the key head it reads (h // (value heads / key heads)), the state S_h
(d_k × d_v, float32) takes each token t in order:
    S ← S · exp(g_t);  S ← S + k_t ⊗ β_t (v_t − Sᵀ k_t);  o_t = Sᵀ q_t.
Each column j of S (one value dimension) is a recurrence of its own, reading only k, q, g and β and
its own v_t[j]: the kernel walks the step's tokens in order for a block of columns at a time, the
block's part of S in local memory, so that a prompt is one kernel per layer and chunk, not a step per
token. On a GPU a block is one column (a thread); on a CPU it is COLUMNS_PER_LANE_BLOCK columns in
vector lanes, whose sums over d_k run side by side (one column's are a chain of dependent adds).
S is stored [value heads, d_k, d_v]: adjacent columns are adjacent in memory.
"""

from __future__ import annotations

import functools
import math

import tvm
from tvm import s_tir
from tvm.script import tirx as T

from kiln.targets import building

WORKGROUP_THREADS = 64
COLUMNS_PER_LANE_BLOCK = 16


def delta_rule_kernel(key_heads: int, value_heads: int, key_dim: int, value_dim: int) -> tvm.tirx.PrimFunc:
    """(q, k [1, n, key heads, d_k]; v [1, n, value heads, d_v]; g, β [1, n, value heads]; S [1, value
    heads, d_k, d_v]) → (o [1, n, value heads, d_v], the state after the step), all float32; q and k
    already normalized (q scaled)."""
    return scheduled_delta_rule(key_heads, value_heads, key_dim, value_dim, building().cpu_kernels)


@functools.cache  # every DeltaNet layer of every step function takes the same kernel: written once (30 ms)
def scheduled_delta_rule(
    key_heads: int, value_heads: int, key_dim: int, value_dim: int, cpu: bool
) -> tvm.tirx.PrimFunc:
    group = value_heads // key_heads
    lanes = math.gcd(value_dim, COLUMNS_PER_LANE_BLOCK) if cpu else 1
    blocks = value_heads * value_dim // lanes

    # fmt: off
    @T.prim_func(private=True, s_tir=True)
    def delta_rule(q_h: T.handle, k_h: T.handle, v_h: T.handle, g_h: T.handle, beta_h: T.handle,
                   past_h: T.handle, o_h: T.handle, state_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        q = T.match_buffer(q_h, (1, n, key_heads, key_dim), "float32")
        k = T.match_buffer(k_h, (1, n, key_heads, key_dim), "float32")
        v = T.match_buffer(v_h, (1, n, value_heads, value_dim), "float32")
        g = T.match_buffer(g_h, (1, n, value_heads), "float32")
        beta = T.match_buffer(beta_h, (1, n, value_heads), "float32")
        past = T.match_buffer(past_h, (1, value_heads, key_dim, value_dim), "float32")
        o = T.match_buffer(o_h, (1, n, value_heads, value_dim), "float32")
        state = T.match_buffer(state_h, (1, value_heads, key_dim, value_dim), "float32")
        for block in range(blocks):
            with T.sblock("delta_rule"):
                T.reads()
                T.writes()
                s = T.sblock_alloc_buffer((key_dim, lanes), "float32", scope="local")  # the block of S
                sums = T.sblock_alloc_buffer((lanes,), "float32", scope="local")  # Sᵀk, then Sᵀq
                deltas = T.sblock_alloc_buffer((lanes,), "float32", scope="local")  # β(v − Sᵀk)
                decay = T.sblock_alloc_buffer((1,), "float32", scope="local")
                h = block * lanes // value_dim
                j = block * lanes % value_dim
                for i in range(key_dim):
                    for lane in T.vectorized(lanes):
                        s[i, lane] = past[0, h, i, j + lane]
                for t in range(n):
                    decay[0] = T.exp(g[0, t, h])
                    for lane in T.vectorized(lanes):
                        sums[lane] = T.float32(0)
                    for i in range(key_dim):
                        for lane in T.vectorized(lanes):
                            s[i, lane] = s[i, lane] * decay[0]
                            sums[lane] = sums[lane] + s[i, lane] * k[0, t, h // group, i]
                    for lane in T.vectorized(lanes):
                        deltas[lane] = (v[0, t, h, j + lane] - sums[lane]) * beta[0, t, h]
                        sums[lane] = T.float32(0)
                    for i in range(key_dim):
                        for lane in T.vectorized(lanes):
                            s[i, lane] = s[i, lane] + k[0, t, h // group, i] * deltas[lane]
                            sums[lane] = sums[lane] + s[i, lane] * q[0, t, h // group, i]
                    for lane in T.vectorized(lanes):
                        o[0, t, h, j + lane] = sums[lane]
                for i in range(key_dim):
                    for lane in T.vectorized(lanes):
                        state[0, h, i, j + lane] = s[i, lane]
    # fmt: on
    schedule = s_tir.Schedule(delta_rule)
    (block,) = schedule.get_loops(schedule.get_sblock("delta_rule"))
    if cpu:
        schedule.parallel(block)
    else:
        workgroups, threads = schedule.split(block, [None, WORKGROUP_THREADS])
        schedule.bind(workgroups, "blockIdx.x")
        schedule.bind(threads, "threadIdx.x")
    return schedule.mod["main"].with_attr("tirx.is_scheduled", True)
