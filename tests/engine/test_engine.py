"""The native engine on the tiny Llama: sampling, stops, streaming, chat cache reuse, errors, CLI."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers.paths import WEB_DIR

from kiln.completions import ChatCompletionRequest, CompletionRequest
from kiln.engine import ERROR_CODES, Engine, EngineBusy, GenerationConfig
from kiln.errors import KilnError
from kiln.sampling import Sampler, exp_nonpositive, nucleus
from kiln.text import StopStrings, TextStream

PROMPT = "The history of the"
KILN = str(Path(sys.executable).with_name("kiln"))


@pytest.fixture(scope="module")
def tiny_dir(tiny_build) -> Path:
    return tiny_build("q0f32")


@pytest.fixture(scope="module")
def engine(tiny_dir) -> Engine:
    return Engine(tiny_dir)


@pytest.fixture
def fresh(engine) -> Engine:
    engine.reset()
    return engine


def copy_model(model_dir: Path, destination: Path) -> Path:
    shutil.copytree(model_dir, destination)
    return destination


def run_kiln(*args: str, input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([KILN, *args], input=input, capture_output=True, text=True, timeout=300)


# Pure parts: sampling, stop strings, streaming text


def test_greedy_takes_the_argmax_after_penalties():
    logits = np.array([3.0, 2.5, 1.0, -1.0], dtype=np.float32)
    assert Sampler(GenerationConfig(), [3]).sample(logits) == 0
    assert Sampler(GenerationConfig(repetition_penalty=2.0), [0]).sample(logits) == 1
    presence = Sampler(GenerationConfig(presence_penalty=1.0), [])
    presence.record(0)
    assert presence.sample(logits) == 1
    frequency = Sampler(GenerationConfig(frequency_penalty=0.3), [])
    frequency.record(0)
    assert frequency.sample(logits) == 0
    frequency.record(0)
    assert frequency.sample(logits) == 1
    negative = np.array([-1.0, -1.5], dtype=np.float32)
    assert Sampler(GenerationConfig(repetition_penalty=2.0), [0]).sample(negative) == 1


def test_top_k_and_top_p_restrict_the_draw():
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1], dtype=np.float32))
    draws = lambda config: {Sampler(config, []).sample(logits) for _ in range(200)}  # noqa: E731
    assert draws(GenerationConfig(temperature=1.0)) == {0, 1, 2, 3}
    assert draws(GenerationConfig(temperature=1.0, top_k=2)) == {0, 1}
    assert draws(GenerationConfig(temperature=1.0, top_p=0.65)) == {0, 1}
    assert draws(GenerationConfig(temperature=1.0, top_p=0.3)) == {0}


def test_nucleus_equals_a_full_sort():
    rng = np.random.default_rng(1)
    for trial in range(100):
        scaled = rng.normal(size=int(rng.integers(1, 6000))) * rng.uniform(0.1, 5)
        if trial % 10 == 0:
            scaled = np.round(scaled, 1)  # ties
        weights = exp_nonpositive(scaled - scaled.max())
        top_p = rng.uniform(0.05, 0.999)
        order = np.argsort(-scaled, kind="stable")
        expected = order[: np.searchsorted(np.cumsum(weights[order]), top_p * np.cumsum(weights)[-1]) + 1]
        np.testing.assert_array_equal(nucleus(scaled, weights, top_p), expected)


def test_sampler_draws_are_reproducible_with_a_seed():
    logits = np.random.default_rng(0).normal(size=1000).astype(np.float32)

    def draws(seed):
        sampler = Sampler(GenerationConfig(temperature=1.0, seed=seed), [])
        return [sampler.sample(logits) for _ in range(20)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


def test_stop_strings_hold_back_a_partial_match():
    stops = StopStrings(["</end>", "STOP"])
    assert stops.feed("hello </") == ("hello ", False)
    assert stops.feed("en") == ("", False)
    assert stops.feed("vy") == ("</envy", False)
    assert stops.feed(" ST") == (" ", False)
    assert stops.feed("OP and more") == ("", True)
    tail = StopStrings(["abc"])
    assert tail.feed("xab") == ("x", False)
    assert tail.flush() == "ab"


def test_text_stream_never_splits_a_multibyte_character(engine):
    text = "naïve café — 日本語 🙂 done"
    ids = engine.tokenizer.encode(text, add_special_tokens=False).ids
    assert len(ids) > len(text.encode()) // 2, "the tiny tokenizer should split these characters into bytes"
    stream = TextStream(engine.tokenizer, [])
    pieces = [stream.add(token) for token in ids] + [stream.flush()]
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == text


# Generation on the tiny model


def test_same_seed_same_text_different_seed_different_text(fresh):
    def sample(seed):
        fresh.reset()
        return fresh.generate(PROMPT, GenerationConfig(max_tokens=24, temperature=1.2, seed=seed, ignore_eos=True))

    first, again, other = sample(1), sample(1), sample(2)
    assert first.tokens == again.tokens and first.text == again.text
    assert first.text != other.text


def test_greedy_is_deterministic_and_logits_are_recorded(fresh):
    config = GenerationConfig(max_tokens=12, logits_top_k=5, ignore_eos=True)
    result = fresh.generate(PROMPT, config)
    assert result.finish_reason == "length" and len(result.tokens) == 12
    assert len(result.logits) == 12
    for token, step in zip(result.tokens, result.logits):
        assert step["token_ids"][0] == token
        assert step["logits"] == sorted(step["logits"], reverse=True)
    fresh.reset()
    assert fresh.generate(PROMPT, config).tokens == result.tokens


def test_stream_concatenates_to_the_result(fresh):
    config = GenerationConfig(max_tokens=20, ignore_eos=True)
    deltas = list(fresh.stream(PROMPT, config))
    fresh.reset()
    result = fresh.generate(PROMPT, config)
    assert "".join(d.text for d in deltas) == result.text
    assert [t for d in deltas for t in d.token_ids] == result.tokens
    assert [d.finish_reason for d in deltas[:-1]] == [None] * (len(deltas) - 1)
    assert deltas[-1].finish_reason == "length" and deltas[-1].usage.completion_tokens == 20
    assert result.text == fresh.tokenizer.decode(result.tokens, skip_special_tokens=False)


def test_a_chat_completion_is_the_chat_s_reply_whole_or_in_chunks(fresh):
    messages = [{"role": "user", "content": "Hi"}]
    config = GenerationConfig(max_tokens=12, ignore_eos=True)
    expected = fresh.generate_chat(messages, config)
    fresh.reset()
    whole = fresh.chat_completion(ChatCompletionRequest(messages, config, "tiny"))
    assert (whole["object"], whole["model"], whole["id"].startswith("chatcmpl-")) == ("chat.completion", "tiny", True)
    (choice,) = whole["choices"]
    assert choice["message"] == {"role": "assistant", "content": expected.text}
    assert choice["finish_reason"] == "length" == expected.finish_reason
    prompt_tokens = len(expected.prompt_tokens)
    assert whole["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 12,
        "total_tokens": prompt_tokens + 12,
    }
    fresh.reset()
    chunks = list(fresh.chat_completion_chunks(ChatCompletionRequest(messages, config, "tiny")))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == expected.text
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert (chunks[-1]["choices"], chunks[-1]["usage"]) == ([], whole["usage"])
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and len({c["id"] for c in chunks}) == 1


def test_a_text_completion_is_the_raw_prompt_s_continuation(fresh):
    config = GenerationConfig(max_tokens=8, ignore_eos=True)
    expected = fresh.generate(PROMPT, config)
    fresh.reset()
    whole = fresh.completion(CompletionRequest(PROMPT, config, "tiny"))
    assert whole["object"] == "text_completion" and whole["choices"][0]["text"] == expected.text
    fresh.reset()
    chunks = list(fresh.completion_chunks(CompletionRequest(PROMPT, config, "tiny")))
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == expected.text


def test_the_native_engine_s_error_codes_are_the_browser_engine_s():
    errors_js = (WEB_DIR / "src" / "errors.js").read_text()
    browser_codes = set(re.findall(r'^  "([a-z-]+)",', errors_js, re.M))
    assert set(ERROR_CODES) <= browser_codes and "busy" in browser_codes
    assert EngineBusy("held").code == "busy"


def test_stop_string_ends_the_text_before_it(fresh):
    config = GenerationConfig(max_tokens=30, ignore_eos=True)
    full = fresh.generate(PROMPT, config).text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert len(stop.strip()) >= 2, f"pick a stop string from {full!r}"
    fresh.reset()
    deltas = list(fresh.stream(PROMPT, GenerationConfig(max_tokens=30, ignore_eos=True, stop=[stop])))
    text = "".join(d.text for d in deltas)
    assert text == full[: full.find(stop)]
    assert deltas[-1].finish_reason == "stop"
    assert all(stop not in d.text for d in deltas)


@pytest.mark.parametrize("field", ["eos_token_id", "stop_token_ids"])
def test_eos_token_ends_generation(tiny_dir, tmp_path, field):
    reference = Engine(tiny_dir).generate(PROMPT, GenerationConfig(max_tokens=10, ignore_eos=True))
    eos = reference.tokens[4]
    first = reference.tokens.index(eos)
    model_dir = copy_model(tiny_dir, tmp_path / "model")
    config_path = model_dir / "mlc-chat-config.json"
    chat_config = json.loads(config_path.read_text())
    chat_config["eos_token_id"] = []
    chat_config["conv_template"]["stop_token_ids"] = []
    (chat_config if field == "eos_token_id" else chat_config["conv_template"])[field] = [eos]
    config_path.write_text(json.dumps(chat_config))

    engine = Engine(model_dir)
    stopped = engine.generate(PROMPT, GenerationConfig(max_tokens=10))
    assert stopped.finish_reason == "stop"
    assert stopped.tokens == reference.tokens[: first + 1]
    assert stopped.text == engine.tokenizer.decode(reference.tokens[:first], skip_special_tokens=False)
    engine.reset()
    assert engine.generate(PROMPT, GenerationConfig(max_tokens=10, ignore_eos=True)).tokens == reference.tokens


def test_second_chat_turn_prefills_only_new_tokens(fresh):
    config = GenerationConfig(max_tokens=12)
    messages = [{"role": "user", "content": "Tell me about the river."}]
    first = fresh.generate_chat(messages, config)
    assert first.usage.prefilled_tokens == first.usage.prompt_tokens == len(fresh.encode_chat(messages))
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And the hills?"}]
    second = fresh.generate_chat(messages, config)

    # The cache holds the first prompt and every reply token but the last (sampled, never run).
    cached = len(first.prompt_tokens) + len(first.tokens) - 1
    assert second.prompt_tokens[: len(first.prompt_tokens)] == first.prompt_tokens
    assert second.usage.prefilled_tokens == len(second.prompt_tokens) - cached

    fresh.reset()
    from_scratch = fresh.generate(second.prompt_tokens, config)
    assert from_scratch.usage.prefilled_tokens == len(second.prompt_tokens)
    assert from_scratch.tokens == second.tokens


def test_raw_prompts_reuse_the_common_prefix(fresh):
    config = GenerationConfig(max_tokens=6, ignore_eos=True)
    first = fresh.generate(PROMPT + " river and the hills", config)
    second = fresh.generate(PROMPT + " sea", config)
    common = next(i for i, (a, b) in enumerate(zip(first.prompt_tokens, second.prompt_tokens)) if a != b)
    assert second.usage.prefilled_tokens == len(second.prompt_tokens) - common
    fresh.reset()
    assert fresh.generate(PROMPT + " sea", config).tokens == second.tokens


def test_chunked_prefill_matches_one_pass(tiny_dir):
    engine = Engine(tiny_dir)
    prompt = "The history of the river and the hills, " * 4
    config = GenerationConfig(max_tokens=8, ignore_eos=True, logits_top_k=3)
    whole = engine.generate(prompt, config)
    engine.reset()
    engine.model.prefill_chunk_size = 7
    chunked = engine.generate(prompt, config)
    assert len(chunked.prompt_tokens) > 14
    assert chunked.tokens == whole.tokens
    np.testing.assert_allclose(chunked.logits[0]["logits"], whole.logits[0]["logits"], atol=1e-4)


def test_the_batch_functions_mlc_llms_engine_runs_give_prefill_and_decode_logits(tiny_dir):
    """MLC-LLM's C++ engine (its Android and iOS apps, which run `kiln package` bundles) prefills and
    decodes with batch_prefill and batch_decode; Kiln's engines and WebLLM use prefill and decode.
    Here two sequences are prefilled apart and decoded in one batch."""
    import tvm
    from tvm.runtime import ShapeTuple

    from kiln.runtime import NativeModel, on_compute_thread

    prompts, next_tokens = [[5, 17, 100, 42, 7], [3, 250, 9]], [9, 11]
    expected = []
    for prompt, token in zip(prompts, next_tokens):
        single = NativeModel(tiny_dir)
        expected.append([single.prefill(prompt), single.decode(token)])
    batched = NativeModel(tiny_dir)
    batched._kv_builtin["kv_state_add_sequence"](batched.kv_cache, 1)  # sequence 0 is the model's own

    def step(function: str, sequences: list[int], token_ids: list[int], *extra) -> np.ndarray:
        embeds = batched.vm["embed"](tvm.runtime.tensor(np.array(token_ids, dtype="int32")), batched.params)
        shape = (1, len(token_ids)) if function == "batch_prefill" else (len(token_ids), 1)
        embeds = embeds._create_view((*shape, embeds.shape[-1]))
        lengths = [len(token_ids)] if function == "batch_prefill" else [1] * len(token_ids)
        batched._kv_builtin["kv_state_begin_forward"](batched.kv_cache, ShapeTuple(sequences), ShapeTuple(lengths))
        logits, _ = batched.vm[function](embeds, *extra, batched.kv_cache, batched.params)
        batched._kv_builtin["kv_state_end_forward"](batched.kv_cache)
        return logits.numpy().reshape(-1, logits.shape[-1])

    last_positions = [tvm.runtime.tensor(np.array([len(prompt) - 1], "int32")) for prompt in prompts]
    prefilled = [
        on_compute_thread(step, "batch_prefill", [seq], prompt, last)
        for seq, (prompt, last) in enumerate(zip(prompts, last_positions))
    ]
    decoded = on_compute_thread(step, "batch_decode", [0, 1], next_tokens)
    for seq, (prefill_logits, decode_logits) in enumerate(expected):
        np.testing.assert_allclose(prefilled[seq][-1], prefill_logits, atol=1e-5)
        np.testing.assert_allclose(decoded[seq], decode_logits, atol=1e-5)


def test_one_generation_at_a_time_and_interrupt(fresh):
    config = GenerationConfig(max_tokens=50, ignore_eos=True)
    running = fresh.stream(PROMPT, config)
    with pytest.raises(EngineBusy):
        fresh.stream(PROMPT, config)
    with pytest.raises(EngineBusy):
        fresh.reset()
    next(running)
    fresh.interrupt()
    *_, last = running
    assert last.finish_reason == "abort" and last.usage.completion_tokens < 50
    # Released when finished, and when a stream is closed early.
    fresh.stream(PROMPT, config).close()
    assert fresh.generate(PROMPT, GenerationConfig(max_tokens=2)).usage.completion_tokens >= 1


def test_bad_prompts_are_clear_errors(fresh):
    with pytest.raises(KilnError, match="empty"):
        fresh.generate("", GenerationConfig())
    with pytest.raises(KilnError, match="context window"):
        fresh.generate([5] * (fresh.model.context_window_size + 1), GenerationConfig())
    with pytest.raises(KilnError, match="token ids"):
        fresh.generate([5, 10**6], GenerationConfig())
    with pytest.raises(KilnError, match="max_tokens"):
        fresh.generate(PROMPT, GenerationConfig(max_tokens=0))
    with pytest.raises(KilnError, match="content"):
        fresh.generate_chat([{"role": "user"}], GenerationConfig())
    assert fresh.generate(PROMPT, GenerationConfig(max_tokens=1)).usage.completion_tokens == 1


def without_chat_template(model_dir: Path) -> dict:
    """Take the chat template out of a copied model's tokenizer_config.json; returns that config."""
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    template = config.pop("chat_template")
    config_path.write_text(json.dumps(config))
    return {**config, "chat_template": template}


