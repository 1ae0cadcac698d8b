"""Structured output in the browser engine (web/src/structured.js) against the native one
(kiln/structured.py): in Node, the same response_format shapes, the same token tables (byte-level
and SentencePiece-style tokenizers) and the same grammars from the same compile options for every
schema of the corpus; in Chromium, on wasm and WebGPU, the same greedy constrained token ids as
the native engine, replies that validate against their schema, and bad schemas and grammars
reported as "bad-response-format" with the engine still usable."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from tokenizers import Tokenizer

from helpers.schema_corpus import SCHEMAS
from helpers.tiny_llama import CHATML_TOKENS, LLAMA_2_TOKENS, trained_tokenizer
from helpers.web import NODE_PRELUDE, run_node_module

from kiln.browser.model import browser_model
from kiln.browser.parity import ParityContract
from kiln.engine import Engine, GenerationConfig
from kiln.errors import KilnError
from kiln.structured import ResponseFormat, TokenTable

OPENAI_FORMATS = [
    {"type": "text"},
    {"type": "json_object"},
    {"type": "json_object", "schema": '{"type": "integer"}'},
    {"type": "json_object", "schema": None},
    {"type": "json_schema", "json_schema": {"name": "a-b_1", "schema": {}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": True, "strict": True}},
    {"type": "grammar", "grammar": 'root ::= "a"'},
    None,
    [],
    {"type": 3},
    {"type": "yaml"},
    {"type": "json_schema"},
    {"type": "json_schema", "json_schema": []},
    {"type": "json_schema", "json_schema": {"schema": {}}},
    {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}},
    {"type": "json_schema", "json_schema": {"name": "x" * 65, "schema": {}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": None}},
    {"type": "json_schema", "json_schema": {"name": "x"}},
    {"type": "json_object", "schema": "[1]"},
    {"type": "json_object", "schema": 3},
    {"type": "json_object", "schema": "{"},
    {"type": "json_object", "schema": " " * 65537},
    {"type": "json_object", "schema": {"a": "x" * 65536}},
    {"type": "grammar"},
    {"type": "grammar", "grammar": " \n"},
    {"type": "grammar", "grammar": "x" * 65537},
]


def python_format(value) -> dict | str | None:
    try:
        parsed = ResponseFormat.from_openai(value)
    except KilnError as e:
        return f"error: {e.problem}"
    return parsed and {
        "kind": parsed.kind,
        "text": json.loads(parsed.text) if parsed.kind == "json_schema" else parsed.text,
    }


def test_response_formats_are_read_as_the_native_engine_reads_them():
    browser = run_node_module(
        """
        import { responseFormatFrom } from "./src/structured.js";
        console.log(JSON.stringify(input.map((value) => {
          try {
            const format = responseFormatFrom(value);
            return format && { ...format, text: format.kind === "json_schema" ? JSON.parse(format.text) : format.text };
          } catch (error) {
            return `${error.code}: ${error.message}`;
          }
        })));
    """,
        OPENAI_FORMATS,
    )
    for value, ours, theirs in zip(OPENAI_FORMATS, map(python_format, OPENAI_FORMATS), browser):
        if isinstance(ours, str):
            assert theirs.startswith("bad-response-format: "), (value, theirs)
            if "not JSON" not in ours:  # the JSON parsers word their errors differently
                assert theirs.removeprefix("bad-response-format: ") in ours, value
        else:
            assert theirs == ours, value


def python_table(path: Path, vocab_type: str, vocab_size: int) -> dict:
    table = TokenTable(Tokenizer.from_file(str(path)), vocab_type, vocab_size)
    return {
        "strings": table.strings,
        "utf8Next": table.utf8_next.reshape(-1).tolist(),
        "hasControl": table.has_control.astype(int).tolist(),
    }


@pytest.mark.parametrize("tokens, vocab_type", [(CHATML_TOKENS, "byte_level"), (LLAMA_2_TOKENS, "byte_fallback")])
def test_the_token_table_is_the_native_one(tokens, vocab_type, tmp_path):
    path = tmp_path / "tokenizer.json"
    trained_tokenizer(tokens, 384).save(str(path))
    vocab_size = 400  # padded past the tokenizer's, as models' embeddings often are
    browser = run_node_module(
        NODE_PRELUDE
        + """
        import { TokenTable, specialTokenIds } from "./src/structured.js";
        const { bytes, tokenizer } = await loadTokenizer(input.path);
        const table = new TokenTable(tokenizer, specialTokenIds(bytes), input.vocabType, input.vocabSize);
        console.log(JSON.stringify({ strings: table.strings, utf8Next: Array.from(table.utf8Next),
                                     hasControl: Array.from(table.hasControl) }));
    """,
        {"path": str(path), "vocabType": vocab_type, "vocabSize": vocab_size},
    )
    native = python_table(path, vocab_type, vocab_size)
    assert browser["strings"] == native["strings"]
    assert browser["hasControl"] == native["hasControl"] and any(native["hasControl"])
    assert browser["utf8Next"] == native["utf8Next"]
    assert any(state < 0 for state in native["utf8Next"])  # some tokens do split characters


GRAMMAR = 'root ::= "{" pair "}"\npair ::= "\\"ok\\": " ("true" | "false")\n'


def formats() -> dict[str, ResponseFormat]:
    return {
        "json_object": ResponseFormat("json_object"),
        "grammar": ResponseFormat.from_grammar(GRAMMAR),
        **{name: ResponseFormat.from_schema(schema) for name, schema in SCHEMAS.items()},
    }


# The two builds of XGrammar 0.1.27 write a bounded repetition (a string's length, an array's items,
# the digits of a number range, a pattern's {n}) as different but equivalent rules, a nested `"" | x rule_N` chain or a
# list of alternatives, not even the same one from run to run. Those grammars are compared by what
# they make the model generate (the browser test below); all others print the same on both sides.
BOUNDED = re.compile(
    r'"(minLength|maxLength|minItems|maxItems|minimum|maximum|'
    r'exclusiveMinimum|exclusiveMaximum|pattern)"'
)


def test_every_format_compiles_to_the_native_grammar(tiny_dir):
    """The compile options are the native ones: the grammars XGrammar made with them print the same."""
    native = Engine(tiny_dir)
    expected = {name: str(native.grammars.compile(format).grammar) for name, format in formats().items()}
    browser = run_node_module(
        NODE_PRELUDE
        + """
        import { Grammars } from "./src/structured.js";
        const { bytes, tokenizer } = await loadTokenizer(input.tokenizer);
        const grammars = new Grammars({ loadXgrammar, tokenizer, tokenizerJSON: bytes, chatConfig: input.chatConfig,
                                        stopTokenIds: new Set(input.stopTokenIds) });
        const printed = {};
        for (const [name, format] of Object.entries(input.formats)) {
          printed[name] = (await grammars.compile(format)).grammar().toString();
        }
        console.log(JSON.stringify(printed));
    """,
        {
            "tokenizer": str(tiny_dir / "tokenizer.json"),
            "chatConfig": native.chat_config,
            "stopTokenIds": sorted(native.eos_token_ids),
            "formats": {name: {"kind": f.kind, "text": f.text} for name, f in formats().items()},
        },
    )
    same = [name for name, format in formats().items() if not BOUNDED.search(format.text)]
    assert len(same) >= 5
    assert {name: browser[name] for name in same} == {name: expected[name] for name in same}
    assert set(browser) == set(expected)


def test_a_rejected_schema_says_why_and_the_next_one_compiles(tiny_dir):
    """web-xgrammar aborts its wasm instance on a bad schema; dozens of them in a row must not break it."""
    chat_config = json.loads((tiny_dir / "mlc-chat-config.json").read_text())
    browser = run_node_module(
        NODE_PRELUDE
        + """
        import { Grammars } from "./src/structured.js";
        const { bytes, tokenizer } = await loadTokenizer(input.tokenizer);
        const grammars = new Grammars({ loadXgrammar, tokenizer, tokenizerJSON: bytes, chatConfig: input.chatConfig,
                                        stopTokenIds: new Set([2]) });
        const errors = [];
        for (let i = 0; i < 150; ++i) {
          const format = i % 2
            ? { kind: "grammar", text: `root ::= rule${i}` }
            : { kind: "json_schema", text: `{"type": ${i}}` };
          await grammars.compile(format).catch((error) => errors.push(`${error.code}: ${error.message}`));
        }
        const constraint = await grammars.constraint({ kind: "json_schema", text: input.schema });
        console.log(JSON.stringify({ errors: errors.slice(0, 2), count: errors.length,
                                     allowed: (await constraint.allowed()).reduce((a, b) => a + b) }));
    """,
        {
            "tokenizer": str(tiny_dir / "tokenizer.json"),
            "chatConfig": chat_config,
            "schema": json.dumps(SCHEMAS["flag"]),
        },
    )
    assert browser["count"] == 150
    assert browser["errors"] == [
        "bad-response-format: the JSON schema cannot be used: "
        'Check failed: (schema_obj.at("type").is<std::string>()) is false: Type should be a string',
        "bad-response-format: the grammar cannot be used: EBNF parser error at line 1, column 10: "
        'Rule "rule1" is not defined',
    ]
    assert browser["allowed"] > 0


def test_masked_tokens_are_never_chosen_and_minus_infinity_is_taken_as_numpy_takes_it():
    from kiln.sampling import Sampler

    rng = np.random.default_rng(7)
    cases = []
    for i in range(60):
        row = rng.normal(size=300).astype(np.float32) * 4
        allowed = rng.random(300) < rng.choice([0.01, 0.1, 0.5])
        allowed[rng.integers(0, 300)] = True
        config = {
            "temperature": float(rng.choice([0, 0.7, 1.5])),
            "top_p": float(rng.choice([1, 0.9, 0.3])),
            "top_k": int(rng.choice([0, 1, 5, 50, 400])),
            "repetition_penalty": 1.1,
            "seed": i,
        }
        cases.append((row, allowed, config))
    python = [Sampler(GenerationConfig(**config), [1, 2, 3]).sample(row, allowed) for row, allowed, config in cases]
    browser = run_node_module(
        """
        import { Sampler } from "./src/sampler.js";
        console.log(JSON.stringify(input.map(({ row, allowed, config }) => new Sampler({
          temperature: config.temperature, topP: config.top_p, topK: config.top_k,
          repetitionPenalty: config.repetition_penalty, presencePenalty: 0, frequencyPenalty: 0, seed: config.seed,
        }, [1, 2, 3]).sample(Float32Array.from(row), Uint8Array.from(allowed)))));
    """,
        [
            {"row": row.tolist(), "allowed": allowed.astype(int).tolist(), "config": config}
            for row, allowed, config in cases
        ],
    )
    assert browser == python
    assert all(allowed[token] for token, (_, allowed, _) in zip(python, cases))


def reply_prompt(name: str) -> list[dict]:
    return [{"role": "user", "content": f"Reply in JSON: {name}"}]


BROWSER_REPLIES_JS = """async (requests) => {
  const engine = globalThis.kilnDriven;
  const replies = [];
  for (const request of requests) {
    await engine.resetChat();
    try {
      const completion = await engine.chat.completions.create(request);
      const { token_ids, extra } = (await engine.stats()).last_request;
      replies.push({ text: completion.choices[0].message.content, finish_reason: completion.choices[0].finish_reason,
                     token_ids, mask_ms_per_token: extra.mask_ms_per_token });
    } catch (error) {
      replies.push({ error: `${error.code}: ${error.message}` });
    }
  }
  return replies;
}"""
MAX_TOKENS = 256
BAD_REQUESTS = [
    {
        "type": "json_schema",
        "json_schema": {"name": "bad", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}},
    },
    {"type": "grammar", "grammar": "root ::= undefined_rule"},
    {"type": "grammar", "grammar": "root ::= root"},  # accepts no text
]


def divergence_is_a_near_tie(engine: Engine, name: str, native: list[int], browser: list[int]) -> bool:
    """Whether the browser's reply leaves the native one where the native logits of the tokens the
    format allows have the browser's token a close second (the parity contract's near tie)."""
    at = next(i for i, (a, b) in enumerate(zip(native, browser)) if a != b)
    constraint = engine.grammars.constraint(ResponseFormat.from_schema(SCHEMAS[name]))
    for token in native[:at]:
        constraint.accept(token)
    allowed = constraint.allowed()
    engine.reset()
    step = engine.generate(
        engine.encode_chat(reply_prompt(name)) + native[:at],
        GenerationConfig(max_tokens=1, logits_top_k=engine.model.vocab_size),
    ).logits[0]
    ranked = [(logit, token) for token, logit in zip(step["token_ids"], step["logits"]) if allowed[token]]
    (best, first), (second, runner_up) = ranked[:2]
    return first == native[at] and runner_up == browser[at] and best - second < ParityContract().near_tie_gap


def check_browser_corpus(model_dir: Path, backend: str, driver) -> None:
    """Every schema of the corpus in one page evaluation; then bad formats and a request after them.
    Replies validate, and are the native tokens (or leave them at a near tie)."""
    native = Engine(model_dir)

    def config(schema: dict) -> GenerationConfig:
        return GenerationConfig(
            max_tokens=MAX_TOKENS, temperature=0, response_format=ResponseFormat.from_schema(schema)
        )

    expected = {name: native.generate_chat(reply_prompt(name), config(schema)) for name, schema in SCHEMAS.items()}
    requests = [
        {
            "messages": reply_prompt(name),
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema}},
        }
        for name, schema in SCHEMAS.items()
    ]
    after = {
        "messages": reply_prompt("flag"),
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "response_format": {"type": "json_object", "schema": SCHEMAS["flag"]},
    }
    bad = [{**after, "response_format": response_format} for response_format in BAD_REQUESTS]
    with browser_model(model_dir, backend, driver) as model:
        replies = model.engine.page.evaluate(BROWSER_REPLIES_JS, [*requests, *bad, after])
    chosen, rejected, following = replies[: len(requests)], replies[len(requests) : -1], replies[-1]
    for (name, schema), reply in zip(SCHEMAS.items(), chosen):
        assert "error" not in reply, (name, reply)
        assert reply["finish_reason"] == "stop", name
        jsonschema.validate(json.loads(reply["text"]), schema, format_checker=jsonschema.FormatChecker())
        if reply["token_ids"] != expected[name].tokens:
            assert divergence_is_a_near_tie(native, name, expected[name].tokens, reply["token_ids"]), name
            print(f"\n{backend}: {name} left the native reply at a near tie")
    assert [reply["error"].split(":")[0] for reply in rejected] == ["bad-response-format"] * len(BAD_REQUESTS)
    assert "nope" in rejected[0]["error"] and "undefined_rule" in rejected[1]["error"]
    assert "accepts no text" in rejected[2]["error"]
    assert json.loads(following["text"]) == json.loads(expected["flag"].text)
    mask_ms = [reply["mask_ms_per_token"] for reply in chosen]
    assert all(ms >= 0 for ms in mask_ms) and sum(mask_ms) > 0  # performance.now() ticks by 0.1 ms in a worker
    print(f"\n{model_dir.name} on {backend}: mask {np.mean(mask_ms):.3f} ms/token on average (max {max(mask_ms):.3f})")


@pytest.mark.browser
@pytest.mark.parametrize("backend", ["wasm", "webgpu"])
def test_the_browser_generates_the_native_constrained_tokens(tiny_dir, backend, driver):
    check_browser_corpus(tiny_dir, backend, driver)


@pytest.mark.slow
@pytest.mark.browser
def test_smollm2_in_the_browser_gives_the_native_constrained_tokens(smollm2_build, driver):
    check_browser_corpus(smollm2_build("q4f32_1", ["cpu", "wasm"]), "wasm", driver)
