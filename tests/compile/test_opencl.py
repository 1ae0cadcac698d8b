"""Android's OpenCL kernels on PoCL, the CPU OpenCL driver: every kernel compiles as OpenCL C, and
one decoder layer of the tiny Llama computes on PoCL what the CPU build computes.

PoCL's CPU device has no half precision (cl_khr_fp16), so PoCL compiles f32 builds and refuses f16
ones with that reason; f16 kernels are checked by clang's OpenCL C front end for a SPIR device."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm.runtime.vm import VMInstrumentReturnKind

from kiln.compile.lower.library import library_metadata, param_specs, scheduled_module
from kiln.compile.source.ingest import ingest
from kiln.compile.toolchain.opencl_check import (
    check_opencl_c,
    check_opencl_kernels,
    kernel_programs,
    pocl_context,
    run_on_opencl,
)
from kiln.compile.pipeline import config_file, quantized_model
from kiln.compile.quantization import quantization_named
from kiln.errors import KilnError
from kiln.models import architecture_for
from kiln.runtime import NativeModel
from kiln.targets import TARGETS

LAYER_TOLERANCE = 1e-4
PROMPT = [5, 17, 100, 42, 7, 250, 3]


@pytest.fixture(scope="module")
def pocl():
    return pocl_context()


def kernel_source(model_dir: Path) -> str:
    record = json.loads((model_dir / "kiln-build.json").read_text())["targets"]["android"]
    return (model_dir / record["kernel_source"]).read_text()


def test_tiny_kernels_compile_on_pocl(tiny_build, pocl):
    source = kernel_source(tiny_build("q4f32_1", ["android"]))
    assert check_opencl_kernels(source) == len(kernel_programs(source)) > 40


@pytest.mark.slow
def test_smollm2_kernels_compile_on_pocl(smollm2_build, pocl):
    source = kernel_source(smollm2_build("q4f32_1", ["android"]))
    count = check_opencl_kernels(source)
    print(f"SmolLM2 q4f32_1: {count} OpenCL kernels compiled on PoCL")
    assert count == len(kernel_programs(source)) > 40


@pytest.mark.slow
def test_smollm2_f16_kernels_are_valid_opencl_c(smollm2_build):
    source = kernel_source(smollm2_build("q4f16_1", ["android"]))
    count = check_opencl_c(source)
    print(f"SmolLM2 q4f16_1: {count} OpenCL kernels valid OpenCL C (clang, SPIR)")
    assert count == len(kernel_programs(source)) > 40


def test_tiny_f16_kernels_are_valid_opencl_c(tiny_build):
    source = kernel_source(tiny_build("q4f16_1", ["android"]))
    assert "half" in source and check_opencl_c(source) == len(kernel_programs(source))


@pytest.mark.parametrize("check", [check_opencl_kernels, check_opencl_c])
def test_a_broken_kernel_is_named_with_its_build_log(pocl, check):
    good = "// Function: good_kernel\n__kernel void good_kernel(__global float* a) { a[0] = 1.0f; }\n"
    broken = "// Function: broken_kernel\n__kernel void broken_kernel(__global float* a) { a[0] = missing_name; }\n"
    with pytest.raises(KilnError) as error:
        check(good + broken)
    message = str(error.value)
    assert "1 of 2 OpenCL kernels" in message and "broken_kernel" in message and "missing_name" in message
    assert "good_kernel" not in message


def test_half_precision_kernels_are_refused_with_the_reason(tiny_build, pocl):
    if "cl_khr_fp16" in pocl.devices[0].extensions:
        pytest.skip("this PoCL device offers cl_khr_fp16")
    with pytest.raises(KilnError, match=r"half precision \(cl_khr_fp16\)"):
        check_opencl_kernels(kernel_source(tiny_build("q4f16_1", ["android"])))


@dataclass
class KernelCall:
    name: str
    before: list  # numpy arrays (or ints), as the kernel got them
    after: list  # the same arguments after it ran
    reads_layer: bool


def cpu_kernel_calls(native: NativeModel, ids: list[int], layer: int) -> list[KernelCall]:
    """Every kernel call of a prefill on the CPU build, with its arguments before and after."""
    names = [p["name"] for p in native.metadata["params"]]
    layer_weights = {t.data_ptr() for name, t in zip(names, native.params) if f".layers.{layer}." in name}
    assert layer_weights, f"no weights of layer {layer} among {names[:4]}…"
    calls, pending = [], {}

    def snapshot(args):
        return [a.numpy() if isinstance(a, tvm.runtime.Tensor) else a for a in args]

    def instrument(func, name, before_run, ret_value, *args):
        # The VM's own builtins (shapes, KV cache bookkeeping) are runtime code, not kernels.
        if name.startswith("vm.builtin.") or not all(isinstance(a, (tvm.runtime.Tensor, int)) for a in args):
            return VMInstrumentReturnKind.NO_OP
        if before_run:
            pending[name] = snapshot(args)
        else:
            reads_layer = any(isinstance(a, tvm.runtime.Tensor) and a.data_ptr() in layer_weights for a in args)
            calls.append(KernelCall(name, pending.pop(name), snapshot(args), reads_layer))
        return VMInstrumentReturnKind.NO_OP

    native.vm.set_instrument(instrument)
    native.prefill(ids)
    return calls


def layer_calls(calls: list[KernelCall]) -> list[KernelCall]:
    """The calls from the first to the last one that reads the layer's weights: the layer's
    kernels (norms, projections, residual adds, the MLP; attention runs inside the KV cache)."""
    touching = [i for i, call in enumerate(calls) if call.reads_layer]
    return calls[touching[0] : touching[-1] + 1]


def android_module(source_dir: Path, quantization: str, work: Path) -> tvm.IRModule:
    """The tiny model's kernels as scheduled for the android target (as its build schedules them)."""
    scheme = quantization_named(quantization)
    source = ingest(str(source_dir), work)
    arch = architecture_for(source.config, config_file(source))
    config = arch.parse_config(source.config, config_file(source), {})
    model, _, _ = quantized_model(source, arch, config, scheme)
    entry = TARGETS["android"]
    return scheduled_module(model, entry, library_metadata(model, scheme.name, param_specs(model)))


