"""Tool calls through `kiln serve` and the `openai` client, on tiny models with Qwen2.5's and Llama
3.1's real chat templates: forced calls fit their function's parameters, calls come back as OpenAI
`tool_calls` (streamed too), tool results go back through the template, and models whose template
has no tools get a clear 400."""

from __future__ import annotations

import json

import jsonschema
import pytest
import requests

from helpers.tiny_llama import TOOL_FAMILIES
from helpers.tools import PARAMETERS, QUESTION, TOOLS, WEATHER

from kiln.engine import Engine
from kiln.tools import TOOL_CALL_FORMATS, ContentBeforeCalls, ToolRequest, ToolRequestError

HERMES, LLAMA3_JSON, GEMMA4 = TOOL_CALL_FORMATS


def client(base):
    from openai import OpenAI

    return OpenAI(base_url=f"{base}v1", api_key="not-needed")


def check_call(call, names=tuple(PARAMETERS)) -> None:
    assert call.type == "function" and call.function.name in names and len(call.id) == 9
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


@pytest.mark.parametrize("family", TOOL_FAMILIES)
def test_a_required_or_named_call_fits_its_parameters(tool_models, family):
    _, base = tool_models
    model = f"tools-{family}-q4f32_1"
    reply = client(base).chat.completions.create(
        model=model, messages=QUESTION, tools=TOOLS, tool_choice="required", max_tokens=128, temperature=0
    )
    (choice,) = reply.choices
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    check_call(choice.message.tool_calls[0])
    for name in PARAMETERS:
        named = client(base).chat.completions.create(
            model=model,
            messages=QUESTION,
            tools=TOOLS,
            max_tokens=128,
            temperature=0.8,
            seed=3,
            tool_choice={"type": "function", "function": {"name": name}},
        )
        check_call(named.choices[0].message.tool_calls[0], names=(name,))


def test_a_forced_call_streams_as_a_tool_call_delta(tool_models):
    _, base = tool_models
    chunks = list(
        client(base).chat.completions.create(
            model="tools-qwen-q4f32_1",
            messages=QUESTION,
            tools=TOOLS,
            max_tokens=128,
            temperature=0,
            stream=True,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )
    )
    calls = [call for c in chunks if c.choices for call in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0
    check_call(calls[0], names=("get_weather",))
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)


@pytest.mark.parametrize("family", TOOL_FAMILIES)
def test_a_tool_result_goes_back_through_the_template(tool_models, family):
    dist, base = tool_models
    model = f"tools-{family}-q4f32_1"
    first = client(base).chat.completions.create(
        model=model, messages=QUESTION, tools=TOOLS, tool_choice="required", max_tokens=128, temperature=0
    )
    call = first.choices[0].message.tool_calls[0]
    conversation = [
        *QUESTION,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    answer = client(base).chat.completions.create(
        model=model, messages=conversation, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0
    )
    assert answer.choices[0].finish_reason in ("stop", "length") and not answer.choices[0].message.tool_calls
    rendered = Engine(dist / model).render_chat(conversation, tools=TOOLS)
    assert "temperature" in rendered and call.function.name in rendered
    assert all(str(value) in rendered for value in json.loads(call.function.arguments).values())


def test_a_model_whose_template_has_no_tools_is_a_400(tool_models):
    _, base = tool_models
    body = {"model": "tiny-llama-q4f32_1", "messages": QUESTION, "tools": TOOLS}
    response = requests.post(f"{base}v1/chat/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "model_cannot_call_tools"
    assert requests.post(f"{base}v1/chat/completions", json={**body, "tool_choice": "none", "max_tokens": 2}).ok


@pytest.mark.parametrize(
    "body, param, problem",
    [
        ({"tools": {"a": 1}}, "tools", "must be a list"),
        ({"tools": [{"type": "function"}]}, "tools", "tools[0] must be"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "name must be"),
        ({"tools": [WEATHER, WEATHER]}, "tools", "a second function"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "must be 'none', 'auto'"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not among",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format", "cannot be combined"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
                "tool_choice": "required",
            },
            "tools",
            "Unsupported type",
        ),
        ({"messages": [{"role": "tool", "content": "x"}]}, "tool_call_id", "Missing required"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": "{"}}],
                    }
                ]
            },
            "messages[0].tool_calls",
            "not JSON text",
        ),
    ],
)
def test_malformed_tool_requests_are_400s(tool_models, body, param, problem):
    _, base = tool_models
    request = {"model": "tools-qwen-q4f32_1", "messages": QUESTION, "max_tokens": 2, **body}
    response = requests.post(f"{base}v1/chat/completions", json=request)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and problem in error["message"]


