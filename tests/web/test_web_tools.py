"""Tool calls in the browser engine (web/src/tools.js, web/src/chat-template.js) against the native
ones (kiln/tools.py): in Node, tool conversations rendered by @huggingface/jinja as the native
engine renders them, and tools, tool_choice and replies read as natively; in Chromium (wasm), forced
and auto calls that are the native engine's tokens and calls, and clear errors."""

from __future__ import annotations

import json
import re

import pytest

from helpers.tiny_llama import TOOL_FAMILIES
from helpers.tools import PARAMETERS, QUESTION, TIME, TOOLS, WEATHER
from helpers.web import NODE_PRELUDE, browser_page, run_node_module, wait_for_state

from kiln.browser.driver import page_engine
from kiln.engine import Engine, GenerationConfig
from kiln.errors import KilnError
from kiln.tools import TOOL_CALL_FORMATS, ContentBeforeCalls, ToolRequest, read_tool_calls

CALL = {
    "id": "abcdefghi",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Zürich <3", "unit": "celsius"}'},
}
CONVERSATION = [
    {"role": "system", "content": "Be brief & kind."},
    *QUESTION,
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "abcdefghi", "content": "21 °C < 25 & sunny ☀"},
]
NAMED = {"type": "function", "function": {"name": "get_time"}}


@pytest.fixture(scope="module")
def browser_tool_models(tool_build, tool_models):
    """The tool models with their wasm libraries too."""
    tool_build(["cpu", "wasm"])
    return tool_models


@pytest.mark.parametrize("family", TOOL_FAMILIES)
def test_a_tool_conversation_renders_as_natively(tool_models, family):
    dist, _ = tool_models
    model_dir = dist / f"tools-{family}-q4f32_1"
    browser = run_node_module(
        """
        import * as jinja from "./node_modules/@huggingface/jinja/dist/index.js";
        import { ChatTemplate } from "./src/chat-template.js";
        import { templateMessages } from "./src/tools.js";
        const template = ChatTemplate.fromTokenizerConfig(readFileSync(input.tokenizerConfig), jinja);
        console.log(JSON.stringify(template.render(templateMessages(input.messages), input.tools)));
    """,
        {"tokenizerConfig": str(model_dir / "tokenizer_config.json"), "messages": CONVERSATION, "tools": TOOLS},
    )
    assert browser == Engine(model_dir).render_chat(CONVERSATION, tools=TOOLS)
    assert "Zürich <3" in browser and "< 25 & sunny ☀" in browser


DOUBLING = (
    '{% set ns = namespace(text="x") %}{% for i in range(24) %}{% set ns.text = ns.text + ns.text %}'
    "{% endfor %}{{ ns.text }}"
)
NAMED_TEMPLATES = [
    {"name": "tool_use", "template": "no"},
    {"name": "default", "template": "{{ bos_token }}{{ messages | tojson(indent=2) }}"},
]
TEMPLATE_CONFIGS = [
    {"chat_template": NAMED_TEMPLATES, "bos_token": {"content": "<s>"}},
    {"chat_template": "{% for m in messages %}{{ raise_exception('no ' + m.role) }}{% endfor %}"},
    {"chat_template": DOUBLING},
    {},
    {"chat_template": NAMED_TEMPLATES[:1]},
    {"chat_template": 3},
    {"chat_template": "{% if %}"},
]


def test_templates_are_found_and_their_failures_reported():
    """Named templates (the default one), special tokens, transformers' tojson; a template that
    refuses the messages or makes too much text is a bad request, one that cannot be read a bad model."""
    browser = run_node_module(
        """
        import * as jinja from "./node_modules/@huggingface/jinja/dist/index.js";
        import { ChatTemplate } from "./src/chat-template.js";
        console.log(JSON.stringify(input.configs.map((config) => {
          try {
            const bytes = new TextEncoder().encode(JSON.stringify(config));
            const template = ChatTemplate.fromTokenizerConfig(bytes, jinja);
            return template && template.render([{ role: "user", content: "é<&" }]);
          } catch (error) {
            return `${error.code}: ${error.message}`;
          }
        })));
    """,
        {"configs": TEMPLATE_CONFIGS},
    )
    assert browser[0] == "<s>" + json.dumps([{"role": "user", "content": "é<&"}], indent=2, ensure_ascii=False)
    assert browser[1] == "bad-request: The chat template refuses or fails on these messages: no user"
    assert browser[2] == "bad-request: The chat template was stopped: its output passes 8388608 characters"
    assert browser[3] is None
    assert [reply.split(":")[0] for reply in browser[4:]] == ["bad-model"] * 3
    assert "none is called 'default'" in browser[4] and "does not parse" in browser[6]