def test_one_layer_on_pocl_matches_the_cpu_build(tiny_build, tiny_source, pocl, tmp_path):
    native = NativeModel(tiny_build("q4f32_1", ["cpu"]))
    calls = layer_calls(cpu_kernel_calls(native, PROMPT, layer=0))
    android = android_module(tiny_source, "q4f32_1", tmp_path)
    target = TARGETS["android"].target()
    names = [call.name for call in calls]
    assert any("matmul" in n for n in names) and any("rms_norm" in n for n in names), names
    missing = [n for n in names if n not in {gv.name_hint for gv in android.functions}]
    assert not missing, f"layer kernels the android build does not have: {missing}"

    worst = {}
    for call in calls:
        if "tirx.is_host_func" in android[call.name].attrs:
            continue  # shape arithmetic for the VM, which runs on the phone's CPU
        on_pocl = run_on_opencl(android[call.name], target, call.before, pocl)
        arrays = [
            (cpu, cl, before)
            for cpu, cl, before in zip(call.after, on_pocl, call.before)
            if isinstance(cpu, np.ndarray)
        ]
        assert any(not np.array_equal(cpu, before) for cpu, _, before in arrays), f"{call.name} wrote nothing"
        # Inputs too: a kernel that wrote where it should not is as wrong as a wrong output.
        worst[f"{len(worst)}:{call.name}"] = max(
            float(np.abs(cl.astype(np.float64) - cpu).max()) for cpu, cl, _ in arrays
        )
    print(f"layer 0: {len(worst)} kernels on PoCL, max |Δ| per kernel vs the CPU build:", worst)
    assert len(worst) >= 5
    assert max(worst.values()) <= LAYER_TOLERANCE, worst
