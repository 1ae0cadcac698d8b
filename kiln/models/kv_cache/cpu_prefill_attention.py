"""Kiln's CPU kernels for prefill attention, which the cpu and wasm libraries run: over the chunk's
own keys (ragged) and over the cached ones (paged).

TVM 0.27's kernels walk the query heads and rows one after another, a scalar at a time, on one
thread; the paged one visits every slot the cache could hold (its capacity, not the sequence's
length) for every query. A verify step of speculative decoding (a few rows after a long prompt)
paid for that: SmolLM2 after 1000 cached tokens, 4 rows took 107 ms where a decode step takes 12.
These give each (query row, head) pair to TVM's thread pool, visit only the keys the row may see,
and meet the keys in blocks with cpu_attention.py's steps, as the decode kernel does.

They compute what TVM's do: the causal mask `col < kv_len - qo_len + row + 1` (or every key without
it), the online softmax in base 2 and the log-sum-exp output, so the cache merges their states as
before. A row that sees no key gives 0 with a log-sum-exp of -5e4 (TVM's gives its masked keys'
mean at that weight): the merge weighs it 0 either way. As the decode kernel, they replace the
full-attention kernels only and need a cache that does not rotate keys in the kernel; a model with
one window over all its layers (Mistral's) keeps TVM's, which that window's cache calls otherwise.
"""

from __future__ import annotations

from tvm.script import tirx as T

from .cache_kernels import replace_cache_kernels
from .cpu_attention import KEYS_PER_BLOCK, SOFTMAX_SLOTS, attention_steps, blocks, page_slot_offset

PAGED = "tir_attention_prefill_cpu"
RAGGED = "tir_attention_prefill_ragged_cpu"


def visible_keys(causal, kv_len, qo_len, row):
    """How many keys (from the first) query `row` of `qo_len` may see among `kv_len`."""
    return T.if_then_else(causal > 0, T.max(kv_len - qo_len + row + 1, 0), kv_len)


