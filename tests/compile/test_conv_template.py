"""Chat formatting in its three places: for each family's real chat template (tests/data/chat_templates),
the browser engine's prompt (web/src/chat-format.js on the conv_template Kiln derives, encoded piece
by piece as WebLLM encodes it) has the token ids of the native engine's (the jinja template, encoded
whole), except for the conversations the family's conv_template cannot express, which the build
names. Then the templates Kiln refuses."""

from __future__ import annotations

import datetime
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from tokenizers import Tokenizer, processors

from helpers.tiny_llama import (
    CHAT_TEMPLATES,
    CHATML_TOKENS,
    GEMMA_4_TOKENS,
    GEMMA_TOKENS,
    GRANITE_TOKENS,
    LLAMA_2_TOKENS,
    LLAMA_3_TOKENS,
    MISTRAL_V3_TOKENS,
    OLMO_2_TOKENS,
    PHI_3_TOKENS,
    QWEN_TOKENS,
    RAW_TEXTS,
    SMOLLM2_TOKENS,
    SMOLLM3_TOKENS,
    TEKKEN_TOKENS,
    TEKKEN_V7_TOKENS,
    ChatTokens,
    write_tokenizer,
)
from helpers.web import run_node_module

import kiln.chat_template
from kiln.chat_template import ChatTemplate
from kiln.compile.chat_config.conv_template import (
    RAW_COMPLETION,
    conv_template_pieces,
    derive_conv_template,
    rendered_or_none,
)
from kiln.errors import KilnError

CONVERSATIONS = {
    "one user message": [{"role": "user", "content": "What is the capital of France?"}],
    "a system message": [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Hello!"}],
    "several turns": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke about GPUs 🎮 — ünïcödé, 12345."},
    ],
    "a system message and several turns": [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Bonjour ! Comment puis-je aider ?"},
        {"role": "user", "content": "Count to 3."},
    ],
    "an empty system message": [{"role": "system", "content": ""}, {"role": "user", "content": "Hello there"}],
    "a long multi-turn chat": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a river."},
        {"role": "assistant", "content": "The Nile."},
        {"role": "user", "content": "Another?"},
        {"role": "assistant", "content": "The Amazon."},
        {"role": "user", "content": "And a mountain?"},
    ],
}

MULTI_TURN_SYSTEM = {"a system message and several turns", "a long multi-turn chat"}
# Llama 2 and Mistral join the system message and the first user message in one text, which WebLLM
# encodes as two pieces: with a SentencePiece tokenizer "\n\nHello" becomes "\n\n" and "▁Hello".
SYSTEM_IN_A_USER_TURN = {"a system message", "an empty system message"} | MULTI_TURN_SYSTEM


@dataclass(frozen=True)
class Case:
    template: str  # a file in tests/data/chat_templates
    tokens: ChatTokens
    family: str
    unexpressed: frozenset[str] = frozenset()  # conversations the conv_template cannot lay out as the template


def case(template: str) -> Case:
    return next(c for c in CASES if c.template == template)


CASES = [
    Case("HuggingFaceTB-SmolLM2-135M-Instruct", SMOLLM2_TOKENS, "chatml"),
    Case("Qwen-Qwen2.5-7B-Instruct", QWEN_TOKENS, "chatml"),
    # Qwen3 shows a system block for an empty system message and none without one: a conv_template
    # cannot tell the two apart.
    Case("Qwen-Qwen3-0.6B", QWEN_TOKENS, "chatml", frozenset({"an empty system message"})),
    Case("meta-llama-Llama-3.1-8B-Instruct", LLAMA_3_TOKENS, "llama-3"),
    Case("meta-llama-Llama-3.2-3B-Instruct", LLAMA_3_TOKENS, "llama-3"),
    Case("microsoft-Phi-3.5-mini-instruct", PHI_3_TOKENS, "phi-3"),
    Case("meta-llama-Llama-2-7b-chat-hf", LLAMA_2_TOKENS, "llama-2", frozenset(SYSTEM_IN_A_USER_TURN)),
    Case("mistralai-Mistral-7B-Instruct-v0.2", LLAMA_2_TOKENS, "mistral-v1", frozenset(SYSTEM_IN_A_USER_TURN)),
    # Mistral's v3 templates fold the system message into the last user turn, a conv_template into the first.
    Case("mistralai-Mistral-Large-Instruct-2407", MISTRAL_V3_TOKENS, "mistral-v3", frozenset(SYSTEM_IN_A_USER_TURN)),
    Case(
        "mistralai-Mistral-Nemo-Instruct-2407",
        TEKKEN_TOKENS,
        "mistral-v3-tekken",
        frozenset({"an empty system message"} | MULTI_TURN_SYSTEM),
    ),
    # Mistral Small 3.2 and Ministral 3 show their default system message for none, and a block for an empty one.
    Case("mistralai-Mistral-Small-3.2-24B-Instruct-2506", TEKKEN_V7_TOKENS, "mistral-v7-tekken"),
    Case("mistralai-Ministral-3-14B-Reasoning-2512", TEKKEN_V7_TOKENS, "mistral-v7-tekken"),
    # Gemma 3 shows no system block for an empty system message but the blank line after it.
    Case("google-gemma-3-4b-it", GEMMA_TOKENS, "gemma", frozenset({"an empty system message"})),
    Case("google-gemma-2-2b-it", GEMMA_TOKENS, "gemma"),
    # Gemma 4, like Qwen3, shows a system block for an empty system message and none without one.
    Case("google-gemma-4-31B-it", GEMMA_4_TOKENS, "gemma-4", frozenset({"an empty system message"})),
    # Granite 3.0, like Qwen3, shows a system block for an empty system message and none without one.
    Case("ibm-granite-granite-3.0-8b-instruct", GRANITE_TOKENS, "granite", frozenset({"an empty system message"})),
    # SmolLM3 shows its default instructions for an empty system message as for none; a conv_template, an empty block.
    Case("HuggingFaceTB-SmolLM3-3B", SMOLLM3_TOKENS, "smollm3", frozenset({"an empty system message"})),
    # OLMo 2 too (an empty system block, "<|system|>\n\n").
    Case("allenai-OLMo-2-1124-7B-Instruct", OLMO_2_TOKENS, "olmo-2", frozenset({"an empty system message"})),
]


