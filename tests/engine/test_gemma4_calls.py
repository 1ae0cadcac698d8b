"""Gemma 4's tool calls (kiln/gemma4_calls.py): a call as Gemma 4's real chat template writes it is read
back to its arguments, and the grammar that holds a call's arguments takes what fits the function's
parameters and nothing else. The browser's copy (web/src/gemma4-calls.js) gives the same grammars and
reads the same calls: tests/web/test_web_tools.py."""

from __future__ import annotations

import pytest
from helpers.tiny_llama import CHAT_TEMPLATES
from hypothesis import given, settings
from hypothesis import strategies as st
from xgrammar.testing import _is_grammar_accept_string as accepts

from kiln.gemma4_calls import arguments_grammar, calls_grammar, format_value, parse_call

KEYS = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True)
TEXT = st.text(st.characters(exclude_categories=["Cs"]), max_size=12).filter(lambda text: "<|" not in text)
VALUES = st.recursive(
    st.booleans() | st.integers(-(10**6), 10**6) | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=3),
    max_leaves=8,
)


@pytest.fixture(scope="module")
def gemma4_template():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    source = (CHAT_TEMPLATES / "google-gemma-4-31B-it.jinja").read_text()
    return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(source)


@settings(max_examples=150, deadline=None)
@given(arguments=st.dictionaries(KEYS, VALUES, max_size=4))
def test_a_call_the_template_writes_is_read_back_to_its_arguments(gemma4_template, arguments):
    call = {"type": "function", "function": {"name": "act", "arguments": arguments}}
    rendered = gemma4_template.render(
        messages=[{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": [call]}],
        bos_token="<bos>",
    )
    written = rendered[rendered.index("<|tool_call>") + len("<|tool_call>") : rendered.index("<tool_call|>")]
    assert written == "call:act" + format_value(arguments)
    assert parse_call(written) == ("act", arguments)


PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "zone": {"type": "integer", "minimum": -2, "maximum": 3},
        "stops": {"type": "array", "items": {"type": "object", "properties": {"at": {"type": "number"}}}},
        "note": {"type": ["string", "null"]},
    },
    "required": ["city", "zone"],
}
FITTING = [
    'city:<|"|>Köln<|"|>,zone:3',
    'city:<|"|><|"|>,unit:<|"|>celsius<|"|>,zone:-2,stops:[{at:1.5e3},{}],note:null',
    'city:<|"|>a<b<|"|>,zone:0,note:<|"|>x<|"|>',
]
NOT_FITTING = [
    'zone:3,city:<|"|>Köln<|"|>',  # out of the schema's order
    'city:<|"|>Lisbon!<|"|>,zone:3',  # longer than maxLength
    'city:<|"|>Köln<|"|>,zone:4',  # past maximum
    'city:<|"|>Köln<|"|>',  # zone is required
    'city:<|"|>Köln<|"|>,zone:1,unit:<|"|>kelvin<|"|>',  # not in the enum, and out of order
    'city:<|"|>Köln<|"|>,zone:1,extra:1',  # a property the schema does not name
    'city:<|"|>a<|b<|"|>,zone:1',  # a string holds no "<|"
    'city:"Köln",zone:1',  # JSON's quotes
]


def test_the_arguments_grammar_takes_what_fits_the_parameters_and_nothing_else():
    grammar = arguments_grammar(PARAMETERS)
    assert [text for text in FITTING if not accepts(grammar, text)] == []
    assert [text for text in NOT_FITTING if accepts(grammar, text)] == []
    assert accepts(arguments_grammar({"type": "object"}), 'any:[1,<|"|>x<|"|>],other:{k:true}')


def test_a_forced_call_names_one_of_the_functions_and_closes():
    grammar = calls_grammar({"get_time": {"type": "object", "properties": {"zone": {"type": "integer"}}}, "ping": {}})
    assert accepts(grammar, "call:get_time{zone:-3}<tool_call|>") and accepts(grammar, "call:ping{}<tool_call|>")
    assert not accepts(grammar, "call:launch{}<tool_call|>") and not accepts(grammar, "call:get_time{zone:1}")


@pytest.mark.parametrize(
    "body",
    ["call:f{a:}", "call:f{a:1} junk", "xcall:f{}", 'call:f{a:<|"|>open}', "call:f{a:1,,b:2}", "call:{}"],
)
def test_text_that_is_not_a_call_is_not_read_as_one(body):
    assert parse_call(body) is None
