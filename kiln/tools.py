"""Tool calls: OpenAI's `tools` and `tool_choice` for models whose chat template renders tools.

The template shows the tools to the model and says how to call one; each family writes a call its
own way (`TOOL_CALL_FORMATS`, recognized in the template's source). How a reply is generated
depends on `tool_choice`:
  - "none": the template renders without the tools and the reply is text;
  - "auto": the reply is free text, but once the model opens a call (the format's trigger), the
    call is held to the function's parameter schema (an XGrammar structural tag); calls are then
    read out of the text;
  - "required" or a named function: the call's opening is written into the prompt, and the model
    writes the call's JSON held to a schema that allows the named function (or any of them).
Arguments always fit the function's `parameters` schema, strict or not: XGrammar holds them to it.
The tools are bounded like a `response_format` (MAX_FORMAT_CHARS of JSON), and so is each format
they make, whichever call format the model has: a request is refused before a model is touched.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any

from kiln import gemma4_calls
from kiln.errors import KilnError
from kiln.structured import MAX_FORMAT_CHARS, ResponseFormat, ResponseFormatError

FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
TOOL_CHOICES = ("none", "auto", "required")
CALL_ID_ALPHABET = string.ascii_letters + string.digits
CALL_ID_LENGTH = 9  # Mistral's templates refuse other lengths; any client takes these


class ToolRequestError(KilnError):
    """`tools` or `tool_choice` (the `param`) is malformed."""

    def __init__(self, problem: str, param: str = "tools"):
        super().__init__(problem)
        self.param = param


@dataclass(frozen=True)
class ToolCallFormat:
    """How a family's model writes one call: `opening`, the call, `closing`."""

    name: str
    template_marker: str  # text only a template of this format holds
    opening: str
    closing: str

    @property
    def trigger(self) -> str:
        """What the model writes first when it starts a call."""
        return self.opening

    @property
    def marks(self) -> tuple[str, ...]:
        """Tokens a call is written with that the grammar must let the model write, special or not."""
        return ()

    def calls_in(self, text: str) -> tuple[str, list[tuple[str, Any]]]:
        """The text outside calls, and the (name, arguments) of each complete call in it."""
        calls, outside, position = [], [], 0
        while (start := text.find(self.trigger, position)) >= 0:
            # A reply may end right after a call, without the closing.
            end = text.find(self.closing, start + len(self.opening)) if self.closing else -1
            end = len(text) if end < 0 else end
            call = self.parsed(text[start + len(self.opening) : end])
            if call is None:
                break
            outside.append(text[position:start])
            calls.append(call)
            position = min(end + len(self.closing), len(text))
        outside.append(text[position:])
        return "".join(outside).strip(), calls

    def parsed(self, body: str) -> tuple[str, Any] | None:
        """(name, arguments) of a call's text between its opening and closing, None if it is not one."""
        raise NotImplementedError

    def tag(self, function: str, parameters: dict) -> dict:
        """The structural tag that holds a call of `function` once the model starts it."""
        raise NotImplementedError

    def forced(self, functions: dict[str, dict]) -> ResponseFormat:
        """What holds a reply that must be one call (after the opening written for it) of one of `functions`."""
        raise NotImplementedError


@dataclass(frozen=True)
class JSONCallFormat(ToolCallFormat):
    """A call as JSON: `opening` + {"name": …, `arguments_key`: {…}} + `closing`."""

    arguments_key: str = "arguments"

    @property
    def trigger(self) -> str:
        return self.opening or '{"name": '

    def parsed(self, body: str) -> tuple[str, Any] | None:
        try:
            call = json.loads(body)
        except ValueError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or self.arguments_key not in call:
            return None
        return call["name"], call[self.arguments_key]

    def tag(self, function: str, parameters: dict) -> dict:
        begin = f'{self.opening}{{"name": {json.dumps(function)}, "{self.arguments_key}": '
        content = {"type": "json_schema", "json_schema": parameters}
        return {"begin": begin, "content": content, "end": "}" + self.closing}

    def forced(self, functions: dict[str, dict]) -> ResponseFormat:
        key = self.arguments_key
        calls = [
            {"type": "object", "properties": {"name": {"const": name}, key: schema}, "required": ["name", key]}
            for name, schema in functions.items()
        ]
        return ResponseFormat.from_schema(calls[0] if len(calls) == 1 else {"anyOf": calls})


