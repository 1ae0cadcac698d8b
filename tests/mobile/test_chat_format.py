"""The mobile runtime's chat prompts (kiln/mobile/runtime/chat_format.cc) are the browser engine's
(web/src/chat-format.js, run in Node): the same pieces, token ids and errors for the conv_templates
Kiln derives from real chat templates (tests/data/chat_templates), the raw-completion one, and
conv_templates with the optional fields chat-format.js reads; for good and bad messages."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from tokenizers import Tokenizer

from helpers.host_cpp import host_program
from helpers.tiny_llama import (
    CHAT_TEMPLATES,
    GEMMA_4_TOKENS,
    GEMMA_TOKENS,
    GRANITE_TOKENS,
    OLMO_2_TOKENS,
    LLAMA_2_TOKENS,
    LLAMA_3_TOKENS,
    MISTRAL_V3_TOKENS,
    PHI_3_TOKENS,
    QWEN_TOKENS,
    SMOLLM2_TOKENS,
    SMOLLM3_TOKENS,
    TEKKEN_TOKENS,
    TEKKEN_V7_TOKENS,
    write_tokenizer,
)
from helpers.web import run_node_module

from kiln.chat_template import ChatTemplate
from kiln.compile.chat_config.conv_template import derive_conv_template, raw_completion_template

REAL_TEMPLATES = {
    "HuggingFaceTB-SmolLM2-135M-Instruct": SMOLLM2_TOKENS,
    "Qwen-Qwen2.5-7B-Instruct": QWEN_TOKENS,
    "meta-llama-Llama-3.1-8B-Instruct": LLAMA_3_TOKENS,
    "microsoft-Phi-3.5-mini-instruct": PHI_3_TOKENS,
    "meta-llama-Llama-2-7b-chat-hf": LLAMA_2_TOKENS,
    "mistralai-Mistral-7B-Instruct-v0.2": LLAMA_2_TOKENS,
    "mistralai-Mistral-Large-Instruct-2407": MISTRAL_V3_TOKENS,
    "mistralai-Mistral-Nemo-Instruct-2407": TEKKEN_TOKENS,
    "mistralai-Mistral-Small-3.2-24B-Instruct-2506": TEKKEN_V7_TOKENS,
    "mistralai-Ministral-3-14B-Reasoning-2512": TEKKEN_V7_TOKENS,
    "google-gemma-3-4b-it": GEMMA_TOKENS,
    "google-gemma-4-31B-it": GEMMA_4_TOKENS,
    "ibm-granite-granite-3.0-8b-instruct": GRANITE_TOKENS,
    "HuggingFaceTB-SmolLM3-3B": SMOLLM3_TOKENS,
    "allenai-OLMo-2-1124-7B-Instruct": OLMO_2_TOKENS,
}
SYSTEM, USER, ASSISTANT = ({"role": role} for role in ("system", "user", "assistant"))
MESSAGES = {
    "one user message": [{**USER, "content": "What is the capital of France?"}],
    "a system message": [{**SYSTEM, "content": "You are a pirate."}, {**USER, "content": "Hello!"}],
    "an empty system message": [{**SYSTEM, "content": ""}, {**USER, "content": "Hello there"}],
    "a long chat": [
        {**SYSTEM, "content": "Be brief."},
        {**USER, "content": "Name a river."},
        {**ASSISTANT, "content": "The Nile."},
        {**USER, "content": "Another? ünïcödé 🎮"},
        {**ASSISTANT, "content": "The Amazon."},
        {**USER, "content": "And a mountain?"},
    ],
    "an assistant message last": [{**USER, "content": "Hi"}, {**ASSISTANT, "content": "Hello! How can I help?"}],
    "text parts": [{**USER, "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world 🎮"}]}],
    "no text parts": [{**USER, "content": []}],
    "empty texts": [{**USER, "content": ""}, {**ASSISTANT, "content": ""}, {**USER, "content": ""}],
    # Taken literally: no $-pattern expands, a placeholder in a message stays as it is.
    "replacement patterns": [
        {**SYSTEM, "content": "$& $' $` $$ $1 {system_message}"},
        {**USER, "content": "{user_message} $& {assistant_message}"},
        {**ASSISTANT, "content": "$'{function_string}"},
        {**USER, "content": '\u0000\n\t"\\'},
    ],
}
BAD_MESSAGES = {
    "not a list": {**USER, "content": "Hi"},
    "null": None,
    "no messages": [],
    "no role": [{"content": "Hi"}],
    "a tool role": [{"role": "tool", "content": "Hi"}],
    "a role that is not a string": [{"role": 5, "content": "Hi"}],
    "a message that is a string": ["Hi"],
    "a null message": [None],
    "a message that is a list": [["user", "Hi"]],
    "a system message second": [{**USER, "content": "Hi"}, {**SYSTEM, "content": "Be brief."}],
    "no content": [USER],
    "null content": [{**USER, "content": None}],
    "a number for content": [{**USER, "content": 5}],
    "an object for content": [{**USER, "content": {"type": "text", "text": "Hi"}}],
    "an image part": [{**USER, "content": [{"type": "text", "text": "Hi"}, {"type": "image_url", "image_url": {}}]}],
    "a part without text": [{**USER, "content": [{"type": "text"}]}],
    "a null part": [{**USER, "content": [None]}],
    "a part whose text is a number": [{**USER, "content": [{"type": "text", "text": 5}]}],
    "the first bad message counts": [{**USER, "content": 5}, {"role": "bogus"}],
    "a bad message after good ones": [{**SYSTEM, "content": "x"}, {**USER, "content": "y"}, {**ASSISTANT}],
}
NODE_PROMPTS_JS = """
    import { encodePrompt, formatChat } from "./src/chat-format.js";
    // The driver's stand-in tokenizer: a piece's byte count, then its UTF-8 bytes.
    const byteIds = (text) => {
      const bytes = new TextEncoder().encode(text);
      return [bytes.length, ...bytes];
    };
    const prompt = (conv, messages) => {
      try {
        const pieces = formatChat(conv, messages);
        return { pieces, ids: encodePrompt(conv, pieces, byteIds) };
      } catch (error) {
        if (error.name !== "EngineError") throw error;
        return { error: { code: error.code, message: error.message } };
      }
    };
    console.log(JSON.stringify(input.map(({ conv, conversations }) => conversations.map((m) => prompt(conv, m)))));
