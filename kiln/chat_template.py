"""A model's jinja chat template: found where checkpoints keep it, rendered in jinja's immutable sandbox.

Checkpoints keep the template in one of three places, and `transformers` reads them in this order:
`chat_template.jinja` (what it writes today), `chat_template.json` (`{"chat_template": ...}`, the
processors' file) and the `chat_template` of tokenizer_config.json — in either JSON file a string
or named templates (`[{"name", "template"}]`), of which Kiln uses the one named "default". A
model without any is a base model: it completes raw text and has no chat.

Chat templates come from files downloaded with the model, so one may try to reach Python's
internals (`cycler.__init__.__globals__.os` and the like); the sandbox refuses every such
attribute. Compile time and run time use this one environment, the one `transformers` renders
with (trim_blocks, lstrip_blocks, `raise_exception`, `strftime_now`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kiln.errors import KilnError

TEMPLATE_FILE = "chat_template.jinja"
PROCESSOR_TEMPLATE_FILE = "chat_template.json"
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class ConversationRefused(KilnError):
    """The template itself refused the messages (its `raise_exception`), e.g. a role it does not know."""


class TemplateRaised(jinja2.TemplateError):
    """What a template's `raise_exception` raises."""


def _raise_exception(message):
    raise TemplateRaised(message)


def template_source(config: dict, path: Path) -> str | None:
    """The default chat template in a JSON file's `chat_template`: a string, or named templates."""
    source = config.get("chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        if "default" not in named:
            raise KilnError(f"named chat templates ({', '.join(map(str, named))}) but none is called 'default'", path)
        source = named["default"]
    return source if isinstance(source, str) and source else None


def special_token_text(value) -> str:
    return value.get("content", "") if isinstance(value, dict) else value or ""


def read_json_object(path: Path) -> dict:
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise KilnError(f"malformed JSON: {e}", path) from None
    if not isinstance(content, dict):
        raise KilnError("malformed: not a JSON object", path)
    return content


@dataclass
class ChatTemplate:
    """A chat template and where it came from; renders with the tokenizer's special tokens."""

    source: str
    path: Path
    special_tokens: dict[str, str]  # bos_token, eos_token, ... as text, from tokenizer_config.json
    _compiled: jinja2.Template | None = field(default=None, repr=False)

    @classmethod
    def find(cls, folder: Path) -> ChatTemplate | None:
        """The model's default chat template, or None when the folder has none (a base model)."""
        tokenizer_config_path = folder / "tokenizer_config.json"
        tokenizer_config = read_json_object(tokenizer_config_path) if tokenizer_config_path.is_file() else {}
        special_tokens = {key: special_token_text(tokenizer_config.get(key)) for key in SPECIAL_TOKEN_KEYS}
        if (folder / TEMPLATE_FILE).is_file():
            return cls((folder / TEMPLATE_FILE).read_text(encoding="utf-8"), folder / TEMPLATE_FILE, special_tokens)
        processor_path = folder / PROCESSOR_TEMPLATE_FILE
        processor_config = read_json_object(processor_path) if processor_path.is_file() else {}
        for config, path in ((processor_config, processor_path), (tokenizer_config, tokenizer_config_path)):
            if source := template_source(config, path):
                return cls(source, path, special_tokens)
        return None

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self._compiled is None:
            self._compiled = compile_chat_template(self.source, self.path)
        return render_chat_template(self._compiled, self.path, messages=messages,
                                    add_generation_prompt=add_generation_prompt, **self.special_tokens)


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
    except TemplateRaised as e:
        raise ConversationRefused(f"the chat template refuses these messages: {e}", path) from None
    except jinja2.exceptions.SecurityError as e:
        raise KilnError(f"the chat_template tried something unsafe and was stopped: {e}", path) from None
    except Exception as e:  # a template is code: it can also fail with TypeError, ZeroDivisionError, ...
        raise KilnError(f"the chat template failed on these messages: {type(e).__name__}: {e}", path) from None
