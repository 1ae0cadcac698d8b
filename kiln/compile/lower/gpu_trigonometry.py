"""sin and cos for GPU kernels from multiplies and adds, as precise as the CPU's.

A GPU's own sin and cos may be coarse: WGSL allows an absolute error of 2^-11 on [-π, π], and
SwiftShader's come close to it. RoPE rotates every query and key by them, so a WebGPU build's
logits drifted from the CPU build's: on the tiny Gemma 3 by 7e-3 (2.5e-5 with RoPE left out),
enough to flip near ties that the parity contract counts. So every float32 sin and cos in a GPU
kernel (the model's RoPE, the KV cache's) is rewritten as Cephes' sinf/cosf do it: the angle
reduced by multiples of π/2 (Cody-Waite: π/2 in three parts, the first two short enough that
k · part is exact), then minimax polynomials on [-π/4, π/4] and the quadrant's sign and swap.
The error is a few float32 ulps for angles up to about 1e5 (k below 2^16).
"""

from __future__ import annotations

import math

import tvm
import tvm_ffi
from tvm import tirx

HALF_PI_PARTS = (1.5703125, 4.837512969970703125e-4, 7.54978995489188216e-8)
SIN_COEFFICIENTS = (-1.6666654611e-1, 8.3321608736e-3, -1.9515295891e-4)
COS_COEFFICIENTS = (4.166664568298827e-2, -1.388731625493765e-3, 2.443315711809948e-5)


def f32(value: float) -> tirx.PrimExpr:
    return tirx.const(value, "float32")


def polynomial(z: tirx.PrimExpr, coefficients: tuple[float, ...]) -> tirx.PrimExpr:
    """c0 + z·(c1 + z·(c2 + …)) by Horner's rule."""
    result = f32(coefficients[-1])
    for c in reversed(coefficients[:-1]):
        result = f32(c) + z * result
    return result


def sin_or_cos(x: tirx.PrimExpr, want_sin: bool) -> tirx.PrimExpr:
    """Written out in full, without Let bindings (TVM's vectorizer mistypes a scalar let variable
    bound to a vector); the shader compiler eliminates the repeated subexpressions."""
    k = tirx.floor(x * f32(2 / math.pi) + f32(0.5))  # quarter turns
    r = x
    for part in HALF_PI_PARTS:
        r = r - k * f32(part)
    z = r * r
    sin_r = r + r * z * polynomial(z, SIN_COEFFICIENTS)
    cos_r = f32(1.0) - f32(0.5) * z + z * z * polynomial(z, COS_COEFFICIENTS)
    # sin(r + q·π/2) is sin r, cos r, −sin r, −cos r for q = 0..3; cos is the next one along.
    # The quadrant stays a float (exact for these integers): the WebGPU code generator mistypes an
    # int cast of a vectorized float.
    turns = k + f32(0.0 if want_sin else 1.0)
    quadrant = turns - f32(4.0) * tirx.floor(turns * f32(0.25))
    return tirx.Select(
        quadrant < f32(1.5),
        tirx.Select(quadrant < f32(0.5), sin_r, cos_r),
        tirx.Select(quadrant < f32(2.5), -sin_r, -cos_r),
    )


def precise(call: tvm.ir.expr.Call) -> tvm.ir.expr.Call | tirx.PrimExpr:
    if call.op.name not in ("tirx.sin", "tirx.cos") or str(call.ty) != "float32":
        return call
    return sin_or_cos(call.args[0], want_sin=call.op.name == "tirx.sin")


@tvm.tirx.transform.prim_func_pass(opt_level=0)
def precise_sin_cos(func: tirx.PrimFunc, mod, ctx) -> tirx.PrimFunc:
    return tvm_ffi.structural_map(func, (tvm.ir.expr.Call, precise))
