"""A Kiln-built model in WebLLM (@mlc-ai/web-llm, the version pinned in web/package.json): it
loads through the app config `kiln serve` publishes and its greedy replies are Kiln's."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from helpers.paths import WEB_DIR
from helpers.schema_corpus import SCHEMAS
from helpers.tiny_llama import (
    CHAT_TEMPLATES,
    GRANITE_TOKENS,
    LLAMA_2_TOKENS,
    LLAMA_3_TOKENS,
    PHI_3_TOKENS,
    QWEN_TOKENS,
    SMOLLM3_TOKENS,
    make_tiny_llama,
)
from helpers.webllm import MAX_TOKENS, assert_kiln_replies_the_same, webllm_replies

from kiln.browser.model import browser_model
from kiln.browser.parity import greedy
from kiln.engine import Engine, GenerationConfig

pytestmark = pytest.mark.browser


def webllm_version() -> str:
    return json.loads((WEB_DIR / "node_modules/@mlc-ai/web-llm/package.json").read_text())["version"]


def test_webllm_is_the_pinned_version():
    package = json.loads((WEB_DIR / "package.json").read_text())
    assert package["devDependencies"]["@mlc-ai/web-llm"] == webllm_version() == "0.2.86"


def test_webllm_generates_what_kiln_generates_on_the_tiny_model(driver, tmp_path, tiny_dir):
    conversations = [
        [{"role": "user", "content": "Tell me about the history of the city"}],
        [
            {"role": "system", "content": "You answer in one line."},
            {"role": "user", "content": "What is in the old market?"},
        ],
    ]
    replies = webllm_replies(driver, tmp_path / "profile", tiny_dir, conversations)
    assert all(reply["text"] for reply in replies)
    assert_kiln_replies_the_same(tiny_dir, conversations, replies)


def test_webllm_json_mode_works_on_a_kiln_model(driver, tmp_path, tiny_dir):
    """WebLLM's own grammar mode reads tokenizer_info from mlc-chat-config.json and the library's
    apply_bitmask_inplace; its JSON options differ from Kiln's, so only validity is compared."""
    schema = SCHEMAS["person"]
    replies = webllm_replies(
        driver,
        tmp_path / "profile",
        tiny_dir,
        [[{"role": "user", "content": "Who?"}]],
        max_tokens=256,
        request={"response_format": {"type": "json_object", "schema": json.dumps(schema)}},
    )
    jsonschema.validate(json.loads(replies[0]["text"]), schema)


@pytest.mark.slow
def test_webllm_generates_what_kiln_generates_on_smollm2(driver, tmp_path, smollm2_build):
    model_dir = smollm2_build("q4f32_1", ["cpu", "webgpu", "wasm"])
    conversations = [[{"role": "user", "content": "What is the capital of France?"}]]
    replies = webllm_replies(driver, tmp_path / "profile", model_dir, conversations)
    assert "Paris" in replies[0]["text"]
    assert_kiln_replies_the_same(model_dir, conversations, replies)


ONE_QUESTION = [{"role": "user", "content": "Tell me about the history of the city"}]
SEVERAL_TURNS = [
    {"role": "user", "content": "What is in the old market?"},
    {"role": "assistant", "content": "Fruit and fish."},
    {"role": "user", "content": "And the river?"},
]
WITH_A_SYSTEM_MESSAGE = [{"role": "system", "content": "You answer in one line."}, *SEVERAL_TURNS]


