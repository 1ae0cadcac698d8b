"""The chat-template sandbox and the tools bound: a huge tool list, a deeply nested tool and a
template that amplifies small inputs (join, replace, format widths, `%*s`, tojson's indent, ...)
are refused before the value is made, in well under the render's deadline and its memory."""

from __future__ import annotations

import json
import time
import tracemalloc
from pathlib import Path

import jinja2
import pytest
from flask import Flask
from transformers.utils.chat_template_utils import _compile_jinja_template

from helpers.paths import TESTS_DATA
from helpers.web import run_node_module

from kiln.chat_template import (
    MAX_TEXT,
    ChatTemplate,
    ConversationRefused,
    TemplateRaised,
)
from kiln.errors import KilnError
from kiln.server.api_request import ApiError, read_request
from kiln.server.app import ServerConfig, create_app
from kiln.structured import MAX_FORMAT_CHARS
from kiln.tools import messages_for_template

TEMPLATES = TESTS_DATA / "chat_templates"
LLAMA_31 = TEMPLATES / "meta-llama-Llama-3.1-8B-Instruct.jinja"
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
MEGABYTE = 1 << 20


def nested_schema(depth: int, description: str) -> dict:
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "description": description, "properties": {"inner": schema}}
    return schema


def tool(parameters: dict, name: str = "deep") -> dict:
    return {"type": "function", "function": {"name": name, "description": "A tool.", "parameters": parameters}}


# A 1 MB body whose one tool's parameters nest 450 deep: Llama 3.1 renders it with tojson(indent=4).
DEEP_TOOLS = [tool(nested_schema(450, "d" * 2200))]


def model_folder(tmp_path: Path, template: Path) -> Path:
    """A model folder as compiled ones keep their template: in tokenizer_config.json."""
    config = {"chat_template": template.read_text(encoding="utf-8"), "bos_token": "<|begin_of_text|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return tmp_path


def parsed(body: dict):
    """The body as `/v1/chat/completions` reads it."""
    with Flask(__name__).test_request_context("/v1/chat/completions", method="POST", json=body):
        return read_request(chat=True)


def measured(work):
    """(what `work` returned or the refusal it raised, seconds, peak bytes allocated meanwhile)."""
    tracemalloc.start()
    start = time.perf_counter()
    try:
        outcome = work()
    except (KilnError, ApiError) as error:
        outcome = error
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return outcome, seconds, peak


def test_a_one_megabyte_deeply_nested_tool_is_refused_in_a_moment(tmp_path):
    body = {"model": "m", "messages": QUESTION, "tools": DEEP_TOOLS, "tool_choice": "auto"}
    assert MEGABYTE - 64 * 1024 < len(json.dumps(body)) <= MEGABYTE
    refused, seconds, peak = measured(lambda: parsed(body))
    assert isinstance(refused, ApiError) and (refused.status, refused.param) == (400, "tools")
    assert f"longer than {MAX_FORMAT_CHARS} characters" in refused.message
    assert seconds < 2 and peak < 100 * MEGABYTE
    # The template alone bounds it too, rendered as the server renders it (Engine.render_chat).
    template = ChatTemplate.find(model_folder(tmp_path, LLAMA_31))
    outcome, seconds, peak = measured(lambda: template.render(messages_for_template(QUESTION), True, DEEP_TOOLS))
    assert isinstance(outcome, KilnError) and "the chat_template was stopped" in str(outcome)
    assert seconds < 2 and peak < 100 * MEGABYTE


def plain_render(source: str, tools: list[dict] | None) -> str:
    """The template as transformers renders it: its sandbox, filters, globals and `{% generation %}` tag."""
    context = {"tools": tools} if tools else {}
    template = _compile_jinja_template(source)
    try:
        return template.render(messages=MESSAGES, add_generation_prompt=True, **SPECIAL, **context)
    except jinja2.exceptions.TemplateError as raised:
        if type(raised) is not jinja2.exceptions.TemplateError:  # not transformers' raise_exception
            raise
        raise TemplateRaised(str(raised)) from raised


def bounded_render(source: str, tools: list[dict] | None) -> str:
    return ChatTemplate(source, Path("chat_template.jinja"), SPECIAL).render(MESSAGES, True, tools)


SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi <there> & 'you' \"all\"\n\ttabbed"},
    {"role": "assistant", "content": "Hello! ünïcödé 🎮"},
    {"role": "user", "content": "Weather in Paris?"},
]
TOOLS = [tool(nested_schema(12, "a level " * 40), name=f"tool_{i}") for i in range(10)]


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no tools", "tools"])
@pytest.mark.parametrize("path", sorted(TEMPLATES.glob("*.jinja")), ids=lambda path: path.stem)
def test_the_corpus_renders_as_in_the_plain_sandbox(path, tools):
    source = path.read_text(encoding="utf-8")
    try:
        expected = plain_render(source, tools)
    except TemplateRaised:  # Gemma has no system role: refused alike
        with pytest.raises(ConversationRefused):
            bounded_render(source, tools)
        return
    rendered, seconds, peak = measured(lambda: bounded_render(source, tools))
    assert rendered == expected
    assert seconds < 2 and peak < 10 * MEGABYTE


