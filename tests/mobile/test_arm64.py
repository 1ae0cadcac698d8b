"""Kiln's mobile runtime on arm64, under qemu-aarch64: a C99 app (tests/mobile/drivers/chat.c) loads
the tiny Llama's `arm64-linux` library through kiln.h and streams chats that equal the native engine's,
reuses the KV cache across turns, stops and aborts, and turns bad input into error codes."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess

import numpy as np
import pytest

from helpers.mobile_app import (
    CHAT_DRIVER,
    ChatApp,
    build_chat_app,
    build_model_driver,
    greedy_arm64_reply,
    run_arm64,
)
from helpers.tiny_families import BROWSER_FAMILIES

from kiln.engine import Engine, GenerationConfig
from kiln.mobile.package import LINK_LINES, package
from kiln.runtime import NativeModel

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "Tell me about the history of the city"}]
GREEDY_TOKENS = 32


@pytest.fixture(scope="session")
def arm64_chat_app(tmp_path_factory):
    return build_chat_app("arm64-linux", tmp_path_factory.mktemp("arm64-app"))


@pytest.fixture(scope="module")
def arm64_model(tiny_build):
    return tiny_build("q4f32_1", ["cpu", "arm64-linux"])


@pytest.fixture(scope="module")
def app(arm64_chat_app, arm64_model):
    running = ChatApp(arm64_chat_app, qemu=True)
    assert running.create({"model": str(arm64_model)}) is None
    yield running
    running.close()


@pytest.fixture(scope="module")
def native(arm64_model) -> Engine:
    return Engine(arm64_model)


def request(**fields) -> dict:
    return {"messages": QUESTION, "temperature": 0, "max_tokens": GREEDY_TOKENS, **fields}


@pytest.fixture(scope="module")
def model_driver(tmp_path_factory):
    return build_model_driver("arm64-linux", tmp_path_factory.mktemp("arm64-driver"))


def test_the_first_logits_and_32_greedy_tokens_equal_the_x86_cpu_library(arm64_model, native, model_driver):
    check_logits_and_greedy_tokens(model_driver, arm64_model, native.encode_chat(QUESTION))


def check_logits_and_greedy_tokens(model_driver, model_dir, prompt_ids: list[int]) -> None:
    result = run_arm64(model_driver, str(model_dir), *map(str, prompt_ids))
    assert result.returncode == 0, result.stderr[-4000:]
    logits, tokens, passes = (json.loads(line) for line in result.stdout.splitlines())
    x86 = NativeModel(model_dir)
    expected_logits = x86.prefill(prompt_ids)
    assert np.abs(np.array(logits) - expected_logits).max() <= 1e-4
    expected_tokens = []
    row = expected_logits
    for _ in range(GREEDY_TOKENS):
        expected_tokens.append(int(np.argmax(row)))
        row = x86.decode(expected_tokens[-1])
    assert tokens == expected_tokens
    # verify passes (verify_<rows>, padded, the padding rolled back; 6 ids: prefill_all_logits)
    for count, verified in zip((1, 3, 4, 6), passes, strict=True):
        assert np.abs(np.array(verified["rows"]) - x86.all_logits(prompt_ids[:count])).max() <= 1e-4
        assert np.abs(np.array(verified["after"]) - x86.decode(prompt_ids[0])).max() <= 1e-4
        x86.rollback(count + 1)


@pytest.mark.parametrize("family", BROWSER_FAMILIES)
def test_every_family_gives_the_x86_logits_and_greedy_tokens(family, family_build, model_driver):
    model_dir = family_build(family, "q4f32_1", ["cpu", "arm64-linux"])
    check_logits_and_greedy_tokens(model_driver, model_dir, list(range(3, 40)))


@pytest.mark.parametrize("family", ["lfm2", "qwen3_5"])
def test_a_hybrid_models_stop_string_and_later_turns_equal_the_native_engine(family, family_build, arm64_chat_app):
    """The recurrent state rolled back as the native engine does it: a stop string's tokens undone in its
    history; an edited second message from the snapshot after the first prompt."""
    model_dir = family_build(family, "q4f32_1", ["cpu", "arm64-linux"])
    native = Engine(model_dir)
    text = native.generate_chat(QUESTION, GenerationConfig(max_tokens=16)).text
    stop = text[len(text) // 2 :][:3]
    turn = [*QUESTION, {"role": "assistant", "content": text[: text.index(stop)]}]
    conversations = [
        QUESTION,
        [*turn, {"role": "user", "content": "And?"}],
        [*turn, {"role": "user", "content": "What came after?"}],
    ]
    native.reset()
    expected = [
        native.generate_chat(messages, GenerationConfig(max_tokens=16, stop=[stop])) for messages in conversations
    ]
    app = ChatApp(arm64_chat_app, qemu=True)
    try:
        assert app.create({"model": str(model_dir)}) is None
        replies = [app.chat(request(messages=messages, max_tokens=16, stop=[stop])) for messages in conversations]
    finally:
        app.close()
    assert [(r.content, r.finish_reason) for r in replies] == [(e.text, e.finish_reason) for e in expected]
    assert [r.usage["extra"]["prefilled_tokens"] for r in replies] == [e.usage.prefilled_tokens for e in expected]
    assert replies[0].finish_reason == "stop"
    assert expected[2].usage.prefilled_tokens < len(native.encode_chat(conversations[2])) - 8


def test_greedy_replies_equal_the_native_engine(app, native):
    app.reset()
    reply = app.chat(request())
    assert reply.status == 0, reply.message
    expected = native.generate_chat(QUESTION, GenerationConfig(max_tokens=GREEDY_TOKENS, temperature=0))
    assert reply.content == expected.text
    assert reply.usage["prompt_tokens"] == len(expected.prompt_tokens)
    assert reply.finish_reason == expected.finish_reason
    assert reply.chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert {chunk["object"] for chunk in reply.chunks} == {"chat.completion.chunk"}


def test_a_seeded_reply_equals_the_native_engine(app, native):
    app.reset()
    settings = {"temperature": 0.9, "top_p": 0.95, "top_k": 40, "seed": 7, "repetition_penalty": 1.1}
    reply = app.chat(request(**settings))
    expected = native.generate_chat(QUESTION, GenerationConfig(max_tokens=GREEDY_TOKENS, **settings))
    assert reply.content == expected.text


def test_a_second_turn_prefills_only_its_new_tokens(app):
    app.reset()
    first = app.chat(request(max_tokens=8))
    conversation = [
        *QUESTION,
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": "And then?"},
    ]
    second = app.chat(request(messages=conversation, max_tokens=8))
    assert second.status == 0, second.message
    assert second.usage["extra"]["prefilled_tokens"] < second.usage["prompt_tokens"] - first.usage["prompt_tokens"]


def test_a_reply_ends_with_abort_when_asked_from_another_thread_or_by_the_callback(app):
    app.reset()
    for reply in (app.chat(request(ignore_eos=True), abort_after=3), app.chat(request(ignore_eos=True), stop_after=3)):
        assert reply.status == 0, reply.message
        assert reply.finish_reason == "abort"
        assert reply.usage["completion_tokens"] < GREEDY_TOKENS


def test_pulled_chunks_are_the_streamed_ones_and_a_dropped_stream_frees_the_engine(app):
    app.reset()
    streamed = app.chat(request(max_tokens=12))
    app.reset()
    pulled = app.pull(request(max_tokens=12))
    assert pulled.status == 0, pulled.message
    assert pulled.content == streamed.content and pulled.finish_reason == streamed.finish_reason
    assert len(app.pull_and_drop(request(ignore_eos=True), after=3)) == 3
    after_drop = app.chat(request(max_tokens=4))
    assert after_drop.status == 0 and after_drop.finish_reason == "length", after_drop.message


def test_prompt_lookup_gives_the_native_replies(arm64_chat_app, arm64_model, app, native):
    """Speculative decoding (speculative.cc): greedy and seeded replies are the native engine's, per
    request and as the engine config's default, with proposals made and some taken."""
    echo = [{"role": "user", "content": "Repeat: a b c d a b c d a b c d"}]
    accepted = 0
    for settings in ({"temperature": 0}, {"temperature": 0.9, "top_p": 0.95, "seed": 3}):
        expected = native.generate_chat(echo, GenerationConfig(max_tokens=GREEDY_TOKENS, **settings))
        app.reset()
        reply = app.chat(request(messages=echo, speculative="prompt-lookup", **settings))
        assert (reply.content, reply.finish_reason) == (expected.text, expected.finish_reason)
        extra = reply.usage["extra"]
        assert extra["model_steps"] == len(expected.tokens) - 1 - extra["accepted_tokens"]
        accepted += extra["accepted_tokens"]
    assert accepted > 0
    speculating = ChatApp(arm64_chat_app, qemu=True)
    try:
        assert speculating.create({"model": str(arm64_model), "speculative": "prompt-lookup"}) is None
        reply = speculating.chat(request(messages=echo))
        assert reply.content == native.generate_chat(echo, GenerationConfig(max_tokens=GREEDY_TOKENS)).text
        assert reply.usage["extra"]["proposed_tokens"] > 0
        assert speculating.chat(request(messages=echo, speculative="off")).usage["extra"]["proposed_tokens"] == 0
    finally:
        speculating.close()


