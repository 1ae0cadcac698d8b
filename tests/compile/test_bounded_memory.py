"""Huge tensors are read and quantized without copies of their whole size beyond the result (Gemma 4
E2B's 262144 x 8960 per-layer table is 9.4 GB in float32: stock copies took some 37 GB). Measured
with tracemalloc, which numpy reports its arrays to."""

from __future__ import annotations

import tracemalloc

import numpy as np

from kiln.compile.quantization.group import GroupFormat, quantize_group
from kiln.compile.source.ingest import BFLOAT16_CHUNK, read_bfloat16

ROWS, COLS = 2048, 4096  # 32 MiB of float32


def peak_bytes(function, *args):
    tracemalloc.start()
    try:
        result = function(*args)
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_bfloat16_tensor_is_read_into_its_float32_result_alone(tmp_path):
    values = np.random.default_rng(0).standard_normal(ROWS * COLS).astype(np.float32)
    path = tmp_path / "tensor.bin"
    path.write_bytes(b"header" + (values.view(np.uint32) >> 16).astype("<u2").tobytes())
    result, peak = peak_bytes(read_bfloat16, path, len(b"header"), values.size)
    assert np.array_equal(result.view(np.uint32), values.view(np.uint32) & 0xFFFF0000)
    assert peak < result.nbytes + 2 * 2 * BFLOAT16_CHUNK + (1 << 20)  # the result, and two chunks of bfloat16 at most


def test_group_quantization_holds_no_copy_of_the_whole_matrix():
    weight = np.random.default_rng(0).standard_normal((ROWS, COLS)).astype(np.float32)
    (packed, scales), peak = peak_bytes(quantize_group, weight, GroupFormat(4, 32, "float16"))
    assert packed.shape == (ROWS, COLS // 8) and scales.shape == (ROWS, COLS // 32)
    assert peak < packed.nbytes + scales.nbytes + 0.25 * weight.nbytes
