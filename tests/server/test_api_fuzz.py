"""Fuzzing the OpenAI API's request bodies (Hypothesis, Flask's test client, the tiny Llama): every
request gets a reply or a JSON 4xx naming its problem, never a 500, a traceback or a broken stream."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.server import ServerConfig, create_app
from kiln.server.api_request import DEFAULT_MAX_TOKENS, MAX_STOP_STRINGS

MODEL_ID = "tiny-llama-q4f32_1"
PATHS = ("/v1/chat/completions", "/v1/completions")

junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.sampled_from(["\ud800", "a\udfffb"]),
    st.lists(st.integers(-5, 5), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
words = st.text(max_size=24) | st.sampled_from(["<|im_end|>", "\x00", "é" * 9])
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant"]),
        "content": words | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": words}), max_size=3),
    }
)
# JSON Schemas made of schema keywords and values, most of them nonsense; and EBNF-like text.
schema_keys = st.sampled_from(
    [
        "type",
        "properties",
        "items",
        "prefixItems",
        "enum",
        "const",
        "anyOf",
        "oneOf",
        "allOf",
        "required",
        "minimum",
        "maximum",
        "minLength",
        "maxLength",
        "minItems",
        "maxItems",
        "pattern",
        "format",
        "$ref",
        "$defs",
        "additionalProperties",
        "a",
    ]
)
schema_leaves = (
    st.booleans()
    | st.none()
    | st.integers(-3, 10**12)
    | st.floats(-1e9, 1e9)
    | st.sampled_from(
        [
            "string",
            "object",
            "integer",
            "array",
            "number",
            "boolean",
            "null",
            "^[a-z]{2}$",
            "(",
            "#/$defs/a",
            "#",
            "date",
            "a",
        ]
    )
)
schemas = st.recursive(
    schema_leaves,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(schema_keys, inner, max_size=4),
    max_leaves=12,
)
grammars = st.text(max_size=30) | st.sampled_from(
    ['root ::= "a"', 'root ::= [a-z]+ "."', "root ::= root", 'root ::= ""']
)
response_formats = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "yaml"])}),
    st.fixed_dictionaries({"type": st.just("json_object"), "schema": schemas | st.text(max_size=12)}),
    st.fixed_dictionaries(
        {
            "type": st.just("json_schema"),
            "json_schema": st.fixed_dictionaries(
                {"name": st.sampled_from(["answer", "", "a b"]), "schema": schemas}, optional={"strict": junk}
            ),
        }
    ),
    st.fixed_dictionaries({"type": st.just("grammar"), "grammar": grammars | junk}),
)
# Valid values of every field (max_tokens kept small so a run stays short); a request then has up
# to two fields (or its whole body) replaced by junk, so most requests get deep into the server.
REQUIRED = {
    "/v1/chat/completions": {
        "model": st.just(MODEL_ID),
        "messages": st.lists(message, min_size=1, max_size=4),
        "max_tokens": st.integers(1, 4),
    },
    "/v1/completions": {
        "model": st.just(MODEL_ID),
        "max_tokens": st.integers(1, 4),
        "prompt": (
            words | st.lists(words, min_size=1, max_size=1) | st.lists(st.integers(-3, 300), min_size=1, max_size=8)
        ),
    },
}
OPTIONAL = {
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0, 1, exclude_min=True),
    "top_k": st.integers(0, 2**70),
    "repetition_penalty": st.floats(0.01, 10),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "seed": st.integers(0, 2**64 - 1),
    "ignore_eos": st.booleans(),
    "max_completion_tokens": st.integers(1, 4),
    "stop": words | st.lists(words, max_size=MAX_STOP_STRINGS),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "n": st.just(1),
    "logprobs": st.just(False),
    "logit_bias": st.just({}),
    "user": words,
    "response_format": response_formats,
}


@st.composite
def api_requests(draw) -> tuple[str, object]:
    path = draw(st.sampled_from(PATHS))
    body = draw(st.fixed_dictionaries(REQUIRED[path], optional=OPTIONAL))
    for name in draw(st.lists(st.sampled_from(sorted({*REQUIRED[path], *OPTIONAL})), max_size=2)):
        body[name] = draw(junk)
    return path, draw(junk) if draw(st.sampled_from(range(20))) == 19 else body


@pytest.fixture(scope="module")
def client(tiny_build):
    return create_app(ServerConfig(dist=tiny_build("q4f32_1").parent)).test_client()


def check_stream(text: str) -> None:
    events = [line.removeprefix("data: ") for line in text.split("\n\n") if line]
    assert events[-1] == "[DONE]", events[-3:]
    for event in events[:-1]:
        assert "error" not in json.loads(event), event


def check_reply(path: str, body, response) -> None:
    text = response.get_data(as_text=True)
    assert response.status_code < 500 and "Traceback" not in text, (path, body, response.status_code, text[:2000])
    if response.status_code != 200:
        error = response.json["error"]
        assert isinstance(error["message"], str) and error["message"], text
    elif response.mimetype == "text/event-stream":
        check_stream(text)
    else:
        (choice,) = response.json["choices"]
        assert choice["finish_reason"] in ("stop", "length"), text
        asked = [body[name] for name in ("max_completion_tokens", "max_tokens") if body.get(name) is not None]
        assert 1 <= response.json["usage"]["completion_tokens"] <= (asked or [DEFAULT_MAX_TOKENS])[0], text


@pytest.mark.filterwarnings("error::RuntimeWarning")  # NaN or overflowing sampling arithmetic fails it
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request=api_requests())
def test_no_request_body_makes_the_server_fail(client, request):
    path, body = request
    response = client.post(path, data=json.dumps(body, allow_nan=True), content_type="application/json")
    check_reply(path, body, response)
