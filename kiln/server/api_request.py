"""Reading an OpenAI-style request body: every field is checked before a model is touched and
every problem is a 400 naming the field, so no request fails after its reply has begun."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from flask import Response, jsonify, request

from kiln.speculative import METHODS, OFF

ROLES = ("system", "user", "assistant", "tool")
MAX_STOP_STRINGS = 4
# Without max_tokens a reply would otherwise run to the end of the context window.
DEFAULT_MAX_TOKENS = 512
# The chat config's sampling defaults (mlc-chat-config.json) apply when a request leaves them out.
MODEL_DEFAULTS = ("temperature", "top_p", "repetition_penalty")


class ApiError(Exception):
    """An error answered as OpenAI's JSON error object."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        error_type: str = "invalid_request_error",
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.error_type, self.code = status, message, param, error_type, code

    def response(self) -> Response:
        body = {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}
        response = jsonify(body)
        response.status_code = self.status
        return response


TYPE_NAMES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


def typed(name: str, value, kinds: tuple[type, ...]):
    # bool is an int in Python; JSON true is never a number here.
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise ApiError(400, f"Invalid type for {name!r}: expected {' or '.join(TYPE_NAMES[k] for k in kinds)}.", name)
    if isinstance(value, float) and not math.isfinite(value):
        raise ApiError(400, f"{name!r} must be a finite number.", name)
    return value


def text(name: str, value) -> str:
    typed(name, value, (str,))
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, f"{name!r} is not valid Unicode (it holds a lone surrogate).", name) from None
    return value


@dataclass(frozen=True)
class Number:
    low: float
    high: float
    low_open: bool = False

    def read(self, name: str, value) -> float:
        typed(name, value, (int, float))
        if not (self.low < value <= self.high if self.low_open else self.low <= value <= self.high):
            raise ApiError(
                400, f"{name!r} must be in {'(' if self.low_open else '['}{self.low}, {self.high}], got {value}.", name
            )
        return float(value)


@dataclass(frozen=True)
class Integer:
    low: int
    high: int | None = None

    def read(self, name: str, value) -> int:
        typed(name, value, (int,))
        if value < self.low or (self.high is not None and value > self.high):
            bound = f"at least {self.low}" if self.high is None else f"in [{self.low}, {self.high}]"
            raise ApiError(400, f"{name!r} must be {bound}, got {value}.", name)
        return value


class Flag:
    def read(self, name: str, value) -> bool:
        return typed(name, value, (bool,))


@dataclass(frozen=True)
class OneOf:
    values: tuple[str, ...]

    def read(self, name: str, value) -> str:
        if typed(name, value, (str,)) not in self.values:
            raise ApiError(400, f"{name!r} must be one of {', '.join(self.values)}, got {value!r}.", name)
        return value


# Request fields that map one to one onto GenerationConfig.
SAMPLING_FIELDS = {
    "temperature": Number(0, 2),
    "top_p": Number(0, 1, low_open=True),
    "top_k": Integer(0),
    "repetition_penalty": Number(0.01, 10),  # a subnormal one would overflow the logits it divides
    "presence_penalty": Number(-2, 2),
    "frequency_penalty": Number(-2, 2),
    "seed": Integer(0, 2**64 - 1),
    "ignore_eos": Flag(),
    "speculative": OneOf((OFF, *METHODS)),  # Kiln's: how to decode (kiln/speculative.py); default the server's
}
MAX_TOKENS_FIELDS = ("max_tokens", "max_completion_tokens")  # the second wins (OpenAI's newer name)
# OpenAI features Kiln does not implement: accepted only at the value that means "off".
UNSUPPORTED = {
    "n": 1,
    "best_of": 1,
    "logprobs": False,
    "top_logprobs": 0,
    "echo": False,
    "logit_bias": {},
    "suffix": "",
}
# Fields only a chat request may have.
CHAT_ONLY = ("tools", "tool_choice", "parallel_tool_calls")


def present(body: dict, name: str) -> bool:
    return body.get(name) is not None


def required(body: dict, name: str):
    if not present(body, name):
        raise ApiError(400, f"Missing required parameter: {name!r}.", name)
    return body[name]


def check_unsupported(body: dict) -> None:
    for name, off in UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and not (type(value) is type(off) and value == off):
            raise ApiError(400, f"{name!r} is not supported here (only {off!r}).", name)


def sampling(body: dict) -> dict:
    """The GenerationConfig fields the body sets, checked."""
    chosen = {name: spec.read(name, body[name]) for name, spec in SAMPLING_FIELDS.items() if present(body, name)}
    for name in MAX_TOKENS_FIELDS:
        if present(body, name):
            chosen["max_tokens"] = Integer(1).read(name, body[name])
    if present(body, "stop"):
        chosen["stop"] = stop_strings(body["stop"])
    if present(body, "response_format"):
        chosen["response_format"] = response_format(body["response_format"])
    return chosen


def response_format(value):
    from kiln.structured import ResponseFormat, ResponseFormatError

    try:
        return ResponseFormat.from_openai(value)
    except ResponseFormatError as e:
        raise ApiError(400, f"{e.problem}.", "response_format") from None


