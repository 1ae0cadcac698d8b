"""The gated delta rule of Qwen3.5's Gated DeltaNet layers, for one step of any number of tokens.

Per value head h, with the key head it reads (h // (value heads / key heads)), the state S_h
(d_k × d_v, float32) takes each token t in order:
    S ← S · exp(g_t);  S ← S + k_t ⊗ β_t (v_t − Sᵀ k_t);  o_t = Sᵀ q_t.
Each column j of S (one value dimension) is a recurrence of its own, reading only k, q, g and β and
its own v_t[j].

Two forms compute it:
- Token by token (`delta_rule_kernel`): a kernel walks the step's tokens in order for a block of
  columns at a time, the block's part of S in local memory. On a CPU (and wasm) a block is
  COLUMNS_PER_LANE_BLOCK columns in vector lanes, whose sums over d_k run side by side (one column's
  are a chain of dependent adds); on a GPU a block is one column (a thread), which is how a GPU
  decodes (one token).
- Chunked, a GPU's prefill (`delta_rule`): CHUNK tokens at a time, as flash-linear-attention's
  chunked form does it. Within a chunk, with γ_i the sum of g up to token i and S₀ the state before
  it, the tokens' deltas u_i = β_i (v_i − Sᵀk_i) solve a unit lower-triangular system
      u_i + Σ_{j<i} M_ij u_j = β_i (v_i − e^{γ_i} S₀ᵀ k_i),   M_ij = β_i e^{γ_i − γ_j} k_i·k_j,
  and then o_i = e^{γ_i} S₀ᵀ q_i + Σ_{j≤i} e^{γ_i − γ_j} (q_i·k_j) u_j and
  S = e^{γ_last} S₀ + Σ_j e^{γ_last − γ_j} k_j ⊗ u_j. M, (I + M)⁻¹ and the q·k weights depend on no
  column: they are made for every chunk at once, in parallel; only S passes from chunk to chunk, in a
  kernel whose threads hold one row of the chunk each, so a chunk is a few sums of CHUNK or d_k
  terms on a thread instead of CHUNK tokens' in a row.
S is stored [value heads, d_k, d_v]: adjacent columns are adjacent in memory.
"""

from __future__ import annotations

import functools
import math

import tvm
from tvm import s_tir
from tvm.relax.frontend import nn
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


CHUNK = 64  # tokens of a chunk of the chunked form (flash-linear-attention's)
SCAN_COLUMNS = 4  # columns of S a workgroup of the chunked form's scan carries: CHUNK × 4 = 256 threads


