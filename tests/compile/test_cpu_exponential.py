"""exp and sigmoid in CPU kernels, written out of multiplies and adds (kiln/compile/lower/cpu_exponential.py)
instead of a call to libm's expf per element; whole models are held to transformers by the family tests."""

from __future__ import annotations

import numpy as np
import tvm
from tvm.script import tirx as T

from kiln.compile.lower.cpu_exponential import written_out_exp
from kiln.targets import cpu_target

POINTS = 1 << 16
EDGES = [0.0, -0.0, 1.0, -1.0, 88.5, 88.72, 88.73, 100.0, -87.3, -87.34, -200.0, np.inf, -np.inf, np.nan, 1e-8, -1e-8]


@T.prim_func(check_well_formed=False)
def exponentials(
    x: T.Buffer((POINTS,), "float32"), e: T.Buffer((POINTS,), "float32"), s: T.Buffer((POINTS,), "float32")
):
    T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
    for outer in range(POINTS // 8):
        for lane in T.vectorized(8):
            e[outer * 8 + lane] = T.exp(x[outer * 8 + lane])
            s[outer * 8 + lane] = T.sigmoid(x[outer * 8 + lane])


def run(x: np.ndarray):
    target = tvm.target.Target(cpu_target())
    library = tvm.compile(written_out_exp(tvm.IRModule({"main": exponentials})), target=target)
    outputs = [tvm.runtime.tensor(np.zeros(POINTS, np.float32)) for _ in range(2)]
    library["main"](tvm.runtime.tensor(x), *outputs)
    return library, [o.numpy() for o in outputs]


def test_exp_and_sigmoid_are_within_two_ulps_and_call_no_libm():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.uniform(-100, 100, POINTS - len(EDGES)), EDGES]).astype(np.float32)
    library, (e, s) = run(x)
    exact = np.exp(x.astype(np.float64))
    normal = np.isfinite(exact) & (exact >= np.finfo(np.float32).tiny) & (exact <= np.finfo(np.float32).max)
    ulps = np.abs(e[normal] - exact[normal]) / np.spacing(exact[normal].astype(np.float32))
    assert ulps.max() <= 2
    sigmoid = 1 / (1 + np.exp(-x.astype(np.float64)))
    finite = ~np.isnan(x)
    assert np.abs(s[finite] - sigmoid[finite]).max() <= 2.5e-7

    edges = dict(zip(EDGES, zip(e[-len(EDGES) :], s[-len(EDGES) :])))
    assert edges[0.0] == (1.0, 0.5)
    assert edges[88.73][0] == np.inf and edges[np.inf] == (np.inf, 1.0)
    assert np.isfinite(edges[88.5][0])  # 2^128 is not a float32, e^88.5 is (and within the 2 ulps above)
    assert edges[-87.34][0] == 0 and edges[-np.inf] == (0.0, 0.0)  # below the smallest normal: 0
    assert np.isnan(e[-3]) and np.isnan(s[-3])
    host = library.mod.imports[0] if library.mod.imports else library.mod
    assert "expf" not in host.inspect_source("asm")
