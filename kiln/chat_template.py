"""A model's jinja chat template: found where checkpoints keep it, rendered in jinja's immutable sandbox.

Checkpoints keep the template in one of three places, and `transformers` reads them in this order:
`chat_template.jinja` (what it writes today), `chat_template.json` (`{"chat_template": ...}`, the
processors' file) and the `chat_template` of tokenizer_config.json — in either JSON file a string
or named templates (`[{"name", "template"}]`), of which Kiln uses the one named "default". A
model without any is a base model: it completes raw text and has no chat.

Chat templates come from files downloaded with the model, so one may try to reach Python's
internals (`cycler.__init__.__globals__.os` and the like); the sandbox refuses every such
attribute. A template may also loop, or make huge values from small ones (`join`, `replace`,
format widths, `tojson(indent=4)` of a deeply nested tool: each makes ~1000 times what it is
given). Two bounds stop it, in the same process and thread as the request:
  - size, before a value is made: every filter, global, str method and operator that can make
    more than it is given has a predictor (`FILTER_SIZES`, `METHOD_SIZES`, `GLOBAL_SIZES`,
    `BINOP_SIZES`) that computes, from its arguments, how large its result can be, and the call
    is refused before it runs when that passes MAX_TEXT (characters of a text, items of a list).
    What a value prints as (`{{ }}`, `~`, `join`, `string`, `tojson`) is counted by walking it
    (`printed_size`), not by printing it, and a value nested deeper than MAX_NESTING is refused.
    Any other call makes at most what its arguments hold plus a count or width among them
    (`shallow_size`); every result is checked again after.
  - time: a render stops after RENDER_SECONDS, checked on every line of Python it runs (the
    template's and the library code it calls; it makes a 100-message render ~3 ms slower). A call
    into C has no lines, which is why no single call may be long: the size bounds keep each one to
    a few MAX_TEXT of work.
Not chosen: rendering in a child process under CPU and memory limits. The server renders in its
request threads, and forking a multi-threaded process that holds loaded models is unsafe, while
spawning a fresh interpreter costs ~100 ms per request; the browser engine cannot do either.
Compile time and run time use this one environment, the one `transformers` renders with
(trim_blocks, lstrip_blocks, `tojson`, `raise_exception`, `strftime_now`, `{% generation %}`).
"""

from __future__ import annotations

import functools
import json
import operator
import re
import sys
import threading
import time
from collections.abc import ItemsView, Iterator, KeysView, Mapping, ValuesView
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

import jinja2
import jinja2.ext
from jinja2.compiler import CodeGenerator
from jinja2.runtime import str_join
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEscapeFormatter, SandboxedFormatter
from jinja2.utils import Namespace, _PassArg
from markupsafe import Markup

from kiln.errors import KilnError, one_line

TEMPLATE_FILE = "chat_template.jinja"
PROCESSOR_TEMPLATE_FILE = "chat_template.json"
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
# Real chat templates render a conversation in milliseconds into a few kilobytes beyond its messages.
RENDER_SECONDS = 2.0
MAX_TEXT = 1 << 23  # characters of a text, items of a list: 8M, some 2M tokens
MAX_NESTING = 64  # levels of lists and objects in a value printed or serialized (tool schemas use ~10)
MAX_MADE = 8 * MAX_TEXT  # characters and items one render may make in all (a loop makes many values)
MAX_INT_BITS = 4096


class ConversationRefused(KilnError):
    """The template itself refused the messages (its `raise_exception`), e.g. a role it does not know."""


class TemplateRaised(jinja2.TemplateError):
    """What a template's `raise_exception` raises."""


class TemplateTooCostly(jinja2.exceptions.SecurityError):
    """A template ran too long or made too much."""


def refuse_size(size: int) -> None:
    if size > MAX_TEXT:
        raise TemplateTooCostly(f"it makes a value of {size} items or more (at most {MAX_TEXT})")


RENDER = threading.local()  # `left`: what the render running in this thread may still make


