"""The build pipeline on tiny generated Llamas: numerics against transformers, the artifact formats,
target reuse, and bad input."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import tvm

from helpers.failures import CommandResult, assert_clean_failure
from helpers.reference import LOGIT_TOLERANCE, PROMPTS, reference_model
from helpers.tiny_llama import CHAT_TEMPLATES, make_tiny_llama

from kiln.cli import main
from kiln.compile.quantization import QUANTIZATIONS
from kiln.compile.quantization.group import dequantize_group, quantize_group
from kiln.runtime import NativeModel
from kiln.tensor_cache import SHARD_CAP_BYTES

KILN = [sys.executable, "-m", "kiln.cli"]


def last_logits(model: torch.nn.Module, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].numpy()


@pytest.mark.parametrize("quantization", ["q0f32", "q4f32_1", pytest.param("q8f32_1", marks=pytest.mark.slow)])
def test_cpu_logits_match_transformers(tiny_build, tiny_source, quantization):
    native = NativeModel(tiny_build(quantization))
    reference = reference_model(tiny_source, None if quantization == "q0f32" else quantization)
    for ids in PROMPTS:
        native.reset()
        diff = np.abs(native.prefill(ids) - last_logits(reference, ids)).max()
        assert diff <= LOGIT_TOLERANCE, f"{quantization} prompt {ids[:4]}…: max |Δ| = {diff}"


@pytest.mark.slow
def test_untied_embeddings_and_decode_steps_match_transformers(builds, tiny_untied_source):
    native = NativeModel(builds.model_dir(tiny_untied_source, "tiny-untied", "q0f32", ["cpu"]))
    reference = reference_model(tiny_untied_source)
    ids = list(PROMPTS[0])
    logits = native.prefill(ids)
    for _ in range(6):
        assert np.abs(logits - last_logits(reference, ids)).max() <= LOGIT_TOLERANCE
        ids.append(int(logits.argmax()))
        logits = native.decode(ids[-1])


def test_all_position_logits_match_transformers(tiny_build, tiny_source):
    native = NativeModel(tiny_build("q0f32"))
    ids = PROMPTS[2]
    with torch.no_grad():
        expected = reference_model(tiny_source)(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(native.all_logits(ids) - expected).max() <= LOGIT_TOLERANCE


def test_a_model_without_a_window_refuses_one_asked_of_its_cache(tiny_build):
    """Its library has no window kernels, so its cache is made without window support whatever the
    runtime asks for (WebLLM's `sliding_window_size` option reaches TVM's check)."""
    from kiln.runtime import PAGE_SIZE, SEQUENCE_ID

    native = NativeModel(tiny_build("q4f32_1"))
    sizes = (1, native.context_window_size, native.prefill_chunk_size, PAGE_SIZE, 1)  # 1: a window, please
    cache = native.vm["create_tir_paged_kv_cache"](*(tvm.runtime.ShapeTuple([size]) for size in sizes))
    tvm.get_global_func("vm.builtin.kv_state_add_sequence")(cache, SEQUENCE_ID)
    with pytest.raises(Exception, match="The KV cache does not support sliding window"):
        tvm.get_global_func("vm.builtin.attention_kv_cache_enable_sliding_window_for_seq")(cache, SEQUENCE_ID, 16, 0)


def test_quantized_parameters_are_packed_like_mlc():
    """int4, groups of 32 along the input dimension, stored value round(w/scale)+7, 8 nibbles
    per little-endian uint32 — checked against a hand-computed row."""
    fmt = QUANTIZATIONS["q4f32_1"].group_format
    weight = np.zeros((1, 32), np.float32)
    weight[0, :8] = [-7, -1, 0, 1, 2, 3, 6, 7]
    q_weight, q_scale = quantize_group(weight, fmt)
    assert q_scale.tolist() == [[1.0]]
    assert q_weight.shape == (1, 4) and q_weight.dtype == np.uint32
    nibbles = [0, 6, 7, 8, 9, 10, 13, 14]
    assert int(q_weight[0, 0]) == sum(n << (4 * i) for i, n in enumerate(nibbles))
    assert int(q_weight[0, 1]) == 0x77777777
    np.testing.assert_array_equal(dequantize_group(q_weight, q_scale, fmt), weight)


GROUP_SCHEMES = ("q4f32_1", "q4f16_1", "q8f32_1", "q8f16_1")


def stored_values(q_weight: np.ndarray, fmt) -> np.ndarray:
    shifts = np.arange(fmt.values_per_word, dtype=np.uint32) * fmt.bits
    stored = (q_weight[..., None] >> shifts) & np.uint32((1 << fmt.bits) - 1)
    return stored.reshape(q_weight.shape[0], -1).astype(np.int64)


def max_scale_quantized(weight: np.ndarray, fmt) -> np.ndarray:
    """The quantizer before the least-squares search: scale max|w| / max_q in the format's dtype,
    levels within ±max_q."""
    groups = weight.reshape(weight.shape[0], -1, fmt.group_size)
    scale = (np.abs(groups).max(axis=-1, keepdims=True) / fmt.max_q).astype(fmt.dtype).astype(np.float32)
    levels = np.clip(np.round(groups / np.where(scale == 0, 1, scale)), -fmt.max_q, fmt.max_q)
    return (levels * scale).reshape(weight.shape)


def group_squared_errors(approximation: np.ndarray, weight: np.ndarray, fmt) -> np.ndarray:
    return ((approximation.astype(np.float64) - weight) ** 2).reshape(-1, fmt.group_size).sum(axis=1)


@pytest.mark.parametrize("quantization", GROUP_SCHEMES)
@pytest.mark.parametrize("distribution", ["normal", "student_t", "laplace"])
def test_group_quantizer_error_is_at_most_the_max_scale_error_in_every_group(quantization, distribution):
    fmt = QUANTIZATIONS[quantization].group_format
    rng = np.random.default_rng(11)
    weight = {
        "normal": lambda: rng.standard_normal((64, 256)),
        "student_t": lambda: rng.standard_t(2, (64, 256)),  # heavy tails: a few outliers per group
        "laplace": lambda: rng.laplace(size=(64, 256)) * 1e-3,
    }[distribution]().astype(np.float32)
    new = group_squared_errors(dequantize_group(*quantize_group(weight, fmt), fmt), weight, fmt)
    old = group_squared_errors(max_scale_quantized(weight, fmt), weight, fmt)
    assert np.all(new <= old * (1 + 1e-6)), f"{np.sum(new > old * (1 + 1e-6))} groups are worse"
    # measured: 0.68–0.79 of the old error with 4 bits, 0.82–0.96 with 8
    assert new.sum() <= (0.85 if fmt.bits == 4 else 0.97) * old.sum()


@pytest.mark.parametrize("quantization", ["q4f32_1", "q8f16_1"])
def test_a_group_uses_the_extra_level_toward_its_largest_magnitude(quantization):
    """Stored values reach 2 max_q + 1: level max_q + 1, which a negative scale turns into
    -(max_q + 1) for a group whose largest magnitude is negative."""
    fmt = QUANTIZATIONS[quantization].group_format
    top = fmt.max_q + 1
    weight = np.zeros((2, 32), np.float32)
    weight[0, :6] = np.array([-top, -3, 0, 2, 5, fmt.max_q]) * 0.5
    weight[1] = -weight[0]
    q_weight, q_scale = quantize_group(weight, fmt)
    assert q_scale.astype(np.float32).tolist() == [[-0.5], [0.5]]
    assert stored_values(q_weight, fmt)[:, 0].tolist() == [2 * fmt.max_q + 1] * 2
    np.testing.assert_array_equal(dequantize_group(q_weight, q_scale, fmt), weight)
    assert not np.array_equal(max_scale_quantized(weight, fmt), weight)


@pytest.mark.parametrize("quantization", GROUP_SCHEMES)
def test_weights_on_a_group_grid_round_trip_exactly(quantization):
    """Levels within ±max_q, or one level further toward the group's largest magnitude, times a
    scale the format's dtype holds."""
    fmt = QUANTIZATIONS[quantization].group_format
    rng = np.random.default_rng(3)
    levels = rng.integers(-fmt.max_q, fmt.max_q + 1, (16, 8, fmt.group_size))
    levels[..., 0] = rng.choice([-fmt.max_q - 1, -fmt.max_q, fmt.max_q, fmt.max_q + 1], (16, 8))
    scale = rng.uniform(1e-3, 1, (16, 8, 1)).astype(np.float16).astype(np.float32)
    weight = (levels * scale).astype(np.float32).reshape(16, -1)
    np.testing.assert_array_equal(dequantize_group(*quantize_group(weight, fmt), fmt), weight)


