"""Chat templates come from downloaded files: they are found where checkpoints keep them, render in
jinja's sandbox, and every failure is one KilnError naming the file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.chat_template import (
    ChatTemplate,
    ConversationRefused,
    compile_chat_template,
    render_chat_template,
    template_source,
)
from kiln.errors import KilnError

PATH = Path("model/tokenizer_config.json")
MESSAGES = [{"role": "user", "content": "Hi"}]


def render(source: str) -> str:
    return render_chat_template(
        compile_chat_template(source, PATH), PATH, messages=MESSAGES, add_generation_prompt=True
    )


@pytest.mark.parametrize(
    "attack",
    [
        "{{ cycler.__init__.__globals__.os.system('true') }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ joiner.__init__.__globals__ }}",
        "{% set x = messages.append({'role': 'user'}) %}",
    ],
)
def test_templates_cannot_reach_python_internals_or_mutate_their_input(attack):
    with pytest.raises(KilnError, match="unsafe") as error:
        render(attack)
    assert error.value.path == PATH


@pytest.mark.parametrize(
    "template, problem",
    [
        ("{{ raise_exception('no system role') }}", "no system role"),
        ("{{ 1 // 0 }}", "ZeroDivisionError"),
        ("{{ messages + 1 }}", "TypeError"),
    ],
)
def test_templates_that_fail_are_one_error_naming_the_file(template, problem):
    with pytest.raises(KilnError, match=problem):
        render(template)


def test_a_template_that_does_not_parse():
    with pytest.raises(KilnError, match="does not parse"):
        compile_chat_template("{% for %}", PATH)


def test_block_tags_leave_no_whitespace_as_in_transformers():
    source = (
        "{% for m in messages %}\n    {% if m['role'] == 'user' %}U:{{ m['content'] }}{% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}A:{% endif %}"
    )
    assert render(source) == "U:HiA:"


def test_a_template_s_own_refusal_is_told_apart():
    with pytest.raises(ConversationRefused, match="refuses these messages: no system role"):
        render("{{ raise_exception('no system role') }}")


def test_named_templates_give_the_default_one():
    config = {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}
    assert template_source(config, PATH) == "D"
    assert template_source({}, PATH) is None
    named = {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "rag", "template": "R"}]}
    with pytest.raises(KilnError, match=r"named chat templates \(tool_use, rag\) but none is called 'default'"):
        template_source(named, PATH)


def write_json(path: Path, content) -> None:
    path.write_text(json.dumps(content))


def test_templates_are_found_where_transformers_looks_first(tmp_path):
    write_json(
        tmp_path / "tokenizer_config.json",
        {
            "chat_template": "from tokenizer_config",
            "bos_token": "<s>",
            "eos_token": {"content": "</s>", "special": True},
        },
    )
    found = ChatTemplate.find(tmp_path)
    assert (found.source, found.path.name) == ("from tokenizer_config", "tokenizer_config.json")
    assert found.special_tokens == {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "", "pad_token": ""}

    write_json(tmp_path / "chat_template.json", {"chat_template": [{"name": "default", "template": "from json"}]})
    assert ChatTemplate.find(tmp_path).source == "from json"

    (tmp_path / "chat_template.jinja").write_text("from jinja {{ bos_token }}")
    found = ChatTemplate.find(tmp_path)
    assert (found.source, found.path.name) == ("from jinja {{ bos_token }}", "chat_template.jinja")
    assert found.render(MESSAGES) == "from jinja <s>"


def test_a_folder_without_a_template_is_a_base_model(tmp_path):
    assert ChatTemplate.find(tmp_path) is None
    write_json(tmp_path / "tokenizer_config.json", {"bos_token": "<s>"})
    assert ChatTemplate.find(tmp_path) is None


def test_malformed_template_files_are_named(tmp_path):
    (tmp_path / "chat_template.json").write_text("{")
    with pytest.raises(KilnError, match="malformed JSON") as error:
        ChatTemplate.find(tmp_path)
    assert error.value.path == tmp_path / "chat_template.json"