MALFORMED = [
    ({"a": 1}, None),
    ([{"type": "function"}], None),
    ([{"type": "function", "function": {"name": "a b"}}], None),
    ([WEATHER, WEATHER], None),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], None),
    (TOOLS, "sometimes"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}),
    (TOOLS, {"type": "function"}),
    (None, "required"),
    ([], {"type": "function", "function": {"name": "get_time"}}),
]
CHOICES = ["auto", "required", NAMED, "none"]


def parsed(held):
    """A format's JSON parsed (an EBNF grammar as it is)."""
    return held.text if held.kind == "grammar" else json.loads(held.text)


def test_tools_and_tool_choice_are_read_as_natively():
    """The same errors, and the same formats holding the reply (the browser's JSON is compact: compared parsed)."""
    native_errors = []
    for tools, choice in MALFORMED:
        with pytest.raises(KilnError) as error:
            ToolRequest.from_openai(tools, choice)
        native_errors.append(f"bad-request: {error.value.problem}")
    native_formats = []
    for call_format in TOOL_CALL_FORMATS:
        for choice in CHOICES:
            request = ToolRequest.from_openai(TOOLS, choice)
            held = request.response_format(call_format)
            native_formats.append(
                {
                    "format": held and {"kind": held.kind, "text": parsed(held)},
                    "opening": request.reply_opening(call_format),
                }
            )
    browser = run_node_module(
        """
        import { TOOL_CALL_FORMATS, toolRequestFrom } from "./src/tools.js";
        const errors = input.malformed.map(([tools, choice]) => {
          try {
            toolRequestFrom(tools, choice);
            return "accepted";
          } catch (error) {
            return `${error.code}: ${error.message}`;
          }
        });
        const formats = TOOL_CALL_FORMATS.flatMap((callFormat) => input.choices.map((choice) => {
          const request = toolRequestFrom(input.tools, choice);
          const held = request.responseFormat(callFormat);
          const opening = request.replyOpening(callFormat);
          const text = held && (held.kind === "grammar" ? held.text : JSON.parse(held.text));
          return { format: held && { kind: held.kind, text }, opening };
        }));
        console.log(JSON.stringify({ errors, formats }));
    """,
        {"malformed": MALFORMED, "choices": CHOICES, "tools": TOOLS},
    )
    assert browser == {"errors": native_errors, "formats": native_formats}


REPLIES = [
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
    '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": 1}}\n</tool_call>',
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": -3}}',
    "Use <tool_call> tags.",
    "A < B and <tool",
    '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "get_time"\n</tool_call>',
    '{"name": "get_time", "parameters": {"zone": -3}}',
    'Plain {"name" text  ',
    'Checking.<|tool_call>call:get_weather{city:<|"|>Paris, "TX" {x:1}<|"|>,unit:<|"|>celsius<|"|>}<tool_call|>'
    "<|tool_call>call:get_time{zone:-3}<tool_call|>",
    '<|tool_call>call:get_time{zone: 2.5e3, extra: [1, {a: null}, true], <|"|>quoted<|"|>: <|"|><|"|>}',
    "Gemma writes <|tool_call> marks.",
    "<|tool_call>call:launch{}<tool_call|>",
    "<|tool_call>call:get_time{zone:}<tool_call|>",
    '<|tool_call>call:get_weather{city:<|"|>Paris}<tool_call|>',
    "<|tool_call>call:get_time{zone:1} and more<tool_call|>",
]