@pytest.fixture(autouse=True)
def fixed_date(monkeypatch):
    """Llama 3.2's template prints today's date: keep one date across a test, midnight or not."""

    class FixedDatetime(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(2025, 3, 14, 12, 0)

    monkeypatch.setattr(kiln.chat_template, "datetime", FixedDatetime)


def model_folder(folder: Path, case: Case) -> Path:
    """A tokenizer folder as current transformers saves it: the template in chat_template.jinja."""
    folder.mkdir(parents=True)
    write_tokenizer(folder, case.tokens, chat_template=None, vocab_size=400)
    shutil.copyfile(CHAT_TEMPLATES / f"{case.template}.jinja", folder / "chat_template.jinja")
    return folder


def browser_prompts(jobs: list[dict]) -> list[list[dict]]:
    """For each {tokenizer, conv, conversations}: the browser engine's prompts ({pieces, ids}), in Node."""
    return run_node_module(
        """
        import { createRequire } from "node:module";
        import { encodePrompt, formatChat } from "./src/chat-format.js";
        // The tokenizers' UMD bundle expects CommonJS globals when it runs under Node.
        globalThis.require = createRequire(import.meta.url);
        globalThis.__filename = "node_modules/@mlc-ai/web-tokenizers/lib/index.js";
        await import("./node_modules/@mlc-ai/web-tokenizers/lib/index.js");
        const results = [];
        for (const job of input) {
          const json = new Uint8Array(readFileSync(job.tokenizer)).buffer;
          const tokenizer = await globalThis.tokenizers.Tokenizer.fromJSON(json);
          const encode = (text) => Array.from(tokenizer.encode(text));
          results.push(job.conversations.map((messages) => {
            const pieces = formatChat(job.conv, messages);
            return { pieces, ids: encodePrompt(job.conv, pieces, encode) };
          }));
        }
        console.log(JSON.stringify(results));
    """,
        jobs,
    )


def normalized(tokenizer: Tokenizer, texts: list[str]) -> str:
    """The texts as the tokenizer's model gets them, each encoded on its own: the tokenizer's normalizer
    runs on each stretch between special tokens (SentencePiece's prepends "▁")."""
    specials = sorted(
        (t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special), key=len, reverse=True
    )
    pattern = re.compile("(" + "|".join(map(re.escape, specials)) + ")")
    normalize = tokenizer.normalizer.normalize_str if tokenizer.normalizer else (lambda text: text)
    return "".join(
        part if part in specials else normalize(part) if part else "" for text in texts for part in pattern.split(text)
    )


def test_browser_prompts_have_the_token_ids_of_the_jinja_templates(tmp_path):
    derived, jobs = [], []
    for case in CASES:
        folder = model_folder(tmp_path / case.template, case)
        template = ChatTemplate.find(folder)
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        conv, unexpressed = derive_conv_template(template, tokenizer, [case.tokens.id(case.tokens.eos_token)])
        derived.append((case, template, tokenizer, conv, unexpressed))
        jobs.append(
            {"tokenizer": str(folder / "tokenizer.json"), "conv": conv, "conversations": list(CONVERSATIONS.values())}
        )
    browser = browser_prompts(jobs)

    for (case, template, tokenizer, conv, unexpressed), prompts in zip(derived, browser):
        assert conv["name"] == case.family, case.template
        # The build names the shapes it probes (all of these but the long chat).
        assert set(unexpressed) == case.unexpressed - {"a long multi-turn chat"}, case.template
        differing = set()
        prefix = "".join(tokenizer.id_to_token(i) for i in conv["system_prefix_token_ids"])
        for (name, messages), prompt in zip(CONVERSATIONS.items(), prompts):
            # The native engine's prompt: the jinja template rendered, then encoded as it is; none
            # when the template refuses the conversation (Gemma 2's system messages).
            text = rendered_or_none(template, messages)
            if text is None:
                continue
            native_ids = tokenizer.encode(text, add_special_tokens=False).ids
            if prompt["ids"] != native_ids:
                differing.add(name)
            # The texts too, as the tokenizer's model gets them (the tiny vocabularies map some
            # characters to <unk>), and the build's own renderer of conv_templates gives the browser's pieces.
            same_text = normalized(tokenizer, [prefix, *prompt["pieces"]]) == normalized(tokenizer, [text])
            assert same_text == (prompt["ids"] == native_ids), (case.template, name)
            assert prompt["pieces"] == conv_template_pieces(conv, messages), (case.template, name)
        assert differing == case.unexpressed, case.template


def derived_from_file(tmp_path: Path, template: str) -> dict:
    folder = model_folder(tmp_path / "model", case(template))
    return derive_conv_template(ChatTemplate.find(folder), Tokenizer.from_file(str(folder / "tokenizer.json")), [2])[0]


@pytest.mark.parametrize(
    "template, system_prefix_token_ids, system_message",
    [
        ("meta-llama-Llama-3.1-8B-Instruct", [0], ""),
        ("mistralai-Mistral-7B-Instruct-v0.2", [1], ""),
        # Its bos_token is <|im_start|>, which the template prints first, but as the system turn's opener.
        (
            "HuggingFaceTB-SmolLM2-135M-Instruct",
            [],
            "You are a helpful AI assistant named SmolLM, trained by Hugging Face",
        ),
        ("Qwen-Qwen2.5-7B-Instruct", [], "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."),
    ],
)
def test_a_bos_token_printed_first_becomes_system_prefix_token_ids(
    tmp_path, template, system_prefix_token_ids, system_message
):
    conv = derived_from_file(tmp_path, template)
    assert conv["system_prefix_token_ids"] == system_prefix_token_ids
    assert conv["system_message"] == system_message


def test_llama_3_1_system_block_carries_the_template_s_date_lines(tmp_path):
    conv = derived_from_file(tmp_path, "meta-llama-Llama-3.1-8B-Instruct")
    assert conv["system_template"] == (
        "<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: "
        "December 2023\nToday Date: 26 Jul 2024\n\n{system_message}<|eot_id|>"
    )
    assert conv["render_empty_system_message"] is True


def derive(tmp_path: Path, source: str, tokens: ChatTokens = QWEN_TOKENS) -> dict:
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    write_tokenizer(folder, tokens, chat_template=source, vocab_size=300)
    return derive_conv_template(ChatTemplate.find(folder), Tokenizer.from_file(str(folder / "tokenizer.json")), [2])[0]


def test_phi_3_is_not_taken_for_zephyr_nor_zephyr_for_phi_3(tmp_path):
    # In the shape of zephyr-7b-beta's: Phi-3's role tags, each turn closed by the EOS token.
    zephyr = (
        "{% for message in messages %}\n{% if message['role'] == 'user' %}\n"
        "{{ '<|user|>\\n' + message['content'] + eos_token }}\n{% elif message['role'] == 'system' %}\n"
        "{{ '<|system|>\\n' + message['content'] + eos_token }}\n{% elif message['role'] == 'assistant' %}\n"
        "{{ '<|assistant|>\\n'  + message['content'] + eos_token }}\n{% endif %}\n"
        "{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n{% endfor %}"
    )
    assert derive(tmp_path, zephyr, LLAMA_2_TOKENS)["name"] == "zephyr"
    phi_3 = (CHAT_TEMPLATES / "microsoft-Phi-3.5-mini-instruct.jinja").read_text()
    assert derive(tmp_path, phi_3, PHI_3_TOKENS)["name"] == "phi-3"


def test_a_template_that_drops_system_messages_gets_no_system_block(tmp_path):
    # Phi-3-mini's first template: system messages vanish.
    source = (
        "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') %}{{'<|user|>' + '\\n' + "
        "message['content'] + '<|end|>' + '\\n' + '<|assistant|>' + '\\n'}}{% elif (message['role'] == "
        "'assistant') %}{{message['content'] + '<|end|>' + '\\n'}}{% endif %}{% endfor %}"
    )
    conv = derive(tmp_path, source, PHI_3_TOKENS)
    assert conv["name"] == "phi-3" and conv["system_template"] == "" and conv["system_prefix_token_ids"] == [1]


@pytest.mark.parametrize(
    "tokens, prefix",
    [(CHATML_TOKENS, []), (LLAMA_2_TOKENS, ["<s>"]), (GEMMA_TOKENS, ["<bos>"])],
    ids=["no-special-tokens", "llama-2-bos", "gemma-bos"],
)
def test_a_model_without_a_chat_template_is_for_raw_completion_with_the_tokenizers_bos(tmp_path, tokens, prefix):
    """WebLLM prefills a base model's BOS only from system_prefix_token_ids: the raw text's ids in
    WebLLM's pieces are the native engine's, the tokenizer's special tokens included."""
    write_tokenizer(tmp_path, tokens, None)
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    conv, unexpressed = derive_conv_template(None, tokenizer, [2])
    assert conv["name"] == RAW_COMPLETION and conv["stop_token_ids"] == [2] and unexpressed == []
    assert conv["system_prefix_token_ids"] == [tokenizer.token_to_id(token) for token in prefix]
    for text in RAW_TEXTS:
        pieces = conv_template_pieces(conv, [{"role": "user", "content": text}])
        assert "".join(pieces) == text
        ids = conv["system_prefix_token_ids"] + [
            i for piece in pieces for i in tokenizer.encode(piece, add_special_tokens=False).ids
        ]
        assert ids == tokenizer.encode(text, add_special_tokens=True).ids, text


def test_a_base_models_eos_after_the_text_is_named_as_what_webllm_cannot_give(tmp_path):
    write_tokenizer(tmp_path, LLAMA_2_TOKENS, None)
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)]
    )
    conv, unexpressed = derive_conv_template(None, tokenizer, [2])
    assert conv["system_prefix_token_ids"] == [1]
    assert len(unexpressed) == 1 and "the ids the tokenizer appends" in unexpressed[0]


