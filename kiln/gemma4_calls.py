"""Gemma 4's tool calls: `<|tool_call>call:NAME{key:value,...}<tool_call|>`, written in the syntax of
its chat template's `format_argument` (keys bare, strings between `<|"|>` marks, numbers, true,
false, null, [lists] and {objects} as in JSON). web/src/gemma4-calls.js is the same in the browser.

`arguments_grammar` holds a call's arguments to the function's parameter schema as XGrammar EBNF,
as a JSON schema holds a JSON call: the properties in the schema's order, the required ones always,
no others; strings (and their minLength and maxLength), numbers, integers (a range of fewer than
MAX_LISTED_INTEGERS values as its list), booleans, null, enums, consts, arrays, nested objects,
anyOf/oneOf and lists of types. Other keywords (patterns, formats, wider ranges, item counts) are
not held. A string holds no `<|`, the start of its closing mark."""

from __future__ import annotations

import json
import re
from typing import Any

QUOTE = '<|"|>'
CALL = re.compile(r"\s*call:([A-Za-z0-9_-]{1,64})\{")
NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")
BARE_KEY = re.compile(r"[^:{}\[\],\s]+")
LITERALS = {"true": True, "false": False, "null": None}
MAX_LISTED_INTEGERS = 256  # an integer range narrower than this is held as the list of its values

COMMON_RULES = r"""
gany ::= gstring | gnumber | "true" | "false" | "null" | garray | gobject
garray ::= "[" (gany ("," gany)*)? "]"
gobject ::= "{" gpairs "}"
gpairs ::= (gpair ("," gpair)*)?
gpair ::= [A-Za-z_] [A-Za-z0-9_]* ":" gany
gstring ::= "<|\"|>" gchar* "<|\"|>"
gchar ::= [^<] | "<" [^|]
gint ::= "0" | [1-9] [0-9]*
ginteger ::= "-"? gint
gnumber ::= "-"? gint ("." [0-9]+)? ([eE] [+-]? [0-9]+)?
"""
TYPE_RULES = {"string": "gstring", "integer": "ginteger", "number": "gnumber", "array": "garray", "object": "gobject"}
TYPE_RULES |= {"boolean": '("true" | "false")', "null": '"null"'}


def format_value(value: Any) -> str:
    """A JSON value as the template's format_argument writes a call's argument (keys bare)."""
    if isinstance(value, str):
        return QUOTE + value + QUOTE
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, dict):  # in the order of jinja's dictsort: by key, case ignored
        items = sorted(value.items(), key=lambda item: item[0].lower())
        return "{" + ",".join(f"{key}:{format_value(item)}" for key, item in items) + "}"
    if isinstance(value, list):
        return "[" + ",".join(map(format_value, value)) + "]"
    return json.dumps(value)


class ArgumentsGrammar:
    """EBNF rules for values of JSON schemas, named r0, r1, ... as they are made."""

    def __init__(self):
        self.rules: list[str] = []

    def rule(self, body: str) -> str:
        name = f"r{len(self.rules)}"
        self.rules.append(f"{name} ::= {body}")
        return name

    def value(self, schema: Any) -> str:
        if not isinstance(schema, dict):
            return "gany"
        if "const" in schema:
            return literal(schema["const"])
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            return "(" + " | ".join(literal(v) for v in schema["enum"]) + ")"
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list) and schema[key]:
                return "(" + " | ".join(self.value({**schema, key: None, **s}) for s in schema[key]) + ")"
        kind = schema.get("type", "object" if "properties" in schema else None)
        if isinstance(kind, list):
            return "(" + " | ".join(self.value({**schema, "type": k}) for k in kind) + ")"
        if kind == "array" and isinstance(schema.get("items"), dict):
            item = self.rule(self.value(schema["items"]))
            return self.rule(f'"[" ({item} ("," {item})*)? "]"')
        if kind == "object" and isinstance(schema.get("properties"), dict):
            return self.rule(f'"{{" {self.properties(schema)} "}}"')
        if kind == "string" and (lengths := length_bounds(schema)):
            return self.rule(f'"<|\\"|>" gchar{{{lengths}}} "<|\\"|>"')
        if kind == "integer" and (values := listed_integers(schema)):
            return "(" + " | ".join(map(literal, values)) + ")"
        return TYPE_RULES.get(kind, "gany")

    def properties(self, schema: dict) -> str:
        """The properties of an object schema between its braces, in order, commas between."""
        required = schema.get("required") if isinstance(schema.get("required"), list) else []
        pairs = [
            (self.rule(f"{literal_text(f'{key}:')} {self.value(value)}"), key in required)
            for key, value in schema["properties"].items()
        ]
        # rest[i]: the pairs from i on after a pair was written; first[i]: the same before any was.
        rest = first = '""'
        for pair, needed in reversed(pairs):
            rest_after = rest
            rest = self.rule(f'"," {pair} {rest_after}' + ("" if needed else f" | {rest_after}"))
            first = self.rule(f"{pair} {rest_after}" + ("" if needed else f" | {first}"))
        return first

    def text(self, root: str) -> str:
        return "\n".join([f"root ::= {root}", *self.rules]) + COMMON_RULES


