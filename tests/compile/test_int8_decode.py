"""`gguf_i8`: a GGUF's matmuls on 8-bit activations (kiln/compile/quantization/int8_decode.py for decode,
int8_prefill.py for prefill), against the exact integer dot products of its blocks and against
`gguf_f32`, the float path."""

from __future__ import annotations

import functools
import json
import re

import gguf
import numpy as np
import pytest
import tvm
from gguf.quants import dequantize
from tvm.relax.frontend import nn

from helpers.failures import assert_clean_failure
from helpers.parity import assert_contract_holds, parity
from helpers.reference import PROMPTS
from helpers.tiny_families import tensor_blocks
from helpers.web import require_tools, run_function

from kiln.compile.lower import cpu_prefetch
from kiln.compile.quantization import int8_decode, int8_prefill
from kiln.compile.quantization.ggml_blocks import BLOCK_TYPES
from kiln.compile.quantization.gguf_blocks import INT8_LOGIT_TOLERANCE, INT8_NEAR_TIE
from kiln.compile.toolchain import wasm_toolchain
from kiln.engine import Engine
from kiln.errors import KilnError
from kiln.runtime import CPU_VARIANT_ENV, NativeModel, cpu_variant, library_path, missing_cpu_features
from kiln.targets import CPU_VARIANTS, cpu_target, target_named

# A GEMV's outputs move from the float path's by up to 2 % of the largest (measured 0.4–0.7 %); a step's
# logits as kiln/compile/quantization/gguf_blocks.py states. A wrong kernel or a wrong wiring moves them
# by far more: each kernel is held to the exact integer dot product of its blocks.
GEMV_TOLERANCE = 0.02
STEPS = 32


def quantized_activations(x: np.ndarray) -> np.ndarray:
    """The activations as the kernels see them: per block of 32, max|x| / 127 times the nearest
    integer to x · 127 / max|x| (ties to even), in float64."""
    blocks = x.reshape(-1, 32)
    largest = np.abs(blocks).max(axis=1)
    scale = np.divide(np.float32(127), largest, out=np.zeros_like(largest), where=largest > 0)
    levels = np.rint(blocks * scale[:, None])
    return (levels.astype(np.float64) * (largest / np.float32(127))[:, None]).reshape(-1)


def kernel_target(isa: str) -> tvm.target.Target:
    """The target whose kernels take `isa`, skipping where this machine's CPU cannot run them."""
    variant = CPU_VARIANTS.get(isa)
    if variant and missing_cpu_features(variant.mcpu, variant.features):
        pytest.skip(f"this machine's CPU has no {isa}")
    target = tvm.target.Target(variant.tvm_target() if variant else cpu_target())
    assert int8_decode.instruction_set(target).name == isa
    return target


def kernel_library(target, type_name: str, rows: int, cols: int, row_bytes: int):
    kernel = int8_decode.gemv(type_name, rows, cols, row_bytes, int8_decode.instruction_set(target))
    return tvm.compile(tvm.IRModule({"main": kernel.with_attr("global_symbol", "main")}), target=target)


