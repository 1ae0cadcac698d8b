"""Chat templates come from downloaded files: they render in jinja's sandbox, and every failure is
one KilnError naming the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.chat_template import compile_chat_template, render_chat_template, template_source
from kiln.errors import KilnError

PATH = Path("model/tokenizer_config.json")
MESSAGES = [{"role": "user", "content": "Hi"}]


def render(source: str) -> str:
    return render_chat_template(compile_chat_template(source, PATH), PATH, messages=MESSAGES,
                                add_generation_prompt=True)


@pytest.mark.parametrize("attack", [
    "{{ cycler.__init__.__globals__.os.system('true') }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ joiner.__init__.__globals__ }}",
    "{% set x = messages.append({'role': 'user'}) %}",
])
def test_templates_cannot_reach_python_internals_or_mutate_their_input(attack):
    with pytest.raises(KilnError, match="unsafe") as error:
        render(attack)
    assert error.value.path == PATH


@pytest.mark.parametrize("template, problem", [
    ("{{ raise_exception('no system role') }}", "no system role"),
    ("{{ 1 // 0 }}", "ZeroDivisionError"),
    ("{{ messages + 1 }}", "TypeError"),
])
def test_templates_that_fail_are_one_error_naming_the_file(template, problem):
    with pytest.raises(KilnError, match=problem):
        render(template)


def test_a_template_that_does_not_parse():
    with pytest.raises(KilnError, match="does not parse"):
        compile_chat_template("{% for %}", PATH)


def test_block_tags_leave_no_whitespace_as_in_transformers():
    source = ("{% for m in messages %}\n    {% if m['role'] == 'user' %}U:{{ m['content'] }}{% endif %}\n{% endfor %}"
              "{% if add_generation_prompt %}A:{% endif %}")
    assert render(source) == "U:HiA:"


def test_named_templates_give_the_default_one():
    config = {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}
    assert template_source(config) == "D"
    assert template_source({"chat_template": [{"name": "tool_use", "template": "T"}]}) is None
    assert template_source({}) is None
