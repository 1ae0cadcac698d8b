"""The gated delta rule of Qwen3.5's Gated DeltaNet layers, for one step of any number of tokens.

Per value head h, with the key head it reads (h // (value heads / key heads)), the state S_h
(d_k × d_v, float32) takes each token t in order:
    S ← S · exp(g_t);  S ← S + k_t ⊗ β_t (v_t − Sᵀ k_t);  o_t = Sᵀ q_t.
Each column j of S (one value dimension) is a recurrence of its own, reading only k, q, g and β and
its own v_t[j]: a thread per column walks the step's tokens, with its d_k numbers in the output state
(S is stored per column, [value heads, d_v, d_k], so that a column is contiguous). A prompt is then
one kernel per layer and chunk, not a step per token.
"""

from __future__ import annotations

import tvm
from tvm import s_tir
from tvm.script import tirx as T

from kiln.targets import building

WORKGROUP_THREADS = 64


def delta_rule_kernel(key_heads: int, value_heads: int, key_dim: int, value_dim: int) -> tvm.tirx.PrimFunc:
    """(q, k [1, n, key heads, d_k]; v [1, n, value heads, d_v]; g, β [1, n, value heads]; S [1, value
    heads, d_v, d_k]) → (o [1, n, value heads, d_v], the state after the step), all float32; q and k
    already normalized (q scaled)."""
    group = value_heads // key_heads
    columns = value_heads * value_dim

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
        past = T.match_buffer(past_h, (1, value_heads, value_dim, key_dim), "float32")
        o = T.match_buffer(o_h, (1, n, value_heads, value_dim), "float32")
        state = T.match_buffer(state_h, (1, value_heads, value_dim, key_dim), "float32")
        for column in range(columns):
            with T.sblock("delta_rule"):
                T.reads()
                T.writes()
                sums = T.sblock_alloc_buffer((2,), "float32", scope="local")  # Sᵀk then Sᵀq; β(v − Sᵀk)
                h = column // value_dim
                j = column % value_dim
                for i in range(key_dim):
                    state[0, h, j, i] = past[0, h, j, i]
                for t in range(n):
                    sums[0] = T.float32(0)
                    for i in range(key_dim):
                        state[0, h, j, i] = state[0, h, j, i] * T.exp(g[0, t, h])
                        sums[0] = sums[0] + state[0, h, j, i] * k[0, t, h // group, i]
                    sums[1] = (v[0, t, h, j] - sums[0]) * beta[0, t, h]
                    sums[0] = T.float32(0)
                    for i in range(key_dim):
                        state[0, h, j, i] = state[0, h, j, i] + k[0, t, h // group, i] * sums[1]
                        sums[0] = sums[0] + state[0, h, j, i] * q[0, t, h // group, i]
                    o[0, t, h, j] = sums[0]
    # fmt: on
    schedule = s_tir.Schedule(delta_rule)
    (column,) = schedule.get_loops(schedule.get_sblock("delta_rule"))
    if building().cpu_kernels:
        schedule.parallel(column)
    else:
        blocks, threads = schedule.split(column, [None, WORKGROUP_THREADS])
        schedule.bind(blocks, "blockIdx.x")
        schedule.bind(threads, "threadIdx.x")
    return schedule.mod["main"].with_attr("tirx.is_scheduled", True)