@pytest.mark.parametrize("quantization", GROUP_SCHEMES)
def test_zero_and_underflowing_groups_quantize_to_zero(quantization):
    fmt = QUANTIZATIONS[quantization].group_format
    weight = np.zeros((2, 64), np.float32)
    weight[1, 32:] = np.linspace(-1e-12, 1e-12, 32)  # float16 scales underflow to 0
    q_weight, q_scale = quantize_group(weight, fmt)
    assert q_scale[0].tolist() == [0, 0] and np.all(np.isfinite(q_scale))
    assert np.all(stored_values(q_weight, fmt)[0] == fmt.max_q)
    dequantized = dequantize_group(q_weight, q_scale, fmt)
    assert np.all(dequantized[0] == 0) and np.all(np.isfinite(dequantized))
    assert np.abs(dequantized - weight).max() <= 1e-12


def test_float16_scales_are_rounded_before_the_weights():
    """q4f16_1 rounds each weight to its nearest level for the scale float16 stores, not for the
    float32 scale the search found (which differs in the last bits and would move a few weights
    of a random matrix to the other level)."""
    fmt = QUANTIZATIONS["q4f16_1"].group_format
    weight = np.random.default_rng(5).standard_normal((256, 256)).astype(np.float32)
    q_weight, q_scale = quantize_group(weight, fmt)
    assert q_scale.dtype == np.float16
    scale = np.repeat(q_scale.astype(np.float32), fmt.group_size, axis=1)
    nearest = np.clip(np.rint(weight / scale), -fmt.max_q, fmt.max_q + 1)
    np.testing.assert_array_equal(stored_values(q_weight, fmt) - fmt.max_q, nearest)


