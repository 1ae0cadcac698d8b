"""SmolLM2-135M-Instruct (GGUF from PyPI) through the whole build: every target and quantization the
issue names, libraries that load in Node with tvmjs, and CPU logits against transformers."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers.paths import WEB_DIR

from kiln.compile.quantization import QUANTIZATIONS
from kiln.compile.quantization.group import dequantize_group, quantize_group
from kiln.compile.toolchain.wasm_toolchain import dawn_node_environment
from kiln.runtime import NativeModel

pytestmark = pytest.mark.slow

LOGIT_TOLERANCE = 2e-3
PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village by the sea,")
EXPORTED = (
    "_metadata",
    "embed",
    "prefill",
    "decode",
    "batch_prefill",
    "batch_decode",
    "prefill_all_logits",
    "create_tir_paged_kv_cache",
    "softmax_with_temperature",
    "argsort_probs",
    "sample_with_top_p",
    "apply_bitmask_inplace",
    "apply_penalty_inplace",
    "apply_logit_bias_inplace",
)
BUILDS = [
    ("q0f32", "cpu"),
    ("q0f32", "webgpu"),
    ("q0f32", "wasm"),
    ("q4f32_1", "cpu"),
    ("q4f32_1", "webgpu"),
    ("q4f32_1", "wasm"),
    ("q4f16_1", "webgpu"),
]


@pytest.fixture(scope="module")
def reference(smollm2_source):
    folder, name = str(smollm2_source.parent), smollm2_source.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder, gguf_file=name)


def fake_quantize(model: torch.nn.Module, quantization: str) -> torch.nn.Module:
    fmt = QUANTIZATIONS[quantization].group_format
    with torch.no_grad():
        layers = {id(m): m for m in model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))}
        for module in layers.values():
            weight = module.weight.numpy()
            module.weight.copy_(torch.from_numpy(dequantize_group(*quantize_group(weight, fmt), fmt)))
    return model


def assert_logits_match(native: NativeModel, model: torch.nn.Module, tokenizer) -> None:
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        native.reset()
        with torch.no_grad():
            expected = model(torch.tensor([ids])).logits[0, -1].numpy()
        diff = np.abs(native.prefill(ids) - expected).max()
        assert diff <= LOGIT_TOLERANCE, f"{prompt!r}: max |Δ| = {diff}"


@pytest.mark.parametrize(("quantization", "target"), BUILDS)
def test_library_loads_in_node_and_lists_its_functions(smollm2_build, quantization, target):
    model_dir = smollm2_build(quantization, [target])
    library = json.loads((model_dir / "kiln-build.json").read_text())["targets"][target]["library"]
    if target == "cpu":
        assert set(EXPORTED) <= {name for name in EXPORTED if NativeModel(model_dir).vm[name] is not None}
        return
    # f32 WebGPU kernels are compiled for real on Dawn's SwiftShader adapter; it has no shader-f16,
    # so f16 kernels cannot be created here and those libraries are listed without a device.
    f16 = QUANTIZATIONS[quantization].model_dtype == "float16"
    device = "webgpu" if target == "webgpu" and not f16 else "cpu"
    result = subprocess.run(
        [
            "node",
            "tools/list-functions.mjs",
            str(model_dir / library),
            "--expect",
            ",".join(EXPORTED),
            "--device",
            device,
        ],
        cwd=WEB_DIR,
        capture_output=True,
        text=True,
        timeout=600,
        env=dawn_node_environment(),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    listing = json.loads(result.stdout)
    assert listing["missing"] == [] and set(EXPORTED) <= set(listing["functions"])
    assert listing["metadata"]["quantization"] == quantization
    assert listing["metadata"]["prefill_chunk_size"] > 0
    assert listing["device"] == device
    if target == "webgpu":
        assert listing["webgpu_kernels"], "a WebGPU library carries its WGSL kernels"


def test_q0f32_cpu_logits_match_transformers(smollm2_build, reference):
    model, tokenizer = reference
    assert_logits_match(NativeModel(smollm2_build("q0f32", ["cpu"])), model, tokenizer)


def test_q4f32_cpu_logits_match_transformers_on_the_dequantized_weights(smollm2_build, smollm2_source):
    folder, name = str(smollm2_source.parent), smollm2_source.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    assert_logits_match(NativeModel(smollm2_build("q4f32_1", ["cpu"])), fake_quantize(model, "q4f32_1"), tokenizer)
