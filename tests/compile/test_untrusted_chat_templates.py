"""Compiling untrusted chat templates (issue 12): hostile and broken Jinja templates, all
generated here.

Every case must end in one KilnError naming the file and the problem, in bounded time and memory,
and through `kiln compile` in exit code 1 with one error line, no traceback, no model folder and no
temporary files.
"""

from __future__ import annotations

import time

import pytest

from helpers.untrusted import assert_clean_cli_failure, assert_refused

from kiln import chat_template
from kiln.chat_template import RENDER_SECONDS, ChatTemplate

MESSAGES = [{"role": "user", "content": "hello"}]
TEMPLATE_CASES = {
    "str mro": ("{{ ''.__class__.__mro__ }}", "tried something unsafe"),
    "cycler globals": ("{{ cycler.__init__.__globals__.os }}", "tried something unsafe"),
    "template reference context": ("{{ self._TemplateReference__context }}", "tried something unsafe"),
    "lipsum globals": ("{{ lipsum.__globals__['os'] }}", "tried something unsafe"),
    "joiner globals": ("{{ joiner.__init__.__globals__ }}", "tried something unsafe"),
    "mutating messages": ("{{ messages.append({'role': 'x'}) }}", "tried something unsafe"),
    "format attribute": ("{{ '{0.__class__}'.format(messages) }}", "tried something unsafe"),
    "nested range loops": (
        "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
        "ran for over 2 s",
    ),
    "loop over a long string": (
        "{% set s = 'a' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
        "ran for over 2 s",
    ),
    "string multiplication": ("{{ messages[0].content * 10**9 }}", "'*' would make a value of over"),
    "list multiplication": ("{{ (messages * 10**8)|length }}", "'*' would make a value of over"),
    "huge power": ("{{ 7 ** (10 ** 9) }}", "has over 4096 bits"),
    "center width": ("{{ messages[0].content|center(10**9) }}", "an argument of 1000000000"),
    "ljust width": ("{{ messages[0].content.ljust(10**9) }}", "an argument of 1000000000"),
    "format width": ("{{ '{:>999999999}'.format(messages[0].content) }}", "pads beyond any text"),
    "printf width": ("{{ '%999999999s' % messages[0].content }}", "pads beyond any text"),
    "format filter width": ("{{ '%999999999s'|format(messages[0].content) }}", "pads beyond any text"),
    "namespace doubling": (
        "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
        "makes a value of",
    ),
    "macro doubling": ("{% macro f(s) %}{{ f(s ~ s) }}{% endmacro %}{{ f('ab') }}", "makes a value of"),
    "output without bound": ("{% for i in range(99999) %}{{ 'a' * 9999 }}{% endfor %}", "output passes"),
    "division by zero": ("{{ messages|length / 0 }}", "ZeroDivisionError"),
    "recursion": ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
    "undefined attribute": ("{{ messages[0].nothing.deeper }}", "UndefinedError"),
    "raise_exception": ("{{ raise_exception('no system role') }}", "refuses these messages: no system role"),
}


# The cases stopped by the render's deadline wait for it: here a quarter of RENDER_SECONDS, the same
# trace stopping the render; `kiln compile` below meets the real one.
SHORT_RENDER_SECONDS = RENDER_SECONDS / 4


@pytest.mark.parametrize("case", TEMPLATE_CASES)
def test_hostile_or_broken_chat_template_is_refused(tmp_path, case, monkeypatch):
    monkeypatch.setattr(chat_template, "RENDER_SECONDS", SHORT_RENDER_SECONDS)
    source, problem = TEMPLATE_CASES[case]
    problem = problem.replace(f"over {RENDER_SECONDS:g} s", f"over {SHORT_RENDER_SECONDS:g} s")
    path = tmp_path / "chat_template.jinja"
    start = time.monotonic()
    assert_refused(lambda: ChatTemplate(source, path, {}).render(MESSAGES), path, problem)
    assert time.monotonic() - start < 10


def test_bounds_leave_ordinary_templates_alone(tmp_path):
    source = (
        "{{ '%s: %d%%'|format('a', 5) }} {{ '{} {:>4}'.format('b', 'c') }} {{ '%03d' % 7 }} {{ 2 ** 10 }} "
        "{{ (range(3)|list + [3])|join(',') }} {{ '-' * 3 }}{% set ns = namespace(n=0) %}"
        "{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}"
    )
    rendered = ChatTemplate(source, tmp_path / "t.jinja", {}).render(MESSAGES * 2)
    assert rendered == "a: 5% b    c 007 1024 0,1,2,3 ---2"


# ---- through `kiln compile`: one line, exit 1, nothing left behind -------------------------


@pytest.mark.slow
@pytest.mark.parametrize("case", ["nested range loops", "namespace doubling", "cycler globals"])
def test_kiln_compile_refuses_a_hostile_chat_template_in_one_line(folder, tmp_path, case):
    """The template is read at ingest but rendered when the conv_template is derived, after the
    weights are converted (it gets ChatML's marker, for a family to be tried)."""
    source, problem = TEMPLATE_CASES[case]
    (folder / "chat_template.jinja").write_text("<|im_start|>" + source)
    assert_clean_cli_failure(folder, tmp_path, folder / "chat_template.jinja", problem)