def test_bench_compile_compares_the_gguf_blocks_of_a_gguf_file(tmp_path):
    from kiln.bench.compile import compared_quantizations

    gguf_file = tmp_path / "model.gguf"
    gguf_file.write_bytes(b"")
    assert compared_quantizations(str(gguf_file), "q4f32_1") == ["q0f32", "q4f32_1", "gguf_f32"]
    assert compared_quantizations(str(gguf_file), "gguf_f32") == ["q0f32", "gguf_f32"]
    assert compared_quantizations(str(tmp_path), "q8f32_1") == ["q0f32", "q8f32_1"]


def test_tensor_cache_reloads_with_tvmjs_to_the_source_weights(tiny_build, tiny_source):
    from safetensors.numpy import load_file
    from tvm.contrib.tvmjs import load_tensor_cache
    import tvm

    model_dir = tiny_build("q0f32")
    loaded, _ = load_tensor_cache(str(model_dir), tvm.cpu())
    source = load_file(tiny_source / "model.safetensors")
    layer = "model.layers.1"
    expected = {
        "model.embed_tokens.weight": source["model.embed_tokens.weight"],
        f"{layer}.self_attn.qkv_proj.weight": np.concatenate(
            [source[f"{layer}.self_attn.{p}_proj.weight"] for p in "qkv"]
        ),
        f"{layer}.mlp.gate_up_proj.weight": np.concatenate(
            [source[f"{layer}.mlp.gate_proj.weight"], source[f"{layer}.mlp.up_proj.weight"]]
        ),
        f"{layer}.mlp.down_proj.weight": source[f"{layer}.mlp.down_proj.weight"],
        "model.norm.weight": source["model.norm.weight"],
    }
    for name, array in expected.items():
        np.testing.assert_array_equal(loaded[name].numpy(), array, err_msg=name)
    metadata = json.loads(str(NativeModel(model_dir).vm["_metadata"]()))
    assert sorted(loaded) == sorted(p["name"] for p in metadata["params"])


def test_every_shard_matches_its_md5_and_size_cap(tiny_build):
    model_dir = tiny_build("q4f32_1")
    index = json.loads((model_dir / "tensor-cache.json").read_text())
    for shard in index["records"]:
        data = (model_dir / shard["dataPath"]).read_bytes()
        assert hashlib.md5(data).hexdigest() == shard["md5sum"]
        assert len(data) == shard["nbytes"]
        assert len(data) <= SHARD_CAP_BYTES or len(shard["records"]) == 1
        for record in shard["records"]:
            assert record["byteOffset"] + record["nbytes"] <= len(data)


