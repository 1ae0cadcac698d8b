"""Structured output natively and through `kiln serve`: replies held to JSON Schemas, to any JSON
object and to EBNF grammars parse and validate; malformed formats are clear errors that leave the
engine usable. (The browser side: tests/web/test_web_structured.py.)"""

from __future__ import annotations

import json

import jsonschema
import pytest
import requests

from helpers.schema_corpus import SCHEMAS
from helpers.tiny_llama import CHATML_TOKENS, LLAMA_2_TOKENS, trained_tokenizer
from helpers.web import run_kiln, served

from kiln.compile.chat_config.configure import tokenizer_info
from kiln.engine import Engine, GenerationConfig
from kiln.structured import ResponseFormat, ResponseFormatError, TokenTable, utf8_after

MODEL_ID = "tiny-llama-q4f32_1"
MAX_TOKENS = 256
YES_NO = 'root ::= "The answer is " ("yes" | "no") "."'


def ask(name: str) -> list[dict]:
    return [{"role": "user", "content": f"Reply in JSON: {name}"}]


def check_valid(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())


@pytest.fixture(scope="module")
def engine(tiny_build) -> Engine:
    return Engine(tiny_build("q4f32_1"))


def constrained(response_format: ResponseFormat | None, **fields) -> GenerationConfig:
    return GenerationConfig(max_tokens=MAX_TOKENS, response_format=response_format, **fields)


# The formats a request may give


@pytest.mark.parametrize(
    "value, expected",
    [
        ({"type": "text"}, None),
        ({"type": "json_object"}, ResponseFormat("json_object")),
        (
            {"type": "json_object", "schema": '{"type": "integer"}'},
            ResponseFormat("json_schema", '{"type": "integer"}'),
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}, "strict": True}},
            ResponseFormat("json_schema", '{"type": "integer"}'),
        ),
        ({"type": "grammar", "grammar": YES_NO}, ResponseFormat("grammar", YES_NO)),
    ],
)
def test_openai_and_webllm_response_formats_are_read(value, expected):
    assert ResponseFormat.from_openai(value) == expected