def made(size: int) -> None:
    """A value of `size` is about to be made: refused past MAX_TEXT, or past what the render has left of MAX_MADE."""
    refuse_size(size)
    left = getattr(RENDER, "left", None)
    if left is not None:
        RENDER.left = left - size
        if RENDER.left < 0:
            raise TemplateTooCostly(f"it makes over {MAX_MADE} characters and items in all")


def checked_size(value):
    if isinstance(value, (str, bytes, list, tuple, dict)):
        refuse_size(len(value))
    return value


def checked_args(args) -> None:
    """No huge text, and no count or width (center, indent, ljust, ...) beyond any text's size."""
    for arg in args:
        if is_int(arg) and abs(arg) > MAX_TEXT:
            raise TemplateTooCostly(f"an argument of {arg} is larger than any text (at most {MAX_TEXT})")
        checked_size(arg)


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# ---- What a value prints as, counted without printing it --------------------------------------


@dataclass(frozen=True)
class Layout:
    """How values are written out: Python's str() (repr inside containers), or JSON; on one line
    (`indent` None) or with each item on a line of its own, `indent` characters per level."""

    json: bool = False
    separator: int = 2  # ", "
    key_separator: int = 2  # ": "
    indent: int | None = None
    ensure_ascii: bool = False


PYTHON = Layout()


def printed_size(value, layout: Layout = PYTHON) -> int:
    """How many characters `value` is written out as in `layout` (an upper bound for Python's str),
    counted by walking it: a part shared many times is counted each time, but walked once at each
    depth. Refuses past MAX_TEXT, or nesting deeper than MAX_NESTING."""
    return SizeWalk(layout).size(value, 0)


class SizeWalk:
    def __init__(self, layout: Layout):
        self.layout = layout
        self.sizes: dict[tuple[int, int], tuple[Any, int]] = {}  # (id, depth) → (the value, kept alive; its size)

    def size(self, value, depth: int) -> int:
        parts = (json_parts if self.layout.json else python_parts)(value)
        if parts is None:
            return (json_scalar_size if self.layout.json else python_scalar_size)(value, depth, self.layout)
        known = self.sizes.get((id(value), depth))
        if known is not None:
            return known[1]
        if depth >= MAX_NESTING:
            raise TemplateTooCostly(f"it nests values more than {MAX_NESTING} deep")
        overhead, count, items, keyed = parts
        total = overhead + self.lines(count, depth) + keyed * count * self.layout.key_separator
        refuse_size(total)
        for item in items:
            if keyed:
                key, item = item
                total += self.key_size(key, depth)
            total += self.size(item, depth + 1)
            refuse_size(total)
        self.sizes[(id(value), depth)] = (value, total)
        return total

    def lines(self, count: int, depth: int) -> int:
        """Separators, and with an indent each item's line and the closing one."""
        if count == 0:
            return 0
        indent = self.layout.indent
        lines = 0 if indent is None else count * (1 + indent * (depth + 1)) + 1 + indent * depth
        return (count - 1) * self.layout.separator + lines

    def key_size(self, key, depth: int) -> int:
        if self.layout.json and not isinstance(key, str):
            return 26  # a number, true, false or null as a quoted key
        return self.size(key, depth + 1)


def python_parts(value):
    """(characters around the items, their count, the items, keyed?) of a container Python prints; None for others."""
    if isinstance(value, (str, bytes)):
        return None
    if isinstance(value, Namespace):
        value = value._Namespace__attrs  # printed as <Namespace {...}>
    if isinstance(value, Mapping):
        return 16, len(value), value.items(), True
    if isinstance(value, (list, tuple, set, frozenset, KeysView, ValuesView, ItemsView)):
        # a type's name and its fields (named tuples), brackets, a 1-tuple's comma
        names = len(type(value).__name__) + sum(len(name) + 1 for name in getattr(value, "_fields", ()))
        return 8 + names, len(value), value, False
    return None


def json_parts(value):
    if isinstance(value, dict):
        return 2, len(value), value.items(), True
    if isinstance(value, (list, tuple)):
        return 2, len(value), value, False
    return None


