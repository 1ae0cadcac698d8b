"""Kiln's WebGPU matmul schedules: the kernels they write (numerics: the browser parity tests)."""

import re

import pytest
import tvm
from tvm import relax

from helpers.wgsl import matmul_wgsl

from kiln.compile.lower import schedules_for
from kiln.compile.quantization.group import GroupFormat
from kiln.models.layers import matmul_transposed
from kiln.targets import TARGETS

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


def normed_matmul_wgsl(out_features: int, in_features: int, target: str, swiglu=False, dtype="float32") -> str:
    """The WGSL of a decode step's RMSNorm followed by a q4 matmul (and SwiGLU's silu · mul), as
    the build lowers a model: through Relax's operator fusion and Kiln's merges."""
    group = GroupFormat(4, 32, dtype)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 1, in_features), dtype))
    norm_weight = relax.Var("norm_weight", relax.TensorType((in_features,), dtype))
    weight = relax.Var("weight", relax.TensorType((out_features, in_features // 8), "uint32"))
    scale = relax.Var("scale", relax.TensorType((out_features, in_features // 32), dtype))
    with bb.function("main", [x, norm_weight, weight, scale]):
        with bb.dataflow():
            normed = bb.emit(relax.op.nn.rms_norm(x, norm_weight, axes=[-1], epsilon=1e-5))
            y = bb.emit_te(
                lambda x, w, s: matmul_transposed(x, group.dequantize_te(w, s, out_features, in_features), dtype),
                normed,
                weight,
                scale,
                primfunc_name_hint="dequantize_matmul",
            )
            if swiglu:
                half = out_features // 2
                gate = relax.op.strided_slice(y, axes=[2], begin=[0], end=[half])
                up = relax.op.strided_slice(y, axes=[2], begin=[half], end=[out_features])
                y = bb.emit(relax.op.multiply(relax.op.nn.silu(gate), up))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    t = relax.transform
    entry = TARGETS[target]
    with entry.target():
        lowering = [t.LegalizeOps(), t.AnnotateTIROpPattern(), t.FuseOps(), t.FuseTIR(), t.DeadCodeElimination()]
        module = tvm.transform.Sequential([*lowering, schedules_for(entry)])(bb.get())
        kernels = {gv.name_hint: f for gv, f in module.functions.items() if isinstance(f, tvm.tirx.PrimFunc)}
        built = [
            tvm.tirx.build(tvm.IRModule({"main": f.with_attr("global_symbol", name)}), target=entry.target())
            for name, f in kernels.items()
        ]
    return "".join(device.inspect_source() for library in built for device in library.imports)


@pytest.mark.parametrize("target", DECODE_WORKGROUPS)
@pytest.mark.parametrize("swiglu", [False, True])
def test_a_norm_before_a_decode_gemv_is_summed_in_the_gemvs_own_loop(target, swiglu):
    """RMSNorm · W = (x ∘ w) · W / rms(x): one kernel, whose threads add up the squares of x in the
    loop that reads x for the dot product and scale their output by 1/rms(x); no workgroup memory,
    no barrier, and on subgroups one more pair of shuffles (the lanes' sums of squares)."""
    wgsl = normed_matmul_wgsl(3072 if swiglu else 960, 576, target, swiglu)
    assert wgsl.count("@compute") == 1 and kilns_decode_gemv(wgsl, target) and "var<workgroup>" not in wgsl
    assert wgsl.count("for (") == 1  # squares and dot products side by side
    assert re.search(r"fma\((\w+_ptr\[[^]]+\]), \1, \w+_local\[0i\]\)", wgsl)  # x[k] · x[k]
    assert "sqrt(((" in wgsl and "/ 5.760000e+02f) + 1.000000e-05f)" in wgsl  # 1/√(mean + ε)
    shuffles = re.findall(r"subgroupShuffleDown\(\w+\[0i\], (\du)\)", wgsl)
    dot_products = 2 if swiglu else 1
    assert shuffles == (["2u", "1u"] * (dot_products + 1) if target == "webgpu-subgroups" else [])


@pytest.mark.parametrize(
    "out_features, dtype, merged",
    [
        (64 * 32, "float32", True),  # 32 rows per input: merged
        (64 * 33, "float32", False),  # a vocabulary head's proportions: the norm keeps its kernel
        (128, "float16", False),  # float16 would sum unnormalized inputs, which can overflow it
    ],
)
def test_a_norm_merges_only_into_float32_gemvs_of_few_rows_per_input(out_features, dtype, merged):
    wgsl = normed_matmul_wgsl(out_features, 64, "webgpu", dtype=dtype)
    assert wgsl.count("@compute") == (1 if merged else 2)
    assert ("workgroupBarrier" in wgsl) != merged  # the norm kernel's own reduction


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