def paged_prefill_attention(num_kv_heads: int, num_qo_heads: int, head_dim: int, dtype: str, page_size: int = 16):
    heads, kv_heads, dim = num_qo_heads, num_kv_heads, head_dim
    group_size = heads // kv_heads
    steps = attention_steps(dim, dtype)
    page_slot = page_slot_offset(kv_heads, page_size, dim)

    @T.prim_func(s_tir=True)
    def batch_prefill_paged_kv(
        q_handle: T.handle,
        q_indptr_handle: T.handle,
        pages_handle: T.handle,
        page_indptr_handle: T.handle,
        page_values_handle: T.handle,
        length_info_handle: T.handle,
        k_rope_pos_offset_handle: T.handle,
        q_rope_position_handle: T.handle,
        output_handle: T.handle,
        lse_handle: T.handle,
        causal: T.int32,
        rotary_mode: T.int32,
        rope_scale: T.float32,
        rope_theta: T.float32,
        sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "global_symbol": "batch_prefill_paged_kv_cpu"})
        batch_size = T.int32()
        total_len = T.int32()
        nnz_pages = T.int32()
        max_num_pages = T.int32()
        q_indptr_elem_offset = T.int32()
        page_indptr_elem_offset = T.int32()
        page_values_elem_offset = T.int32()
        length_info_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()

        q = T.match_buffer(q_handle, (total_len, heads, dim), dtype)
        q_indptr = T.match_buffer(q_indptr_handle, (batch_size + 1,), "int32", elem_offset=q_indptr_elem_offset)
        pages = T.match_buffer(pages_handle, (max_num_pages, 2, kv_heads, page_size, dim), dtype)
        page_indptr = T.match_buffer(
            page_indptr_handle, (batch_size + 1,), "int32", elem_offset=page_indptr_elem_offset
        )
        page_values = T.match_buffer(page_values_handle, (nnz_pages,), "int32", elem_offset=page_values_elem_offset)
        last_page_len = T.match_buffer(length_info_handle, (batch_size,), "int32", elem_offset=length_info_elem_offset)
        # the signature's, unused: no rotation in the kernel
        T.match_buffer(k_rope_pos_offset_handle, (batch_size,), "int32", elem_offset=k_rope_pos_offset_elem_offset)
        T.match_buffer(q_rope_position_handle, (total_len,), "int32", elem_offset=q_rope_position_elem_offset)
        output = T.match_buffer(output_handle, (total_len, heads, dim), dtype)
        lse = T.match_buffer(lse_handle, (total_len, heads), "float32")
        pages_flat = T.decl_buffer((max_num_pages * 2 * kv_heads * page_size * dim,), dtype, data=pages.data)

        for pair in T.parallel(total_len * heads):
            with T.sblock("attn"):
                T.reads()
                T.writes()
                q_local = T.sblock_alloc_buffer((dim,), "float32", scope="local")
                o_local = T.sblock_alloc_buffer((dim,), "float32", scope="local")
                partial = T.sblock_alloc_buffer((KEYS_PER_BLOCK, steps.lanes), "float32", scope="local")
                S_val = T.sblock_alloc_buffer((KEYS_PER_BLOCK,), "float32", scope="local")
                softmax = T.sblock_alloc_buffer((SOFTMAX_SLOTS,), "float32", scope="local")
                sequence = T.sblock_alloc_buffer((1,), "int32", scope="local")

                row: T.let[T.int32] = pair // heads
                h_qo: T.let[T.int32] = pair % heads
                h_kv: T.let[T.int32] = h_qo // group_size
                sequence[0] = 0
                for b in T.serial(batch_size):
                    if q_indptr[b + 1] <= row:
                        sequence[0] = b + 1
                b: T.let[T.int32] = sequence[0]
                first_page: T.let[T.int32] = page_indptr[b]
                page_count: T.let[T.int32] = page_indptr[b + 1] - first_page
                kv_len: T.let[T.int32] = T.if_then_else(
                    page_count > 0, (page_count - 1) * page_size + last_page_len[b], 0
                )
                seen: T.let[T.int32] = visible_keys(causal, kv_len, q_indptr[b + 1] - q_indptr[b], row - q_indptr[b])
                steps.start(q_local, o_local, softmax, q, row, h_qo)
                for block in T.serial(blocks(seen)):
                    col: T.let[T.int32] = block * KEYS_PER_BLOCK
                    key_at: T.let[T.int32] = page_slot(
                        page_values[first_page + col // page_size], h_kv, col % page_size
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
                        T.min(KEYS_PER_BLOCK, seen - col),
                        sm_scale,
                    )
                steps.finish(o_local, softmax, output, lse, row, h_qo)

    return batch_prefill_paged_kv


def ragged_prefill_attention(num_kv_heads: int, num_qo_heads: int, head_dim: int, dtype: str):
    heads, kv_heads, dim = num_qo_heads, num_kv_heads, head_dim
    group_size = heads // kv_heads
    steps = attention_steps(dim, dtype)

    @T.prim_func(s_tir=True)
    def batch_prefill_ragged_kv(
        q_handle: T.handle,
        q_indptr_handle: T.handle,
        k_handle: T.handle,
        v_handle: T.handle,
        kv_indptr_handle: T.handle,
        q_rope_position_handle: T.handle,
        k_rope_pos_offset_handle: T.handle,
        output_handle: T.handle,
        lse_handle: T.handle,
        causal: T.int32,
        rotary_mode: T.int32,
        rope_scale: T.float32,
        rope_theta: T.float32,
        sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "global_symbol": "batch_prefill_ragged_kv_cpu"})
        batch_size = T.int32()
        qo_len = T.int32()
        kv_len = T.int32()
        q_indptr_elem_offset = T.int32()
        kv_indptr_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()

        q = T.match_buffer(q_handle, (qo_len, heads, dim), dtype)
        q_indptr = T.match_buffer(q_indptr_handle, (batch_size + 1,), "int32", elem_offset=q_indptr_elem_offset)
        k = T.match_buffer(k_handle, (kv_len, kv_heads, dim), dtype)
        v = T.match_buffer(v_handle, (kv_len, kv_heads, dim), dtype)
        kv_indptr = T.match_buffer(kv_indptr_handle, (batch_size + 1,), "int32", elem_offset=kv_indptr_elem_offset)
        # the signature's, unused: no rotation in the kernel
        T.match_buffer(q_rope_position_handle, (qo_len,), "int32", elem_offset=q_rope_position_elem_offset)
        T.match_buffer(k_rope_pos_offset_handle, (batch_size,), "int32", elem_offset=k_rope_pos_offset_elem_offset)
        output = T.match_buffer(output_handle, (qo_len, heads, dim), dtype)
        lse = T.match_buffer(lse_handle, (qo_len, heads), "float32")
        k_flat = T.decl_buffer((kv_len * kv_heads * dim,), dtype, data=k.data)
        v_flat = T.decl_buffer((kv_len * kv_heads * dim,), dtype, data=v.data)

        for pair in T.parallel(qo_len * heads):
            with T.sblock("attn"):
                T.reads()
                T.writes()
                q_local = T.sblock_alloc_buffer((dim,), "float32", scope="local")
                o_local = T.sblock_alloc_buffer((dim,), "float32", scope="local")
                partial = T.sblock_alloc_buffer((KEYS_PER_BLOCK, steps.lanes), "float32", scope="local")
                S_val = T.sblock_alloc_buffer((KEYS_PER_BLOCK,), "float32", scope="local")
                softmax = T.sblock_alloc_buffer((SOFTMAX_SLOTS,), "float32", scope="local")
                sequence = T.sblock_alloc_buffer((1,), "int32", scope="local")

                row: T.let[T.int32] = pair // heads
                h_qo: T.let[T.int32] = pair % heads
                h_kv: T.let[T.int32] = h_qo // group_size
                sequence[0] = 0
                for b in T.serial(batch_size):
                    if q_indptr[b + 1] <= row:
                        sequence[0] = b + 1
                b: T.let[T.int32] = sequence[0]
                first_key: T.let[T.int32] = kv_indptr[b]
                seen: T.let[T.int32] = visible_keys(
                    causal, kv_indptr[b + 1] - first_key, q_indptr[b + 1] - q_indptr[b], row - q_indptr[b]
                )
                steps.start(q_local, o_local, softmax, q, row, h_qo)
                for block in T.serial(blocks(seen)):
                    col: T.let[T.int32] = block * KEYS_PER_BLOCK
                    key_at: T.let[T.int32] = ((first_key + col) * kv_heads + h_kv) * dim
                    steps.attend_block(
                        q_local,
                        o_local,
                        partial,
                        S_val,
                        softmax,
                        k_flat,
                        key_at,
                        v_flat,
                        key_at,
                        kv_heads * dim,
                        T.min(KEYS_PER_BLOCK, seen - col),
                        sm_scale,
                    )
                steps.finish(o_local, softmax, output, lse, row, h_qo)

    return batch_prefill_ragged_kv


def replace_prefill_attention_kernels(num_kv_heads: int, num_qo_heads: int, head_dim: int, dtype: str) -> None:
    """In the module being built, swap the KV cache's CPU prefill attention kernels for Kiln's (a GPU
    target has none)."""
    kernels = {
        PAGED: lambda: paged_prefill_attention(num_kv_heads, num_qo_heads, head_dim, dtype),
        RAGGED: lambda: ragged_prefill_attention(num_kv_heads, num_qo_heads, head_dim, dtype),
    }
    replace_cache_kernels(lambda name, _: kernels[name]() if name in kernels else None)