def run(library, rows: int, units: np.ndarray, x: np.ndarray) -> np.ndarray:
    y = tvm.runtime.tensor(np.zeros((1, 1, rows), np.float32))
    library["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(units), y)
    return y.numpy().reshape(rows)


def random_gemv(type_name: str, rows: int, cols: int):
    """A matrix of `type_name` blocks, its float64 weights, its bytes, and an activation row whose
    blocks range over two orders of magnitude."""
    rng = np.random.default_rng(0)
    blocks = tensor_blocks(type_name, rows, cols, rng)
    weights = dequantize(blocks, gguf.GGMLQuantizationType[type_name]).astype(np.float64)
    units = BLOCK_TYPES[type_name].words(blocks).view(np.uint8).reshape(rows, -1)
    x = (rng.standard_normal((1, 1, cols)) * np.repeat(rng.uniform(0.1, 5, cols // 32), 32)).astype(np.float32)
    x[0, 0, :32] = 0  # a block of zeros has the scale 0
    return weights, units, x


@pytest.mark.parametrize("isa", ["avx2", "avx512-vnni"])
@pytest.mark.parametrize("type_name", list(int8_decode.KERNEL_BLOCKS))
def test_every_int8_kernel_is_the_exact_integer_dot_of_its_blocks(type_name, isa):
    rows, cols = 24, 512
    weights, units, x = random_gemv(type_name, rows, cols)
    y = run(kernel_library(kernel_target(isa), type_name, rows, cols, units.shape[1]), rows, units, x)

    exact = weights @ quantized_activations(x)
    scale = np.abs(exact).max()
    assert np.abs(y - exact).max() <= 1e-5 * scale
    assert np.abs(y - weights @ x.reshape(cols)).max() <= GEMV_TOLERANCE * scale


@functools.cache
def prefill_library(isa: str, type_name: str, rows: int, cols: int, row_bytes: int):
    """The kernel built once for the tests that run it (a build takes a quarter to half a second)."""
    target = kernel_target(isa)
    kernel = int8_prefill.gemm(type_name, rows, cols, row_bytes, int8_decode.instruction_set(target))
    return tvm.compile(tvm.IRModule({"main": kernel.with_attr("global_symbol", "main")}), target=target)


def run_prefill(library, rows: int, units: np.ndarray, x: np.ndarray) -> np.ndarray:
    y = tvm.runtime.tensor(np.full((*x.shape[:-1], rows), np.nan, np.float32))
    library["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(units), y)
    return y.numpy()[0]


def activation_rows(cols: int, count: int) -> np.ndarray:
    """`count` activation rows whose blocks range over two orders of magnitude, the first block zeros."""
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((1, count, cols)) * rng.uniform(0.1, 5, (1, count, cols // 32)).repeat(32, axis=2)).astype(
        np.float32
    )
    x[0, 0, :32] = 0
    return x


# Row counts: fewer than a vector of rows' 16, and more than two whole register tiles' (a ragged last one).
PREFILL_ROWS = (3, 37)
PREFILL_MATRIX = (48, 512)  # weight rows, columns


@pytest.mark.parametrize("isa", ["avx2", "avx512-vnni"])
@pytest.mark.parametrize("type_name", list(int8_decode.KERNEL_BLOCKS))
def test_every_int8_prefill_kernel_is_the_exact_integer_dot_of_its_blocks(type_name, isa):
    rows, cols = PREFILL_MATRIX
    weights, units, _ = random_gemv(type_name, rows, cols)
    library = prefill_library(isa, type_name, rows, cols, units.shape[1])
    for count in PREFILL_ROWS:
        x = activation_rows(cols, count)
        y = run_prefill(library, rows, units, x)
        exact = np.stack([quantized_activations(row) for row in x[0]]) @ weights.T
        scale = np.abs(exact).max()
        assert np.abs(y - exact).max() <= 1e-5 * scale
        assert np.abs(y - x[0] @ weights.T).max() <= GEMV_TOLERANCE * scale


@pytest.mark.parametrize("type_name", list(int8_decode.KERNEL_BLOCKS))
def test_the_avx2_and_avx512_prefill_kernels_give_the_same_bits(type_name):
    """Their integer sums are exact and their float epilogues the same operations in the same order."""
    rows, cols = PREFILL_MATRIX
    _, units, _ = random_gemv(type_name, rows, cols)
    x = activation_rows(cols, 37)
    outputs = [
        run_prefill(prefill_library(isa, type_name, rows, cols, units.shape[1]), rows, units, x)
        for isa in ("avx2", "avx512-vnni")
    ]
    np.testing.assert_array_equal(*outputs)


@pytest.mark.slow
def test_every_wasm_prefill_kernel_sums_what_the_x86_one_does(tmp_path):
    """Each block type's wasm kernel (widened bytes, `i32x4.dot_i16x8_s`), run in Node, against the
    AVX2 one: the same integer sums, the float epilogue rounded apart (no fused multiply-add in wasm)."""
    require_tools()
    wasm_toolchain.ensure_web_runtime()
    wasm = tvm.target.Target(target_named("wasm").tvm_target())
    rows, cols = PREFILL_MATRIX
    x = activation_rows(cols, 21)
    for type_name in int8_decode.KERNEL_BLOCKS:
        _, units, _ = random_gemv(type_name, rows, cols)
        kernel = int8_prefill.gemm(type_name, rows, cols, units.shape[1], int8_decode.instruction_set(wasm))

        class Matmul(nn.Module):
            def forward(self, x, w):
                y = nn.Tensor.placeholder((1, x.shape[1], rows), "float32")
                return nn.op.tensor_ir_op(kernel, "gemm", [x, w], y)

        spec = {"x": nn.spec.Tensor(list(x.shape), "float32"), "w": nn.spec.Tensor(list(units.shape), "uint8")}
        module, _ = Matmul().export_tvm(spec={"forward": spec})
        library = tmp_path / f"{type_name}.wasm"
        tvm.compile(module, wasm).export_library(str(library), fcompile=wasm_toolchain.link_tvmjs_wasm)
        _, (got,) = run_function(library, "forward", [x, units], tmp_path)
        avx2 = prefill_library("avx2", type_name, rows, cols, units.shape[1])
        expected = run_prefill(avx2, rows, units, x)
        assert np.abs(got[0] - expected).max() <= 1e-6 * np.abs(expected).max(), type_name


def forced_decode(model: NativeModel, reference: NativeModel, ids: list[int]) -> tuple[float, list[int]]:
    """Both models decode the reference's greedy tokens after `ids`: the largest logit difference
    relative to the largest logit, and the steps where their argmax differs, if not at a near tie."""
    model.reset()
    reference.reset()
    logits, expected = model.prefill(ids), reference.prefill(ids)
    worst, parted = 0.0, []
    for step in range(STEPS):
        worst = max(worst, float(np.abs(logits - expected).max() / np.abs(expected).max()))
        top2 = np.sort(expected)[-2:]
        if logits.argmax() != expected.argmax() and top2[1] - top2[0] > INT8_NEAR_TIE:
            parted.append(step)
        token = int(expected.argmax())
        logits, expected = model.decode(token), reference.decode(token)
    return worst, parted


def assert_decodes_within_tolerance(int8: NativeModel, floats: NativeModel, prompts: list[list[int]]) -> None:
    for ids in prompts:
        worst, parted = forced_decode(int8, floats, ids)
        print(f"prompt of {len(ids)} tokens: decode logits within {worst:.2%} of the largest, parted at {parted}")
        assert worst <= INT8_LOGIT_TOLERANCE and parted == []


def assert_prefills_and_decodes_within_tolerance(int8: NativeModel, floats: NativeModel) -> None:
    """A prefill's logits at every position move from the float path's as a decode step's may, and
    its greedy tokens part from them only at near ties."""
    for ids in PROMPTS:
        int8.reset()
        floats.reset()
        logits, expected = int8.all_logits(ids), floats.all_logits(ids)
        worst = np.abs(logits - expected).max() / np.abs(expected).max()
        top2 = np.sort(expected, axis=1)[:, -2:]
        parted = (logits.argmax(axis=1) != expected.argmax(axis=1)) & (top2[:, 1] - top2[:, 0] > INT8_NEAR_TIE)
        print(f"prompt of {len(ids)} tokens: prefill logits within {worst:.2%} of the largest")
        assert 0 < worst <= INT8_LOGIT_TOLERANCE and not parted.any()
    assert_decodes_within_tolerance(int8, floats, PROMPTS)


def test_gguf_i8_prefills_and_decodes_within_its_tolerance_of_gguf_f32(mixed_build):
    """The mixed GGUF holds every type: the quantized ones prefill and decode on 8-bit activations,
    F16, BF16 and F32 on float ones."""
    assert_prefills_and_decodes_within_tolerance(
        NativeModel(mixed_build("gguf_i8")), NativeModel(mixed_build("gguf_f32"))
    )


def test_q8_0_i8_quantizes_a_checkpoint_and_runs_within_its_tolerance_of_q0f32(tiny_build):
    """A safetensors checkpoint quantized into Q8_0 blocks at conversion takes gguf_i8's kernels."""
    assert_prefills_and_decodes_within_tolerance(NativeModel(tiny_build("q8_0_i8")), NativeModel(tiny_build("q0f32")))


@pytest.mark.slow
def test_gguf_i8_decodes_smollm2_as_gguf_f32_up_to_near_ties(smollm2_build):
    int8, floats = NativeModel(smollm2_build("gguf_i8")), NativeModel(smollm2_build("gguf_f32"))
    engine = Engine(smollm2_build("gguf_f32"))
    questions = ["What is the capital of France?", "Write a haiku about kilns.", "List three uses of clay."]
    prompts = [
        engine.tokenizer.encode(engine.render_chat([{"role": "user", "content": q}]), add_special_tokens=False).ids
        for q in questions
    ]
    assert_decodes_within_tolerance(int8, floats, prompts)


@pytest.mark.parametrize("target", ["webgpu", "arm64-linux"])
@pytest.mark.parametrize("source, quantization", [("mixed_gguf", "gguf_i8"), ("tiny_source", "q8_0_i8")])
def test_8_bit_activations_are_refused_for_a_target_without_their_kernels(
    request, tmp_path, run_compile, target, source, quantization
):
    result = run_compile(request.getfixturevalue(source), tmp_path / "out", "-q", quantization, "-t", target)
    assert_clean_failure(
        result,
        tmp_path / "out",
        "this quantization runs matmuls on 8-bit activations, with x86-64 (AVX2) and wasm (SIMD) kernels only",
    )


@pytest.mark.browser
def test_gguf_i8_in_wasm_generates_what_the_native_library_does(mixed_build, tmp_path):
    """The wasm kernels (i32x4.dot_i16x8_s on widened bytes) sum the same integers as the x86 ones:
    the browser engine's greedy tokens are the native engine's, every block type of the mixed GGUF on
    8-bit activations, its logits within their tolerance (the float epilogue rounds apart, a fused
    multiply-add natively, and a quantized row after it may round apart: `ParityContract.of`)."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(
        "The history of the city is long and full of stories about the river\n"
        "In the morning the people of the town walk to the harbour\n"
    )
    model_dir = mixed_build("gguf_i8", ["cpu", "wasm"])
    code, report = parity(model_dir, "--prompts", str(prompts), "--max-tokens", "8", "--target", "wasm")
    print({k: v for k, v in report.items() if k != "prompts"})
    assert report["browser"] == "wasm"
    assert_contract_holds(code, report, prompts=2, max_tokens=8)


def greedy_logits(model_dir, ids: list[int], steps: int = 8) -> np.ndarray:
    model = NativeModel(model_dir)
    logits = [model.prefill(ids)]
    for _ in range(steps):
        logits.append(model.decode(int(logits[-1].argmax())))
    return np.stack(logits)


def test_gguf_i8_builds_an_avx512_vnni_library_that_decodes_as_the_portable_one(mixed_build, monkeypatch):
    """A portable build also holds the library of int8_decode.py's AVX-512 VNNI kernels, which the
    engine loads where the CPU runs it: its integer sums are the AVX2 kernels', added in the same
    lanes in the same order, so are its logits."""
    model_dir = mixed_build("gguf_i8")
    cpu = json.loads((model_dir / "kiln-build.json").read_text())["targets"]["cpu"]
    variant = CPU_VARIANTS["avx512-vnni"]
    assert cpu["variants"] == {
        "avx512-vnni": {
            "library": cpu["library"].replace(".so", "-avx512-vnni.so"),
            "mcpu": variant.mcpu,
            "features": list(variant.features),
        }
    }
    assert (model_dir / cpu["variants"]["avx512-vnni"]["library"]).is_file()
    if missing_cpu_features(variant.mcpu, variant.features):
        pytest.skip("this machine's CPU has no AVX-512 VNNI")
    assert library_path(model_dir, "cpu").name.endswith("-avx512-vnni.so")
    for ids in PROMPTS:
        monkeypatch.setenv(CPU_VARIANT_ENV, "portable")
        portable = greedy_logits(model_dir, ids)
        monkeypatch.setenv(CPU_VARIANT_ENV, "avx512-vnni")
        vnni = greedy_logits(model_dir, ids)
        np.testing.assert_allclose(vnni, portable, rtol=0, atol=1e-5 * np.abs(portable).max())
        assert (vnni.argmax(axis=1) == portable.argmax(axis=1)).all()


def test_a_variant_the_cpu_cannot_run_is_passed_over_and_refused_by_name(mixed_build, monkeypatch, tmp_path):
    richer = next(
        str(cpu)
        for cpu in tvm.target.codegen.llvm_get_cpu_archlist(tvm.target.Target({"kind": "llvm"}))
        if missing_cpu_features(str(cpu))
    )
    entry = {
        "library": "libs/m-cpu.so",
        "variants": {"rich": {"library": "libs/m-cpu-rich.so", "mcpu": richer, "features": []}},
    }
    monkeypatch.delenv(CPU_VARIANT_ENV, raising=False)
    assert cpu_variant(entry, tmp_path) == ("portable", entry)
    monkeypatch.setenv(CPU_VARIANT_ENV, "rich")
    with pytest.raises(KilnError, match=f"{CPU_VARIANT_ENV}=rich: this machine's CPU lacks "):
        cpu_variant(entry, tmp_path)
    monkeypatch.setenv(CPU_VARIANT_ENV, "other")
    with pytest.raises(KilnError, match=r"this library has no such variant \(it has: portable, rich\)"):
        cpu_variant(entry, tmp_path)


@pytest.mark.parametrize("type_name", ["Q5_0", "Q4_1", "Q4_K", "Q6_K"])
def test_a_kernels_weight_loads_keep_their_alias_information(type_name):
    """Every vector and half the kernel loads is marked with its buffer: a load LLVM cannot place
    (RowBytes.f16's two bytes joined into one half lost the mark) may read the sums, which then go
    back to memory at every step."""
    target = tvm.target.Target(CPU_VARIANTS["avx512-vnni"].tvm_target())
    blocks = int8_decode.KERNEL_BLOCKS[type_name]
    row_bytes = 512 // blocks.elements * blocks.bytes
    library = kernel_library(target, type_name, 96, 512, row_bytes)
    host = library.mod.imports[0] if library.mod.imports else library.mod
    loads = [
        line
        for line in host.inspect_source("ll").splitlines()
        if re.search(r"= load (<\d+ x (i8|i16|i32|float)>|half)", line)
    ]
    assert loads and all("!tbaa" in line for line in loads)


@pytest.mark.parametrize("isa", ["avx2", "avx512-vnni"])
def test_a_kernel_asks_for_its_weights_ahead_of_its_steps(isa):
    """x86 kernels prefetch the weights cpu_prefetch.AHEAD bytes past each step's (one per cache line it
    takes): on its own, the hardware streamed a matrix larger than the caches at 18–24 GB/s of 35."""
    target = tvm.target.Target(CPU_VARIANTS[isa].tvm_target() if isa in CPU_VARIANTS else cpu_target())
    blocks = int8_decode.KERNEL_BLOCKS["Q4_K"]
    library = kernel_library(target, "Q4_K", 96, 512, 512 // blocks.elements * blocks.bytes)
    host = library.mod.imports[0] if library.mod.imports else library.mod
    ahead = [int(m) for m in re.findall(r"prefetcht0\s+(\d+)\(", host.inspect_source("asm"))]
    lines = -(-blocks.bytes // cpu_prefetch.CACHE_LINE)  # a Q4_K row's loop takes a stored block a step
    assert ahead and min(ahead) == cpu_prefetch.AHEAD and len(ahead) >= lines