def python_scalar_size(value, depth: int, layout: Layout) -> int:
    if isinstance(value, str):
        return len(value) if depth == 0 else repr_text_size(value)
    if isinstance(value, bytes):
        return 3 + 4 * len(value)
    if isinstance(value, bool) or value is None:
        return 5
    if isinstance(value, int):
        return int_text_size(value)
    if isinstance(value, float):
        return 24
    # Undefined, macros, loops, iterators, ranges: a few words
    return len(str(value) if depth == 0 else repr(value))


def json_scalar_size(value, depth: int, layout: Layout) -> int:
    if isinstance(value, str):
        return json_string_size(value, layout.ensure_ascii)
    if isinstance(value, bool) or value is None:
        return 5
    if isinstance(value, int):
        return int_text_size(value)
    return 24  # a float; anything else is a TypeError of json.dumps


def int_text_size(value: int) -> int:
    return value.bit_length() * 3 // 10 + 2


REPR_SHORT_ESCAPES = "\n\r\t"


def repr_text_size(text: str) -> int:
    """repr(text) at most: quotes, escaped quotes and backslashes, and \\n or \\x.. for others."""
    size = 2 + len(text) + text.count("\\") + text.count("'")
    if text.isprintable():
        return size
    others = text
    for escape in REPR_SHORT_ESCAPES:
        others = others.replace(escape, "")
    return size + sum(map(text.count, REPR_SHORT_ESCAPES)) + (0 if others.isprintable() else 9 * len(text))


JSON_SHORT_ESCAPES = "\n\r\t\b\f"
JSON_LONG_ESCAPES = [chr(c) for c in range(0x20) if chr(c) not in JSON_SHORT_ESCAPES]  # \u00XX


def json_string_size(text: str, ensure_ascii: bool) -> int:
    size = 2 + len(text) + text.count('"') + text.count("\\")
    if not text.isprintable():
        size += sum(map(text.count, JSON_SHORT_ESCAPES)) + 5 * sum(map(text.count, JSON_LONG_ESCAPES))
    if ensure_ascii and not text.isascii():
        size += 11 * len(text)  # \uXXXX, or two of them
    return size


def text_of(value) -> str:
    """str(value), once it is known not to be huge."""
    if isinstance(value, str):
        return value
    refuse_size(printed_size(value))
    return str(value)


# ---- How large a call's result can be, from its arguments ---------------------------------------


def shallow_size(*args, **kwargs) -> int:
    """What a call not listed in the predictors makes at most: as much as its arguments hold, and a
    count or width among them (center, ljust, batch)."""
    return sum(
        abs(a) if is_int(a) else len(a) if isinstance(a, (str, bytes, list, tuple, dict)) else 0
        for a in [*args, *kwargs.values()]
    )


def replaced_size(text, old, new, count=-1) -> int:
    if not all(isinstance(t, (str, bytes)) for t in (text, old, new)):
        return 0  # str.replace raises
    occurrences = text.count(old) if old else len(text) + 1
    if is_int(count) and count >= 0:
        occurrences = min(occurrences, count)
    return len(text) + occurrences * (len(new) - len(old))


def joined_size(separator, items, item_size: Callable[[Any], int]) -> int:
    if isinstance(items, (str, bytes)):
        return len(items) * (1 + len(separator))
    total = 0
    for item in items:
        total += item_size(item)
        refuse_size(total)
    return total + max(len(items) - 1, 0) * len(separator)


def text_len(value) -> int:
    return len(value) if isinstance(value, (str, bytes)) else 0


def translated_size(text, table) -> int:
    """Each character becomes its entry in the table: at most the longest entry."""
    entries = table.values() if isinstance(table, Mapping) else table if isinstance(table, (list, tuple)) else ()
    return len(text) * max([1, *map(text_len, entries)])


def tabs_expanded_size(text, tabsize=8) -> int:
    tab = "\t" if isinstance(text, str) else b"\t"
    return len(text) + text.count(tab) * max(tabsize, 0) if is_int(tabsize) else 0


