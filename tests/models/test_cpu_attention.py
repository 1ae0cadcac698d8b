"""The steps Kiln's CPU attention kernels share (kiln/models/kv_cache/cpu_attention.py): the softmax's
exp2, written out instead of libm's. The kernels themselves are held to transformers by every
family's test (tests/models/test_families.py), natively and in wasm."""

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