@pytest.mark.parametrize(
    "value, problem",
    [
        ("json", "an object with a string 'type'"),
        ({"type": "yaml"}, "not 'yaml'"),
        ({"type": "json_schema"}, "must be an object with 'name' and 'schema'"),
        ({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}, "name must be"),
        ({"type": "json_schema", "json_schema": {"name": "a"}}, "schema is missing"),
        ({"type": "json_schema", "json_schema": {"name": "a", "schema": [1]}}, "must be an object"),
        ({"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "strict": "yes"}}, "strict must be"),
        ({"type": "json_object", "schema": "{not json"}, "is not JSON"),
        ({"type": "json_object", "schema": "x" * 70_000}, "longer than"),
        ({"type": "grammar", "grammar": ""}, "non-empty EBNF"),
        ({"type": "grammar"}, "non-empty EBNF"),
    ],
)
def test_malformed_response_formats_name_their_problem(value, problem):
    with pytest.raises(ResponseFormatError, match=problem):
        ResponseFormat.from_openai(value)


def test_the_utf8_automaton_accepts_exactly_well_formed_utf8():
    for text in ["a", "é", "€", "😀", "\x7f", "\u0800", "\ud7ff", "\ue000", "\U0010ffff"]:
        assert utf8_after(0, text.encode()) == 0, text
    for data in [
        b"\x80",
        b"\xc0\x80",
        b"\xc1\xbf",
        b"\xe0\x80\x80",
        b"\xed\xa0\x80",
        b"\xf0\x80\x80\x80",
        b"\xf4\x90\x80\x80",
        b"\xf5",
        b"\xff",
        b"\xe2\x82a",
    ]:
        assert utf8_after(0, data) == -1, data
    split = "€".encode()
    assert utf8_after(utf8_after(0, split[:1]), split[1:]) == 0


def test_the_token_table_reads_tokens_as_bytes(engine):
    table = TokenTable(engine.tokenizer, "byte_level", engine.model.vocab_size)
    special = [i for i, t in engine.tokenizer.get_added_tokens_decoder().items() if t.special]
    assert special and all(table.strings[i] == "" for i in special)
    newline = engine.tokenizer.token_to_id("Ċ")
    assert table.has_control[newline] and not table.has_control[engine.tokenizer.token_to_id("a")]


@pytest.mark.parametrize(
    "tokens, expected",
    [
        (CHATML_TOKENS, ("byte_level", False, False)),
        (LLAMA_2_TOKENS, ("byte_fallback", True, True)),  # Llama 2's Prepend("▁") normalizer and Strip decoder
    ],
)
def test_tokenizer_info_says_how_to_read_the_vocabulary(tmp_path, tokens, expected):
    trained_tokenizer(tokens, 300).save(str(tmp_path / "tokenizer.json"))
    info = tokenizer_info(tmp_path)
    assert (info["token_postproc_method"], info["prepend_space_in_encode"], info["strip_space_in_decode"]) == expected


def test_a_metaspace_tokenizer_prepends_a_space(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tokenizer.decoder = decoders.Metaspace(prepend_scheme="first")
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    assert tokenizer_info(tmp_path) == {
        "token_postproc_method": "byte_fallback",
        "prepend_space_in_encode": True,
        "strip_space_in_decode": True,
    }


# Natively


def test_every_schema_gives_valid_json_natively(engine):
    for name, schema in SCHEMAS.items():
        result = engine.generate_chat(ask(name), constrained(ResponseFormat.from_schema(schema)))
        assert result.finish_reason == "stop", (name, result.text)
        check_valid(result.text, schema)
        assert result.usage.mask_ms_per_token > 0


def test_any_json_object_and_a_grammar_natively(engine):
    reply = engine.generate_chat(ask("anything"), constrained(ResponseFormat("json_object"), ignore_eos=True))
    assert reply.finish_reason == "stop" and isinstance(json.loads(reply.text), dict)
    answer = engine.generate("Is it?", constrained(ResponseFormat.from_grammar(YES_NO)))
    assert answer.text in ("The answer is yes.", "The answer is no.")


def test_a_seeded_sampled_reply_fits_the_schema(engine):
    schema = SCHEMAS["order"]
    for seed in range(3):
        config = constrained(
            ResponseFormat.from_schema(schema), temperature=1.0, top_p=0.9, seed=seed, repetition_penalty=1.1
        )
        check_valid(engine.generate_chat(ask("order"), config).text, schema)


@pytest.mark.parametrize(
    "response_format, problem",
    [
        (ResponseFormat("json_schema", '{"type": "objekt"}'), 'JSON schema cannot be used: Unsupported type "objekt"'),
        (ResponseFormat("json_schema", '{"$ref": "#/nowhere"}'), "JSON schema cannot be used"),
        (ResponseFormat("grammar", 'root ::= "a" |'), "grammar cannot be used: EBNF parser error"),
        (ResponseFormat("grammar", 'start ::= "a"'), "grammar cannot be used"),
        (ResponseFormat("grammar", "root ::= root"), "grammar accepts no text"),
    ],
)
def test_a_format_that_does_not_compile_is_an_error_and_the_engine_stays_usable(engine, response_format, problem):
    with pytest.raises(ResponseFormatError, match=problem):
        engine.generate("x", constrained(response_format))
    assert not engine.busy
    assert engine.generate("x", GenerationConfig(max_tokens=2)).tokens


def test_kiln_generate_takes_a_schema_or_a_grammar_file(tiny_build, tmp_path):
    model_dir = tiny_build("q4f32_1")
    schema, grammar, broken = tmp_path / "person.json", tmp_path / "yes.ebnf", tmp_path / "broken.json"
    schema.write_text(json.dumps(SCHEMAS["person"]))
    grammar.write_text(YES_NO)
    broken.write_text('{"type": "objekt"}')
    reply = run_kiln("generate", str(model_dir), "--chat", "-p", "Who?", "--json-schema", str(schema))
    assert reply.returncode == 0, reply.stderr
    check_valid(reply.stdout, SCHEMAS["person"])
    answer = run_kiln("generate", str(model_dir), "-p", "Is it?", "--grammar", str(grammar))
    assert answer.stdout.strip() in ("The answer is yes.", "The answer is no.")
    for path, problem in [
        (broken, 'the JSON schema cannot be used: Unsupported type "objekt"'),
        (tmp_path / "missing.json", "cannot read the file: No such file or directory"),
    ]:
        failed = run_kiln("generate", str(model_dir), "-p", "x", "--json-schema", str(path))
        assert failed.returncode == 1 and failed.stderr.strip().splitlines() == [f"kiln: error: {path}: {problem}"]


# Through the API


def test_every_schema_through_the_openai_client(url):
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}v1", api_key="not-needed")
    for name, schema in SCHEMAS.items():
        reply = client.chat.completions.create(
            model=MODEL_ID,
            messages=ask(name),
            max_tokens=MAX_TOKENS,
            temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}},
        )
        check_valid(reply.choices[0].message.content, schema)
    stream = client.chat.completions.create(
        model=MODEL_ID,
        messages=ask("anything"),
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads("".join(c.choices[0].delta.content or "" for c in stream if c.choices)), dict)
    completion = client.completions.create(
        model=MODEL_ID,
        prompt="Is it?",
        max_tokens=MAX_TOKENS,
        extra_body={"response_format": {"type": "grammar", "grammar": YES_NO}},
    )
    assert completion.choices[0].text in ("The answer is yes.", "The answer is no.")


@pytest.mark.parametrize(
    "response_format, problem",
    [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}, "Unsupported type"),
        ({"type": "grammar", "grammar": "root ::= ("}, "EBNF parser error"),
        ({"type": "json_schema", "json_schema": {"schema": {}}}, "name must be"),
        ({"type": "xml"}, "must be text, json_object"),
    ],
)
def test_a_bad_format_is_a_400_naming_it(url, response_format, problem):
    body = {"model": MODEL_ID, "messages": ask("x"), "max_tokens": 4, "response_format": response_format}
    response = requests.post(f"{url}v1/chat/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "response_format" and problem in error["message"]
    fine = requests.post(f"{url}v1/chat/completions", json={**body, "response_format": {"type": "text"}})
    assert fine.status_code == 200


# SmolLM2 end to end


@pytest.mark.slow
def test_every_schema_gives_valid_json_with_smollm2_natively_and_through_the_api(smollm2_build):
    from openai import OpenAI

    model_dir = smollm2_build("q4f32_1")
    engine = Engine(model_dir)
    with served(model_dir.parent) as url:
        client = OpenAI(base_url=f"{url}v1", api_key="not-needed")
        for name, schema in SCHEMAS.items():
            native = engine.generate_chat(ask(name), constrained(ResponseFormat.from_schema(schema)))
            check_valid(native.text, schema)
            reply = client.chat.completions.create(
                model=model_dir.name,
                messages=ask(name),
                max_tokens=MAX_TOKENS,
                temperature=0,
                response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema}},
            )
            assert reply.choices[0].message.content == native.text, name