# Each makes ~1000 times what it is given (or squares its way past any memory): the would-be size
# in characters, items or bytes.
AMPLIFIERS = {
    "join": ("{{ (['x' * 8000000] * 1000)|join }}", 8 * 10**9),
    "replace": ("{{ ('x' * 1000).replace('x', 'y' * 8000000) }}", 8 * 10**9),
    "replace filter": ("{{ ('x' * 1000)|replace('x', 'y' * 8000000) }}", 8 * 10**9),
    "nested format widths": ("{{ ('{0:>{1}}' * 1000).format('', 8000000) }}", 8 * 10**9),
    "format width from a list": ("{{ ('{0:>{1[0]}}' * 1000).format('', [8000000]) }}", 8 * 10**9),
    "printf star width": ("{{ ('%*s' * 1000) % ((8000000, '') * 1000) }}", 8 * 10**9),
    "format filter star width": ("{{ ('%*s' * 1000)|format(*((8000000, '') * 1000)) }}", 8 * 10**9),
    "printing a shared list": ("{% set b = ['x' * 8000000] * 1000 %}{{ b }}", 8 * 10**9),
    "concatenating a shared list": ("{% set b = ['x' * 8000000] * 1000 %}{{ (b ~ '')|length }}", 8 * 10**9),
    "string filter": ("{{ (['x' * 8000000] * 1000)|string|length }}", 8 * 10**9),
    "tojson of a shared list": ("{{ (['x' * 8000000] * 1000)|tojson|length }}", 8 * 10**9),
    "expandtabs": ("{{ ('\t' * 1000).expandtabs(8000000) }}", 8 * 10**9),
    "translate": ("{{ ('x' * 1000).translate({120: 'y' * 8000000}) }}", 8 * 10**9),
    "indent": ("{{ ('\n' * 1000)|indent('y' * 8000000) }}", 8 * 10**9),
    "wordwrap": ("{{ ('x ' * 4000000)|wordwrap(1, wrapstring='y' * 1000) }}", 4 * 10**9),
    "center of a shared list": ("{{ (['x' * 8000000] * 1000)|center(10) }}", 8 * 10**9),
    "upper of a shared list": ("{{ (['x' * 8000000] * 1000)|upper }}", 8 * 10**9),
    "macro output": (
        "{% macro m() %}{% for i in range(1000) %}{{ 'x' * 8000000 }}{% endfor %}{% endmacro %}{{ m()|length }}",
        8 * 10**9,
    ),
    "set block": (
        "{% set b = 'x' * 8000000 %}{% set s %}{% for i in range(1000) %}{{ b }}{% endfor %}{% endset %}",
        8 * 10**9,
    ),
    "strftime_now": ("{{ strftime_now('%c' * 1000000) }}", 24 * 10**6),
    "lipsum": ("{{ lipsum(1000, max=100000)|length }}", 10**9),
    "squared integers": (
        "{% set ns = namespace(n=3) %}{% for i in range(34) %}{% set ns.n = ns.n * ns.n %}{% endfor %}",
        2**34 * 3 // 2 // 8,  # 3 ** (2 ** 34) in bytes
    ),
}


@pytest.mark.parametrize("case", AMPLIFIERS)
def test_amplifiers_are_refused_before_they_allocate(tmp_path, case):
    source, would_make = AMPLIFIERS[case]
    template = ChatTemplate(source, tmp_path / "chat_template.jinja", {})
    outcome, seconds, peak = measured(lambda: template.render(QUESTION))
    assert isinstance(outcome, KilnError), outcome[:200]
    assert "the chat_template was stopped" in str(outcome) and "ran for over" not in str(outcome)
    assert peak < 4 * MAX_TEXT + 8 * MEGABYTE and peak < would_make / 10
    assert seconds < 2


