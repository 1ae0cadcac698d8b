"""Kiln's kernels read llama.cpp's blocks (ggml_blocks.BLOCK_TYPES) as gguf-py's `dequantize` does,
bit for bit: on this CPU, and in Chromium on the wasm library and on WebGPU (SwiftShader).

Each type gets random valid blocks at three sizes, blocks quantized by gguf-py where it has a
quantizer for the type, and a row of awkward float16 (or BF16/F32) fields: subnormals, ±0, the
smallest and largest normals. One Relax module holds a dequantize kernel per type; it is built
once per target with Kiln's own pipeline (dlight's GPU rules bind the WebGPU kernels).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import relax as R

from helpers.random_blocks import HALF_FIELDS, random_blocks
from helpers.web import browser_page, served

from kiln.compile.digests import file_digests
from kiln.compile.lower import kiln_pipeline
from kiln.compile.lower.library import EXPORTS, KERNEL_CHECKS, device_source
from kiln.compile.quantization.ggml_blocks import BLOCK_TYPES, BlockType
from kiln.compile.quantization.gguf_blocks import as_units, reads_words
from kiln.targets import BROWSER_TARGETS, TARGETS

COLS = 512  # two K-quant blocks, sixteen of the 32-weight ones
# gguf-py quantizes these types itself (its K-quants only dequantize).
QUANTIZED_BY_GGUF = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
# Awkward IEEE halves for the float16 fields: the smallest and largest subnormals and some between,
# both zeros, the smallest and largest normals, and ordinary values of both signs. (Subnormal
# halves caught 2^-24 written into WGSL as 5.960464e-08, one float32 ulp short.)
SPECIAL_HALVES = np.array(
    [0x0001, 0x03FF, 0x0155, 0x8001, 0x83FF, 0x0000, 0x8000, 0x0400, 0x8400, 0x7BFF, 0xFBFF, 0x3C00, 0xB555, 0x2E66],
    dtype="<u2",
)
# F16 weights are read without arithmetic, so infinities and NaN must come through too.
SPECIAL_F16 = np.concatenate([SPECIAL_HALVES, np.array([0x7C00, 0xFC00, 0x7E00], dtype="<u2")])
# The same for BF16 and F32: subnormals, zeros, the smallest and largest normals.
SPECIAL_BF16 = np.array([0x0001, 0x007F, 0x8001, 0x0000, 0x8000, 0x0080, 0x7F7F, 0xFF7F, 0x3F80, 0xBE4D], dtype="<u2")
SPECIAL_F32 = np.array(
    [
        0x00000001,
        0x007FFFFF,
        0x80000001,
        0x00000000,
        0x80000000,
        0x00800000,
        0x7F7FFFFF,
        0xFF7FFFFF,
        0x3F800000,
        0xBE4CCCCD,
    ],
    dtype="<u4",
)


def special_row(name: str, rng: np.random.Generator) -> np.ndarray:
    """One row of `name` whose float fields cycle through the awkward values above."""
    if name in ("F16", "BF16", "F32"):
        values = {"F16": SPECIAL_F16, "BF16": SPECIAL_BF16, "F32": SPECIAL_F32}[name]
        return np.resize(values, COLS).view(np.uint8).reshape(1, -1)
    block_type = BLOCK_TYPES[name]
    blocks = random_blocks(name, 1, COLS, rng).reshape(-1, block_type.bytes)
    fields = blocks[:, HALF_FIELDS[name][0] : HALF_FIELDS[name][-1] + 2].view("<u2")
    fields[:] = np.resize(SPECIAL_HALVES, fields.size).reshape(fields.shape)
    return blocks.reshape(1, -1)


def source_rows(name: str, rng: np.random.Generator) -> np.ndarray:
    """[rows, row bytes] uint8: the blocks every target dequantizes for type `name`."""
    rows = [random_blocks(name, 1, COLS, rng, scale) for scale in (1.0, 1e-3, 40.0)]
    if name in QUANTIZED_BY_GGUF:
        weights = rng.standard_normal((2, COLS)).astype(np.float32) * np.float32(0.02)
        weights[1, ::37] *= 50  # outliers, as real weight rows have
        rows.append(np.asarray(gguf.quants.quantize(weights, gguf.GGMLQuantizationType[name])).view(np.uint8))
    rows.append(special_row(name, rng))
    return np.concatenate(rows)


def function_name(name: str) -> str:
    return f"dequantize_{name.lower()}"


def dequantize_module(shapes: dict[str, int]) -> tvm.IRModule:
    """A Relax function per block type, `dequantize_<type>(words) → float32 [rows, COLS]`, reading
    the words as a model's kernels read them on the target being built (bytes, or words on WebGPU)."""
    builder = relax.BlockBuilder()
    for name, rows in shapes.items():
        block_type: BlockType = BLOCK_TYPES[name]
        row_words = block_type.row_words(COLS)
        words = relax.Var("words", R.Tensor((rows, row_words), "uint32"))
        with builder.function(function_name(name), [words]):
            with builder.dataflow():
                stored = words if reads_words() else builder.emit(as_units(words, block_type, rows, row_words))
                weights = builder.emit_output(
                    builder.call_te(
                        lambda w, t=block_type, n=rows: t.dequantize_te(w, n, COLS, "float32"),
                        stored,
                        primfunc_name_hint=function_name(name),
                    )
                )
            builder.emit_func_output(weights)
    return builder.get()


