"""Kiln's CPU kernel for decode attention over the paged KV cache, which the cpu and wasm libraries run.

TVM 0.27's kernel walks the (sequence, query head) pairs one after another, a scalar at a time, on
one thread however many the library has: its share of a decode step grows with the cached tokens
(SmolLM2 after a 512-token prompt, 2 threads: native decode 43 -> 70 tokens/s with this kernel, wasm
15 -> 20; after 128 tokens the gain was within the noise). This one gives TVM's thread pool the
query heads of a key head (up to 8) as one task, which meets each key for all of them
(cpu_attention.py's steps, side by side: SmolLM2 after 1000 tokens, one thread, 4.45 -> 3.76 ms of
attention a step, and 3.05 with the exp2 written out).

It computes what TVM's does: the same online softmax in base 2, the same score statement (so the
soft-cap rewrite still finds it), the same log-sum-exp output. It replaces the full-attention kernel
only: sliding-window layers keep TVM's, whose window and attention-sink bookkeeping it does not
repeat, and the cache must not rotate keys in the kernel (RopeMode.INLINE), which Kiln never asks for.
"""

from __future__ import annotations

from tvm.script import tirx as T

from .cache_kernels import replace_cache_kernels
from .cpu_attention import SOFTMAX_SLOTS, attention_steps, page_slot_offset

KERNEL = "tir_attention_decode_cpu"
MOST_INTERLEAVED_HEADS = 8


def decode_attention(num_kv_heads: int, num_qo_heads: int, head_dim: int, dtype: str, page_size: int = 16):
    heads, kv_heads, dim = num_qo_heads, num_kv_heads, head_dim
    group_size = num_qo_heads // num_kv_heads
    # A task takes this many query heads of one key head, one key at a time for all of them: each
    # head's softmax is a chain of dependent steps per key, and independent chains side by side
    # keep the core busy (the keys are read once for them too).
    interleaved = max(n for n in range(1, MOST_INTERLEAVED_HEADS + 1) if group_size % n == 0)
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

        for task in T.parallel(B * heads // interleaved):
            with T.sblock("attn"):
                # no regions to infer: the block is already scheduled, and its extents are its own lets
                T.reads()
                T.writes()
                q_local = T.sblock_alloc_buffer((interleaved, dim), "float32", scope="local")
                o_local = T.sblock_alloc_buffer((interleaved, dim), "float32", scope="local")
                partial = T.sblock_alloc_buffer((interleaved, steps.lanes), "float32", scope="local")
                S_val = T.sblock_alloc_buffer((interleaved,), "float32", scope="local")
                softmax = T.sblock_alloc_buffer((interleaved, SOFTMAX_SLOTS), "float32", scope="local")

                b: T.let[T.int32] = task // (heads // interleaved)
                first_head: T.let[T.int32] = task % (heads // interleaved) * interleaved
                h_kv: T.let[T.int32] = first_head // group_size
                first_page: T.let[T.int32] = page_table_indptr[b]
                page_count: T.let[T.int32] = page_table_indptr[b + 1] - first_page
                kv_len: T.let[T.int32] = T.if_then_else(
                    page_count > 0, (page_count - 1) * page_size + last_page_len[b], 0
                )
                for slot in T.unroll(interleaved):
                    steps.start(q_local, o_local, softmax, Q, b, first_head + slot, slot)
                for row in T.serial(kv_len):
                    key_at: T.let[T.int32] = page_slot(
                        page_table_values[first_page + row // page_size], h_kv, row % page_size
                    )
                    for slot in T.unroll(interleaved):
                        steps.attend_key(
                            q_local,
                            o_local,
                            partial,
                            S_val,
                            softmax,
                            pages_flat,
                            key_at,
                            pages_flat,
                            key_at + kv_heads * page_size * dim,
                            sm_scale,
                            slot,
                        )
                for slot in T.unroll(interleaved):
                    steps.finish(o_local, softmax, output, lse, b, first_head + slot, slot)

    return batch_decode_paged_kv


def replace_decode_attention_kernel(num_kv_heads: int, num_qo_heads: int, head_dim: int, dtype: str) -> None:
    """In the module being built, swap the KV cache's CPU decode attention kernel for Kiln's (a GPU
    target has none)."""
    replace_cache_kernels(
        lambda name, _: decode_attention(num_kv_heads, num_qo_heads, head_dim, dtype) if name == KERNEL else None
    )