def test_a_prompt_past_the_context_window_gets_its_code(app):
    long_question = [{"role": "user", "content": "the river " * 600}]
    reply = app.chat(request(messages=long_question))
    assert (reply.status, reply.code) == (18, "context-window-exceeded")
    assert "context window" in reply.message


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("not json", "not JSON"),
        (json.dumps({"messages": QUESTION, "temperature": 5}), "temperature must be a number in [0, 2]"),
        (json.dumps({"messages": []}), "messages must be a non-empty list"),
        (json.dumps({"messages": QUESTION, "max_tokens": 0}), "max_tokens must be a positive integer"),
        (json.dumps({"messages": QUESTION, "speculative": "maybe"}), "speculative must be one of off, prompt-lookup"),
    ],
)
def test_a_bad_request_is_a_bad_request(app, body, message):
    reply = app.chat(body)
    assert (reply.status, reply.code) == (1, "bad-request")
    assert message in reply.message
    assert reply.chunks == []


def test_bad_model_folders_are_refused_with_their_codes(arm64_chat_app, arm64_model, tmp_path):
    folders = {}
    for name in ("other-kiln", "bad-index", "bad-shard"):
        folders[name] = tmp_path / name
        shutil.copytree(arm64_model, folders[name])
    build = json.loads((arm64_model / "kiln-build.json").read_text())
    (folders["other-kiln"] / "kiln-build.json").write_text(json.dumps({**build, "kiln_version": "0.0.9"}))
    (folders["bad-index"] / "tensor-cache.json").write_text('{"records": [')
    shard = folders["bad-shard"] / "params_shard_0.bin"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    expected = [
        (tmp_path / "missing", "bad-model", "missing or unreadable"),
        (folders["other-kiln"], "incompatible-model", "built by Kiln 0.0.9"),
        (folders["bad-index"], "bad-model", "malformed JSON"),
        (folders["bad-shard"], "integrity", "does not match its md5"),
    ]
    app = ChatApp(arm64_chat_app, qemu=True)
    try:
        for folder, code, message in expected:
            failure = app.create({"model": str(folder)})
            assert failure is not None and failure.code == code, failure
            assert message in failure.message and str(folder) in failure.message
    finally:
        app.close()