def build(target_name: str, shapes: dict[str, int]):
    """The module compiled for a Kiln target, as `kiln compile` compiles a model's kernels."""
    entry = TARGETS[target_name]
    target = entry.target()
    with target:
        scheduled = kiln_pipeline(entry)(dequantize_module(shapes))
    return tvm.compile(scheduled, target, relax_pipeline=None)


def assert_same_bits(name: str, where: str, got: np.ndarray, want: np.ndarray) -> None:
    """Equal as float32 bit patterns (so -0.0 is not 0.0), or a message naming the first differences."""
    differ = got.view(np.uint32) != want.view(np.uint32)
    if differ.any():
        first = [(int(r), int(c)) for r, c in np.argwhere(differ)[:6]]
        examples = ", ".join(
            f"[{r},{c}] {got[r, c]!r} (0x{got.view(np.uint32)[r, c]:08x}) "
            f"vs {want[r, c]!r} (0x{want.view(np.uint32)[r, c]:08x})"
            for r, c in first
        )
        pytest.fail(
            f"{name} on {where}: {differ.sum()} of {differ.size} weights differ from gguf-py "
            f"(rows {sorted(set(np.nonzero(differ)[0].tolist()))}): {examples}"
        )


@pytest.fixture(scope="module")
def cases() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """type → (stored words, gguf-py's float32 weights)."""
    rng = np.random.default_rng(11)
    found = {}
    for name, block_type in BLOCK_TYPES.items():
        rows = source_rows(name, rng)
        reference = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType[name]).astype(np.float32)
        found[name] = (block_type.words(rows), reference.reshape(len(rows), COLS))
    return found


def shapes_of(cases) -> dict[str, int]:
    return {name: len(reference) for name, (_, reference) in cases.items()}


@pytest.fixture(scope="module")
def cpu_vm(cases) -> relax.VirtualMachine:
    return relax.VirtualMachine(build("cpu", shapes_of(cases)), tvm.cpu())


@pytest.mark.parametrize("name", list(BLOCK_TYPES))
def test_cpu_dequantizes_as_gguf_py(cpu_vm, cases, name):
    words, reference = cases[name]
    got = cpu_vm[function_name(name)](tvm.runtime.tensor(words)).numpy()
    assert_same_bits(name, "cpu", got, reference)


# Runs every dequantize function of a library in the page and returns the weights as base64
# float32. On WebGPU each kernel's WGSL is first compiled on its own, so that a shader error comes
# back naming its kernel and line instead of failing the whole library's pipeline creation.
RUN_LIBRARY_JS = """async ({ library, webgpu, calls }) => {
  const fromBase64 = (text) => Uint8Array.from(atob(text), (c) => c.charCodeAt(0));
  const toBase64 = (bytes) => {
    let text = "";
    for (let i = 0; i < bytes.length; i += 0x8000) text += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
    return btoa(text);
  };
  const shaderMessages = [];
  const deviceErrors = [];
  let tvm;
  try {
    await import("/web/node_modules/@mlc-ai/web-runtime/lib/index.js");
    const tvmjs = globalThis.tvmjs;
    const { instantiateLibrary } = await import("/web/src/wasm-threads.js");  // the wasm library's shared memory
    const bytes = new Uint8Array(await (await fetch(library)).arrayBuffer());
    tvm = (await instantiateLibrary(tvmjs, bytes, { log: (message) => console.info(message) })).tvm;
    let gpu = null;
    if (webgpu) {
      gpu = (await tvmjs.detectGPUDevice()).device;
      gpu.addEventListener("uncapturederror", (event) => deviceErrors.push(event.error.message));
      tvm.initWebGPU(gpu);  // before the first systemLib(): loading the WebGPU module needs it
      tvm.beginScope();
      const lib = tvm.systemLib();
      const getShader = lib.getFunction("webgpu.get_shader");
      for (const name of Object.keys(JSON.parse(lib.getFunction("webgpu.get_fmap")()))) {
        const info = await gpu.createShaderModule({ code: getShader(name) }).getCompilationInfo();
        for (const m of info.messages) {
          shaderMessages.push({ kernel: name, type: m.type, text: `${m.lineNum}:${m.linePos} ${m.message}` });
        }
      }
      tvm.endScope();
      if (shaderMessages.some((m) => m.type === "error")) return { shaderMessages, deviceErrors };
      tvm.beginScope();
      await tvm.asyncLoadWebGPUPipelines(tvm.systemLib());
      tvm.endScope();
      gpu.pushErrorScope("validation");
    }
    const device = webgpu ? tvm.webgpu() : tvm.cpu();
    const outputs = {};
    tvm.beginScope();
    const vm = tvm.createVirtualMachine(device);
    for (const { name, shape, words } of calls) {
      const input = tvm.empty(shape, "uint32", device).copyFromRawBytes(fromBase64(words));
      const output = vm.getFunction(name)(input);
      const host = tvm.empty(output.shape, output.dtype, tvm.cpu()).copyFrom(output);
      await device.sync();
      outputs[name] = toBase64(host.toRawBytes());
    }
    tvm.endScope();
    if (gpu) {
      const error = await gpu.popErrorScope();
      if (error) deviceErrors.push(error.message);
    }
    return { outputs, shaderMessages, deviceErrors };
  } catch (error) {
    return { error: error.stack ?? error.message ?? JSON.stringify(error), shaderMessages, deviceErrors };
  } finally {
    tvm?.dispose();
  }
}"""