@pytest.mark.parametrize(
    "source, problem",
    [
        ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}", "no family"),
        # phi-4: ChatML's tags, its own separator.
        (
            "{% for m in messages %}"
            "{{ '<|im_start|>' + m['role'] + '<|im_sep|>' + m['content'] + '<|im_end|>' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant<|im_sep|>' }}{% endif %}",
            "<|im_sep|>",
        ),
    ],
)
def test_templates_no_family_reproduces_are_refused(tmp_path, source, problem):
    with pytest.raises(KilnError, match="family") as error:
        derive(tmp_path, source)
    assert problem in str(error.value)


@pytest.mark.parametrize(
    "template, warning", [("Qwen-Qwen2.5-7B-Instruct", None), ("Qwen-Qwen3-0.6B", "an empty system message")]
)
def test_the_configure_stage_writes_the_template_where_both_engines_find_it(tmp_path, capsys, template, warning):
    from kiln.compile.chat_config.configure import write_chat_config
    from kiln.models import architecture_for

    source = model_folder(tmp_path / "source", case(template))
    out = tmp_path / "out"
    out.mkdir()
    config = {
        "model_type": "llama",
        "vocab_size": 400,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "eos_token_id": 2,
    }
    parsed = architecture_for(config, source / "config.json").parse_config(config, source / "config.json", {})
    chat_config = write_chat_config(out, source, "llama", "q4f32_1", parsed)
    written = json.loads((out / "tokenizer_config.json").read_text())
    assert written["chat_template"] == (CHAT_TEMPLATES / f"{template}.jinja").read_text()
    assert ChatTemplate.find(out).path == out / "tokenizer_config.json"
    assert chat_config["conv_template"]["name"] == "chatml"
    assert "tokenizer_config.json" in chat_config["tokenizer_files"]
    stderr = capsys.readouterr().err
    assert (
        (f"kiln: warning: {source / 'chat_template.jinja'}: " in stderr and warning in stderr)
        if warning
        else stderr == ""
    )


def test_kiln_compile_refuses_a_template_of_no_known_family_in_one_line(tmp_path, tiny_source, run_compile):
    source = Path(shutil.copytree(tiny_source, tmp_path / "source"))
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    (source / "tokenizer_config.json").write_text(json.dumps(config))
    result = run_compile(source, tmp_path / "out")
    last_line = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 1 and last_line.startswith(f"kiln: error: {source / 'tokenizer_config.json'}: ")
    assert "no family" in last_line and "chatml, llama-3" in last_line
    assert not (tmp_path / "out" / "broken").exists()
