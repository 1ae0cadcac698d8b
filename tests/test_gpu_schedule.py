"""Kiln's WebGPU matmul schedules: the kernels they write (numerics: the browser parity tests)."""

import re

import pytest
import tvm
from tvm import te

from kiln.compile.quantization.group import GroupFormat
from kiln.compile.targets import TARGETS
from kiln.models.layers import matmul_transposed

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
        module = entry.schedules()(module)
    built = tvm.tirx.build(module, target=entry.target())
    return "".join(device.inspect_source() for device in built.imports)


# target → the workgroup of its decode GEMV
DECODE_WORKGROUPS = {"webgpu": "@workgroup_size(64, 1, 1)", "webgpu-subgroups": "@workgroup_size(4, 16, 1)"}


def kilns_decode_gemv(wgsl: str, target: str) -> bool:
    """Whether `wgsl` is Kiln's decode GEMV for `target` (dlight's also has 64 threads, and barriers)."""
    return DECODE_WORKGROUPS[target] in wgsl and "workgroupBarrier" not in wgsl


@pytest.mark.parametrize("residual", [False, True])
def test_webgpu_decode_gemv_sums_a_row_per_thread_without_barriers(residual):
    wgsl = matmul_wgsl(1536, 576, residual)
    assert DECODE_WORKGROUPS["webgpu"] in wgsl
    assert "workgroupBarrier" not in wgsl and "var<workgroup>" not in wgsl and "subgroup" not in wgsl
    assert ("skip_ptr[" in wgsl) == residual


@pytest.mark.parametrize("residual", [False, True])
def test_subgroup_decode_gemv_adds_four_lanes_with_two_shuffles_down(residual):
    wgsl = matmul_wgsl(1536, 576, residual, target="webgpu-subgroups")
    assert DECODE_WORKGROUPS["webgpu-subgroups"] in wgsl and "enable subgroups;" in wgsl
    assert "workgroupBarrier" not in wgsl and "var<workgroup>" not in wgsl
    assert re.findall(r"subgroupShuffleDown\(\w+\[0i\], (\du)\)", wgsl) == ["2u", "1u"]
    # no broadcast from an absolute lane (TVM's own lowering, wrong on subgroups of another size)
    assert "subgroupShuffle(" not in wgsl
    assert re.search(r"if \(i32\(threadIdx\.x\) == 0i\) \{(\s+let .*)?\s+\w+_ptr\[", wgsl)  # lane 0 writes


@pytest.mark.parametrize("target", DECODE_WORKGROUPS)
def test_a_swiglu_gemv_sums_the_gate_and_up_rows_of_an_output_together(target):
    """SmolLM2's gate/up projection with its silu · mul is one kernel: a gate row and its up row
    are summed side by side (by a thread, or by the lanes of an output), in registers, and
    silu(gate) · up is written once per output."""
    wgsl = matmul_wgsl(3072, 576, swiglu=True, target=target)
    assert wgsl.count("@compute") == 1 and kilns_decode_gemv(wgsl, target) and "var<workgroup>" not in wgsl
    assert re.search(r"var \w+ : array<f32, 2>;", wgsl)  # the gate and up sums
    assert wgsl.count("exp(") == 1
    shuffles = re.findall(r"subgroupShuffleDown\(\w+\[0i\], (\du)\)", wgsl)
    assert shuffles == (["2u", "1u"] * 2 if target == "webgpu-subgroups" else [])


def test_only_the_subgroup_gemv_enables_subgroups():
    """Other reductions in the subgroup library (here a prefill matmul) keep workgroup memory:
    TVM's warp lowering assumes subgroups of 32."""
    wgsl = matmul_wgsl(1536, 576, rows=tvm.tirx.Var("n", "int32"), target="webgpu-subgroups")
    assert "subgroup" not in wgsl and "workgroupBarrier" in wgsl


@pytest.mark.parametrize(
    "target, shape",
    [
        ("webgpu", (40, 576)),  # 40 rows: not a multiple of a workgroup's 64
        ("webgpu-subgroups", (40, 576)),  # nor of 16
        ("webgpu-subgroups", (1536, 48)),  # 48 weights: not a multiple of four lanes' packed words
    ],
)
def test_shapes_that_do_not_split_keep_dlights_schedule(target, shape):
    assert not kilns_decode_gemv(matmul_wgsl(*shape, target=target), target)


@pytest.mark.parametrize("target", DECODE_WORKGROUPS)
def test_rows_longer_than_1536_weights_keep_dlights_schedule(target):
    assert kilns_decode_gemv(matmul_wgsl(576, 1536, target=target), target)  # SmolLM2's down projection
    assert not kilns_decode_gemv(matmul_wgsl(576, 1536 + 32 * 4, target=target), target)


def prefill_kernels(target: str = "webgpu", residual: bool = True) -> tuple[list[tuple[str, str]], str, str]:
    """The workgroup arrays of a prefill matmul's WGSL and its two kernels: for short inputs, and
    dlight's tiled one."""
    wgsl = matmul_wgsl(1536, 576, residual, rows=tvm.tirx.Var("n", "int32"), target=target)
    shared = re.findall(r"var<workgroup> (\w+) : array<f32, (\d+)>", wgsl)
    short, long = re.split(r"(?=@compute)", wgsl)[1:]
    return shared, short.split("var<workgroup>")[0], long  # the long kernel's arrays are declared between


def test_long_prefill_matmuls_step_through_32_deep_tiles():
    shared, _, long = prefill_kernels()
    assert [size for _, size in shared] == ["1024", "1024"]  # 32 rows × 32 deep
    steps = re.findall(r"for \(var \w+ : i32 = 0i; \w+ < (\d+)i", long)
    assert "18" in steps and "72" not in steps, steps  # 576 / 32; dlight's 8-deep tiles took 72


@pytest.mark.parametrize("target", DECODE_WORKGROUPS)
@pytest.mark.parametrize("residual", [False, True])
def test_short_prefill_matmuls_sum_four_input_rows_per_thread_without_branches_or_barriers(target, residual):
    """Up to 64 input rows a thread computes an output for four rows at once, in registers; the rows
    past the input's end read its last row again (a branch per load blew up SwiftShader's compiler)."""
    shared, short, _ = prefill_kernels(target, residual)
    assert "@workgroup_size(64, 1, 1)" in short and re.search(r"var \w+ : array<f32, 4>;", short)
    assert "workgroupBarrier" not in short and not any(name in short for name, _ in shared)
    assert "if (" not in short.split("for (")[1]  # the loop over the weights
    assert short.count("min(") >= 4 and ("skip_ptr[" in short) == residual