@dataclass(frozen=True)
class Gemma4CallFormat(ToolCallFormat):
    """Gemma 4's `<|tool_call>call:NAME{key:<|"|>text<|"|>,n:1}<tool_call|>` (kiln/gemma4_calls.py)."""

    @property
    def marks(self) -> tuple[str, ...]:
        return (self.opening, self.closing, gemma4_calls.QUOTE)

    def parsed(self, body: str) -> tuple[str, Any] | None:
        return gemma4_calls.parse_call(body)

    def tag(self, function: str, parameters: dict) -> dict:
        grammar = gemma4_calls.arguments_grammar(parameters)
        begin = f"{self.opening}call:{function}{{"
        return {"begin": begin, "content": {"type": "grammar", "grammar": grammar}, "end": "}" + self.closing}

    def forced(self, functions: dict[str, dict]) -> ResponseFormat:
        return ResponseFormat.from_grammar(gemma4_calls.calls_grammar(functions))


TOOL_CALL_FORMATS = (
    # Qwen2.5, Qwen3, Hermes: <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>
    JSONCallFormat("hermes", "<tool_call>", opening="<tool_call>\n", closing="\n</tool_call>"),
    # Llama 3.1 and later: the reply is the call's JSON.
    JSONCallFormat(
        "llama3_json", '"parameters": dictionary of argument name', opening="", closing="", arguments_key="parameters"
    ),
    Gemma4CallFormat("gemma4", "<|tool_call>call:", opening="<|tool_call>", closing="<tool_call|>"),
)


def tool_call_format(template_source: str) -> ToolCallFormat | None:
    return next((f for f in TOOL_CALL_FORMATS if f.template_marker in template_source), None)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return "".join(secrets.choice(CALL_ID_ALPHABET) for _ in range(CALL_ID_LENGTH))


@dataclass(frozen=True)
class ToolRequest:
    """Checked `tools` and `tool_choice`: `functions` maps each name to its parameter schema;
    `choice` is "none", "auto", "required" or a function's name."""

    tools: list[dict]
    functions: dict[str, dict]
    choice: str

    @classmethod
    def from_openai(cls, tools: Any, tool_choice: Any) -> ToolRequest | None:
        """None when the request has no tools (a tool_choice of "none" or "auto" is then moot)."""
        if tools is None or tools == []:
            if tool_choice not in (None, "none", "auto"):
                raise ToolRequestError("tool_choice needs tools", "tool_choice")
            return None
        if not isinstance(tools, list):
            raise ToolRequestError("tools must be a list of {'type': 'function', 'function': {...}}")
        functions = {}
        for i, tool in enumerate(tools):
            function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
            if not isinstance(function, dict):
                raise ToolRequestError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
            name = function.get("name")
            if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
                raise ToolRequestError(f"tools[{i}].function.name must be 1 to 64 letters, digits, '_' or '-'")
            if name in functions:
                raise ToolRequestError(f"tools[{i}]: a second function named {name!r}")
            parameters = function.get("parameters", {"type": "object", "properties": {}})
            if not isinstance(parameters, dict):
                raise ToolRequestError(f"tools[{i}].function.parameters must be a JSON Schema object")
            functions[name] = parameters
        request = cls(tools, functions, choose(tool_choice, functions))
        request.check_size()
        return request

    def check_size(self) -> None:
        """The tools' JSON, and every format they make (for any call format), within MAX_FORMAT_CHARS."""
        try:
            if len(json.dumps(self.tools, ensure_ascii=False, separators=(",", ":"))) > MAX_FORMAT_CHARS:
                raise ToolRequestError(f"the tools are longer than {MAX_FORMAT_CHARS} characters of JSON")
            for call_format in TOOL_CALL_FORMATS:
                self.response_format(call_format)
        except RecursionError:
            raise ToolRequestError("the tools nest too deeply") from None
        except ResponseFormatError as e:
            raise ToolRequestError(f"the tools make a format too long: {e.problem}") from None

    def response_format(self, call_format: ToolCallFormat) -> ResponseFormat | None:
        """What holds the reply: calls' arguments to their schemas (auto), or the whole reply to one call."""
        if self.choice == "none":
            return None
        if self.choice == "auto":
            tags = [call_format.tag(name, schema) for name, schema in self.functions.items()]
            return ResponseFormat.from_structural_tag(tags, [call_format.trigger])
        names = list(self.functions) if self.choice == "required" else [self.choice]
        return call_format.forced({name: self.functions[name] for name in names})

    def reply_opening(self, call_format: ToolCallFormat) -> str:
        """Text written into the prompt after the generation prompt: a forced call's opening."""
        return call_format.opening if self.choice not in ("none", "auto") else ""


