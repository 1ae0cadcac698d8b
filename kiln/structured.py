"""Structured output: a reply held to a JSON Schema, to any JSON object, or to an EBNF grammar.

XGrammar compiles the format against the model's token table; before each step it says which
tokens keep the reply inside the grammar, and the sampler chooses among those only
(`Sampler.sample(logits, allowed)`). The mask is applied on the host, in the sampler, rather than
with the library's `apply_bitmask_inplace`: both engines bring every step's logits to the host to
sample anyway, so masking there costs no extra upload or dispatch, and the browser does it in the
same place (web/src/sampler.js).

The browser's @mlc-ai/web-xgrammar 0.1.27 is built from xgrammar 0.1.27, which Kiln pins here, and
both sides build the token table and the grammar with the same inputs and options
(web/src/structured.js): the masks, and so the greedy constrained tokens, are the same.
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from kiln.errors import KilnError, one_line

# A format is compiled while the request waits; bound what a client can make it compile.
MAX_FORMAT_CHARS = 64 * 1024
# Strict: properties and items a schema does not name are not generated (OpenAI's strict mode).
# Compact separators and no free whitespace: a reply cannot pad itself with blank space forever.
SCHEMA_OPTIONS = {"any_whitespace": False, "strict_mode": True}
# Any JSON object: the schema {"type": "object"}, not strict, so that it may have any properties.
ANY_OBJECT_SCHEMA = '{"type": "object"}'
ANY_OBJECT_OPTIONS = {"any_whitespace": False, "strict_mode": False}
SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
XGRAMMAR_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # "[12:00:00] /project/cpp/x.cc:902: "
MISSING_XGRAMMAR = "structured output needs the xgrammar package: pip install 'kiln-llm[structured]'"
# tokenizer_info.token_postproc_method (as WebLLM reads it) → XGrammar's vocabulary type.
VOCAB_TYPES = {"raw": "RAW", "byte_fallback": "BYTE_FALLBACK", "byte_level": "BYTE_LEVEL"}


class ResponseFormatError(KilnError):
    """The response format cannot be used: malformed, too large, or not compilable."""


@dataclass(frozen=True)
class ResponseFormat:
    """What a reply must be: "json_object" (any object), "json_schema" (`text` is the schema as
    JSON), "grammar" (`text` is EBNF in XGrammar's dialect, root rule `root`) or "structural_tag"
    (`text` is XGrammar's structural tag as JSON; see `from_structural_tag`)."""

    kind: str
    text: str = ""

    @classmethod
    def from_openai(cls, value: Any) -> ResponseFormat | None:
        """OpenAI's `response_format` (and WebLLM's: a schema string in json_object, or
        {"type": "grammar", "grammar": EBNF}); None for plain text. ResponseFormatError names the problem."""
        if not isinstance(value, dict) or not isinstance(value.get("type"), str):
            raise ResponseFormatError("response_format must be an object with a string 'type'")
        kind = value["type"]
        if kind == "text":
            return None
        if kind == "json_object":
            schema = value.get("schema")
            return cls("json_object") if schema is None else cls.from_schema(schema)
        if kind == "json_schema":
            spec = value.get("json_schema")
            if not isinstance(spec, dict):
                raise ResponseFormatError("response_format.json_schema must be an object with 'name' and 'schema'")
            if not isinstance(spec.get("name"), str) or not SCHEMA_NAME.fullmatch(spec["name"]):
                raise ResponseFormatError(
                    "response_format.json_schema.name must be 1 to 64 letters, digits, '_' or '-'"
                )
            if not isinstance(spec.get("strict", False), bool):
                raise ResponseFormatError("response_format.json_schema.strict must be true or false")
            if "schema" not in spec:
                raise ResponseFormatError("response_format.json_schema.schema is missing")
            return cls.from_schema(spec["schema"])
        if kind == "grammar":
            return cls.from_grammar(value.get("grammar"))
        raise ResponseFormatError(
            f"response_format.type must be text, json_object, json_schema or grammar, not {kind!r}"
        )

    @classmethod
    def from_schema(cls, schema: Any) -> ResponseFormat:
        """A JSON Schema, as an object or as its JSON text."""
        if isinstance(schema, str):
            if len(schema) > MAX_FORMAT_CHARS:
                raise ResponseFormatError(f"the JSON schema is longer than {MAX_FORMAT_CHARS} characters")
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise ResponseFormatError(f"the JSON schema is not JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ResponseFormatError("the JSON schema must be an object")
        text = json.dumps(schema, ensure_ascii=False)
        if len(text) > MAX_FORMAT_CHARS:
            raise ResponseFormatError(f"the JSON schema is longer than {MAX_FORMAT_CHARS} characters")
        return cls("json_schema", text)

    @classmethod
    def from_structural_tag(cls, tags: list[dict], triggers: list[str]) -> ResponseFormat:
        """Free text in which each tag ({begin, content, end}), once its trigger appears, runs from its
        `begin` through text fitting its `content` (a JSON schema or a grammar, in XGrammar's structural
        tag format) to its `end` (how tool calls are held)."""
        tagged = [{"type": "tag", **tag} for tag in tags]
        spec = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": triggers, "tags": tagged}}
        text = json.dumps(spec, ensure_ascii=False)
        if len(text) > MAX_FORMAT_CHARS:
            raise ResponseFormatError(f"the structural tag is longer than {MAX_FORMAT_CHARS} characters")
        return cls("structural_tag", text)

    @classmethod
    def from_grammar(cls, grammar: Any) -> ResponseFormat:
        if not isinstance(grammar, str) or not grammar.strip():
            raise ResponseFormatError("the grammar must be a non-empty EBNF string")
        if len(grammar) > MAX_FORMAT_CHARS:
            raise ResponseFormatError(f"the grammar is longer than {MAX_FORMAT_CHARS} characters")
        return cls("grammar", grammar)


def xgrammar_module():
    try:
        import xgrammar
    except ImportError:
        raise KilnError(MISSING_XGRAMMAR) from None
    return xgrammar


def xgrammar_problem(error: Exception) -> str:
    return one_line(XGRAMMAR_LOCATION.sub("", str(error).strip()))


def gpt2_byte_decoder() -> dict[str, int]:
    """Byte-level BPE's alphabet: each byte is a printable character (GPT-2's bytes_to_unicode)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(0x100 + n): b for n, b in enumerate(others)}}


BYTE_FALLBACK_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_bytes(token: str, vocab_type: str, byte_decoder: dict[str, int]) -> bytes:
    """The bytes a token stands for, read as XGrammar reads it."""
    if vocab_type == "byte_level":
        return b"".join(bytes([byte_decoder[c]]) if c in byte_decoder else c.encode() for c in token)
    if vocab_type == "byte_fallback":
        byte = BYTE_FALLBACK_TOKEN.fullmatch(token)
        return bytes([int(byte.group(1), 16)]) if byte else token.replace("\u2581", " ").encode()
    return token.encode()


# Well-formed UTF-8 (Unicode's Table 3-7) as an automaton: per state, (first byte, last byte, next
# state). State 0 is "between characters"; the others expect continuation bytes.
UTF8_STEPS = (
    (
        (0x00, 0x7F, 0),
        (0xC2, 0xDF, 1),
        (0xE0, 0xE0, 3),
        (0xE1, 0xEC, 2),
        (0xED, 0xED, 4),
        (0xEE, 0xEF, 2),
        (0xF0, 0xF0, 6),
        (0xF1, 0xF3, 5),
        (0xF4, 0xF4, 7),
    ),
    ((0x80, 0xBF, 0),),
    ((0x80, 0xBF, 1),),
    ((0xA0, 0xBF, 1),),
    ((0x80, 0x9F, 1),),
    ((0x80, 0xBF, 2),),
    ((0x90, 0xBF, 2),),
    ((0x80, 0x8F, 2),),
)
UTF8_STATES = len(UTF8_STEPS)
UTF8_NEXT = [[next((to for lo, hi, to in steps if lo <= b <= hi), -1) for b in range(256)] for steps in UTF8_STEPS]


def utf8_after(state: int, data: bytes) -> int:
    """The automaton's state after `data` from `state`; -1 when the bytes cannot continue well-formed UTF-8."""
    for byte in data:
        state = UTF8_NEXT[state][byte]
        if state < 0:
            return -1
    return state


class TokenTable:
    """A model's tokens as XGrammar and the masks see them.

    `strings`: the tokenizer's tokens by id, padded to the model's vocabulary (the logits' length),
    special tokens as "" (XGrammar never allows those, except its stop tokens at the end:
    <|im_start|> is not the text "<|im_start|>" inside a JSON string). `utf8_next[state, token]`: the
    UTF-8 automaton's state after the token, -1 if it would break a character (XGrammar 0.1.27 lets
    a byte-level token split a character wrongly, and the text gets U+FFFD). `has_control`: tokens
    with a byte below 0x20, which a compact JSON reply never holds raw (XGrammar 0.1.27 lets one into
    a string with a length bound). `marks`: special tokens kept as their text, those a tool call is
    written with (Gemma 4's <|tool_call> and <|"|>)."""

    def __init__(self, tokenizer, vocab_type: str, vocab_size: int, marks: tuple[str, ...] = ()):
        added = tokenizer.get_added_tokens_decoder().items()
        special = {i for i, token in added if token.special and token.content not in marks}
        self.strings = [
            "" if i in special else tokenizer.id_to_token(i) or "" for i in range(tokenizer.get_vocab_size())
        ]
        byte_decoder = gpt2_byte_decoder()
        self.utf8_next = np.full((UTF8_STATES, vocab_size), -1, dtype=np.int8)
        self.utf8_next[0] = 0  # a special token, and ids past the tokenizer's, end no character
        self.has_control = np.zeros(vocab_size, dtype=bool)
        for i, token in enumerate(self.strings):
            data = token_bytes(token, vocab_type, byte_decoder)
            self.has_control[i] = any(b < 0x20 for b in data)
            if not data.isascii():
                self.utf8_next[:, i] = [utf8_after(state, data) for state in range(UTF8_STATES)]


class GrammarCompiler:
    """Compiles response formats against one model's token table (XGrammar caches what it compiled).

    How to read the tokens (byte-level BPE, SentencePiece byte fallback or raw; whether encoding
    prepends a space) comes from `tokenizer_info` in mlc-chat-config.json, as WebLLM reads it."""

    def __init__(self, tokenizer, chat_config: dict, vocab_size: int, stop_token_ids, marks: tuple[str, ...] = ()):
        self.tokenizer, self.chat_config, self.marks = tokenizer, chat_config, marks
        self.vocab_size, self.stop_token_ids = vocab_size, sorted(stop_token_ids)
        self.table: TokenTable | None = None
        self._compiler = None
        self._lock = threading.Lock()

    def compiler(self):
        with self._lock:
            if self._compiler is None:
                xgr = xgrammar_module()
                info = self.chat_config.get("tokenizer_info")
                if not isinstance(info, dict) or info.get("token_postproc_method") not in VOCAB_TYPES:
                    raise KilnError(
                        "mlc-chat-config.json has no usable tokenizer_info; rebuild the model with kiln compile"
                    )
                vocab_type = info["token_postproc_method"]
                self.table = TokenTable(self.tokenizer, vocab_type, self.vocab_size, self.marks)
                tokenizer_info = xgr.TokenizerInfo(
                    self.table.strings,
                    vocab_type=xgr.VocabType[VOCAB_TYPES[vocab_type]],
                    vocab_size=self.vocab_size,
                    stop_token_ids=self.stop_token_ids,
                    add_prefix_space=bool(info.get("prepend_space_in_encode")),
                )
                self._compiler = xgr.GrammarCompiler(tokenizer_info)
            return self._compiler

    def compile(self, response_format: ResponseFormat):
        compiler = self.compiler()
        try:
            if response_format.kind == "json_object":
                return compiler.compile_json_schema(ANY_OBJECT_SCHEMA, **ANY_OBJECT_OPTIONS)
            if response_format.kind == "json_schema":
                return compiler.compile_json_schema(response_format.text, **SCHEMA_OPTIONS)
            if response_format.kind == "structural_tag":
                return compiler.compile_structural_tag(response_format.text)
            return compiler.compile_grammar(response_format.text)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ResponseFormatError(
                f"the {format_name(response_format.kind)} cannot be used: {xgrammar_problem(e)}"
            ) from None

    def constraint(self, response_format: ResponseFormat) -> TokenConstraint:
        compiled = self.compile(response_format)
        constraint = TokenConstraint(compiled, self.table, json=response_format.kind.startswith("json"))
        if not constraint.grammar_allows().any():  # e.g. "root ::= root": no text matches it
            raise ResponseFormatError(f"the {format_name(response_format.kind)} accepts no text")
        return constraint


def format_name(kind: str) -> str:
    return "JSON schema" if kind.startswith("json") else kind.replace("_", " ")


class TokenConstraint:
    """One reply's place in its format: which tokens may come next, updated as tokens are taken.

    A token may come next when XGrammar's mask allows it, it keeps the text well-formed UTF-8, and,
    in a JSON reply, it holds no control byte."""

    def __init__(self, compiled, table: TokenTable, json: bool):
        xgr = xgrammar_module()
        self.matcher = xgr.GrammarMatcher(compiled)
        self.table = table
        self.vocab_size = table.utf8_next.shape[1]
        self.bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        self.words = self.bitmask.numpy().view(np.uint8)
        self.excluded = table.has_control if json else np.zeros(self.vocab_size, dtype=bool)
        self.utf8_state = 0
        self.mask_s = 0.0  # time spent computing masks, for the usage numbers
        self.steps = 0

    def grammar_allows(self) -> np.ndarray:
        """A boolean per token id: does XGrammar's mask allow it next?"""
        self.matcher.fill_next_token_bitmask(self.bitmask)
        return np.unpackbits(self.words, bitorder="little", count=self.vocab_size).view(bool)

    def allowed(self) -> np.ndarray:
        """A boolean per token id: may it come next?"""
        started = time.perf_counter()
        grammar_allows = self.grammar_allows()
        allowed = grammar_allows & (self.table.utf8_next[self.utf8_state] >= 0) & ~self.excluded
        if not allowed.any():  # the grammar can only go on with a broken character: let it
            allowed = grammar_allows
        self.mask_s += time.perf_counter() - started
        self.steps += 1
        return allowed

    def accept(self, token: int) -> None:
        if not self.matcher.accept_token(token):
            raise KilnError(f"token {token} does not fit the response format (the sampler chose a masked token)")
        self.utf8_state = max(0, int(self.table.utf8_next[self.utf8_state, token]))

    def fitting(self, tokens: list[int]) -> int:
        """How many of `tokens`, from the first, may come next one after another (speculative
        decoding's proposals); the place in the format stays where it is."""
        taken, utf8_state = 0, self.utf8_state
        for token in tokens:
            utf8_next = int(self.table.utf8_next[utf8_state, token])
            if utf8_next < 0 or self.excluded[token] or not self.matcher.accept_token(token):
                break
            taken, utf8_state = taken + 1, utf8_next
        if taken:
            self.matcher.rollback(taken)
        return taken

    @property
    def finished(self) -> bool:
        """The reply is complete and its stop token taken."""
        return self.matcher.is_terminated()