@pytest.fixture(scope="module")
def browser_libraries(cases, tmp_path_factory) -> Path:
    """A dist folder whose `ggml-blocks/` holds the dequantize module linked for wasm and WebGPU."""
    dist = tmp_path_factory.mktemp("dist")
    for target_name in BROWSER_TARGETS:
        entry = TARGETS[target_name]
        executable = build(target_name, shapes_of(cases))
        if entry.kernel_check:
            KERNEL_CHECKS[entry.kernel_check](device_source(executable.mod, entry.target().kind.name))
        EXPORTS[entry.export](executable, dist / "ggml-blocks" / f"dequantize-{target_name}.{entry.extension}")
    # `kiln serve` serves the files a folder's build record lists.
    (dist / "ggml-blocks" / "kiln-build.json").write_text(json.dumps({"files": file_digests(dist / "ggml-blocks")}))
    return dist


@pytest.fixture(scope="module")
def browser_weights(driver, browser_libraries, cases, tmp_path_factory) -> dict[str, dict]:
    """target → what RUN_LIBRARY_JS answered, with the outputs as float32 arrays and the page's
    console lines; one Chromium runs every browser library, one after the other."""
    calls = [
        {"name": function_name(name), "shape": list(words.shape), "words": base64.b64encode(words.tobytes()).decode()}
        for name, (words, _) in cases.items()
    ]
    answers = {}
    with served(browser_libraries) as url, browser_page(driver, tmp_path_factory.mktemp("profile"), url) as (_, page):
        console: list[str] = []
        page.on("console", lambda message: console.append(f"{message.type}: {message.text}"))
        page.on("pageerror", lambda error: console.append(f"page error: {error}"))
        for target_name in BROWSER_TARGETS:
            console.clear()
            answer = page.evaluate(
                RUN_LIBRARY_JS,
                {
                    "library": f"/models/ggml-blocks/dequantize-{target_name}.wasm",
                    "webgpu": TARGETS[target_name].tvm_target()["kind"] == "webgpu",
                    "calls": calls,
                },
            )
            answer["console"] = list(console)
            answer["outputs"] = {
                name: np.frombuffer(base64.b64decode(data), dtype=np.float32)
                for name, data in answer.get("outputs", {}).items()
            }
            answers[target_name] = answer
    return answers


def page_problems(answer: dict) -> dict:
    """What went wrong in the page: a thrown error, WGSL compile errors, WebGPU device errors."""
    problems = {
        "error": answer.get("error"),
        "deviceErrors": answer.get("deviceErrors"),
        "shaderErrors": [m for m in answer.get("shaderMessages", []) if m["type"] == "error"],
    }
    return {key: value for key, value in problems.items() if value}


@pytest.mark.browser
@pytest.mark.parametrize("target", BROWSER_TARGETS)
def test_browser_library_loads_without_webgpu_errors(browser_weights, target):
    answer = browser_weights[target]
    console = "\n".join(answer["console"][-30:])
    assert not page_problems(answer), f"{target}: {page_problems(answer)}\nconsole:\n{console}"


@pytest.mark.browser
@pytest.mark.parametrize("target", BROWSER_TARGETS)
@pytest.mark.parametrize("name", list(BLOCK_TYPES))
def test_browser_dequantizes_as_gguf_py(browser_weights, cases, target, name):
    answer = browser_weights[target]
    got = answer["outputs"].get(function_name(name))
    assert got is not None, f"{target} gave no weights: {page_problems(answer)}"
    _, reference = cases[name]
    assert_same_bits(name, target, got.reshape(reference.shape), reference)