def grown(factor: int):
    """A method that makes at most `factor` characters of each (Unicode case mappings make up to 3)."""
    return lambda text, *args, **kwargs: factor * len(text)


METHOD_SIZES = {  # of str and bytes, given the text the method is of, then its arguments
    "replace": replaced_size,
    "join": lambda separator, items: joined_size(separator, items, text_len),
    "expandtabs": tabs_expanded_size,
    "translate": translated_size,
    "encode": lambda text, encoding="utf-8", errors="strict": 10 * len(text) + 4,  # unicode_escape: \U0001f600
    "hex": grown(3),
    **dict.fromkeys(("upper", "lower", "title", "capitalize", "swapcase", "casefold"), grown(3)),
}


def printing(factor: int):
    """A filter that writes its value out as text and makes at most `factor` characters of each
    (escaping: '&#34;'; case mappings: 3), besides its other arguments."""
    return lambda value, *args, **kwargs: factor * printed_size(value) + shallow_size(*args, **kwargs)


def tojson_size(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> int:
    width = len(indent) if isinstance(indent, str) else max(indent, 0) if is_int(indent) else None
    item_separator, key_separator = separators or ((", " if width is None else ","), ": ")
    layout = Layout(True, text_len(item_separator), text_len(key_separator), width, bool(ensure_ascii))
    return printed_size(value, layout)


def indented_size(text, width=4, first=False, blank=False) -> int:
    text = text_of(text)
    per_line = len(width) if isinstance(width, str) else width if is_int(width) else printed_size(width)
    return len(text) + (text.count("\n") + 1) * max(per_line, 0)


def summed_size(items, attribute=None, start=0) -> int:
    """sum() adds sequences one at a time, copying what it has so far each time."""
    lengths = [
        printed_size(item) if attribute is not None else len(item)
        for item in items
        if isinstance(item, (str, bytes, list, tuple)) or (attribute is not None and python_parts(item))
    ]
    return len(lengths) * (sum(lengths) + shallow_size(start))


FILTER_SIZES = {  # given the filter's arguments, after the context jinja passes some filters
    **dict.fromkeys(("center", "safe", "string", "striptags", "trim", "truncate", "wordcount"), printing(1)),
    **dict.fromkeys(("capitalize", "lower", "upper", "title"), printing(3)),
    **dict.fromkeys(("e", "escape", "forceescape", "xmlattr"), printing(5)),
    "urlencode": printing(12),  # a 4-byte character as %XX%XX%XX%XX
    # each word may become <a href="word" rel=.. target=..>word</a>
    "urlize": lambda value, *args, **kwargs: printed_size(value) * (50 + shallow_size(*args, **kwargs)),
    "join": lambda value, d="", attribute=None: joined_size(text_of(d), value, printed_size),
    "replace": lambda s, old, new, count=None: replaced_size(
        text_of(s), text_of(old), text_of(new), -1 if count is None else count
    ),
    "format": lambda value, *args, **kwargs: percent_size(text_of(value), kwargs or args),
    "indent": indented_size,
    "wordwrap": lambda s, width=79, break_long_words=True, wrapstring=None, break_on_hyphens=True: (
        printed_size(s) * (1 + (len(wrapstring) if isinstance(wrapstring, str) else 1))
    ),
    "tojson": tojson_size,
    "sum": summed_size,
}
# Not offered: pprint, whose indentation grows with the keys of the objects it nests in (no chat
# template prints Python's repr of a value).
REMOVED_FILTERS = ("pprint",)

GLOBAL_SIZES = {
    "lipsum": lambda n=5, html=True, min=20, max=100: n * (15 * max + 8) if is_int(n) and is_int(max) else 0,
    "strftime_now": lambda format: 20 * text_len(format) + 32,  # %c: 24 characters of 2
}


# ---- Formats: printf-style `%` and the `format` filter; str.format ------------------------------

PERCENT_CONVERSION = re.compile(
    r"%(?:\((?P<key>[^)]*)\))?[#0 +-]*(?P<width>\*|\d+)?(?:\.(?P<precision>\*|\d*))?[hlL]?(?P<kind>.?)", re.S
)
FORMAT_SPEC = re.compile(
    r"(?:.?[<>=^])?[-+ ]?z?#?0?(?P<width>\d*)(?P<grouping>[,_]?)(?:\.(?P<precision>\d*))?(?P<kind>[a-zA-Z%]?)", re.S
)


def spec_number(number, spec: str) -> int | None:
    """A width or precision, from its digits or from a `*` argument."""
    if isinstance(number, str):
        if not number:
            return None
        if len(number) > len(str(MAX_TEXT)):
            raise TemplateTooCostly(f"the format {spec!r} pads beyond any text")
        number = int(number)
    if not is_int(number):
        return None
    if abs(number) > MAX_TEXT:
        raise TemplateTooCostly(f"the format {spec!r} pads beyond any text")
    return abs(number)


def conversion_size(value, kind: str, width: int | None, precision: int | None, grouping: bool = False) -> int:
    """How long one converted value can be: its text (cut to `precision`), a number's digits, or its width."""
    if kind in ("r", "a"):
        base = printed_size([value]) - 2  # a repr, as inside a list
    elif isinstance(value, str):
        base = len(value) if precision is None else min(len(value), precision)
    elif is_int(value) or isinstance(value, bool):
        base = value.bit_length() + 8 + (precision or 0)  # binary digits, a prefix and a sign
    elif isinstance(value, float):
        base = 320 + (precision or 0)  # 1e308 in fixed point
    else:
        base = printed_size(value)
    return max(width or 0, base * (2 if grouping else 1))


def percent_size(text, values) -> int:
    """How long `text % values` can be: each conversion as long as its value or its width."""
    if isinstance(text, bytes):
        text = text.decode("latin-1")
    if not isinstance(text, str):
        return 0  # a number's remainder
    mapping = values if isinstance(values, Mapping) else None
    positional = iter(values if isinstance(values, tuple) else (values,))
    size = len(text)
    for conversion in PERCENT_CONVERSION.finditer(text):
        if conversion["kind"] == "%":
            continue
        spec = conversion[0]
        width = spec_number(next(positional, None) if conversion["width"] == "*" else conversion["width"], spec)
        precision = conversion["precision"]
        precision = spec_number(next(positional, None) if precision == "*" else precision, spec)
        keyed = mapping is not None and conversion["key"] is not None
        value = mapping.get(conversion["key"]) if keyed else next(positional, "")
        size += conversion_size(value, conversion["kind"], width, precision)
        refuse_size(size)
    return size


def field_size(value, spec: str) -> int:
    match = FORMAT_SPEC.fullmatch(spec)
    if match is None:  # not a standard spec: format() refuses it
        return printed_size(value) + len(spec)
    width, precision = spec_number(match["width"], spec), spec_number(match["precision"], spec)
    return conversion_size(value, match["kind"], width, precision, bool(match["grouping"]))


class BoundedFormatting:
    """str.format that counts what each field makes (its value's text, a number, its width) before
    making it, nested widths (`{0:>{1}}`) included."""

    growth = 1

    def vformat(self, format_string, args, kwargs):
        self.made = len(format_string)
        return super().vformat(format_string, args, kwargs)

    def convert_field(self, value, conversion):
        if conversion is not None:
            refuse_size(conversion_size(value, conversion, None, None))
        return super().convert_field(value, conversion)

    def format_field(self, value, format_spec):
        self.made += self.growth * field_size(value, format_spec)
        refuse_size(self.made)
        return super().format_field(value, format_spec)


class BoundedFormatter(BoundedFormatting, SandboxedFormatter):
    pass


class BoundedEscapeFormatter(BoundedFormatting, SandboxedEscapeFormatter):
    growth = 5  # '&#34;'


# ---- The sandbox --------------------------------------------------------------------------------


def product_size(left, right) -> int:
    if is_int(left) and is_int(right):
        if left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise TemplateTooCostly(
                f"a product of {left.bit_length()} and {right.bit_length()} bits has over {MAX_INT_BITS} bits"
            )
        return 0
    times, sequence = (left, right) if is_int(left) else (right, left)
    return len(sequence) * times if isinstance(sequence, (str, bytes, list, tuple)) and is_int(times) else 0


def concatenated_size(left, right) -> int:
    sequences = all(isinstance(side, (str, bytes, list, tuple)) for side in (left, right))
    return len(left) + len(right) if sequences else 0


def power_size(left, right) -> int:
    if is_int(left) and is_int(right) and abs(left) > 1 and right * abs(left).bit_length() > MAX_INT_BITS:
        raise TemplateTooCostly(f"{left} ** {right} has over {MAX_INT_BITS} bits")
    return 0


BINOP_SIZES = {"*": product_size, "+": concatenated_size, "**": power_size, "%": percent_size}
BINOPS = {"*": operator.mul, "+": operator.add, "**": operator.pow, "%": operator.mod}


def materialized(args: tuple) -> tuple:
    """One-pass iterators (map, select, ...) as lists, so that both the predictor and the call see their items."""
    return tuple(list(arg) if isinstance(arg, Iterator) else arg for arg in args)


def bounded(function, predict=shallow_size, iterates: bool = False):
    """`function` (a filter or a global), refused before it runs when `predict`, given the same
    arguments, says it makes more than MAX_TEXT, and after it runs when it did."""
    passed = 1 if _PassArg.from_obj(function) else 0  # the context jinja passes some filters first

    @functools.wraps(function)
    def call(*args, **kwargs):
        context, args = args[:passed], args[passed:]
        if iterates:
            args = materialized(args)
        checked_args([*args, *kwargs.values()])
        made(predict(*args, **kwargs))
        return checked_size(function(*context, *args, **kwargs))

    return call


def printed(value):
    """What `{{ value }}` writes, once its size is known (the environment's `finalize`)."""
    made(printed_size(value))
    return value


class BoundedNamespace(Namespace):
    """`namespace()`, whose attributes (the only values a template can carry from one loop pass to
    the next, and so double each pass) are no larger than MAX_TEXT."""

    def __setitem__(self, name, value):
        super().__setitem__(name, checked_size(value))


class BoundedCodeGenerator(CodeGenerator):
    """Writes `a ~ b` as the environment's `joined_text`, which counts what the parts print as first."""

    def visit_Concat(self, node, frame) -> None:
        self.write("environment.joined_text((")
        for part in node.nodes:
            self.visit(part, frame)
            self.write(", ")
        self.write("))")


def _raise_exception(message):
    raise TemplateRaised(message)


def strftime_now(format):
    return datetime.now().strftime(format)


def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' `tojson`: plain JSON (jinja's own escapes <, >, & and ' for HTML), with an indent."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


TRANSFORMERS_FILTERS = {"tojson": tojson}
TRANSFORMERS_GLOBALS = {"raise_exception": _raise_exception, "strftime_now": strftime_now}
ITERATING_FILTERS = ("join", "sum")


class GenerationBlocks(jinja2.ext.Extension):
    """transformers' `{% generation %}` … `{% endgeneration %}` (its AssistantTracker marks an assistant
    turn for training masks; SmolLM3's template has it): the block renders as its body."""

    tags = {"generation"}

    def parse(self, parser) -> list:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox that also refuses to make huge values (see the module doc), with
    transformers' filters and globals."""

    code_generator_class = BoundedCodeGenerator
    intercepted_binops = frozenset(BINOP_SIZES)

    def __init__(self, **options):
        super().__init__(finalize=printed, extensions=[GenerationBlocks], **options)
        for name in REMOVED_FILTERS:
            del self.filters[name]
        self.filters.update(TRANSFORMERS_FILTERS)
        self.globals.update(TRANSFORMERS_GLOBALS)
        self.filters = {
            name: bounded(f, FILTER_SIZES.get(name, shallow_size), name in ITERATING_FILTERS)
            for name, f in self.filters.items()
        }
        self.globals.update({name: bounded(self.globals[name], predict) for name, predict in GLOBAL_SIZES.items()})
        self.globals["namespace"] = BoundedNamespace

    @staticmethod
    def concat(pieces) -> str:
        """The output of a macro, a `{% set %}` block or a `{% filter %}` block, joined once its size is known."""
        pieces = list(pieces)
        made(sum(map(len, pieces)))
        return "".join(pieces)

    @staticmethod
    def joined_text(parts: tuple) -> str:
        made(sum(map(printed_size, parts)))
        return str_join(parts)

    def unsafe_undefined(self, obj, attribute):
        """Fail rather than print nothing: a chat template has no reason to look at Python's internals."""
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )

    def wrap_str_format(self, value):
        """`text.format` and `text.format_map`, by a formatter that bounds each field (jinja's wrapper, with it)."""
        text = getattr(value, "__self__", None)
        if not isinstance(text, str) or getattr(value, "__name__", None) not in ("format", "format_map"):
            return None
        formatter = (
            BoundedEscapeFormatter(self, escape=text.escape) if isinstance(text, Markup) else BoundedFormatter(self)
        )

        def format_map(mapping):
            return type(text)(formatter.vformat(text, (), mapping))

        def format(*args, **kwargs):
            return type(text)(formatter.vformat(text, args, kwargs))

        return functools.update_wrapper(format_map if value.__name__ == "format_map" else format, value)

    def call_binop(self, context, operation, left, right):
        size = BINOP_SIZES[operation](left, right)
        if size > MAX_TEXT:
            raise TemplateTooCostly(f"'{operation}' would make a value of over {MAX_TEXT} items")
        made(size)
        return BINOPS[operation](left, right)

    def call(self, context, obj, *args, **kwargs):
        text = getattr(obj, "__self__", None)
        predict = METHOD_SIZES.get(getattr(obj, "__name__", None)) if isinstance(text, (str, bytes)) else None
        if predict is not None:
            args = materialized(args)
        checked_args([*args, *kwargs.values()])
        if isinstance(text, (str, bytes)):
            made((predict or shallow_size)(text, *args, **kwargs) * (5 if isinstance(text, Markup) else 1))
        else:
            made(shallow_size(*args, **kwargs))
        return checked_size(super().call(context, obj, *args, **kwargs))