def test_calls_are_read_out_of_replies_as_natively():
    functions = ToolRequest.from_openai(TOOLS, "auto").functions
    native = []
    for call_format in TOOL_CALL_FORMATS:
        for reply in REPLIES:
            reader = ContentBeforeCalls(call_format, functions)
            streamed = "".join(reader.feed(reply[i : i + 3]) for i in range(0, len(reply), 3))
            rest, calls = reader.finish()
            native.append([streamed, rest, [[c.name, json.loads(c.arguments)] for c in calls]])
    browser = run_node_module(
        """
        import { ContentBeforeCalls, TOOL_CALL_FORMATS, toolRequestFrom } from "./src/tools.js";
        const { functions } = toolRequestFrom(input.tools, "auto");
        console.log(JSON.stringify(TOOL_CALL_FORMATS.flatMap((callFormat) => input.replies.map((reply) => {
          const reader = new ContentBeforeCalls(callFormat, functions);
          let streamed = "";
          for (let i = 0; i < reply.length; i += 3) streamed += reader.feed(reply.slice(i, i + 3));
          const { content, toolCalls } = reader.finish();
          const calls = toolCalls.map((call) => [call.function.name, JSON.parse(call.function.arguments)]);
          return [streamed, content, calls];
        }))));
    """,
        {"tools": TOOLS, "replies": REPLIES},
    )
    assert browser == native
    assert sum(len(calls) for _, _, calls in native) >= 4


# Parameters without bounds (maxLength, minimum, …), which the two XGrammar builds write as different rules.
UNBOUNDED_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "integer"}, "dst": {"type": "boolean"}},
                "required": ["zone"],
            },
        },
    },
]


def test_the_formats_holding_calls_compile_to_the_native_grammars(tool_models):
    """The structural tag (auto) and the call schema (required) reach XGrammar as natively: the
    grammars print the same."""
    dist, _ = tool_models
    native = Engine(dist / "tools-qwen-q4f32_1")
    formats = [
        ToolRequest.from_openai(UNBOUNDED_TOOLS, choice).response_format(call_format)
        for call_format in TOOL_CALL_FORMATS
        for choice in ("auto", "required")
    ]
    browser = run_node_module(
        NODE_PRELUDE
        + """
        import { Grammars } from "./src/structured.js";
        import { TOOL_CALL_FORMATS, toolRequestFrom } from "./src/tools.js";
        const { bytes, tokenizer } = await loadTokenizer(input.tokenizer);
        const grammars = new Grammars({ loadXgrammar, tokenizer, tokenizerJSON: bytes, chatConfig: input.chatConfig,
                                        stopTokenIds: new Set(input.stopTokenIds) });
        const printed = [];
        for (const callFormat of TOOL_CALL_FORMATS) {
          for (const choice of ["auto", "required"]) {
            const format = toolRequestFrom(input.tools, choice).responseFormat(callFormat);
            printed.push((await grammars.compile(format)).grammar().toString());
          }
        }
        console.log(JSON.stringify(printed));
    """,
        {
            "tokenizer": str(native.model_dir / "tokenizer.json"),
            "chatConfig": native.chat_config,
            "stopTokenIds": sorted(native.eos_token_ids),
            "tools": UNBOUNDED_TOOLS,
        },
    )
    assert browser == [str(native.grammars.compile(f).grammar) for f in formats]


TOOL_REPLIES_JS = """async (requests) => {
  const engine = globalThis.kilnDriven;
  const replies = [];
  for (const request of requests) {
    await engine.resetChat();
    try {
      const completion = await engine.chat.completions.create(request);
      const cached = await engine.session.cachedTokenIds();
      replies.push({ choice: completion.choices[0], prompt_ids: cached.slice(0, completion.usage.prompt_tokens),
                     token_ids: (await engine.stats()).last_request.token_ids });
    } catch (error) {
      replies.push({ error: `${error.code}: ${error.message}` });
    }
  }
  return replies;
}"""
MAX_TOKENS = 128


def native_reply(engine: Engine, messages: list[dict], choice) -> dict:
    """The native engine's greedy reply as the browser's: prompt and reply ids, and its calls' (name, arguments)."""
    call_format = engine.tool_call_format
    tools = ToolRequest.from_openai(TOOLS, choice)
    config = GenerationConfig(max_tokens=MAX_TOKENS, temperature=0, response_format=tools.response_format(call_format))
    engine.reset()
    if tools.choice == "none":
        result = engine.generate_chat(messages, config)
        return {"prompt_ids": result.prompt_tokens, "token_ids": result.tokens, "calls": []}
    opening = tools.reply_opening(call_format)
    result = engine.generate_chat(messages, config, TOOLS, opening)
    _, calls = read_tool_calls(call_format, tools.functions, opening + result.text)
    return {
        "prompt_ids": result.prompt_tokens,
        "token_ids": result.tokens,
        "calls": [[c.name, json.loads(c.arguments)] for c in calls],
    }