def test_an_arm64_linux_bundle_links_as_its_readme_says_and_chats(arm64_model, native, tmp_path):
    config = tmp_path / "kiln-package.json"
    model_entry = {"model": str(arm64_model), "model_id": "tiny", "bundle_weight": True}
    config.write_text(json.dumps({"platforms": ["arm64-linux"], "model_list": [model_entry]}))
    bundle = package(config, tmp_path / "out")["arm64-linux"]
    assert LINK_LINES["arm64-linux"] in (bundle / "BUNDLE.md").read_text()
    (entry,) = json.loads((bundle / "mlc-app-config.json").read_text())["model_list"]

    shutil.copyfile(CHAT_DRIVER, bundle / "app.c")
    link = subprocess.run(shlex.split(LINK_LINES["arm64-linux"]) + ["-o", "app"], cwd=bundle, capture_output=True)
    assert link.returncode == 0, link.stderr.decode()[-4000:]
    config = {"model": str(bundle / entry["model_path"]), "model_lib": str(bundle / entry["model_lib"])}
    reply = greedy_arm64_reply(bundle / "app", config, QUESTION, 8)
    assert reply.content == native.generate_chat(QUESTION, GenerationConfig(max_tokens=8, temperature=0)).text


def test_smollm2_on_arm64_replies_as_the_native_engine(arm64_chat_app, smollm2_build):
    model_dir = smollm2_build("q4f32_1", ["cpu", "arm64-linux"])
    question = [{"role": "user", "content": "What is the capital of France?"}]
    reply = greedy_arm64_reply(arm64_chat_app, {"model": str(model_dir)}, question, 16)
    assert reply.status == 0, reply.message
    expected = Engine(model_dir).generate_chat(question, GenerationConfig(max_tokens=16, temperature=0))
    assert reply.content == expected.text
    print(f"SmolLM2 under qemu-aarch64: {reply.usage['extra']['decode_tokens_per_s']:.1f} decode tok/s")