def test_a_template_in_chat_template_jinja_is_used(engine, tiny_dir, tmp_path):
    model_dir = copy_model(tiny_dir, tmp_path / "model")
    (model_dir / "chat_template.jinja").write_text(without_chat_template(model_dir)["chat_template"])
    messages = [{"role": "user", "content": "Tell me about the river."}]
    assert Engine(model_dir).encode_chat(messages) == engine.encode_chat(messages)


def test_a_model_without_a_chat_template_completes_but_does_not_chat(tiny_dir, tmp_path):
    model_dir = copy_model(tiny_dir, tmp_path / "base-model")
    without_chat_template(model_dir)
    base = Engine(model_dir)
    assert base.generate(PROMPT, GenerationConfig(max_tokens=2)).usage.completion_tokens == 2
    with pytest.raises(KilnError, match="no chat template") as error:
        base.generate_chat([{"role": "user", "content": "Hi"}], GenerationConfig())
    assert error.value.path == model_dir
    run = run_kiln("chat", str(model_dir), input="Hi\n")
    assert run.returncode == 1 and run.stderr.count("\n") == 1 and "no chat template" in run.stderr, run.stderr


def test_generation_stops_at_the_context_window(fresh):
    window = fresh.model.context_window_size
    prompt = fresh.encode("the river " * window)[: window - 3]
    result = fresh.generate(prompt, GenerationConfig(max_tokens=50, ignore_eos=True))
    assert result.finish_reason == "length" and len(result.tokens) == 4


