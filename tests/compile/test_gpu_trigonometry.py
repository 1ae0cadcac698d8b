"""The sin and cos Kiln writes into GPU kernels (kiln/compile/lower/gpu_trigonometry.py), run on the CPU
against float64: RoPE's angles (position · frequency) up to the longest context, and negatives."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import te, tirx

from kiln.compile.lower.gpu_trigonometry import precise_sin_cos


def test_sin_and_cos_are_within_a_few_float32_ulps():
    size = 1 << 16
    angles = te.placeholder((size,), "float32", name="angles")
    sines = te.compute((size,), lambda i: tirx.sin(angles[i]), name="sines")
    cosines = te.compute((size,), lambda i: tirx.cos(angles[i]), name="cosines")
    module = precise_sin_cos(tvm.IRModule({"main": te.create_prim_func([angles, sines, cosines])}))
    assert "T.sin(" not in module["main"].script() and "T.cos(" not in module["main"].script()
    kernel = tvm.tirx.build(module, target="llvm")

    rng = np.random.default_rng(0)
    x = np.concatenate(
        [rng.uniform(-10, 10, size // 2), rng.uniform(0, 8192, size // 4), rng.uniform(0, 1e5, size // 4)]
    )
    x = x.astype(np.float32)
    out = [tvm.runtime.tensor(np.zeros(size, np.float32)) for _ in range(2)]
    kernel(tvm.runtime.tensor(x), *out)
    sin_error = np.abs(out[0].numpy() - np.sin(x.astype(np.float64)))
    cos_error = np.abs(out[1].numpy() - np.cos(x.astype(np.float64)))
    within_context = np.abs(x) <= 8192
    assert max(sin_error[within_context].max(), cos_error[within_context].max()) < 2e-7
    assert max(sin_error.max(), cos_error.max()) < 2e-6  # the reduction's error grows with the angle