def test_sum_of_lists_is_refused_before_its_quadratic_copying(tmp_path):
    template = ChatTemplate("{{ ([['x']] * 100000)|sum(start=[])|length }}", tmp_path / "t.jinja", {})
    outcome, seconds, _ = measured(lambda: template.render(QUESTION))
    assert isinstance(outcome, KilnError) and "makes a value of" in str(outcome)
    assert seconds < 2


def test_values_nested_past_the_bound_are_refused_when_written_out(tmp_path):
    source = (
        "{% set ns = namespace(v=1) %}{% for i in range(200) %}{% set ns.v = [ns.v] %}{% endfor %}"
        "{{ ns.v|tojson(indent=4) }}"
    )
    template = ChatTemplate(source, tmp_path / "t.jinja", {})
    with pytest.raises(KilnError, match="nests values more than 64 deep"):
        template.render(QUESTION)


def error_of(response) -> dict:
    assert response.status_code == 400, response.get_data(as_text=True)
    return response.get_json()["error"]


# Under the bound as JSON, but the formats holding their calls (a begin, a schema, an end per tool) pass it.
MANY_SMALL_TOOLS = [{"type": "function", "function": {"name": f"t{i}"}} for i in range(1300)]


def many_parameters(count: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(count)}}


def test_the_tools_bound_answers_like_the_response_format_bound(tmp_path):
    client = create_app(ServerConfig(dist=tmp_path)).test_client()
    big_schema = many_parameters(4000)
    base = {"model": "no-model-needed", "messages": QUESTION}
    format_error = error_of(
        client.post(
            "/v1/chat/completions",
            json={
                **base,
                "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": big_schema}},
            },
        )
    )
    tools_error = error_of(
        client.post("/v1/chat/completions", json={**base, "tools": [tool(big_schema)], "tool_choice": "auto"})
    )
    tag_error = error_of(client.post("/v1/chat/completions", json={**base, "tools": MANY_SMALL_TOOLS}))
    assert len(json.dumps(MANY_SMALL_TOOLS, separators=(",", ":"))) <= MAX_FORMAT_CHARS
    for error, param in ((format_error, "response_format"), (tools_error, "tools"), (tag_error, "tools")):
        assert set(error) == {"message", "type", "param", "code"}
        assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, None)
        assert error["message"].endswith(f"longer than {MAX_FORMAT_CHARS} characters.") or (
            error["message"].endswith(f"longer than {MAX_FORMAT_CHARS} characters of JSON.")
        )
    assert "structural tag" in tag_error["message"]


BROWSER_BOUNDS_JS = """
    import { toolRequestFrom } from "./src/tools.js";
    import { responseFormatFrom } from "./src/structured.js";
    const tool = (parameters) => ({ type: "function", function: { name: "f", parameters } });
    const outcome = (work) => {
      try {
        work();
        return null;
      } catch (error) {
        return { code: error.code, message: error.message };
      }
    };
    const schemaFormat = { type: "json_schema", json_schema: { name: "s", schema: input.big } };
    console.log(JSON.stringify({
      format: outcome(() => responseFormatFrom(schemaFormat)),
      tools: outcome(() => toolRequestFrom([tool(input.big)], "auto")),
      tag: outcome(() => toolRequestFrom(input.many, "auto")),
      required: outcome(() => toolRequestFrom(input.many, "required")),
      small: outcome(() => toolRequestFrom([tool(input.small)], "auto")),
    }));
"""


def test_the_browser_bounds_tools_like_a_response_format():
    outcomes = run_node_module(
        BROWSER_BOUNDS_JS, {"big": many_parameters(4000), "many": MANY_SMALL_TOOLS, "small": many_parameters(3)}
    )
    assert outcomes["format"] == {
        "code": "bad-response-format",
        "message": f"the JSON schema is longer than {MAX_FORMAT_CHARS} characters",
    }
    assert outcomes["tools"] == {
        "code": "bad-request",
        "message": f"the tools are longer than {MAX_FORMAT_CHARS} characters of JSON",
    }
    for case in ("tag", "required"):
        assert outcomes[case]["code"] == "bad-request"
        assert outcomes[case]["message"].startswith("the tools make a format too long: the ")
    assert outcomes["small"] is None
