"""`kiln parity` and `kiln generate --device browser`: the browser engine in headless Chromium
against the native build, on the tiny Llama (WebGPU and the CPU wasm library) and SmolLM2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from helpers.parity import PROMPTS, assert_contract_holds, parity
from helpers.web import run_kiln

from kiln.compile.digests import file_digests
from kiln.compile.pipeline import BUILD_RECORD
from kiln.tensor_cache import md5_of, read_index, records

pytestmark = pytest.mark.browser


@pytest.mark.parametrize("backend", ["webgpu", "wasm"])
def test_parity_holds_on_the_tiny_model(tiny_dir, backend):
    code, report = parity(tiny_dir, "--prompts", str(PROMPTS), "--max-tokens", "32", "--target", backend)
    assert report["browser"] == backend
    assert_contract_holds(code, report, prompts=9, max_tokens=32)
    # Forced decoding covers every position of every prompt and its 32 tokens.
    assert all(p["forced_positions"] == len(p["prompt_ids"]) + 31 for p in report["prompts"])


def corrupt_one_weight(model_dir: Path, name: str) -> None:
    """Scale one tensor's bytes in place (as float32) and fix its shard's md5 and every digest of the
    build record, so the browser loads the corrupted copy without complaint."""
    record = next(r for r in records(model_dir) if r.name == name)
    data = bytearray(record.shard.read_bytes())
    values = np.frombuffer(data, dtype=np.float32, count=int(np.prod(record.shape)), offset=record.byte_offset)
    values *= 3.0
    record.shard.write_bytes(bytes(data))
    index_path, index = read_index(model_dir)
    for shard in index["records"]:
        if shard["dataPath"] == record.shard.name:
            shard["md5sum"] = md5_of(record.shard)
    index_path.write_text(json.dumps(index))
    build_record = json.loads((model_dir / BUILD_RECORD).read_text())
    (model_dir / BUILD_RECORD).unlink()
    build_record["files"] = file_digests(model_dir)
    (model_dir / BUILD_RECORD).write_text(json.dumps(build_record))


def test_parity_fails_when_the_browser_copy_has_a_corrupted_weight(tiny_dir, tmp_path):
    deployed = tmp_path / "site" / tiny_dir.name
    shutil.copytree(tiny_dir, deployed)
    corrupt_one_weight(deployed, "model.layers.1.mlp.down_proj.q_scale")
    code, report = parity(tiny_dir, "--browser-model-dir", str(deployed), "--target", "wasm", "--max-tokens", "8")
    assert code == 1 and not report["passed"]
    assert report["max_logit_abs_diff"] > 1e-2
    assert any("last-token logits differ" in failure for failure in report["failures"])
    # The same copy uncorrupted passes: the failure is the weight's.
    shutil.copytree(tiny_dir, tmp_path / "clean" / tiny_dir.name)
    code, report = parity(
        tiny_dir,
        "--browser-model-dir",
        str(tmp_path / "clean" / tiny_dir.name),
        "--target",
        "wasm",
        "--max-tokens",
        "8",
    )
    assert code == 0, report["failures"]


def test_generate_in_the_browser_prints_the_native_json(tiny_dir):
    common = (
        "generate",
        str(tiny_dir),
        "--prompt",
        "The history of the city",
        "--max-tokens",
        "12",
        "--ignore-eos",
        "--json",
        "--logits",
        "2",
    )
    native = json.loads(run_kiln(*common).stdout)
    result = run_kiln(*common, "--device", "browser", "--target", "webgpu")
    assert result.returncode == 0, result.stderr[-3000:]
    browser = json.loads(result.stdout)
    assert (native["device"], browser["device"]) == ("cpu", "browser-webgpu")
    assert browser.keys() == native.keys()
    for key in ("prompt_tokens", "tokens", "text", "finish_reason"):
        assert browser[key] == native[key], key
    assert browser["usage"].keys() == native["usage"].keys()
    for b, n in zip(browser["logits"], native["logits"]):
        assert b["token_ids"] == n["token_ids"]
        np.testing.assert_allclose(b["logits"], n["logits"], atol=1e-2)


@pytest.mark.slow
@pytest.mark.parametrize("target", ["webgpu", "webgpu-subgroups"])
def test_parity_holds_on_smollm2_on_webgpu(smollm2_build, tmp_path, target):
    model_dir = smollm2_build("q4f32_1", ["cpu", "webgpu", "webgpu-subgroups", "wasm"])
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(
        "The capital of France is a city with a long history, and its most famous landmark is\n"
        "Write a short poem about the sea, the wind and the boats that sail home at night.\n"
    )
    code, report = parity(
        model_dir, "--prompts", str(prompts), "--max-tokens", "8", "--forced-positions", "16", "--target", target
    )
    print(json.dumps({k: v for k, v in report.items() if k != "prompts"}, indent=2))
    assert report["browser"] == target
    assert_contract_holds(code, report, prompts=2, max_tokens=8)
    # The last 16 positions, and every one from a greedy divergence on.
    assert all(p["forced_positions"] == 16 or p["first_divergence"] is not None for p in report["prompts"])


def test_a_missing_or_empty_prompts_file_is_a_clear_error(tiny_dir, tmp_path):
    result = run_kiln("parity", str(tiny_dir), "--prompts", str(tmp_path / "nope.txt"))
    assert result.returncode == 1 and "nope.txt" in result.stderr and "no such prompts file" in result.stderr
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    result = run_kiln("parity", str(tiny_dir), "--prompts", str(empty))
    assert result.returncode == 1 and "no prompts" in result.stderr


def test_a_model_without_a_browser_library_is_a_clear_error(tiny_build):
    cpu_only = tiny_build("q0f32", ["cpu"])
    result = run_kiln("generate", str(cpu_only), "--prompt", "hi", "--device", "browser")
    assert result.returncode == 1
    assert "no webgpu library" in result.stderr and "--target webgpu" in result.stderr
