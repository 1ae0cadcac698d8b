"""Kiln's WebGPU matmul schedules: the kernels they write (numerics: the browser parity tests)."""

import re

import pytest
import tvm
from tvm import te

from kiln.compile.quantization.group import GroupFormat
from kiln.compile.targets import TARGETS
from kiln.models.layers import matmul_transposed

Q4F32 = GroupFormat(4, 32, "float32")


def matmul_wgsl(out_features: int, in_features: int, residual: bool = False, rows=1) -> str:
    """The WGSL of a q4f32_1 matmul of `rows` input rows (one: decode), optionally + a residual,
    under the webgpu target's schedules."""
    x = te.placeholder((1, rows, in_features), "float32", name="x")
    weight = te.placeholder((out_features, in_features // 8), "uint32", name="weight")
    scale = te.placeholder((out_features, in_features // 32), "float32", name="scale")
    y = matmul_transposed(x, Q4F32.dequantize_te(weight, scale, out_features, in_features), "float32")
    args = [x, weight, scale]
    if residual:
        skip = te.placeholder((1, rows, out_features), "float32", name="skip")
        y = te.compute(y.shape, lambda *i: y(*i) + skip(*i), name="add")
        args.append(skip)
    module = tvm.IRModule({"main": te.create_prim_func([*args, y]).with_attr("global_symbol", "main")})
    entry = TARGETS["webgpu"]
    target = entry.target()
    with target:
        module = entry.schedules()(module)
    return tvm.tirx.build(module, target=target).imports[0].inspect_source()


@pytest.mark.parametrize("residual", [False, True])
def test_a_workgroup_computes_16_outputs_with_4_lanes_each(residual):
    wgsl = matmul_wgsl(1536, 576, residual)
    assert "@workgroup_size(4, 16, 1)" in wgsl
    # adding four lanes' sums: two steps; dlight's GEMV gave every output 64 lanes and 8 barriers
    assert wgsl.count("workgroupBarrier()") <= 4


def test_widths_that_do_not_split_into_lanes_keep_dlights_schedule():
    assert "@workgroup_size(4, 16, 1)" not in matmul_wgsl(1536, 48)
    assert "@workgroup_size(4, 16, 1)" not in matmul_wgsl(40, 576)


def test_rows_longer_than_48_words_a_lane_keep_dlights_schedule():
    assert "@workgroup_size(4, 16, 1)" in matmul_wgsl(576, 1536)  # SmolLM2's down projection
    assert "@workgroup_size(4, 16, 1)" not in matmul_wgsl(576, 1536 + 32 * 4)


def test_prefill_matmuls_step_through_32_deep_tiles():
    wgsl = matmul_wgsl(1536, 576, rows=tvm.tirx.Var("n", "int32"))
    assert re.findall(r"var<workgroup> \w+ : array<f32, (\d+)>", wgsl) == ["1024", "1024"]  # 32 rows × 32 deep
    steps = re.findall(r"for \(var \w+ : i32 = 0i; \w+ < (\d+)i", wgsl)
    assert "18" in steps and "72" not in steps, steps  # 576 / 32; dlight's 8-deep tiles took 72