def browser_calls(choice: dict) -> list:
    calls = choice["message"].get("tool_calls", [])
    return [[call["function"]["name"], json.loads(call["function"]["arguments"])] for call in calls]


@pytest.mark.browser
def test_the_browser_calls_tools_as_the_native_engine(browser_tool_models, driver):
    """Required, named and auto calls are the native tokens and calls (streamed as one delta); a tool
    result goes back with tool_choice none; a bad tool_choice and a model without tools are clear errors."""
    dist, _ = browser_tool_models
    after_call = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "abcdefghi", "content": "21 & sunny"},
    ]
    cases = [(QUESTION, "required"), (QUESTION, NAMED), (QUESTION, "auto"), (after_call, "none")]
    requests = [
        {"messages": messages, "tools": TOOLS, "tool_choice": choice, "max_tokens": MAX_TOKENS, "temperature": 0}
        for messages, choice in cases
    ]
    bad = {**requests[0], "tool_choice": "sometimes"}
    with page_engine(dist, webgpu=False, driver=driver) as page:
        replies, streams = {}, {}
        for family in TOOL_FAMILIES:
            page.load(f"tools-{family}-q4f32_1", "wasm")
            replies[family] = page.page.evaluate(TOOL_REPLIES_JS, [*requests, bad])
            page.call("resetChat")
            streams[family] = page.chat({**requests[1], "stream": True})["chunks"]
        page.load("tiny-llama-q4f32_1", "wasm")
        (without_tools,) = page.page.evaluate(TOOL_REPLIES_JS, [requests[0]])
    for family in TOOL_FAMILIES:
        native = Engine(dist / f"tools-{family}-q4f32_1")
        *answered, rejected = replies[family]
        for (messages, choice), reply in zip(cases, answered):
            assert "error" not in reply, (family, choice, reply)
            expected = native_reply(native, messages, choice)
            assert reply["prompt_ids"] == expected["prompt_ids"], (family, choice)
            assert reply["token_ids"] == expected["token_ids"], (family, choice)
            assert browser_calls(reply["choice"]) == expected["calls"], (family, choice)
            if choice in ("required", NAMED):
                assert reply["choice"]["finish_reason"] == "tool_calls" and len(expected["calls"]) == 1
                assert all(
                    re.fullmatch("[A-Za-z0-9]{9}", call["id"]) and call["type"] == "function"
                    for call in reply["choice"]["message"]["tool_calls"]
                )
        assert browser_calls(answered[1]["choice"])[0][0] == TIME["function"]["name"]
        deltas = [chunk["choices"][0] for chunk in streams[family] if chunk["choices"]]
        (streamed_calls,) = [choice["delta"]["tool_calls"] for choice in deltas if choice["delta"].get("tool_calls")]
        assert [call["index"] for call in streamed_calls] == [0]
        assert browser_calls({"message": {"tool_calls": streamed_calls}}) == browser_calls(answered[1]["choice"])
        assert [choice["finish_reason"] for choice in deltas if choice["finish_reason"]] == ["tool_calls"]
        assert not any(choice["delta"].get("content") for choice in deltas)
        assert rejected["error"] == (
            "bad-request: tool_choice must be 'none', 'auto', 'required' or "
            "{'type': 'function', 'function': {'name': ...}}"
        )
    assert without_tools["error"].startswith("no-tool-support: tiny-llama-q4f32_1 cannot call tools")


@pytest.mark.browser
def test_the_harness_shows_a_reply_s_tool_calls(browser_tool_models, driver, tmp_path):
    _, base = browser_tool_models
    with browser_page(driver, tmp_path / "profile", f"{base}?model=tools-qwen-q4f32_1", webgpu=False) as (_, page):
        page.click("#load-button")
        wait_for_state(page, "ready")
        page.click(".settings summary")
        page.fill("#tools", json.dumps(TOOLS))
        page.select_option("#tool-choice", "required")
        page.fill("#max-tokens", "128")
        page.fill("#prompt", QUESTION[0]["content"])
        page.keyboard.press("Enter")
        wait_for_state(page, "ready")
        call = page.locator("#transcript .turn.assistant .tool-call")
        assert call.count() == 1
        name = call.locator("code").inner_text()
        assert name in ("get_weather", "get_time")
        assert json.loads(call.locator("pre").inner_text()).keys() <= PARAMETERS[name]["properties"].keys()
        assert "\n  " in call.locator("pre").inner_text()  # pretty-printed
