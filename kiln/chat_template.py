"""A model's jinja chat template, always rendered in jinja's immutable sandbox.

Chat templates come from files downloaded with the model, so one may try to reach Python's
internals (`cycler.__init__.__globals__.os` and the like); the sandbox refuses every such
attribute. Compile time and run time use this one environment, the one `transformers` renders
with (trim_blocks, lstrip_blocks, `raise_exception`, `strftime_now`).
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kiln.errors import KilnError


def template_source(tokenizer_config: dict) -> str | None:
    """The default chat template of a tokenizer_config.json (a string, or named templates)."""
    source = tokenizer_config.get("chat_template")
    if isinstance(source, list):
        source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None)
    return source if isinstance(source, str) and source else None


def _raise_exception(message):
    raise jinja2.TemplateError(message)


def compile_chat_template(source: str, path: Path) -> jinja2.Template:
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return environment.from_string(source)
    except jinja2.TemplateError as e:
        raise KilnError(f"the chat_template does not parse: {e}", path) from None


def render_chat_template(template: jinja2.Template, path: Path, **context) -> str:
    """Render, turning the template's own failures and sandbox refusals into one KilnError."""
    try:
        return template.render(**context)
    except jinja2.exceptions.SecurityError as e:
        raise KilnError(f"the chat_template tried something unsafe and was stopped: {e}", path) from None
    except Exception as e:  # a template is code: it can also fail with TypeError, ZeroDivisionError, ...
        raise KilnError(f"the chat template failed on these messages: {type(e).__name__}: {e}", path) from None
