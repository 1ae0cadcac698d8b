"""The wasm toolchain: TVM's web runtime built from the wheels, model libraries linked against it,
loaded in Node with @mlc-ai/web-runtime (tvmjs) and, on the CPU and on WebGPU, run against numpy."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from helpers.paths import WEB_DIR
from helpers.web import node_tool, require_tools, run_function, run_node_module

from kiln.compile.lower.library import prepare_toolchains
from kiln.compile.toolchain import wasm_toolchain
from kiln.errors import KilnError
from kiln.targets import target_named

WASM32 = {"kind": "llvm", "mtriple": "wasm32-unknown-unknown-wasm"}
# library name → (target, linker): the CPU wasm library is linked threaded, as Kiln's wasm target does
TARGETS = {
    "wasm": (WASM32, wasm_toolchain.link_tvmjs_wasm),
    "webgpu": ({"kind": "webgpu", "host": WASM32}, wasm_toolchain.link_tvmjs_wasm),
    "wasm-threaded": (WASM32, wasm_toolchain.link_threaded_wasm),
}
METADATA = {"model": "kiln-toolchain-test", "params": []}
# A constant lands in the VM executable's constant pool, which the web runtime deserializes.
OFFSET = np.array([0.5, -1.0, 2.0], dtype=np.float32)

pytestmark = pytest.mark.slow


def affine_module():
    """y = x @ w + b + OFFSET, plus a `_metadata` function like the one WebLLM reads."""
    import tvm
    from tvm import relax
    from tvm.script import relax as R

    @tvm.script.ir_module
    class Affine:
        @R.function
        def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 3), "float32"), b: R.Tensor((3,), "float32")):
            with R.dataflow():
                y = R.add(R.add(R.matmul(x, w), b), R.const(OFFSET))
                R.output(y)
            return y

    builder = relax.BlockBuilder(Affine)
    with builder.function("_metadata", []):
        builder.emit_func_output(tvm.ir.StringImm(json.dumps(METADATA)))
    return builder.get()


@pytest.fixture(scope="module")
def libraries(tmp_path_factory) -> dict[str, Path]:
    """The affine module linked for each of TARGETS: {name: path}."""
    require_tools()
    import tvm

    wasm_toolchain.ensure_web_runtime()
    out_dir = tmp_path_factory.mktemp("wasm-libraries")
    paths = {}
    for name, (target, link) in TARGETS.items():
        executable = tvm.compile(affine_module(), tvm.target.Target(target))
        paths[name] = out_dir / f"affine-{name}.wasm"
        executable.export_library(str(paths[name]), fcompile=link)
    return paths


def run_affine(library: Path, tmp_path: Path, device: str) -> tuple[dict, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    x, w, b = (rng.standard_normal(shape, dtype=np.float32) for shape in ((4, 8), (8, 3), (3,)))
    result, (got,) = run_function(library, "main", [x, w, b], tmp_path, device)
    return result, got, x @ w + b + OFFSET


def require_webgpu() -> None:
    helpers = json.dumps(str(WEB_DIR / "tools" / "tvm-node.mjs"))
    probe = subprocess.run(
        [
            "node",
            "--input-type=module",
            "-e",
            f"import {{ requestWebGPUDevice }} from {helpers};await requestWebGPUDevice(); process.exit(0);",
        ],
        capture_output=True,
        text=True,
        env=wasm_toolchain.dawn_node_environment(),
        timeout=120,
        check=False,
    )
    if probe.returncode != 0:
        pytest.skip(f"no WebGPU adapter for Node: {probe.stderr.strip()[-500:]}")


def test_cached_runtime_matches_this_toolchain():
    require_tools()
    runtime_dir = wasm_toolchain.ensure_web_runtime()
    assert runtime_dir == wasm_toolchain.web_runtime_dir()
    assert runtime_dir.name == wasm_toolchain.tvm_version()
    assert all(p.stat().st_size > 0 for p in wasm_toolchain.web_runtime_objects(runtime_dir))
    info = json.loads((runtime_dir / wasm_toolchain.BUILD_INFO).read_text())
    assert info["emcc"] == wasm_toolchain.emcc_version()
    assert wasm_toolchain.web_runtime_is_built(runtime_dir)


def test_cache_with_another_fingerprint_is_stale(tmp_path, monkeypatch):
    require_tools()
    copy = tmp_path / "web-runtime" / wasm_toolchain.tvm_version()
    shutil.copytree(wasm_toolchain.ensure_web_runtime(), copy)
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    assert wasm_toolchain.web_runtime_dir() == copy
    assert wasm_toolchain.web_runtime_is_built()
    info = json.loads((copy / wasm_toolchain.BUILD_INFO).read_text())
    (copy / wasm_toolchain.BUILD_INFO).write_text(json.dumps(dict(info, headers="edited")))
    assert not wasm_toolchain.web_runtime_is_built()


def test_failed_runtime_build_names_the_source_and_leaves_no_cache(tmp_path, monkeypatch):
    require_tools()
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(
        wasm_toolchain, "COMPILE_FLAGS", [*wasm_toolchain.COMPILE_FLAGS, "-include", "kiln_missing_header.h"]
    )
    with pytest.raises(KilnError) as failure:
        wasm_toolchain.build_web_runtimes(progress=False)  # every flavor, side by side
    assert failure.value.path.name == "wasm_runtime.cc"
    assert "kiln_missing_header.h" in failure.value.problem
    assert list((tmp_path / "web-runtime").iterdir()) == []


def test_link_error_is_a_kiln_error_with_the_linker_output(tmp_path):
    require_tools()
    bogus = tmp_path / "bogus.o"
    bogus.write_bytes(b"\0asm\x01\0\0\0not a valid object")
    output = tmp_path / "out" / "lib.wasm"
    with pytest.raises(KilnError) as failure:
        wasm_toolchain.link_tvmjs_wasm(output, [bogus])
    assert failure.value.path == output
    assert "bogus.o" in failure.value.problem
    assert not output.exists() and list(output.parent.iterdir()) == []


def test_libraries_are_wasm_with_object_format_o(libraries):
    assert wasm_toolchain.link_tvmjs_wasm.object_format == "o"
    for path in libraries.values():
        assert path.read_bytes()[:4] == b"\0asm"


@pytest.mark.parametrize("target", ["wasm", "webgpu"])
def test_library_loads_in_node_and_lists_its_functions(libraries, target):
    report = node_tool("list-functions.mjs", str(libraries[target]), "--device", "cpu", "--expect", "main,_metadata")
    assert sorted(report["functions"]) == ["_metadata", "main"]
    assert report["expected"] == {"main": True, "_metadata": True} and report["missing"] == []
    assert report["metadata"] == METADATA
    assert bool(report["webgpu_kernels"]) == (target == "webgpu")


def test_missing_function_is_reported_with_status_1(libraries):
    report = node_tool("list-functions.mjs", str(libraries["wasm"]), "--expect", "main,decode", expect_status=1)
    assert report["missing"] == ["decode"]


@pytest.mark.parametrize("library", ["wasm", "wasm-threaded"])
def test_cpu_wasm_runs_in_node_like_numpy(libraries, tmp_path, library):
    result, got, want = run_affine(libraries[library], tmp_path, "cpu")
    assert result["device"] == "cpu"
    assert np.abs(got - want).max() < 1e-5


def test_the_threaded_library_imports_shared_memory_and_exports_the_pool(libraries):
    report = run_node_module(
        """
        import { importedMemory } from "./src/wasm-threads.js";
        const bytes = readFileSync(input);
        console.log(JSON.stringify({
          memory: importedMemory(bytes),
          exports: WebAssembly.Module.exports(new WebAssembly.Module(bytes)).map((entry) => entry.name),
        }));
    """,
        str(libraries["wasm-threaded"]),
    )
    assert report["memory"]["shared"] and report["memory"]["maximum"] == 2**32 // 2**16  # wasm32: 4 GiB
    assert set(wasm_toolchain.THREAD_POOL_EXPORTS) <= set(report["exports"])
    assert wasm_toolchain.web_runtime_is_built(flavor=wasm_toolchain.THREADED_RUNTIME)
    plain = wasm_toolchain.web_runtime_dir()
    assert wasm_toolchain.web_runtime_dir(wasm_toolchain.THREADED_RUNTIME) == plain.with_name(plain.name + "-threads")


def test_webgpu_library_compiles_its_shaders_in_node(libraries):
    require_webgpu()
    report = node_tool("list-functions.mjs", str(libraries["webgpu"]), "--device", "webgpu", "--expect", "main")
    assert report["device"] == "webgpu" and report["missing"] == []
    assert report["webgpu"]["pipelines"] == len(report["webgpu_kernels"]) > 0


def test_webgpu_library_runs_in_node_like_numpy(libraries, tmp_path):
    require_webgpu()
    result, got, want = run_affine(libraries["webgpu"], tmp_path, "webgpu")
    assert result["device"] == "webgpu"
    assert np.abs(got - want).max() < 1e-5


def test_toolchain_status_reports_every_tool():
    statuses = {status.name: status for status in wasm_toolchain.toolchain_status()}
    assert list(statuses) == ["TVM", "emcc", "node", "Chromium", "TVM web runtime"]
    for status in statuses.values():
        assert status.detail
        assert (status.fix is None) == status.ok
    assert statuses["TVM"].ok and wasm_toolchain.tvm_version() in statuses["TVM"].detail


def test_toolchain_status_without_emcc_names_the_fixes(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    statuses = {status.name: status for status in wasm_toolchain.toolchain_status()}
    assert statuses["emcc"].fix == "apt-get install -y emscripten"
    assert statuses["TVM web runtime"].fix == "kiln doctor --build-runtime"
    with pytest.raises(KilnError, match="apt-get install -y emscripten"):
        wasm_toolchain.find_emcc()


@pytest.mark.parametrize("library", ["webgpu", "webgpu-subgroups"])
def test_a_decode_step_on_dawn_in_node_has_the_dispatches_and_barriers_of_the_budget(tiny_dir, library):
    """Issue 15's dispatch budget, checked outside Chromium: Dawn's Node bindings run the library as
    the browser engine does (its ModelSession) and time one decode step kernel by kernel."""
    require_webgpu()
    report = node_tool("decode-node.mjs", str(tiny_dir), "--library", library, "--decode-tokens", "4")
    print(json.dumps({key: value for key, value in report.items() if key != "decode_step_kernels"}))
    kernels = {kernel["kernel"]: kernel for kernel in report["decode_step_kernels"]}
    assert sum(kernel["dispatches"] for kernel in kernels.values()) == report["decode_step_dispatches"]
    # a layer: qkv (with the norm before it), RoPE, KV append, attention, o (+ residual), gate/up
    # (with the norm, and silu·mul), down (+ residual); then the embedding and the head with the
    # final norm (the tiny head has 6 rows per input, few enough to merge)
    assert report["decode_step_dispatches"] == 7 * report["layers"] + 2
    (swiglu,) = [name for name in kernels if "silu" in name]
    assert "matmul" in swiglu and "add" not in swiglu  # in the gate/up GEMV, not the down projection's
    gemvs = [kernel for name, kernel in kernels.items() if "matmul" in name or "lm_head" in name]
    assert len(gemvs) == 5 and not any(kernel["barriers"] + kernel["loopBarriers"] for kernel in gemvs), gemvs
    normed = [name for name in kernels if "rms_norm" in name]
    assert len(normed) == 3 and all("matmul" in name or "lm_head" in name for name in normed), normed
    assert report["decode_step_barriers"] == sum(k["dispatches"] * k["barriers"] for k in kernels.values())
    assert report["decode_tokens_per_s"] > 0


def test_doctor_passes_without_the_optional_kernel_check_only():
    from kiln.cli import doctor_exit_code

    built = wasm_toolchain.ToolStatus("emscripten", True, "4.0")
    pocl_missing = wasm_toolchain.ToolStatus("PoCL (OpenCL check)", False, "pyopencl is missing", "pip", optional=True)
    emcc_missing = wasm_toolchain.ToolStatus("emscripten", False, "not found", "apt-get install emscripten")
    assert doctor_exit_code([built, pocl_missing]) == 0
    assert doctor_exit_code([emcc_missing, pocl_missing]) == 1


def test_a_build_has_the_web_runtimes_its_targets_link_ready_before_it_compiles_them_side_by_side(monkeypatch):
    built = []
    monkeypatch.setattr(wasm_toolchain, "build_web_runtime", lambda progress, flavor, position: built.append(flavor))
    for targets, flavors in (
        (("cpu", "webgpu", "webgpu-subgroups"), [wasm_toolchain.PLAIN_RUNTIME]),
        (("wasm", "webgpu"), [wasm_toolchain.PLAIN_RUNTIME, wasm_toolchain.THREADED_RUNTIME]),
        (("cpu", "arm64-linux", "android"), []),
    ):
        built.clear()
        prepare_toolchains([target_named(target) for target in targets])
        assert built == flavors, targets