def is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def length_bounds(schema: dict) -> str | None:
    """A string schema's "min,max" lengths (max may be left open), None when it bounds neither."""
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    if not is_integer(low) or low < 0 or (high is not None and not (is_integer(high) and high >= low)):
        return None
    return None if (low, high) == (0, None) else f"{low},{'' if high is None else high}"


def listed_integers(schema: dict) -> range | None:
    low, high = schema.get("minimum"), schema.get("maximum")
    if is_integer(low) and is_integer(high) and 0 <= high - low < MAX_LISTED_INTEGERS:
        return range(low, high + 1)
    return None


def literal_text(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def literal(value: Any) -> str:
    return literal_text(format_value(value))


def arguments_grammar(parameters: Any) -> str:
    """EBNF for what a call writes between `{` and `}`: its arguments, held to `parameters`."""
    grammar = ArgumentsGrammar()
    has_properties = isinstance(parameters, dict) and isinstance(parameters.get("properties"), dict)
    return grammar.text(grammar.properties(parameters) if has_properties else "gpairs")


def calls_grammar(functions: dict[str, Any]) -> str:
    """EBNF for a forced call after its opening (`<|tool_call>`): one of `functions`, closed."""
    grammar = ArgumentsGrammar()
    calls = []
    for name, parameters in functions.items():
        body = grammar.rule(
            grammar.properties(parameters)
            if isinstance(parameters, dict) and isinstance(parameters.get("properties"), dict)
            else "gpairs"
        )
        calls.append(f'{literal_text(f"call:{name}{{")} {body} "}}"')
    return grammar.text("(" + " | ".join(calls) + ') "<tool_call|>"')


class Reader:
    """Reads one value of the call syntax from `text` at `at`; ValueError where it is not one."""

    def __init__(self, text: str, at: int = 0):
        self.text, self.at = text, at

    def skip_space(self) -> None:
        while self.at < len(self.text) and self.text[self.at].isspace():
            self.at += 1

    def take(self, expected: str) -> bool:
        self.skip_space()
        if self.text.startswith(expected, self.at):
            self.at += len(expected)
            return True
        return False

    def value(self) -> Any:
        self.skip_space()
        if self.take(QUOTE):
            end = self.text.find(QUOTE, self.at)
            if end < 0:
                raise ValueError("an unclosed string")
            value, self.at = self.text[self.at : end], end + len(QUOTE)
            return value
        if self.take("{"):
            return self.items("}", self.pair, dict)
        if self.take("["):
            return self.items("]", self.value, list)
        for word, value in LITERALS.items():
            if self.take(word):
                return value
        if number := NUMBER.match(self.text, self.at):
            self.at = number.end()
            return json.loads(number.group())
        raise ValueError(f"no value at {self.at}")

    def items(self, closing: str, item, kind):
        items = []
        if not self.take(closing):
            items.append(item())
            while self.take(","):
                items.append(item())
            if not self.take(closing):
                raise ValueError(f"no {closing!r} at {self.at}")
        return kind(items)

    def pair(self) -> tuple[str, Any]:
        self.skip_space()
        if self.take(QUOTE):
            end = self.text.find(QUOTE, self.at)
            key, self.at = (self.text[self.at : end], end + len(QUOTE)) if end >= 0 else ("", self.at)
        elif key_match := BARE_KEY.match(self.text, self.at):
            key, self.at = key_match.group(), key_match.end()
        else:
            raise ValueError(f"no key at {self.at}")
        if not key or not self.take(":"):
            raise ValueError(f"no ':' after a key at {self.at}")
        return key, self.value()


def parse_call(body: str) -> tuple[str, dict] | None:
    """(name, arguments) of a call's text after `<|tool_call>` (`call:NAME{...}`), None if it is not one."""
    call = CALL.match(body)
    if call is None:
        return None
    reader = Reader(body, call.end() - 1)
    try:
        arguments = reader.value()
    except ValueError:
        return None
    reader.skip_space()
    return (call.group(1), arguments) if reader.at == len(body) else None