@pytest.mark.slow
@pytest.mark.parametrize(
    "template, tokens, conversations",
    [
        # a BOS as system_prefix_token_ids, and the template's date lines in the system block
        ("meta-llama-Llama-3.1-8B-Instruct", LLAMA_3_TOKENS, [ONE_QUESTION, WITH_A_SYSTEM_MESSAGE]),
        ("microsoft-Phi-3.5-mini-instruct", PHI_3_TOKENS, [ONE_QUESTION, WITH_A_SYSTEM_MESSAGE]),
        ("Qwen-Qwen2.5-7B-Instruct", QWEN_TOKENS, [ONE_QUESTION, WITH_A_SYSTEM_MESSAGE]),  # a default system message
        # one special token ends each turn and the chat, and is the BOS, which the template does not print
        ("ibm-granite-granite-3.0-8b-instruct", GRANITE_TOKENS, [ONE_QUESTION, WITH_A_SYSTEM_MESSAGE]),
        # a system block of metadata and today's date, closed by a blank line; its default instructions
        # (no system message) are longer than the tiny model's context in the tiny tokenizer
        ("HuggingFaceTB-SmolLM3-3B", SMOLLM3_TOKENS, [WITH_A_SYSTEM_MESSAGE]),
        # SentencePiece. WebLLM encodes the system block and the first message apart, and Mistral's
        # template joins them in one turn: "\n\nWhat" becomes "\n\n▁What" (a known difference, in the README).
        ("mistralai-Mistral-7B-Instruct-v0.2", LLAMA_2_TOKENS, [ONE_QUESTION, SEVERAL_TURNS]),
    ],
)
def test_webllm_lays_out_each_familys_chat_as_kiln_does(
    driver, tmp_path, builds, tmp_path_factory, template, tokens, conversations
):
    source = make_tiny_llama(
        tmp_path_factory.mktemp("sources") / template,
        tokens=tokens,
        chat_template=(CHAT_TEMPLATES / f"{template}.jinja").read_text(),
    )
    model_dir = builds.model_dir(source, f"tiny-{template}", "q4f32_1", ["cpu", "webgpu"])
    replies = webllm_replies(driver, tmp_path / "profile", model_dir, conversations)
    assert_kiln_replies_the_same(model_dir, conversations, replies)


BASE_MODEL_PROMPTS = ["The history of the city is", "Once upon a time"]


@pytest.mark.slow
def test_webllm_prompts_a_base_model_with_the_bos_its_tokenizer_adds_as_kiln_does(
    driver, tmp_path, builds, tmp_path_factory
):
    """A model without a chat template whose tokenizer adds a BOS (Llama 2's, Gemma's): WebLLM lays a
    raw text out with the `LM` conv_template, which carries the BOS in system_prefix_token_ids; its
    prompt and greedy text are the native engine's, and so are the browser engine's."""
    source = make_tiny_llama(
        tmp_path_factory.mktemp("sources") / "tiny-base", tokens=LLAMA_2_TOKENS, chat_template=None
    )
    model_dir = builds.model_dir(source, "tiny-base", "q4f32_1", ["cpu", "webgpu"])
    engine = Engine(model_dir)
    expected = [engine.generate(prompt, GenerationConfig(max_tokens=MAX_TOKENS)) for prompt in BASE_MODEL_PROMPTS]
    bos = LLAMA_2_TOKENS.id(LLAMA_2_TOKENS.bos_token)
    assert all(result.prompt_tokens[0] == bos for result in expected)
    assert engine.chat_config["conv_template"]["system_prefix_token_ids"] == [bos]

    conversations = [[{"role": "user", "content": prompt}] for prompt in BASE_MODEL_PROMPTS]
    replies = webllm_replies(driver, tmp_path / "profile", model_dir, conversations)
    for reply, result in zip(replies, expected, strict=True):
        assert reply["text"] == result.text
        # WebLLM prefills the system_prefix_token_ids but counts only the encoded text.
        assert reply["usage"]["prompt_tokens"] == len(result.prompt_tokens) - 1

    with browser_model(model_dir, "webgpu", driver=driver) as browser:
        for prompt, result in zip(BASE_MODEL_PROMPTS, expected, strict=True):
            assert browser.engine.call("session.encodeText", prompt) == result.prompt_tokens
            steps = greedy(browser, result.prompt_tokens, len(result.tokens))
            assert [int(np.argmax(logits)) for logits in steps] == result.tokens
