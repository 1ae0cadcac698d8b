"""Qwen3.5's delta rule (kiln/models/delta_rule.py): the token-by-token kernel on the CPU, where it runs
blocks of 16 columns in vector lanes, against the rule computed token by token in float64; the chunked
form a GPU prefills with, built for every GPU target (tests/models/test_hybrid.py runs it on WebGPU
against the CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm

from kiln.models.delta_rule import chunk_inverse, chunk_scan, chunk_weights, delta_rule_kernel
from kiln.targets import TARGETS

KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM = 2, 4, 16, 48


def delta_rule(q, k, v, g, beta, past):
    """The rule as transformers' torch_recurrent_gated_delta_rule states it, S per head [d_k, d_v]."""
    state = past[0].astype(np.float64).copy()
    group = VALUE_HEADS // KEY_HEADS
    out = np.zeros(v.shape[1:])
    for t in range(v.shape[1]):
        for h in range(VALUE_HEADS):
            kt, qt = k[0, t, h // group].astype(np.float64), q[0, t, h // group].astype(np.float64)
            state[h] *= np.exp(g[0, t, h])
            state[h] += np.outer(kt, (v[0, t, h] - kt @ state[h]) * beta[0, t, h])
            out[t, h] = qt @ state[h]
    return out, state


@pytest.mark.parametrize("tokens", [1, 7])
def test_the_cpu_kernel_computes_the_rule(tokens):
    entry = TARGETS["cpu"]
    with entry.target():
        kernel = delta_rule_kernel(KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM)
    library = tvm.compile(tvm.IRModule({"main": kernel.with_attr("global_symbol", "main")}), target=entry.target())
    rng = np.random.default_rng(tokens)
    q, k = (rng.standard_normal((1, tokens, KEY_HEADS, KEY_DIM)).astype("float32") * 0.3 for _ in range(2))
    v = rng.standard_normal((1, tokens, VALUE_HEADS, VALUE_DIM)).astype("float32")
    g = -rng.random((1, tokens, VALUE_HEADS)).astype("float32")
    beta = rng.random((1, tokens, VALUE_HEADS)).astype("float32")
    past = rng.standard_normal((1, VALUE_HEADS, KEY_DIM, VALUE_DIM)).astype("float32")
    arguments = [tvm.runtime.tensor(a) for a in (q, k, v, g, beta, past, np.zeros_like(v), np.zeros_like(past))]
    library["main"](*arguments)
    expected_out, expected_state = delta_rule(q, k, v, g, beta, past)
    assert np.abs(arguments[6].numpy()[0] - expected_out).max() < 1e-4
    assert np.abs(arguments[7].numpy()[0] - expected_state).max() < 1e-4


@pytest.mark.parametrize("target", [name for name, entry in TARGETS.items() if not entry.cpu_kernels])
def test_the_chunked_form_builds_for_every_gpu_target(target):
    entry = TARGETS[target]
    kernels = {
        "weights": chunk_weights(KEY_HEADS, VALUE_HEADS, KEY_DIM),
        "inverse": chunk_inverse(VALUE_HEADS),
        "scan": chunk_scan(KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM),
    }
    module = tvm.IRModule({name: kernel.with_attr("global_symbol", name) for name, kernel in kernels.items()})
    with entry.target():
        tvm.compile(module, target=entry.target())