# The command line


def test_generate_json_matches_the_engine(engine, tiny_dir):
    config = GenerationConfig(max_tokens=10, temperature=1.0, seed=3, ignore_eos=True, logits_top_k=2)
    engine.reset()
    expected = engine.generate(PROMPT, config)
    run = run_kiln(
        "generate",
        str(tiny_dir),
        "--prompt",
        PROMPT,
        "--max-tokens",
        "10",
        "--temperature",
        "1",
        "--seed",
        "3",
        "--ignore-eos",
        "--logits",
        "2",
        "--json",
    )
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["prompt_tokens"] == expected.prompt_tokens
    assert out["tokens"] == expected.tokens and out["text"] == expected.text
    assert [step["token_ids"] for step in out["logits"]] == [step["token_ids"] for step in expected.logits]
    assert set(out["usage"]) >= {"prompt_tokens", "completion_tokens", "ttft_s", "decode_tokens_per_s"}


def test_chat_command_runs_a_conversation(tiny_dir):
    run = run_kiln(
        "chat",
        str(tiny_dir),
        "--max-tokens",
        "8",
        input="Hello there\n/stats\n/system You are terse.\nHi again\n/reset\n/nonsense\n/exit\n",
    )
    assert run.returncode == 0, run.stderr
    assert "prefilled" in run.stdout and "decode" in run.stdout
    assert "unknown command" in run.stdout
    assert "Traceback" not in run.stderr