def stop_strings(stop) -> list[str]:
    stops = [stop] if isinstance(stop, str) else typed("stop", stop, (str, list))
    if len(stops) > MAX_STOP_STRINGS:
        raise ApiError(400, f"'stop' must be a string or a list of at most {MAX_STOP_STRINGS} strings.", "stop")
    return [text("stop", s) for s in stops]


def include_usage(body: dict) -> bool:
    """stream_options.include_usage (only meaningful for a stream)."""
    if not present(body, "stream_options"):
        return False
    options = typed("stream_options", body["stream_options"], (dict,))
    return present(options, "include_usage") and Flag().read("stream_options.include_usage", options["include_usage"])


def message_content(content, index: int) -> str:
    name = f"messages[{index}].content"
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(text(name, p.get("text")) for p in content)
    if not isinstance(content, str):
        raise ApiError(400, f"{name} must be a string or a list of text parts.", name)
    return text(name, content)


def chat_messages(body: dict) -> list[dict]:
    messages = typed("messages", required(body, "messages"), (list,))
    if not messages:
        raise ApiError(400, "'messages' must not be empty.", "messages")
    checked = []
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if not isinstance(role, str) or role not in ROLES:
            raise ApiError(400, f"messages[{i}].role must be one of {', '.join(ROLES)}.", f"messages[{i}].role")
        calls = tool_calls(message.get("tool_calls"), i) if role == "assistant" else []
        content = message.get("content")
        out = {"role": role, "content": "" if calls and content is None else message_content(content, i)}
        if calls:
            out["tool_calls"] = calls
        if role == "tool":
            out["tool_call_id"] = text(f"messages[{i}].tool_call_id", required(message, "tool_call_id"))
        checked.append(out)
    return checked


def tool_calls(calls, index: int) -> list[dict]:
    """An assistant message's earlier tool calls, as OpenAI sends them back."""
    name = f"messages[{index}].tool_calls"
    if calls is None:
        return []
    checked = []
    for call in typed(name, calls, (list,)):
        function = call.get("function") if isinstance(call, dict) else None
        if not (
            isinstance(function, dict)
            and isinstance(call.get("id"), str)
            and call.get("type") == "function"
            and isinstance(function.get("name"), str)
            and isinstance(function.get("arguments"), str)
        ):
            raise ApiError(
                400,
                f"{name} must be a list of {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}}}.",
                name,
            )
        try:
            json.loads(function["arguments"])
        except ValueError:
            raise ApiError(400, f"{name}: the arguments of {function['name']!r} are not JSON text.", name) from None
        checked.append(
            {
                "id": call["id"],
                "type": "function",
                "function": {"name": text(name, function["name"]), "arguments": function["arguments"]},
            }
        )
    return checked


def tool_request(body: dict):
    from kiln.tools import ToolRequest, ToolRequestError

    if present(body, "parallel_tool_calls"):
        Flag().read("parallel_tool_calls", body["parallel_tool_calls"])
    try:
        return ToolRequest.from_openai(body.get("tools"), body.get("tool_choice"))
    except ToolRequestError as e:
        raise ApiError(400, f"{e.problem}.", e.param) from None


def completion_prompt(body: dict) -> str | list[int]:
    prompt = typed("prompt", required(body, "prompt"), (str, list))
    if isinstance(prompt, str):
        return text("prompt", prompt)
    if len(prompt) == 1 and isinstance(prompt[0], str):
        return text("prompt", prompt[0])
    if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise ApiError(400, "'prompt' must be a string, a list of one string, or a list of token ids.", "prompt")


@dataclass
class ApiRequest:
    """A checked request: the model, how to answer, and what to generate from (messages or a prompt)."""

    model: str
    stream: bool
    include_usage: bool
    sampling: dict
    messages: list[dict] | None = None
    prompt: str | list[int] | None = None
    tools: object = None  # a kiln.tools.ToolRequest when the chat offers tools

    def generation_config(self, chat_config: dict):
        from kiln.engine import GenerationConfig

        defaults = {name: chat_config[name] for name in MODEL_DEFAULTS if name in chat_config}
        return GenerationConfig(**{"max_tokens": DEFAULT_MAX_TOKENS, **defaults, **self.sampling})


def body_object() -> dict:
    try:
        body = request.get_json(silent=True)
    except RecursionError:  # nesting deeper than the JSON parser's recursion limit
        body = None
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object (Content-Type: application/json).")
    return body


def read_request(chat: bool) -> ApiRequest:
    """The request body of /v1/chat/completions (`chat`) or /v1/completions, checked throughout."""
    body = body_object()
    check_unsupported(body)
    if not chat:
        for name in CHAT_ONLY:
            if present(body, name):
                raise ApiError(400, f"{name!r} is for /v1/chat/completions.", name)
    source = {"messages": chat_messages(body)} if chat else {"prompt": completion_prompt(body)}
    chosen = sampling(body)
    tools = tool_request(body) if chat else None
    if tools and tools.choice != "none" and chosen.get("response_format"):
        raise ApiError(400, "'response_format' cannot be combined with tools the model may call.", "response_format")
    return ApiRequest(
        model=text("model", required(body, "model")),
        stream=present(body, "stream") and Flag().read("stream", body["stream"]),
        include_usage=include_usage(body),
        sampling=chosen,
        tools=tools,
        **source,
    )