@contextmanager
def deadline(seconds: float):
    """Stops a render that runs past `seconds`: a trace that looks at the clock on every line of
    Python the render runs, the template's own (a loop in a template gives jinja no place to check)
    and the library code it calls (jinja's filters, json's indenting encoder, markupsafe)."""
    end = time.monotonic() + seconds

    def on_event(frame, event, arg):
        if time.monotonic() > end:
            raise TemplateTooCostly(f"it ran for over {seconds:g} s")
        return on_event

    previous = sys.gettrace()
    sys.settrace(on_event)
    try:
        yield
    finally:
        sys.settrace(previous)


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


def compile_chat_template(source: str, path: Path) -> jinja2.Template:
    environment = BoundedSandbox(trim_blocks=True, lstrip_blocks=True)
    try:
        return environment.from_string(source)
    except jinja2.TemplateError as e:
        raise KilnError(f"the chat_template does not parse: {one_line(e)}", path) from None
    except RecursionError:
        raise KilnError("the chat_template does not parse: it nests too deeply", path) from None


def bounded_render(template: jinja2.Template, context: dict) -> str:
    pieces, size = [], 0
    RENDER.left = MAX_MADE
    try:
        with deadline(RENDER_SECONDS):
            for piece in template.generate(**context):
                size += len(piece)
                if size > MAX_TEXT:
                    raise TemplateTooCostly(f"its output passes {MAX_TEXT} characters")
                pieces.append(piece)
    finally:
        RENDER.left = None
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