def choose(tool_choice: Any, functions: dict[str, dict]) -> str:
    if tool_choice is None:
        return "auto"
    if tool_choice in TOOL_CHOICES:
        return tool_choice
    named = isinstance(tool_choice, dict) and tool_choice.get("type") == "function"
    function = tool_choice.get("function") if named else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ToolRequestError(
            "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
            "tool_choice",
        )
    if name not in functions:
        raise ToolRequestError(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    return name


def read_tool_calls(call_format: ToolCallFormat, functions: dict[str, dict], text: str) -> tuple[str, list[ToolCall]]:
    """A reply's text content and its calls (text: the reply with the opening written for it)."""
    content, calls = call_format.calls_in(text)
    if any(name not in functions for name, _ in calls):  # a call to a function it was not given: text
        return text, []
    return content, [
        ToolCall(new_call_id(), name, json.dumps(arguments, ensure_ascii=False)) for name, arguments in calls
    ]


def messages_for_template(messages: list[dict]) -> list[dict]:
    """OpenAI messages as chat templates expect them: a call's arguments as an object, not JSON text."""
    return [
        {**m, "content": m.get("content") or "", "tool_calls": [template_call(call) for call in m["tool_calls"]]}
        if m.get("tool_calls")
        else m
        for m in messages
    ]


def template_call(call: dict) -> dict:
    try:
        return {**call, "function": {**call["function"], "arguments": json.loads(call["function"]["arguments"])}}
    except (KeyError, TypeError, ValueError):
        raise KilnError(
            f"a tool call needs a function with a name and its arguments as JSON text, got {call!r}"
        ) from None


class ContentBeforeCalls:
    """Streams a reply's text until a call may be starting (the format's trigger, or a tail that
    could become it), then holds the rest back to be read as calls when the reply ends."""

    def __init__(self, call_format: ToolCallFormat, functions: dict[str, dict], opening: str = ""):
        self.call_format, self.functions = call_format, functions
        self.trigger = call_format.trigger
        self.held = ""
        self.in_call = False
        self.feed(opening)

    def feed(self, text: str) -> str:
        self.held += text
        if self.in_call:
            return ""
        at = self.held.find(self.trigger)
        if at >= 0:
            self.in_call = True
        else:
            at = len(self.held) - next(
                (
                    n
                    for n in range(min(len(self.held), len(self.trigger) - 1), 0, -1)
                    if self.trigger.startswith(self.held[-n:])
                ),
                0,
            )
        safe, self.held = self.held[:at], self.held[at:]
        return safe

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The text not streamed yet, and the calls."""
        return read_tool_calls(self.call_format, self.functions, self.held)
