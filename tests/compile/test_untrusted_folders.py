"""Compiling untrusted Hugging Face folders (issue 12): a tiny valid folder broken in its config.json,
its tokenizer files and its weight index, all generated here.

Every case must end in one KilnError naming the file and the problem, and through `kiln compile`
in exit code 1 with one error line, no traceback, no model folder and no temporary files.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers.untrusted import TINY_CONFIG, assert_clean_cli_failure, assert_refused, write

from kiln.compile.source.ingest import ingest, read_config
from kiln.models import architecture_for


def with_config(**changes):
    return lambda folder: (folder / "config.json").write_text(json.dumps({**TINY_CONFIG, **changes}))


def with_tokenizer_config(**changes):
    def change(folder: Path) -> None:
        path = folder / "tokenizer_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))

    return change


def write_file(name: str, text: str):
    return lambda folder: (folder / name).write_text(text)


def sharded(weight_map: dict):
    def change(folder: Path) -> None:
        (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
        shutil.copy(folder / "model-00001-of-00002.safetensors", folder / "model-00002-of-00002.safetensors")
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    return change


FOLDER_CASES = {
    # config.json
    "config not JSON": (write_file("config.json", "{'hidden_size': 64"), "config.json", "malformed JSON"),
    "config a list": (write_file("config.json", "[1, 2]"), "config.json", "no model_type"),
    "hidden_size a string": (with_config(hidden_size="32"), "config.json", "'hidden_size' should be int, got '32'"),
    "hidden_size a bool": (with_config(hidden_size=True), "config.json", "'hidden_size' should be int, got True"),
    "hidden_size a float": (with_config(hidden_size=32.0), "config.json", "'hidden_size' should be int, got 32.0"),
    "hidden_size a list": (with_config(hidden_size=[32]), "config.json", "'hidden_size' should be int, got [32]"),
    "hidden_size zero": (with_config(hidden_size=0), "config.json", "'hidden_size' should be positive, got 0"),
    "layers negative": (with_config(num_hidden_layers=-1), "config.json", "'num_hidden_layers' should be positive"),
    "rms_norm_eps NaN": (
        write_file("config.json", json.dumps(TINY_CONFIG).replace("1e-05", "NaN")),
        "config.json",
        "'rms_norm_eps' should be positive, got nan",
    ),
    "hidden_size 10**9": (with_config(hidden_size=10**9), "config.json", "'hidden_size' is 1000000000, beyond"),
    "vocab_size 10**12": (with_config(vocab_size=10**12), "config.json", "'vocab_size' is 1000000000000, beyond"),
    "layers 10**6": (with_config(num_hidden_layers=10**6), "config.json", "'num_hidden_layers' is 1000000, beyond"),
    "heads not dividing hidden": (
        with_config(num_attention_heads=3),
        "config.json",
        "num_attention_heads 3 does not divide hidden_size 32",
    ),
    "kv heads not dividing heads": (
        with_config(num_key_value_heads=3, num_attention_heads=4),
        "config.json",
        "num_key_value_heads 3 does not divide num_attention_heads 4",
    ),
    "unknown model_type": (with_config(model_type="gpt-9"), "config.json", "unknown model_type 'gpt-9'"),
    # tokenizer files
    "tokenizer.json missing": (lambda folder: (folder / "tokenizer.json").unlink(), "", "no tokenizer"),
    "tokenizer.json not JSON": (write_file("tokenizer.json", "{"), "tokenizer.json", "cannot read the tokenizer"),
    "tokenizer.json wrong structure": (
        write_file("tokenizer.json", '{"model": 5}'),
        "tokenizer.json",
        "cannot read the tokenizer",
    ),
    "tokenizer_config not JSON": (
        write_file("tokenizer_config.json", "{,}"),
        "tokenizer_config.json",
        "malformed JSON",
    ),
    "tokenizer_config a list": (
        write_file("tokenizer_config.json", "[]"),
        "tokenizer_config.json",
        "not a JSON object",
    ),
    "eos_token a number": (with_tokenizer_config(eos_token=5), "tokenizer_config.json", "eos_token should be a string"),
    "bos_token content a list": (
        with_tokenizer_config(bos_token={"content": ["<s>"]}),
        "tokenizer_config.json",
        "bos_token should be a string",
    ),
    "chat_template a number": (
        with_tokenizer_config(chat_template=5),
        "tokenizer_config.json",
        "chat_template should be a string or named templates, got int",
    ),
    "chat_template without default": (
        with_tokenizer_config(chat_template=[{"name": "tool_use", "template": "x"}]),
        "tokenizer_config.json",
        "none is called 'default'",
    ),
    "chat_template does not parse": (
        write_file("chat_template.jinja", "{% for m in messages %}"),
        "chat_template.jinja",
        "the chat_template does not parse",
    ),
    "chat_template nested too deeply": (
        write_file("chat_template.jinja", "{{ " + "(" * 10000 + "1" + ")" * 10000 + " }}"),
        "chat_template.jinja",
        "the chat_template does not parse",
    ),
    # weights
    "index outside the folder": (
        sharded({"a": "../../etc/passwd"}),
        "model.safetensors.index.json",
        "'../../etc/passwd', which is not a file name in its folder",
    ),
    "index absolute path": (sharded({"a": "/etc/passwd"}), "model.safetensors.index.json", "not a file name"),
    "index not an object": (sharded([1]), "model.safetensors.index.json", "malformed weight index"),
    "tensor in two shards": (
        sharded({"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}),
        "model-00002-of-00002.safetensors",
        "is also in model-00001-of-00002.safetensors",
    ),
}


def parse_folder(folder: Path, work_dir: Path) -> None:
    """What the build reads before any long work: the source, then its family's config."""
    source = ingest(folder, work_dir)
    architecture_for(source.config, folder / "config.json").parse_config(source.config, folder / "config.json", {})


@pytest.mark.parametrize("case", FOLDER_CASES)
def test_broken_hf_folder_is_refused(folder, tmp_path, case):
    break_folder, named_file, problem = FOLDER_CASES[case]
    break_folder(folder)
    assert_refused(lambda: parse_folder(folder, tmp_path / "work"), folder / named_file, problem)


def test_the_valid_folder_parses(folder, tmp_path):
    parse_folder(folder, tmp_path / "work")


def test_read_config_of_an_untrusted_file(tmp_path):
    path = write(tmp_path, "config.json", b"\xff\xfe not utf-8")
    assert_refused(lambda: read_config(path), path, "malformed JSON")


# ---- through `kiln compile`: one line, exit 1, nothing left behind -------------------------

FOLDER_CLI_CASES = ["layers 10**6", "tokenizer.json wrong structure", "index outside the folder"]


@pytest.mark.slow
@pytest.mark.parametrize("case", FOLDER_CLI_CASES)
def test_kiln_compile_refuses_a_broken_folder_in_one_line(folder, tmp_path, case):
    break_folder, named_file, problem = FOLDER_CASES[case]
    break_folder(folder)
    assert_clean_cli_failure(folder, tmp_path, folder / named_file, problem)