def delta_rule(
    q: nn.Tensor, k: nn.Tensor, v: nn.Tensor, g: nn.Tensor, beta: nn.Tensor, past: nn.Tensor
) -> tuple[nn.Tensor, nn.Tensor]:
    """(o, the state after the step), as `delta_rule_kernel` takes and gives them: token by token on a
    CPU and for a step of one token, in the chunked form for a GPU's longer steps."""
    _, seq_len, key_heads, key_dim = k.shape
    _, _, value_heads, value_dim = v.shape
    outputs = [nn.Tensor.placeholder(v.shape, "float32"), nn.Tensor.placeholder(past.shape, "float32")]
    if building().cpu_kernels or (isinstance(seq_len, int) and seq_len == 1):
        kernel = delta_rule_kernel(key_heads, value_heads, key_dim, value_dim)
        return nn.op.tensor_ir_op(kernel, "delta_rule", [q, k, v, g, beta, past], outputs)
    per_chunk_row = nn.Tensor.placeholder((value_heads, (seq_len + CHUNK - 1) // CHUNK * CHUNK, CHUNK), "float32")
    solve, weigh = nn.op.tensor_ir_op(
        chunk_weights(key_heads, value_heads, key_dim),
        "delta_rule_chunk_weights",
        [q, k, g, beta],
        [per_chunk_row, per_chunk_row],
    )
    inverse = nn.op.tensor_ir_op(chunk_inverse(value_heads), "delta_rule_chunk_inverse", [solve], per_chunk_row)
    return nn.op.tensor_ir_op(
        chunk_scan(key_heads, value_heads, key_dim, value_dim),
        "delta_rule_chunk_scan",
        [q, k, v, g, beta, past, inverse, weigh],
        outputs,
    )


@functools.cache
def chunk_weights(key_heads: int, value_heads: int, key_dim: int) -> tvm.tirx.PrimFunc:
    """Per value head and chunk row i: M_ij (j < i), the system's, and e^{γ_i − γ_j} q_i·k_j (j ≤ i),
    the output's; zero elsewhere and for rows past the step's tokens. A thread per row."""
    group = value_heads // key_heads

    # fmt: off
    @T.prim_func(private=True, s_tir=True)
    def weights(q_h: T.handle, k_h: T.handle, g_h: T.handle, beta_h: T.handle, solve_h: T.handle,
                weigh_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        n, padded = T.int64(), T.int64()
        q = T.match_buffer(q_h, (1, n, key_heads, key_dim), "float32")
        k = T.match_buffer(k_h, (1, n, key_heads, key_dim), "float32")
        g = T.match_buffer(g_h, (1, n, value_heads), "float32")
        beta = T.match_buffer(beta_h, (1, n, value_heads), "float32")
        solve = T.match_buffer(solve_h, (value_heads, padded, CHUNK), "float32")
        weigh = T.match_buffer(weigh_h, (value_heads, padded, CHUNK), "float32")
        for chunk_head in T.thread_binding(padded // CHUNK * value_heads, thread="blockIdx.x"):
            for row in T.thread_binding(CHUNK, thread="threadIdx.x"):
                with T.sblock("chunk_weights"):
                    T.reads()
                    T.writes()
                    gates = T.sblock_alloc_buffer((2,), "float32", scope="local")  # γ_i, γ_j
                    dots = T.sblock_alloc_buffer((2,), "float32", scope="local")  # k_i·k_j, q_i·k_j
                    h = T.Cast("int32", chunk_head % value_heads)  # int32: WebGPU has no 64-bit locals
                    start = T.Cast("int32", chunk_head // value_heads) * CHUNK
                    tokens = T.Cast("int32", n)
                    i = start + row
                    gates[0] = T.float32(0)
                    for j in range(CHUNK):
                        if j <= row and start + j < tokens:
                            gates[0] = gates[0] + g[0, start + j, h]
                    gates[1] = T.float32(0)
                    for j in range(CHUNK):
                        solve[h, i, j] = T.float32(0)
                        weigh[h, i, j] = T.float32(0)
                        if j <= row and i < tokens:
                            gates[1] = gates[1] + g[0, start + j, h]
                            dots[0] = T.float32(0)
                            dots[1] = T.float32(0)
                            for d in range(key_dim):
                                dots[0] = dots[0] + k[0, i, h // group, d] * k[0, start + j, h // group, d]
                                dots[1] = dots[1] + q[0, i, h // group, d] * k[0, start + j, h // group, d]
                            weigh[h, i, j] = T.exp(gates[0] - gates[1]) * dots[1]
                            if j < row:
                                solve[h, i, j] = beta[0, i, h] * T.exp(gates[0] - gates[1]) * dots[0]
    # fmt: on
    return weights


@functools.cache
def chunk_inverse(value_heads: int) -> tvm.tirx.PrimFunc:
    """(I + M)⁻¹ of each value head's chunks, M strictly lower-triangular: a thread per column, which
    forward substitution makes row by row."""

    # fmt: off
    @T.prim_func(private=True, s_tir=True)
    def inverse(solve_h: T.handle, inverse_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        padded = T.int64()
        solve = T.match_buffer(solve_h, (value_heads, padded, CHUNK), "float32")
        inverted = T.match_buffer(inverse_h, (value_heads, padded, CHUNK), "float32")
        for chunk_head in T.thread_binding(padded // CHUNK * value_heads, thread="blockIdx.x"):
            for column in T.thread_binding(CHUNK, thread="threadIdx.x"):
                with T.sblock("chunk_inverse"):
                    T.reads()
                    T.writes()
                    sums = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    h = T.Cast("int32", chunk_head % value_heads)  # int32: WebGPU has no 64-bit locals
                    start = T.Cast("int32", chunk_head // value_heads) * CHUNK
                    for i in range(CHUNK):
                        sums[0] = T.float32(0)
                        for j in range(CHUNK):
                            if column <= j and j < i:
                                sums[0] = sums[0] + solve[h, start + i, j] * inverted[h, start + j, column]
                        inverted[h, start + i, column] = T.Select(i == column, T.float32(1), T.float32(0)) - sums[0]
    # fmt: on
    return inverse


@functools.cache
def chunk_scan(key_heads: int, value_heads: int, key_dim: int, value_dim: int) -> tvm.tirx.PrimFunc:
    """S from chunk to chunk, and the outputs: a workgroup per value head and SCAN_COLUMNS columns of S
    (in shared memory), a thread per chunk row and column."""
    group = value_heads // key_heads
    columns = math.gcd(value_dim, SCAN_COLUMNS)
    column_blocks = value_dim // columns
    row_passes = -(-key_dim // CHUNK)  # the rows of S a thread updates, CHUNK apart

    # fmt: off
    @T.prim_func(private=True, s_tir=True)
    def scan(q_h: T.handle, k_h: T.handle, v_h: T.handle, g_h: T.handle, beta_h: T.handle, past_h: T.handle,
             inverse_h: T.handle, weigh_h: T.handle, o_h: T.handle, state_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        n, padded = T.int64(), T.int64()
        q = T.match_buffer(q_h, (1, n, key_heads, key_dim), "float32")
        k = T.match_buffer(k_h, (1, n, key_heads, key_dim), "float32")
        v = T.match_buffer(v_h, (1, n, value_heads, value_dim), "float32")
        g = T.match_buffer(g_h, (1, n, value_heads), "float32")
        beta = T.match_buffer(beta_h, (1, n, value_heads), "float32")
        past = T.match_buffer(past_h, (1, value_heads, key_dim, value_dim), "float32")
        inverted = T.match_buffer(inverse_h, (value_heads, padded, CHUNK), "float32")
        weigh = T.match_buffer(weigh_h, (value_heads, padded, CHUNK), "float32")
        o = T.match_buffer(o_h, (1, n, value_heads, value_dim), "float32")
        state = T.match_buffer(state_h, (1, value_heads, key_dim, value_dim), "float32")
        for block in T.thread_binding(value_heads * column_blocks, thread="blockIdx.x"):
            for row in T.thread_binding(CHUNK, thread="threadIdx.y"):
                for lane in T.thread_binding(columns, thread="threadIdx.x"):
                    with T.sblock("chunk_scan"):
                        T.reads()
                        T.writes()
                        s = T.sblock_alloc_buffer((key_dim, columns), "float32", scope="shared")
                        rhs = T.sblock_alloc_buffer((CHUNK, columns), "float32", scope="shared")
                        deltas = T.sblock_alloc_buffer((CHUNK, columns), "float32", scope="shared")  # u
                        gates = T.sblock_alloc_buffer((CHUNK,), "float32", scope="shared")  # γ
                        sums = T.sblock_alloc_buffer((4,), "float32", scope="local")  # γ_i, k·S, o, S's update
                        h = block // column_blocks
                        col = block % column_blocks * columns + lane
                        tokens = T.Cast("int32", n)
                        for r in range(row_passes):
                            d = r * CHUNK + row
                            if d < key_dim:
                                s[d, lane] = past[0, h, d, col]
                        T.tvm_storage_sync("shared")
                        for c in range(padded // CHUNK):
                            start = T.Cast("int32", c) * CHUNK
                            t = start + row
                            sums[0] = T.float32(0)
                            for j in range(CHUNK):
                                if j <= row and start + j < tokens:
                                    sums[0] = sums[0] + g[0, start + j, h]
                            if lane == 0:
                                gates[row] = sums[0]
                            sums[1] = T.float32(0)
                            sums[2] = T.float32(0)
                            rhs[row, lane] = T.float32(0)
                            if t < tokens:
                                for d in range(key_dim):
                                    sums[1] = sums[1] + k[0, t, h // group, d] * s[d, lane]
                                    sums[2] = sums[2] + q[0, t, h // group, d] * s[d, lane]
                                rhs[row, lane] = beta[0, t, h] * (v[0, t, h, col] - T.exp(sums[0]) * sums[1])
                            sums[2] = T.exp(sums[0]) * sums[2]
                            T.tvm_storage_sync("shared")
                            sums[1] = T.float32(0)
                            for j in range(CHUNK):
                                sums[1] = sums[1] + inverted[h, t, j] * rhs[j, lane]
                            deltas[row, lane] = sums[1]
                            T.tvm_storage_sync("shared")
                            for j in range(CHUNK):
                                sums[2] = sums[2] + weigh[h, t, j] * deltas[j, lane]
                            if t < tokens:
                                o[0, t, h, col] = sums[2]
                            for r in range(row_passes):
                                d = r * CHUNK + row
                                if d < key_dim:
                                    sums[3] = T.float32(0)
                                    for j in range(CHUNK):
                                        if start + j < tokens:
                                            decay = T.exp(gates[CHUNK - 1] - gates[j])
                                            sums[3] = sums[3] + k[0, start + j, h // group, d] * decay * deltas[j, lane]
                                    s[d, lane] = T.exp(gates[CHUNK - 1]) * s[d, lane] + sums[3]
                            T.tvm_storage_sync("shared")
                        for r in range(row_passes):
                            d = r * CHUNK + row
                            if d < key_dim:
                                state[0, h, d, col] = s[d, lane]
    # fmt: on
    return scan
