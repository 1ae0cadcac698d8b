"""exp (and sigmoid, which TVM lowers to it) for CPU kernels from multiplies and adds.

LLVM has no vector exp: each float32 exp in a cpu or wasm kernel was a call to libm's expf per
element, which SwiGLU's sigmoid takes for every intermediate value (Qwen2.5-0.5B's 128-token
prefill on 2 threads: `split_silu_multiply` 35 ms, 16 written out). So every float32 exp in a CPU kernel
is written out as Cephes' expf computes it: x = n · ln 2 + r with ln 2 in two parts (Cody-Waite, the
first short enough that n times it is exact), e^r = 1 + r + r² · P(r) on |r| ≤ ln 2 / 2, and 2^n
put into the exponent's bits: within 2 float32 ulps of the exact value. Above 88.72 it gives +inf,
below −87.33 (where expf's results become subnormal) 0, and NaN for NaN.
"""

from __future__ import annotations

import math

import tvm
import tvm_ffi
from tvm import tirx

from kiln.compile.lower.gpu_trigonometry import f32, polynomial

LN2_PARTS = (0.693359375, -2.12194440e-4)
EXP_COEFFICIENTS = (
    5.0000001201e-1,
    1.6666665459e-1,
    4.1665795894e-2,
    8.3334519073e-3,
    1.3981999507e-3,
    1.9875691500e-4,
)
SMALLEST = -87.33654022216797  # ln of float32's smallest normal value
BEYOND_LARGEST = 88.8  # past ln of its largest (88.7228): e^r · 2^128, +inf


def exp(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """e^x in float32, written out in full (no Let bindings: TVM's vectorizer mistypes a scalar let
    variable bound to a vector); LLVM eliminates the repeated subexpressions."""
    clamped = tirx.max(tirx.min(x, f32(BEYOND_LARGEST)), f32(SMALLEST))
    n = tirx.floor(clamped * f32(1 / math.log(2)) + f32(0.5))  # -126 … 128
    r = clamped
    for part in LN2_PARTS:
        r = r - n * f32(part)
    e_r = f32(1.0) + r + r * r * polynomial(r, EXP_COEFFICIENTS)
    # 2^n as two normal powers (2^128 alone is not a float32; exp(88.5) is)
    half = tirx.floor(n * f32(0.5))
    written = tirx.Select(x < f32(SMALLEST), f32(0.0), e_r * power_of_two(half) * power_of_two(n - half))
    return tirx.Select(tirx.isnan(x), x, written)


def power_of_two(n: tirx.PrimExpr) -> tirx.PrimExpr:
    """2^n for a whole float n in -126 … 127, from its exponent bits."""
    return tirx.reinterpret("float32", (n + f32(127)).astype("int32") << tirx.const(23, "int32"))


WRITTEN_OUT = {
    "tirx.exp": exp,
    "tirx.sigmoid": lambda x: f32(1.0) / (f32(1.0) + exp(-x)),  # TVM lowers it to this, with libm's exp
}


def written_out(call: tvm.ir.expr.Call) -> tvm.ir.expr.Call | tirx.PrimExpr:
    if call.op.name not in WRITTEN_OUT or str(call.ty) != "float32":
        return call
    return WRITTEN_OUT[call.op.name](call.args[0])


@tvm.tirx.transform.prim_func_pass(opt_level=0)
def written_out_exp(func: tirx.PrimFunc, mod, ctx) -> tirx.PrimFunc:
    return tvm_ffi.structural_map(func, (tvm.ir.expr.Call, written_out))