# Reading calls out of a reply (the "auto" choice)


def test_calls_are_read_out_of_free_text():
    functions = ToolRequest.from_openai(TOOLS, "auto").functions
    reply = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
        '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": 1}}\n</tool_call>'
    )
    reader = ContentBeforeCalls(HERMES, functions)
    streamed = "".join(reader.feed(reply[i : i + 3]) for i in range(0, len(reply), 3))
    assert streamed == "Let me check.\n"
    rest, calls = reader.finish()
    assert rest == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}),
        ("get_time", {"zone": 1}),
    ]
    llama = ContentBeforeCalls(LLAMA3_JSON, functions)
    assert llama.feed('{"name": "get_time", "parameters": {"zone": -3}}') == ""
    assert [c.name for c in llama.finish()[1]] == ["get_time"]
    gemma = ContentBeforeCalls(GEMMA4, functions)
    gemma_reply = 'Checking.<|tool_call>call:get_weather{city:<|"|>Paris, "TX"<|"|>,unit:<|"|>celsius<|"|>}<tool_call|>'
    assert "".join(gemma.feed(gemma_reply[i : i + 4]) for i in range(0, len(gemma_reply), 4)) == "Checking."
    rest, calls = gemma.finish()
    assert rest == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": 'Paris, "TX"', "unit": "celsius"})
    ]


LOOK_ALIKES = [
    (HERMES, "Use <tool_call> tags."),
    (HERMES, '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>'),
    (HERMES, "A < B and <tool"),
    (HERMES, '<tool_call>\n{"name": "get_time"\n</tool_call>'),
    (GEMMA4, "Gemma writes <|tool_call> marks."),
    (GEMMA4, "<|tool_call>call:launch{}<tool_call|>"),
    (GEMMA4, "<|tool_call>call:get_time{zone:}<tool_call|>"),
    (GEMMA4, '<|tool_call>call:get_weather{city:<|"|>Paris}<tool_call|>'),
]


@pytest.mark.parametrize("call_format, reply", LOOK_ALIKES)
def test_text_that_only_looks_like_a_call_stays_text(call_format, reply):
    reader = ContentBeforeCalls(call_format, ToolRequest.from_openai(TOOLS, "auto").functions)
    streamed = reader.feed(reply)
    rest, calls = reader.finish()
    assert calls == [] and streamed + rest == reply


def test_tool_choice_shapes():
    assert ToolRequest.from_openai(None, None) is None and ToolRequest.from_openai([], "auto") is None
    assert ToolRequest.from_openai(TOOLS, None).choice == "auto"
    assert ToolRequest.from_openai(TOOLS, {"type": "function", "function": {"name": "get_time"}}).choice == "get_time"
    with pytest.raises(ToolRequestError, match="needs tools"):
        ToolRequest.from_openai(None, "required")


@pytest.mark.parametrize("family", TOOL_FAMILIES)
def test_tools_and_calls_render_as_transformers_renders_them(tool_models, family):
    from transformers import AutoTokenizer

    dist, _ = tool_models
    model_dir = dist / f"tools-{family}-q4f32_1"
    call = {
        "id": "abcdefghi",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Zürich <3", "unit": "celsius"}'},
    }
    conversation = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "abcdefghi", "content": "21 & sunny"},
    ]
    reference = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        [
            *QUESTION,
            {
                "role": "assistant",
                "tool_calls": [
                    {**call, "function": {"name": "get_weather", "arguments": {"city": "Zürich <3", "unit": "celsius"}}}
                ],
            },
            conversation[-1],
        ],
        tools=TOOLS,
        tokenize=False,
        add_generation_prompt=True,
    )
    assert Engine(model_dir).render_chat(conversation, tools=TOOLS) == reference