"""
NODE_PARTS_JS = """
    import { piecesFrom } from "./src/chat-format.js";
    console.log(JSON.stringify(input.map(({ pieces, previous }) => ({ parts: piecesFrom(pieces, previous.length) }))));
"""


def real_conv_template(folder, name: str) -> dict:
    """The conv_template Kiln derives from the model's chat template (a tiny tokenizer of its family)."""
    folder.mkdir()
    write_tokenizer(folder, REAL_TEMPLATES[name], chat_template=None, vocab_size=300)
    shutil.copyfile(CHAT_TEMPLATES / f"{name}.jinja", folder / "chat_template.jinja")
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return derive_conv_template(ChatTemplate.find(folder), tokenizer, [2])[0]


@pytest.fixture(scope="module")
def conv_templates(tmp_path_factory) -> dict[str, dict]:
    folder = tmp_path_factory.mktemp("models")
    real = {name: real_conv_template(folder / name, name) for name in REAL_TEMPLATES}
    chatml = real["Qwen-Qwen2.5-7B-Instruct"]
    unset = ("role_content_sep", "role_empty_sep", "system_prefix_token_ids", "render_empty_system_message")
    return {
        **real,
        "raw completion": raw_completion_template([2], [1]),
        "role templates": {
            **chatml,
            "role_templates": {
                "user": "{function_string}<q>{user_message}</q>{user_message}",
                "assistant": "A: {assistant_message}",
            },
        },
        "defaults": {key: value for key, value in chatml.items() if key not in unset},
        "no seps": {**chatml, "seps": []},
    }


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    return host_program("chat_format.cc", ["chat_format.cc"], tmp_path_factory.mktemp("chat_format"))


def run_driver(program, config_path, requests: list[dict]) -> list[dict]:
    lines = "".join(json.dumps(request) + "\n" for request in requests)
    result = subprocess.run(
        [program, config_path], input=lines, capture_output=True, text=True, encoding="utf-8", check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines()]


def mobile_prompts(program, tmp_path, conv: dict, conversations: list) -> list[dict]:
    config_path = tmp_path / "mlc-chat-config.json"
    config_path.write_text(json.dumps({"conv_template": conv}))
    return run_driver(program, config_path, [{"messages": messages} for messages in conversations])


def test_prompts_and_errors_are_the_browser_engines(program, conv_templates, tmp_path):
    conversations = [*MESSAGES.values(), *BAD_MESSAGES.values()]
    names = [*MESSAGES, *BAD_MESSAGES]
    browser = run_node_module(
        NODE_PROMPTS_JS, [{"conv": conv, "conversations": conversations} for conv in conv_templates.values()]
    )

    for (template, conv), theirs in zip(conv_templates.items(), browser):
        ours = mobile_prompts(program, tmp_path, conv, conversations)
        for name, mine, js in zip(names, ours, theirs):
            assert mine == js, (template, name)
        expected_codes = {
            "raw completion": ["no-chat-template"] * len(names),
            "no seps": ["bad-model"] * len(names),
        }.get(template, [None] * len(MESSAGES) + ["bad-request"] * len(BAD_MESSAGES))
        assert [answer.get("error", {}).get("code") for answer in ours] == expected_codes, template


PIECES = [["<s>", "héllo 🎮", "", "wörld\n", "🎮🎮", "x"], ["only one"], ["", "ü"]]


def test_the_pieces_after_a_previous_text_are_the_browser_engines(program, tmp_path):
    """Every text the joined pieces start with, cut between characters: its length in UTF-16 units
    in Node, in bytes here."""
    cuts = [
        {"pieces": pieces, "previous": "".join(pieces)[:end]}
        for pieces in PIECES
        for end in range(len("".join(pieces)) + 1)
    ]
    config_path = tmp_path / "mlc-chat-config.json"
    config_path.write_text(json.dumps({"conv_template": {}}))
    ours = run_driver(program, config_path, cuts)
    assert ours == run_node_module(NODE_PARTS_JS, cuts)
    assert ours[len("<s>hé")] == {"parts": ["llo 🎮", "", "wörld\n", "🎮🎮", "x"]}