def test_bad_input_gives_one_line_errors(tiny_dir, tmp_path):
    no_library = copy_model(tiny_dir, tmp_path / "no-library")
    for library in (no_library / "libs").glob("*-cpu.so"):
        library.unlink()
    corrupt = copy_model(tiny_dir, tmp_path / "corrupt")
    shard = corrupt / "params_shard_0.bin"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    cases = {
        "no cpu library": ([str(no_library), "--prompt", PROMPT], "no cpu library"),
        "corrupt shard": (
            [str(corrupt), "--prompt", PROMPT],
            "params_shard_0.bin: weight shard does not match its md5",
        ),
        "empty prompt": ([str(tiny_dir), "--prompt", ""], "the prompt is empty"),
        "too long": ([str(tiny_dir), "--prompt", "the river " * 600], "more than the context window"),
    }
    # Started together: each pays the TVM import once, in parallel.
    running = {
        name: subprocess.Popen([KILN, "generate", *args], text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for name, (args, _) in cases.items()
    }
    for name, process in running.items():
        stdout, stderr = process.communicate(timeout=300)
        expected = cases[name][1]
        assert process.returncode == 1, (name, stderr)
        assert "Traceback" not in stderr, name
        assert stderr.startswith("kiln: error: ") and stderr.count("\n") == 1, (name, stderr)
        assert expected in stderr, (name, stderr)
        assert stdout == "", name


def test_bench_native_reports_the_numbers(tiny_dir):
    from kiln.bench.native import bench_native

    report = bench_native(tiny_dir, prompt_tokens=32, decode_tokens=16, runs=2, bandwidth_bytes=64 << 20)
    for key in (
        "load_s",
        "ttft_s",
        "prefill_tokens_per_s",
        "decode_tokens_per_s",
        "peak_rss_mb",
        "bandwidth_fraction",
        "bandwidth_gb_per_s",
        "decode_bytes_per_token",
        "threads",
    ):
        assert report[key] > 0, key
    assert report["bandwidth_fraction"] < 1
    assert any(f"{report['threads']}-thread numpy copy" in line for line in report["lines"])
    (matrices,) = report["matrix_types"]  # the tiny Llama at q0f32: float32 weights
    assert matrices["kind"] == "float32" and matrices["gb_per_s"] > 0
    assert matrices["bytes"] < report["decode_bytes_per_token"]
    assert report["lines"][-1].lstrip().startswith("together")
    assert report["matrix_kernels_as_built"]  # built in this session, by this code


@pytest.mark.parametrize(
    "name, tied, read_whole",
    [
        ("model.embed_tokens.q_weight", False, False),
        ("model.embed_tokens.q_weight", True, True),  # also the output projection
        ("model.embed_tokens_per_layer.q_weight", True, False),  # Gemma 4's per-layer table: one row a token
        ("model.embed_tokens_per_layer.q_scale", False, False),
        ("model.layers.0.self_attn.qkv_proj.q_weight", False, True),
        ("lm_head.q_weight", False, True),
    ],
)
def test_a_decode_step_reads_all_but_the_embedding_tables_it_gathers_from(name, tied, read_whole):
    from kiln.bench.matrices import read_whole_by_decode
    from kiln.tensor_cache import TensorRecord

    assert read_whole_by_decode(TensorRecord(name, (8, 8), "uint32", Path("shard"), 0, 256, {}), tied) == read_whole


def test_the_cpu_library_runs_on_the_physical_cores_or_as_asked(tiny_dir):
    from kiln.runtime import default_cpu_threads

    assert 1 <= default_cpu_threads() <= len(os.sched_getaffinity(0))
    for asked, expected in ((None, default_cpu_threads()), ("1", 1)):
        arguments = [
            "bench",
            "native",
            str(tiny_dir),
            "--json",
            "--runs",
            "1",
            "--prompt-tokens",
            "8",
            "--decode-tokens",
            "4",
            *(["--threads", asked] if asked else []),
        ]
        result = run_kiln(*arguments)
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["threads"] == expected
    assert (
        run_kiln("bench", "native", str(tiny_dir), "--threads", "0").stderr.strip()
        == "kiln: error: the thread count must be at least 1, got 0"
    )
