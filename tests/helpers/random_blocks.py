"""Random but valid GGUF blocks of every type Kiln keeps as they are (ggml_blocks.BLOCK_TYPES):
random quant bits, and finite float16 scales of a chosen size, so dequantized weights are
about `scale` in magnitude. gguf-py quantizes only some types; this covers the K-quants too."""

from __future__ import annotations

import numpy as np

# Byte offsets of each block's float16 fields (d, and m or dmin), as ggml lays the blocks out.
HALF_FIELDS = {
    "Q4_0": [0],
    "Q4_1": [0, 2],
    "Q5_0": [0],
    "Q5_1": [0, 2],
    "Q8_0": [0],
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "Q6_K": [208],
}
# How large d must be for weights of about 1: the largest quant level times the largest sub-scale.
LEVEL_SPAN = {
    "Q4_0": 8,
    "Q4_1": 15,
    "Q5_0": 16,
    "Q5_1": 31,
    "Q8_0": 128,
    "Q4_K": 15 * 63,
    "Q5_K": 31 * 63,
    "Q6_K": 32 * 128,
}
BLOCK_SHAPES = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q8_0": (32, 34),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
}


def random_blocks(type_name: str, rows: int, cols: int, rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    """A [rows, row bytes] uint8 array of `type_name` blocks (F32, F16 and BF16: values of that dtype)."""
    if type_name in ("F32", "F16", "BF16"):
        values = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        if type_name == "BF16":
            return (values.view(np.uint32) >> 16).astype("<u2").view(np.uint8).reshape(rows, -1)
        return values.astype("<f4" if type_name == "F32" else "<f2").view(np.uint8).reshape(rows, -1)
    elements, size = BLOCK_SHAPES[type_name]
    blocks = rng.integers(0, 256, (rows, cols // elements, size), dtype=np.uint8)
    for offset in HALF_FIELDS[type_name]:
        half = (rng.uniform(0.5, 1.5, blocks.shape[:2]) * scale / LEVEL_SPAN[type_name]).astype("<f2")
        blocks[:, :, offset : offset + 2] = half.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(rows, -1)
