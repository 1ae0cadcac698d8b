"""A model's jinja chat template: found where checkpoints keep it, rendered in jinja's immutable sandbox.

Checkpoints keep the template in one of three places, and `transformers` reads them in this order:
`chat_template.jinja` (what it writes today), `chat_template.json` (`{"chat_template": ...}`, the
processors' file) and the `chat_template` of tokenizer_config.json — in either JSON file a string
or named templates (`[{"name", "template"}]`), of which Kiln uses the one named "default". A
model without any is a base model: it completes raw text and has no chat.

Chat templates come from files downloaded with the model, so one may try to reach Python's
internals (`cycler.__init__.__globals__.os` and the like); the sandbox refuses every such
attribute. A template may also loop or grow its output without bound: a render stops after
RENDER_SECONDS, and no text or list it makes (by `*`, `+`, `**`, a filter or a method) nor its
output may pass MAX_TEXT items. Compile time and run time use this one environment, the one
`transformers` renders with (trim_blocks, lstrip_blocks, `raise_exception`, `strftime_now`).
"""

from __future__ import annotations

import functools
import json
import operator
import re
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

from kiln.errors import KilnError, one_line

TEMPLATE_FILE = "chat_template.jinja"
PROCESSOR_TEMPLATE_FILE = "chat_template.json"
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
# Real chat templates render a conversation in milliseconds into a few kilobytes beyond its messages.
RENDER_SECONDS = 2.0
MAX_TEXT = 1 << 23  # characters of a text, items of a list: 8M, some 2M tokens
MAX_POWER_BITS = 4096
TEMPLATE_CODE = "<template>"  # the file name jinja compiles templates under
# A width or precision of 8 digits or more in a printf-style or str.format conversion.
HUGE_FORMAT_WIDTH = re.compile(r"(%[^a-zA-Z%]*|\{[^{}]*:[^{}]*)\d{8}")


class ConversationRefused(KilnError):
    """The template itself refused the messages (its `raise_exception`), e.g. a role it does not know."""


class TemplateRaised(jinja2.TemplateError):
    """What a template's `raise_exception` raises."""


class TemplateTooCostly(jinja2.exceptions.SecurityError):
    """A template ran too long or made too much."""


def checked_size(value):
    if isinstance(value, (str, list, tuple, dict)) and len(value) > MAX_TEXT:
        raise TemplateTooCostly(f"it makes a value of {len(value)} items (at most {MAX_TEXT})")
    return value


def checked_args(args) -> None:
    """No huge text, and no count or width (center, indent, ljust, ...) beyond any text's size."""
    for arg in args:
        if isinstance(arg, int) and abs(arg) > MAX_TEXT:
            raise TemplateTooCostly(f"an argument of {arg} is larger than any text (at most {MAX_TEXT})")
        checked_size(arg)


def checked_format(text):
    if isinstance(text, str) and (match := HUGE_FORMAT_WIDTH.search(text)):
        raise TemplateTooCostly(f"the format {match.group()!r} pads beyond any text")
    return text


class BoundedNamespace(Namespace):
    """`namespace()`, whose attributes (the only values a template can carry from one loop pass to
    the next, and so double each pass) are no larger than MAX_TEXT."""

    def __setitem__(self, name, value):
        super().__setitem__(name, checked_size(value))


def result_size(left, right, operation: str) -> int:
    """How many items `left <operation> right` makes of sequences (0 for numbers)."""
    if operation == "*":
        times, sequence = (left, right) if isinstance(left, int) else (right, left)
        return len(sequence) * times if isinstance(sequence, (str, list, tuple)) and isinstance(times, int) else 0
    if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
        return len(left) + len(right)
    return 0


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox that also refuses to make huge values (see the module doc)."""

    intercepted_binops = frozenset({"*", "+", "**", "%"})
    binops = {"*": operator.mul, "+": operator.add, "**": operator.pow, "%": operator.mod}

    def __init__(self, **options):
        super().__init__(**options)
        self.filters = {name: self.bounded(f) for name, f in self.filters.items()}
        self.filters["format"] = self.bounded(self.filters["format"], checked_format)
        self.globals["namespace"] = BoundedNamespace

    @staticmethod
    def bounded(function, check_first=lambda value: value):
        @functools.wraps(function)
        def call(first, *args, **kwargs):
            checked_args([check_first(first), *args, *kwargs.values()])
            return checked_size(function(first, *args, **kwargs))

        return call

    def unsafe_undefined(self, obj, attribute):
        """Fail rather than print nothing: a chat template has no reason to look at Python's internals."""
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )

    def wrap_str_format(self, value):
        """`text.format` (the sandbox's own), for a text without huge widths."""
        wrapped = super().wrap_str_format(value)
        if wrapped is not None:
            checked_format(value.__self__)
        return wrapped

    def call_binop(self, context, operation, left, right):
        if operation == "%":
            checked_format(left)
        if result_size(left, right, operation) > MAX_TEXT:
            raise TemplateTooCostly(f"'{operation}' would make a value of over {MAX_TEXT} items")
        if (
            operation == "**"
            and isinstance(left, int)
            and isinstance(right, int)
            and abs(left) > 1
            and right * abs(left).bit_length() > MAX_POWER_BITS
        ):
            raise TemplateTooCostly(f"{left} ** {right} has over {MAX_POWER_BITS} bits")
        return self.binops[operation](left, right)

    def call(self, context, obj, *args, **kwargs):
        checked_args([*args, *kwargs.values()])
        return checked_size(super().call(context, obj, *args, **kwargs))


