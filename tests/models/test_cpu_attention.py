"""Kiln's CPU attention kernels (kiln/models/kv_cache/): the softmax's exp2, written out instead of
libm's, and each kernel against softmax attention at key counts around its blocks of keys and the
cache's pages, with every cache slot no token has written NaN. The kernels are also held to
transformers by every family's test (tests/models/test_families.py), natively and in wasm."""

from __future__ import annotations

import numpy as np
import tvm
from tvm.script import tirx as T

from kiln.models.kv_cache.cpu_attention import exp2

POINTS = 4096


@T.prim_func
def powers_of_two(x: T.Buffer((POINTS,), "float32"), y: T.Buffer((POINTS,), "float32")):
    for i in range(POINTS):
        y[i] = exp2(x[i])


def test_the_softmax_exp2_is_libms_to_float32_rounding_and_exact_where_the_softmax_needs_it():
    x = np.concatenate([-np.linspace(0, 126, POINTS - 8), [0, -0.5, -1e-8, -0.49999, -126.4, -127, -200, -1e30]])
    x = x.astype(np.float32)
    y = tvm.runtime.tensor(np.zeros(POINTS, np.float32))
    tvm.compile(tvm.IRModule({"main": powers_of_two}), target="llvm")["main"](tvm.runtime.tensor(x), y)
    got, exact = y.numpy(), np.exp2(x.astype(np.float64))
    normal = exact >= 2.0**-126
    assert (np.abs(got[normal] - exact[normal]) <= 2e-7 * exact[normal]).all()
    assert got[POINTS - 8] == 1.0  # exp2(0): a key that does not raise the maximum leaves the sums as they are
    assert (got[-3:] == 0).all()  # far below every other weight: nothing, not a denormal or garbage


HEADS, KV_HEADS, DIM, PAGE = 4, 2, 32, 16
SM_SCALE = DIM**-0.5


def reference_attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, seen: int):
    """One query row [heads, dim] over the first `seen` of keys and values [n, kv heads, dim]: the
    output and the log-sum-exp in base 2, from float64 numpy."""
    group = HEADS // KV_HEADS
    k, v = keys[:seen, np.arange(HEADS) // group].astype(np.float64), values[:seen, np.arange(HEADS) // group]
    scores = np.einsum("hd,nhd->hn", q, k) * SM_SCALE * np.log2(np.e)
    weights = np.exp2(scores - scores.max(1, keepdims=True))
    output = np.einsum("hn,nhd->hd", weights / weights.sum(1, keepdims=True), v)
    return output, scores.max(1) + np.log2(weights.sum(1))


def paged(sequences: list[tuple[np.ndarray, np.ndarray]], rng) -> tuple[np.ndarray, ...]:
    """A cache's pages holding each sequence's keys and values, its pages in shuffled order and every
    slot no token has written NaN: pages, page indptr, page values, last page lengths."""
    counts = [-(-len(keys) // PAGE) for keys, _ in sequences]
    order = rng.permutation(sum(counts)).astype(np.int32)
    pages = np.full((sum(counts), 2, KV_HEADS, PAGE, DIM), np.nan, np.float32)
    for (keys, values), first in zip(sequences, np.cumsum([0, *counts[:-1]])):
        for position in range(len(keys)):
            page = order[first + position // PAGE]
            pages[page, 0, :, position % PAGE], pages[page, 1, :, position % PAGE] = keys[position], values[position]
    last = [len(keys) - (count - 1) * PAGE for (keys, _), count in zip(sequences, counts)]
    return pages, np.cumsum([0, *counts]).astype(np.int32), order, np.array(last, np.int32)


def keys_and_values(rng, count: int) -> tuple[np.ndarray, np.ndarray]:
    return tuple(rng.standard_normal((count, KV_HEADS, DIM), np.float32) for _ in range(2))


def tensors(*arrays):
    return [tvm.runtime.tensor(np.ascontiguousarray(array)) for array in arrays]


# Key counts around the kernels' blocks of keys (cpu_attention.KEYS_PER_BLOCK) and the cache's pages.
LENGTHS = [1, 7, 8, 9, 16, 17, 40, 300]


def test_decode_attention_over_pages_matches_softmax_attention_at_every_length():
    from kiln.models.kv_cache.cpu_decode_attention import decode_attention

    rng = np.random.default_rng(0)
    sequences = [keys_and_values(rng, n) for n in LENGTHS]
    pages, indptr, values, last = paged(sequences, rng)
    q = rng.standard_normal((len(LENGTHS), HEADS, DIM), np.float32)
    output, lse = np.zeros_like(q), np.zeros((len(LENGTHS), HEADS), np.float32)
    zeros = np.zeros(len(LENGTHS), np.int32)
    kernel = tvm.compile(tvm.IRModule({"main": decode_attention(KV_HEADS, HEADS, DIM, "float32")}), target="llvm")
    args = tensors(q, pages, indptr, values, last, zeros, zeros, output, lse)
    kernel["batch_decode_paged_kv_cpu"](*args, 0, 1.0, 1e4, SM_SCALE)
    for b, (keys, vals) in enumerate(sequences):
        expected, expected_lse = reference_attention(q[b], keys, vals, len(keys))
        np.testing.assert_allclose(args[-2].numpy()[b], expected, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(args[-1].numpy()[b], expected_lse, rtol=1e-5, atol=1e-5)


def test_prefill_attention_ragged_and_over_pages_matches_causal_softmax_attention():
    from kiln.models.kv_cache.cpu_prefill_attention import paged_prefill_attention, ragged_prefill_attention

    rng = np.random.default_rng(1)
    rows = 5
    sequences = [keys_and_values(rng, n + rows) for n in LENGTHS]
    q = rng.standard_normal((len(LENGTHS) * rows, HEADS, DIM), np.float32)
    q_indptr = np.arange(0, len(q) + 1, rows, dtype=np.int32)
    zeros = np.zeros(len(q), np.int32)

    def run(kernel, name, *inputs):
        library = tvm.compile(tvm.IRModule({"main": kernel(KV_HEADS, HEADS, DIM, "float32")}), target="llvm")
        output = tensors(np.zeros_like(q), np.zeros((len(q), HEADS), np.float32))
        library[name](*tensors(*inputs), *output, 1, 0, 1.0, 1e4, SM_SCALE)
        return [tensor.numpy() for tensor in output]

    keys = np.concatenate([k for k, _ in sequences])
    vals = np.concatenate([v for _, v in sequences])
    kv_indptr = np.cumsum([0, *(len(k) for k, _ in sequences)]).astype(np.int32)
    per_sequence = zeros[: len(LENGTHS)]
    ragged = run(
        ragged_prefill_attention, "batch_prefill_ragged_kv_cpu", q, q_indptr, keys, vals, kv_indptr, zeros, per_sequence
    )
    over_pages = run(
        paged_prefill_attention, "batch_prefill_paged_kv_cpu", q, q_indptr, *paged(sequences, rng), per_sequence, zeros
    )
    for b, (k, v) in enumerate(sequences):
        for row in range(rows):
            expected, expected_lse = reference_attention(q[b * rows + row], k, v, len(k) - rows + row + 1)
            for output, lse in (ragged, over_pages):
                np.testing.assert_allclose(output[b * rows + row], expected, rtol=1e-5, atol=1e-5)
                np.testing.assert_allclose(lse[b * rows + row], expected_lse, rtol=1e-5, atol=1e-5)
