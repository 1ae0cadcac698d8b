"""The WGSL Kiln's WebGPU schedules write for a q4f32_1 matmul."""

import tvm
from tvm import te

from kiln.compile.lower import schedules_for
from kiln.compile.quantization.group import GroupFormat
from kiln.models.layers import matmul_transposed
from kiln.targets import TARGETS

Q4F32 = GroupFormat(4, 32, "float32")


def matmul_wgsl(
    out_features: int, in_features: int, residual: bool = False, rows=1, target="webgpu", swiglu: bool = False
) -> str:
    """The WGSL of a q4f32_1 matmul of `rows` input rows (one: decode), optionally + a residual or
    followed by SwiGLU's silu(first half) · second half, under `target`'s schedules."""
    x = te.placeholder((1, rows, in_features), "float32", name="x")
    weight = te.placeholder((out_features, in_features // 8), "uint32", name="weight")
    scale = te.placeholder((out_features, in_features // 32), "float32", name="scale")
    y = matmul_transposed(x, Q4F32.dequantize_te(weight, scale, out_features, in_features), "float32")
    args = [x, weight, scale]
    if residual:
        skip = te.placeholder((1, rows, out_features), "float32", name="skip")
        y = te.compute(y.shape, lambda *i: y(*i) + skip(*i), name="add")
        args.append(skip)
    if swiglu:
        gate_up, half = y, out_features // 2
        silu = te.compute((1, rows, half), lambda b, r, i: gate_up[b, r, i] * tvm.tirx.sigmoid(gate_up[b, r, i]))
        y = te.compute(silu.shape, lambda b, r, i: silu[b, r, i] * gate_up[b, r, i + half], name="swiglu")
    module = tvm.IRModule({"main": te.create_prim_func([*args, y]).with_attr("global_symbol", "main")})
    entry = TARGETS[target]
    with entry.target():
        module = schedules_for(entry)(module)
    built = tvm.tirx.build(module, target=entry.target())
    return "".join(device.inspect_source() for device in built.imports)