@contextmanager
def deadline(seconds: float):
    """Stops template code (not the Python it calls) that runs past `seconds`: a trace on the
    template's own lines, since a loop in a template gives jinja no place to check."""
    end = time.monotonic() + seconds

    def on_line(frame, event, arg):
        if time.monotonic() > end:
            raise TemplateTooCostly(f"it ran for over {seconds:g} s")
        return on_line

    def on_call(frame, event, arg):
        return on_line if frame.f_code.co_filename == TEMPLATE_CODE else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        yield
    finally:
        sys.settrace(previous)


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
    if source is not None and not isinstance(source, str):
        raise KilnError(f"chat_template should be a string or named templates, got {type(source).__name__}", path)
    return source or None


def special_token_text(key: str, value, path: Path) -> str:
    """A special token as text: a string, or an added token's `{"content": ...}`."""
    text = value.get("content") if isinstance(value, dict) else value
    if text is not None and not isinstance(text, str):
        raise KilnError(f'{key} should be a string or {{"content": string}}, got {value!r}', path)
    return text or ""


def read_json_object(path: Path) -> dict:
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise KilnError(f"malformed JSON: {one_line(e)}", path) from None
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
        special_tokens = {
            key: special_token_text(key, tokenizer_config.get(key), tokenizer_config_path) for key in SPECIAL_TOKEN_KEYS
        }
        if (folder / TEMPLATE_FILE).is_file():
            return cls((folder / TEMPLATE_FILE).read_text(encoding="utf-8"), folder / TEMPLATE_FILE, special_tokens)
        processor_path = folder / PROCESSOR_TEMPLATE_FILE
        processor_config = read_json_object(processor_path) if processor_path.is_file() else {}
        for config, path in ((processor_config, processor_path), (tokenizer_config, tokenizer_config_path)):
            if source := template_source(config, path):
                return cls(source, path, special_tokens)
        return None

    def compiled(self) -> jinja2.Template:
        if self._compiled is None:
            self._compiled = compile_chat_template(self.source, self.path)
        return self._compiled

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
        tools_context = {"tools": tools} if tools else {}
        return render_chat_template(
            self.compiled(),
            self.path,
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            **tools_context,
            **self.special_tokens,
        )


def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' `tojson`: plain JSON (jinja's own escapes <, >, & and ' for HTML), with an indent."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_chat_template(source: str, path: Path) -> jinja2.Template:
    environment = BoundedSandbox(trim_blocks=True, lstrip_blocks=True)
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    environment.filters["tojson"] = tojson
    try:
        return environment.from_string(source)
    except jinja2.TemplateError as e:
        raise KilnError(f"the chat_template does not parse: {one_line(e)}", path) from None
    except RecursionError:
        raise KilnError("the chat_template does not parse: it nests too deeply", path) from None


def bounded_render(template: jinja2.Template, context: dict) -> str:
    pieces, size = [], 0
    with deadline(RENDER_SECONDS):
        for piece in template.generate(**context):
            size += len(piece)
            if size > MAX_TEXT:
                raise TemplateTooCostly(f"its output passes {MAX_TEXT} characters")
            pieces.append(piece)
    return "".join(pieces)


def render_chat_template(template: jinja2.Template, path: Path, **context) -> str:
    """Render, turning the template's own failures and sandbox refusals into one KilnError."""
    try:
        return bounded_render(template, context)
    except TemplateRaised as e:
        raise ConversationRefused(f"the chat template refuses these messages: {one_line(e)}", path) from None
    except TemplateTooCostly as e:
        raise KilnError(f"the chat_template was stopped: {e}", path) from None
    except jinja2.exceptions.SecurityError as e:
        raise KilnError(f"the chat_template tried something unsafe and was stopped: {one_line(e)}", path) from None
    except Exception as e:  # a template is code: it can also fail with TypeError, ZeroDivisionError, ...
        raise KilnError(
            f"the chat template failed on these messages: {type(e).__name__}: {one_line(e)}", path
        ) from None