def test_chat_config_is_what_webllm_reads(tiny_build):
    config = json.loads((tiny_build("q4f32_1") / "mlc-chat-config.json").read_text())
    for field in (
        "model_type",
        "quantization",
        "model_config",
        "vocab_size",
        "context_window_size",
        "prefill_chunk_size",
        "sliding_window_size",
        "attention_sink_size",
        "temperature",
        "top_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "tokenizer_files",
        "conv_template",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "version",
    ):
        assert field in config, field
    assert "tokenizer.json" in config["tokenizer_files"]
    template = config["conv_template"]
    assert template["system_message"] == "You are a tiny test model."
    assert template["stop_str"] == ["<|im_end|>"] and template["stop_token_ids"] == [2]
    for field in ("system_template", "roles", "seps", "stop_str", "stop_token_ids"):
        assert field in template


@pytest.mark.slow
def test_a_library_cache_gives_a_fine_tune_the_library_of_its_base_and_compiles_what_differs(tmp_path, tiny_source):
    """`--library-cache`: a model of the same family, config and quantization as one built before (here
    its weights with another chat template) gets a copy of its library, which runs it as a compiled one
    does; another context window is another compile."""
    from kiln.compile.pipeline import BuildRequest, build

    cache = tmp_path / "cache"

    def built(source: Path, name: str) -> tuple[Path, dict]:
        request = BuildRequest(str(source), "q4f32_1", ["cpu"], tmp_path / name, name, library_cache=cache)
        model_dir = build(request).model_dir
        return model_dir, json.loads((model_dir / "kiln-build.json").read_text())["targets"]["cpu"]

    base, base_target = built(tiny_source, "base")
    fine_tune = tmp_path / "fine-tune-source"
    shutil.copytree(tiny_source, fine_tune)
    config = json.loads((fine_tune / "tokenizer_config.json").read_text())
    qwen_template = (CHAT_TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
    (fine_tune / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": qwen_template}))
    tuned, tuned_target = built(fine_tune, "tuned")
    assert "from_library_cache" not in base_target and tuned_target["from_library_cache"]
    assert tuned_target["planned_storage"] == base_target["planned_storage"]
    assert (tuned / tuned_target["library"]).read_bytes() == (base / base_target["library"]).read_bytes()
    prompt = [3, 14, 15, 92, 65]
    np.testing.assert_array_equal(NativeModel(tuned).prefill(prompt), NativeModel(base).prefill(prompt))

    # From the command line: another context window, another compile.
    args = ["compile", str(tiny_source), "-q", "q4f32_1", "-t", "cpu", "-o", str(tmp_path / "shorter")]
    assert main([*args, "--model-id", "shorter", "--context-window-size", "256", "--library-cache", str(cache)]) == 0
    shorter = json.loads((tmp_path / "shorter" / "shorter" / "kiln-build.json").read_text())
    assert "from_library_cache" not in shorter["targets"]["cpu"]
    assert len([entry for entry in cache.iterdir() if not entry.name.startswith(".")]) == 2


@pytest.mark.slow
def test_a_second_target_reuses_the_converted_weights(tmp_path, tiny_source):
    from kiln.compile.pipeline import BuildRequest, build

    first = build(BuildRequest(str(tiny_source), "q4f32_1", ["cpu"], tmp_path, "reuse"))
    shard = first.model_dir / "params_shard_0.bin"
    inode = shard.stat().st_ino
    second = build(BuildRequest(str(tiny_source), "q4f32_1", ["wasm"], tmp_path, "reuse"))
    record = json.loads((second.model_dir / "kiln-build.json").read_text())
    assert second.reused_weights and record["reused_weights"]
    assert "convert" not in record["timings"]
    assert shard.stat().st_ino == inode
    assert sorted(record["targets"]) == ["cpu", "wasm"]
    previous_library = tmp_path / "previous-cpu.so"
    os.link(second.model_dir / record["targets"]["cpu"]["library"], previous_library)
    before = previous_library.read_bytes()
    third = build(BuildRequest(str(tiny_source), "q4f32_1", ["cpu"], tmp_path, "reuse"))
    assert third.reused_weights
    assert previous_library.read_bytes() == before, "rebuilding a target must not write through the old file"
    third_record = json.loads((third.model_dir / "kiln-build.json").read_text())
    assert sorted(third_record["targets"]) == ["cpu", "wasm"]
    # The record names the tools of every library it lists, the kept wasm library's too.
    assert third_record["versions"]["emscripten"] == record["versions"]["emscripten"]
    assert (second.model_dir / record["targets"]["cpu"]["library"]).is_file()
    assert not list(tmp_path.glob(".kiln-build-*"))


@pytest.mark.slow
def test_targets_compiled_side_by_side_are_those_compiled_one_after_another(tmp_path, tiny_source):
    """Compile processes make the module again from the source: the build writes the same weights,
    configs and memory plans, and the libraries compute the same logits. (Not the same bytes: TVM's
    code generation varies in small ways with what its process compiled before.)"""
    from kiln.compile.pipeline import BuildRequest, build

    records, logits = {}, {}
    for jobs in (1, 2):
        request = BuildRequest(
            str(tiny_source), "q4f32_1", ["cpu", "wasm"], tmp_path / f"jobs-{jobs}", "tiny", jobs=jobs
        )
        model_dir = build(request).model_dir
        records[jobs] = json.loads((model_dir / "kiln-build.json").read_text())
        logits[jobs] = NativeModel(model_dir).prefill(list(PROMPTS[0]))
    assert {f: d for f, d in records[1]["files"].items() if not f.startswith("libs/")} == {
        f: d for f, d in records[2]["files"].items() if not f.startswith("libs/")
    }
    assert {t: r["planned_storage"] for t, r in records[1]["targets"].items()} == {
        t: r["planned_storage"] for t, r in records[2]["targets"].items()
    }
    assert np.abs(logits[1] - logits[2]).max() < 1e-5


# ---- bad input ------------------------------------------------------------------------------


@pytest.mark.slow
def test_errors_exit_non_zero_with_one_line_and_no_traceback(tmp_path, tiny_source):
    result = subprocess.run(
        [*KILN, "compile", str(tmp_path / "nowhere"), "-q", "q4f32_1", "-o", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == f"kiln: error: {tmp_path / 'nowhere'}: no such file or folder"
    assert "Traceback" not in result.stderr


@pytest.fixture
def broken_source(tmp_path, tiny_source) -> Path:
    folder = tmp_path / "broken-source"
    shutil.copytree(tiny_source, folder)
    return folder


def test_missing_config_json(broken_source, tmp_path, run_compile):
    (broken_source / "config.json").unlink()
    assert_clean_failure(run_compile(broken_source, tmp_path / "out"), tmp_path / "out", "config.json")


def test_malformed_config_json(broken_source, tmp_path, run_compile):
    (broken_source / "config.json").write_text('{"model_type": "llama", ')
    assert_clean_failure(run_compile(broken_source, tmp_path / "out"), tmp_path / "out", "config.json")


def test_config_with_a_wrong_field_type(broken_source, tmp_path, run_compile):
    config = json.loads((broken_source / "config.json").read_text())
    config["hidden_size"] = "wide"
    (broken_source / "config.json").write_text(json.dumps(config))
    assert_clean_failure(run_compile(broken_source, tmp_path / "out"), tmp_path / "out", "config.json", "hidden_size")


def test_unknown_model_type(broken_source, tmp_path, run_compile):
    config = json.loads((broken_source / "config.json").read_text())
    config["model_type"] = "mamba9"
    (broken_source / "config.json").write_text(json.dumps(config))
    assert_clean_failure(run_compile(broken_source, tmp_path / "out"), tmp_path / "out", "config.json", "mamba9")


def test_unknown_quantization(tiny_source, tmp_path, capsys):
    assert main(["compile", str(tiny_source), "-q", "q3f99", "-o", str(tmp_path / "out"), "--model-id", "broken"]) == 1
    assert_clean_failure(CommandResult(1, capsys.readouterr().err), tmp_path / "out", "q3f99")


def test_unknown_target(tiny_source, tmp_path, run_compile):
    result = run_compile(tiny_source, tmp_path / "out", "-t", "vulkan")
    assert_clean_failure(result, tmp_path / "out", "vulkan")


def test_truncated_safetensors(broken_source, tmp_path, run_compile):
    weights = broken_source / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert_clean_failure(run_compile(broken_source, tmp_path / "out"), tmp_path / "out", "model.safetensors")


def test_no_tokenizer(broken_source, tmp_path, run_compile):
    (broken_source / "tokenizer.json").unlink()
    assert_clean_failure(run_compile(broken_source, tmp_path / "out"), tmp_path / "out", "tokenizer")


def test_gguf_with_an_unsupported_tensor_type(tmp_path, run_compile):
    path = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(32)
    writer.add_head_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.int32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_clean_failure(run_compile(path, tmp_path / "out"), tmp_path / "out", "odd.gguf")


@pytest.mark.slow
def test_a_failed_rebuild_leaves_the_previous_build_intact(tmp_path, tiny_source, broken_source, run_compile):
    out = tmp_path / "out"
    assert run_compile(tiny_source, out).returncode == 0
    before = sorted(p.name for p in (out / "broken").iterdir())
    (broken_source / "config.json").write_text("{")
    assert run_compile(broken_source, out).returncode != 0
    assert sorted(p.name for p in (out / "broken").iterdir()) == before


def test_a_model_id_that_is_not_a_plain_folder_name_is_refused(tiny_source, tmp_path, capsys):
    argv = ["compile", str(tiny_source), "-q", "q0f32", "-o", str(tmp_path / "out"), "--model-id", "../escape"]
    assert main(argv) == 1
    assert "model id '../escape'" in capsys.readouterr().err
    assert not (tmp_path / "escape").exists()


def test_a_matrix_whose_rows_are_not_whole_groups_keeps_its_float_weights(tmp_path, run_compile):
    """A down projection 100 wide (3 groups of 32 and 4 more): the build goes on, as llama.cpp keeps
    such a tensor in a float type, with that matrix in float and the others quantized, and gives
    transformers' logits on the same weights."""
    from transformers import AutoConfig, LlamaForCausalLM

    source = make_tiny_llama(tmp_path / "odd-width", num_layers=1)
    config = AutoConfig.from_pretrained(source)
    config.intermediate_size = 100
    torch.manual_seed(0)
    LlamaForCausalLM(config).eval().save_pretrained(source, safe_serialization=True)
    result = run_compile(source, tmp_path / "out")
    assert result.returncode == 0, result.stderr
    model_dir = tmp_path / "out" / "broken"
    records = json.loads((model_dir / "tensor-cache.json").read_text())["records"]
    stored = {record["name"]: record["dtype"] for shard in records for record in shard["records"]}
    assert stored["model.layers.0.mlp.down_proj.weight"] == "float32"
    assert "model.layers.0.mlp.gate_up_proj.q_weight" in stored
    native, reference = NativeModel(model_dir), reference_model(source, "q4f32_1")
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPTS[0]])).logits[0].numpy()
    assert np.abs(native.all_logits(PROMPTS[0]) - expected).max() <= LOGIT_TOLERANCE


# ---- WebLLM's sampling functions, run natively ------------------------------------------------


def test_webllm_sampling_functions_compute_what_webllm_expects(tiny_build):
    native = NativeModel(tiny_build("q0f32"))
    vm, vocab = native.vm, native.vocab_size
    tensor = lambda a, dtype="float32": tvm.runtime.tensor(np.asarray(a, dtype=dtype), native.device)  # noqa: E731
    rng = np.random.default_rng(0)
    logits = (rng.normal(size=(2, 1, vocab)) * 3).astype(np.float32)

    probs = vm["softmax_with_temperature"](tensor(logits), tensor([0.7, 1.3])).numpy().reshape(2, vocab)
    scaled = logits[:, 0, :] / np.array([[0.7], [1.3]], np.float32)
    expected = np.exp(scaled - scaled.max(axis=1, keepdims=True))
    np.testing.assert_allclose(probs, expected / expected.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-7)

    sorted_probs, sorted_indices = (x.numpy() for x in vm["argsort_probs"](tensor(probs)))
    np.testing.assert_array_equal(sorted_probs, -np.sort(-probs, axis=1))
    np.testing.assert_array_equal(np.take_along_axis(probs, sorted_indices, axis=1), sorted_probs)
    assert all(sorted(row) == list(range(vocab)) for row in sorted_indices.tolist())

    def sample(uniform, rows, top_p):
        return (
            vm["sample_with_top_p"](
                tensor(sorted_probs),
                tensor(sorted_indices, "int32"),
                tensor(uniform),
                tensor(rows, "int32"),
                tensor(top_p),
            )
            .numpy()
            .tolist()
        )

    argmax = probs.argmax(axis=1).tolist()
    assert sample([0.0, 0.5, 0.999], [0, 1, 1], [1e-5, 1e-5]) == [argmax[0], argmax[1], argmax[1]]
    nucleus = set(sorted_indices[1, : int(np.searchsorted(np.cumsum(sorted_probs[1]), 0.5)) + 1].tolist())
    assert set(sample(np.linspace(0, 0.999, 50), [1] * 50, [1.0, 0.5])) <= nucleus
    draws = sample(rng.random(4000), [0] * 4000, [1.0, 1.0])
    for token in sorted_indices[0, :3]:
        assert abs(draws.count(int(token)) / 4000 - probs[0, token]) < 0.03

    row = (rng.normal(size=(1, vocab))).astype(np.float32)
    processed = tensor(row)
    vm["apply_logit_bias_inplace"](processed, tensor([0, 0], "int32"), tensor([3, 7], "int32"), tensor([1.5, -2.0]))
    expected = row.copy()
    expected[0, 3] += 1.5
    expected[0, 7] -= 2.0
    np.testing.assert_allclose(processed.numpy(), expected, rtol=1e-6)

    processed = tensor(row)
    # presence 0.5, frequency 0.25, repetition 2.0 on tokens 3 (seen twice) and 7 (once)
    vm["apply_penalty_inplace"](
        processed,
        tensor([0], "int32"),
        tensor([0, 0], "int32"),
        tensor([3, 7], "int32"),
        tensor([2, 1], "int32"),
        tensor([[0.5, 0.25, 2.0]]),
    )
    expected = row.copy()
    for token, count in ((3, 2), (7, 1)):
        shifted = row[0, token] - 0.5 - 0.25 * count
        expected[0, token] = shifted / 2.0 if shifted > 0 else shifted * 2.0
    np.testing.assert_allclose(processed.numpy(), expected, rtol=1e-6)

    processed = tensor(row)
    words = (vocab + 31) // 32
    bitmask = np.zeros((1, words), np.int32)
    bitmask[0, 0] = -1  # tokens 0..31 allowed
    vm["apply_bitmask_inplace"](processed, tensor([0], "int32"), tensor(bitmask, "int32"))
    result = processed.numpy()
    np.testing.assert_array_equal(result[0, :32], row[0, :32])
    assert (result[0, 32:] == np.finfo(np.float32).min).all()


@pytest.mark.slow
def test_cuda_library_carries_cuda_kernels(tiny_build):
    """Codegen only here (no GPU): the kernels travel as CUDA source, compiled when a GPU machine loads them."""
    model_dir = tiny_build("q4f16_1", ["cuda"])
    library = model_dir / json.loads((model_dir / "kiln-build.json").read_text())["targets"]["cuda"]["library"]
    data = library.read_bytes()
    assert b"__global__" in data and b"dequantize_matmul" in data


def set_chat_template(source: Path, template: str) -> None:
    config_path = source / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template
    config_path.write_text(json.dumps(config))


def test_a_chat_template_that_reaches_for_the_shell_is_stopped(broken_source, tmp_path, run_compile):
    marker = tmp_path / "pwned"
    set_chat_template(
        broken_source, "<|im_start|>{{ cycler.__init__.__globals__.os.system('touch " + str(marker) + "') }}"
    )
    result = run_compile(broken_source, tmp_path / "out")
    assert not marker.exists()
    assert_clean_failure(result, tmp_path / "out", "tokenizer_config.json", "unsafe")


def test_a_chat_template_that_does_not_render(broken_source, tmp_path, run_compile):
    set_chat_template(broken_source, "<|im_start|>{{ raise_exception('no system role here') }}")
    assert_clean_failure(
        run_compile(broken_source, tmp_path / "out"), tmp_path / "out", "tokenizer_config.json", "no system role here"
    )


def test_a_wasm_library_that_could_not_hold_its_model_is_refused(tiny_source, tmp_path, run_compile):
    """8.5M tokens of KV cache: 2 layers of 2.1 GiB, past what wasm32 (and one allocation) can hold."""
    result = run_compile(tiny_source, tmp_path / "out", "-t", "wasm", "--context-window-size", "8500000")
    assert_clean_failure(result, tmp_path / "out", "cannot run from a wasm library", "MiB", "--context-window-size")
