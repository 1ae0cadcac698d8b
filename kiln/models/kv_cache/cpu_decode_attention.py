"""Kiln's CPU kernel for decode attention over the paged KV cache, which the cpu and wasm libraries run.

TVM 0.27's kernel walks the (sequence, query head) pairs one after another, a scalar at a time, on
one thread however many the library has: its share of a decode step grows with the cached tokens
(SmolLM2 after a 512-token prompt, 2 threads: native decode 43 -> 70 tokens/s with this kernel, wasm
15 -> 20; after 128 tokens the gain was within the noise). This one gives TVM's thread pool each
pair as a task, which meets its keys in blocks (cpu_attention.py). Tasks of all the query heads of a
key head kept a core busy with their per-key chains side by side when a step met one key; with
blocks they lost (SmolLM2 after 1000 tokens, 2 threads, a first version of the blocks: 5.2 ms of
attention a step against 4.3 with a task a pair, 3 tasks against 9). After that many tokens much of
the step is reading the float32 cache (46 MB a token for SmolLM2).

It computes what TVM's does: the same online softmax in base 2, the same score statement (so the
soft-cap rewrite still finds it), the same log-sum-exp output. It replaces the full-attention kernel
only: sliding-window layers keep TVM's, whose window and attention-sink bookkeeping it does not
repeat, and the cache must not rotate keys in the kernel (RopeMode.INLINE), which Kiln never asks for.
"""

from __future__ import annotations

from tvm.script import tirx as T

from .cache_kernels import replace_cache_kernels
from .cpu_attention import KEYS_PER_BLOCK, SOFTMAX_SLOTS, attention_steps, blocks, page_slot_offset

KERNEL = "tir_attention_decode_cpu"


def decode_attention(num_kv_heads: int, num_qo_heads: int, head_dim: int, dtype: str, page_size: int = 16):
    heads, kv_heads, dim = num_qo_heads, num_kv_heads, head_dim
    group_size = num_qo_heads // num_kv_heads
    steps = attention_steps(dim, dtype)
    page_slot = page_slot_offset(kv_heads, page_size, dim)

    @T.prim_func(s_tir=True)
    def batch_decode_paged_kv(
        Q_handle: T.handle,
        pages_handle: T.handle,
        page_table_indptr_handle: T.handle,
        page_table_values_handle: T.handle,
        last_page_len_handle: T.handle,
        k_rope_pos_offset_handle: T.handle,
        q_rope_position_handle: T.handle,
        output_handle: T.handle,
        lse_handle: T.handle,
        rotary_mode: T.int32,
        rope_scale: T.float32,
        rope_theta: T.float32,
        sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "global_symbol": "batch_decode_paged_kv_cpu"})
        B = T.int32()
        nnz_pages = T.int32()
        max_num_pages = T.int32()
        page_indptr_elem_offset = T.int32()
        page_values_elem_offset = T.int32()
        last_page_len_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()

        Q = T.match_buffer(Q_handle, (B, heads, dim), dtype)
        pages = T.match_buffer(pages_handle, (max_num_pages, 2, kv_heads, page_size, dim), dtype)
        page_table_indptr = T.match_buffer(
            page_table_indptr_handle, (B + 1,), "int32", elem_offset=page_indptr_elem_offset
        )
        page_table_values = T.match_buffer(
            page_table_values_handle, (nnz_pages,), "int32", elem_offset=page_values_elem_offset
        )
        last_page_len = T.match_buffer(last_page_len_handle, (B,), "int32", elem_offset=last_page_len_elem_offset)
        # the signature's, unused: no rotation in the kernel
        T.match_buffer(k_rope_pos_offset_handle, (B,), "int32", elem_offset=k_rope_pos_offset_elem_offset)
        T.match_buffer(q_rope_position_handle, (B,), "int32", elem_offset=q_rope_position_elem_offset)
        output = T.match_buffer(output_handle, (B, heads, dim), dtype)
        lse = T.match_buffer(lse_handle, (B, heads), "float32")

        pages_flat = T.decl_buffer((max_num_pages * 2 * kv_heads * page_size * dim,), dtype, data=pages.data)

        for pair in T.parallel(B * heads):
            with T.sblock("attn"):
                # no regions to infer: the block is already scheduled, and its extents are its own lets
                T.reads()
                T.writes()
                q_local = T.sblock_alloc_buffer((dim,), "float32", scope="local")
                o_local = T.sblock_alloc_buffer((dim,), "float32", scope="local")
                partial = T.sblock_alloc_buffer((KEYS_PER_BLOCK, steps.lanes), "float32", scope="local")
                S_val = T.sblock_alloc_buffer((KEYS_PER_BLOCK,), "float32", scope="local")
                softmax = T.sblock_alloc_buffer((SOFTMAX_SLOTS,), "float32", scope="local")

                b: T.let[T.int32] = pair // heads
                head: T.let[T.int32] = pair % heads
                h_kv: T.let[T.int32] = head // group_size
                first_page: T.let[T.int32] = page_table_indptr[b]
                page_count: T.let[T.int32] = page_table_indptr[b + 1] - first_page
                kv_len: T.let[T.int32] = T.if_then_else(
                    page_count > 0, (page_count - 1) * page_size + last_page_len[b], 0
                )
                steps.start(q_local, o_local, softmax, Q, b, head)
                for block in T.serial(blocks(kv_len)):
                    col: T.let[T.int32] = block * KEYS_PER_BLOCK
                    key_at: T.let[T.int32] = page_slot(
                        page_table_values[first_page + col // page_size], h_kv, col % page_size
                    )
                    steps.attend_block(
                        q_local,
                        o_local,
                        partial,
                        S_val,
                        softmax,
                        pages_flat,
                        key_at,
                        pages_flat,
                        key_at + kv_heads * page_size * dim,
                        dim,
                        T.min(KEYS_PER_BLOCK, kv_len - col),
                        sm_scale,
                    )
                steps.finish(o_local, softmax, output, lse, b, head)

    return batch_decode_paged_kv


def replace_decode_attention_kernel(num_kv_heads: int, num_qo_heads: int, head_dim: int, dtype: str) -> None:
    """In the module being built, swap the KV cache's CPU decode attention kernel for Kiln's (a GPU
    target has none)."""
    replace_cache_kernels(
        lambda name, _: decode_attention(num_kv_heads, num_qo_heads, head_dim, dtype) if name == KERNEL else None
    )
