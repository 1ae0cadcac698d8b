"""What a model source may make a build read and write: files only from inside the source, no
pickles on an old torch, bounded GGUF metadata, checked generation settings, no hub download
for a mistyped local path."""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import gguf
import numpy as np
import pytest

from helpers.hub import FAKE_COMMIT, fake_hub

from kiln.cli import main
from kiln.compile.chat_config.configure import write_chat_config
from kiln.compile.source.gguf_file import read_gguf
from kiln.compile.source.gguf_source import MAX_TOKEN_CHARS, GGUFMetadata, write_tokenizer_files
from kiln.compile.source.ingest import IngestOptions, ingest, looks_like_hub_id, torch_unpickles_safely
from kiln.errors import KilnError
from kiln.models import architecture_for

SECRET = "hf_SECRETSECRETSECRET"


@pytest.fixture
def secret_file(tmp_path) -> Path:
    """A local file outside the model folder, JSON so that a JSON reader would take it."""
    path = tmp_path / "elsewhere" / "credentials.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"HF_TOKEN": SECRET}))
    return path


def link(path: Path, target: Path) -> None:
    if path.exists():
        path.unlink()
    path.symlink_to(target)


def configure(folder: Path, out_dir: Path) -> dict:
    """The configure stage over a source folder (what `kiln compile` writes next to the weights)."""
    source = ingest(folder, out_dir.parent / "work")
    config = architecture_for(source.config, folder / "config.json").parse_config(
        source.config, folder / "config.json", {}
    )
    out_dir.mkdir(exist_ok=True)
    return write_chat_config(out_dir, source.tokenizer_dir, "llama", "q0f32", config)


def assert_one_line(error: KilnError, path: Path, problem: str) -> None:
    message = str(error)
    assert message.startswith(f"{path}: ") and problem in message and "\n" not in message, message


# ---- 1. every file read lies inside the source ----------------------------------------------

LINKED_FILES = ["special_tokens_map.json", "tokenizer.model", "model.safetensors", "added_tokens.json"]


@pytest.mark.parametrize("name", LINKED_FILES)
def test_a_link_out_of_the_folder_is_refused(folder, secret_file, tmp_path, name):
    link(folder / name, secret_file)
    with pytest.raises(KilnError) as error:
        ingest(folder, tmp_path / "work")
    assert_one_line(error.value, folder / name, "a link to a file outside the model folder")


def test_a_link_out_is_refused_by_kiln_compile_with_nothing_written(folder, secret_file, tmp_path, capsys):
    link(folder / "special_tokens_map.json", secret_file)
    output = tmp_path / "dist"
    args = ["compile", str(folder), "-q", "q0f32", "-t", "cpu", "-o", str(output), "--model-id", "linked"]
    assert main(args) == 1
    errors = capsys.readouterr().err.strip().splitlines()
    assert errors[-1].startswith(f"kiln: error: {folder / 'special_tokens_map.json'}: a link to a file outside")
    assert list(output.iterdir()) == []


def test_the_configure_stage_refuses_a_link_out_too(folder, secret_file, tmp_path):
    """write_chat_config reads the source folder again, after the long stages: a link made since
    ingest is refused, and no byte of the secret reaches the output."""
    out_dir = tmp_path / "out"
    source = ingest(folder, tmp_path / "work")
    config = architecture_for(source.config, folder / "config.json").parse_config(
        source.config, folder / "config.json", {}
    )
    link(folder / "tokenizer.model", secret_file)
    out_dir.mkdir()
    with pytest.raises(KilnError) as error:
        write_chat_config(out_dir, folder, "llama", "q0f32", config)
    assert_one_line(error.value, folder / "tokenizer.model", "outside the model folder")
    assert all(SECRET.encode() not in path.read_bytes() for path in out_dir.rglob("*") if path.is_file())


def test_links_inside_the_folder_still_work(folder, tmp_path):
    (folder / "weights").mkdir()
    (folder / "model.safetensors").rename(folder / "weights" / "model.safetensors")
    link(folder / "model.safetensors", Path("weights") / "model.safetensors")
    (folder / "side").mkdir()
    (folder / "side" / "special_tokens_map.json").write_text('{"eos_token": "<|im_end|>"}')
    link(folder / "special_tokens_map.json", folder / "side" / "special_tokens_map.json")
    out_dir = tmp_path / "out"
    configure(folder, out_dir)
    written = out_dir / "special_tokens_map.json"
    assert not written.is_symlink() and json.loads(written.read_text()) == {"eos_token": "<|im_end|>"}


def hub_snapshot(folder: Path, cache: Path) -> Path:
    """`folder` laid out as the Hugging Face cache keeps a download: snapshot files linking to blobs."""
    repository = cache / "models--org--tiny"
    snapshot = repository / "snapshots" / FAKE_COMMIT
    (repository / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for index, path in enumerate(sorted(folder.iterdir())):
        blob = repository / "blobs" / f"blob{index}"
        shutil.copy(path, blob)
        (snapshot / path.name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
    return snapshot


def test_a_hub_cache_snapshot_reads_through_its_blob_links(folder, secret_file, tmp_path):
    snapshot = hub_snapshot(folder, tmp_path / "hub")
    assert ingest(snapshot, tmp_path / "work").source_hash == ingest(folder, tmp_path / "work").source_hash
    link(snapshot / "special_tokens_map.json", secret_file)
    with pytest.raises(KilnError, match="a link to a file outside the model folder"):
        ingest(snapshot, tmp_path / "work")


def test_json_side_files_are_parsed_and_written_anew(folder, tmp_path):
    (folder / "added_tokens.json").write_text('{"<extra>":   383}')
    out_dir = tmp_path / "out"
    configure(folder, out_dir)
    assert json.loads((out_dir / "added_tokens.json").read_text()) == {"<extra>": 383}
    (folder / "added_tokens.json").write_text(f"{SECRET}\n")
    with pytest.raises(KilnError) as error:
        configure(folder, tmp_path / "again")
    assert_one_line(error.value, folder / "added_tokens.json", "malformed JSON")


def test_a_gguf_linked_from_outside_its_folder_is_refused(tmp_path, secret_file):
    (tmp_path / "models").mkdir()
    link(tmp_path / "models" / "model.gguf", secret_file)
    with pytest.raises(KilnError) as error:
        ingest(tmp_path / "models" / "model.gguf", tmp_path / "work")
    assert_one_line(error.value, tmp_path / "models" / "model.gguf", "outside the model folder")


# ---- 5. pytorch_model*.bin only with a torch that unpickles safely -------------------------


@pytest.mark.parametrize(
    "version, safe",
    [
        ("2.5.1", False),  # CVE-2025-32434
        ("2.9.1+cu128", False),  # CVE-2026-24747
        ("2.10.0a0+git1234567", False),  # a pre-release of 2.10
        ("2.10.0", True),
        ("2.13.0+cpu", True),
        ("not a version", False),
    ],
)
def test_torch_floor_for_pickled_weights(version, safe):
    assert torch_unpickles_safely(version) is safe


def test_kiln_compile_takes_allow_pickle_and_revision(capsys):
    with pytest.raises(SystemExit):
        main(["compile", "--help"])
    usage = capsys.readouterr().out
    assert "--allow-pickle" in usage and "--revision" in usage


# ---- 7. GGUF metadata arrays are numpy arrays; tokens have a length cap ---------------------

FLOAT_ARRAY_BYTES = 25 << 20


def gguf_string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def test_a_large_float_array_costs_about_its_bytes(tmp_path):
    values = np.arange(FLOAT_ARRAY_BYTES // 4, dtype="<f4")
    path = tmp_path / "floats.gguf"
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + gguf_string("tokenizer.ggml.scores")
    path.write_bytes(header + struct.pack("<IIQ", gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.FLOAT32, len(values)))
    with open(path, "ab") as file:
        file.write(values.tobytes())
    tracemalloc.start()
    try:
        metadata = read_gguf(path).metadata
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * FLOAT_ARRAY_BYTES, f"{peak / 2**20:.0f} MiB for a {FLOAT_ARRAY_BYTES >> 20} MiB array"
    np.testing.assert_array_equal(metadata["tokenizer.ggml.scores"], values)


def write_vocabulary_gguf(path: Path, tokens: list[str], model: str = "llama") -> Path:
    """A GGUF holding only a SentencePiece-style vocabulary."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model(model)
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
    writer.add_token_scores([-float(index) for index in range(len(tokens))])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def vocabulary_tokenizer(path: Path, folder: Path) -> None:
    write_tokenizer_files(GGUFMetadata(read_gguf(path).metadata, path), folder)


def test_an_over_long_token_is_refused_quickly(tmp_path):
    """Building SentencePiece merges tries every cut of a token: 80,000 characters took 1.6 s."""
    path = write_vocabulary_gguf(tmp_path / "long.gguf", ["<unk>", "▁", "a", "a" * 80_000])
    start = time.perf_counter()
    with pytest.raises(KilnError) as error:
        vocabulary_tokenizer(path, tmp_path / "tokenizer")
    assert time.perf_counter() - start < 0.5
    assert_one_line(
        error.value, path, f"tokenizer.ggml.tokens holds an entry of 80000 characters (at most {MAX_TOKEN_CHARS}"
    )


def test_tokens_up_to_the_cap_build_quickly(tmp_path):
    tokens = ["<unk>", "▁", "a", *("a" * length for length in range(2, MAX_TOKEN_CHARS + 1, 61)), "a" * MAX_TOKEN_CHARS]
    path = write_vocabulary_gguf(tmp_path / "capped.gguf", tokens)
    start = time.perf_counter()
    vocabulary_tokenizer(path, tmp_path / "tokenizer")
    assert time.perf_counter() - start < 1.0
    assert (tmp_path / "tokenizer" / "tokenizer.json").is_file()


def test_numeric_metadata_arrays_keep_their_kinds(tmp_path):
    path = write_vocabulary_gguf(tmp_path / "vocabulary.gguf", ["<unk>", "▁", "a"])
    metadata = GGUFMetadata(read_gguf(path).metadata, path)
    scores = metadata.get("tokenizer.ggml.scores", kind=list[float])
    assert isinstance(scores, np.ndarray) and scores.tolist() == [0.0, -1.0, -2.0]
    assert metadata.get("tokenizer.ggml.token_type") == [1, 1, 1]  # untyped: Python values
    with pytest.raises(KilnError, match="tokenizer.ggml.scores should be list\\[int\\], got a list of 3"):
        metadata.get("tokenizer.ggml.scores", kind=list[int])


# ---- 8. generation_config.json is checked -----------------------------------------------------

GENERATION_CASES = {
    "temperature NaN": ('{"temperature": NaN}', "temperature is not a finite number"),
    "temperature 1e999": ('{"temperature": 1e999}', "temperature is not a finite number"),
    "temperature negative": ('{"temperature": -0.5}', "temperature should be a finite number >= 0"),
    "temperature a list": ('{"temperature": [0.7]}', "temperature should be a finite number >= 0, got [0.7]"),
    "temperature a string": ('{"temperature": "0.7"}', "temperature should be a finite number >= 0, got '0.7'"),
    "temperature of 400 digits": ('{"temperature": 1%s}' % ("0" * 400), "temperature should be a finite number >= 0"),
    "an integer of 5000 digits": ('{"max_length": 1%s}' % ("0" * 5000), "malformed JSON"),
    "top_p 0": ('{"top_p": 0}', "top_p should be a number in (0, 1] (1 turns it off), got 0"),
    "top_p above 1": ('{"top_p": 1.5}', "top_p should be a number in (0, 1]"),
    "repetition_penalty -Infinity": ('{"repetition_penalty": -Infinity}', "repetition_penalty is not a finite"),
    "repetition_penalty 0": ('{"repetition_penalty": 0}', "repetition_penalty should be a finite number > 0"),
    "repetition_penalty a bool": ('{"repetition_penalty": true}', "repetition_penalty should be"),
    "eos_token_id beyond the vocabulary": ('{"eos_token_id": 100000}', "eos_token_id should be a token id (0 to"),
    "eos_token_id a string": ('{"eos_token_id": "</s>"}', "eos_token_id should be a token id"),
    "eos_token_id a list with a float": ('{"eos_token_id": [1, 2.0]}', "eos_token_id should be a token id"),
    "bos_token_id negative": ('{"bos_token_id": -2}', "bos_token_id should be a token id"),
    "another field NaN": ('{"typical_p": NaN}', "typical_p is not a finite number"),
    "a list": ("[1, 2]", "not a JSON object"),
}


@pytest.mark.parametrize("case", GENERATION_CASES)
def test_a_bad_generation_config_is_refused(folder, tmp_path, case):
    text, problem = GENERATION_CASES[case]
    (folder / "generation_config.json").write_text(text)
    with pytest.raises(KilnError) as error:
        configure(folder, tmp_path / "out")
    assert_one_line(error.value, folder / "generation_config.json", problem)


def test_a_token_id_of_minus_one_is_no_token(folder, tmp_path):
    (folder / "generation_config.json").write_text('{"pad_token_id": -1, "eos_token_id": 2}')
    out_dir = tmp_path / "out"
    configure(folder, out_dir)
    chat_config = json.loads((out_dir / "mlc-chat-config.json").read_text())
    assert chat_config["pad_token_id"] == 0 and chat_config["eos_token_id"] == [2]


def no_constants(name: str):
    raise AssertionError(f"{name} in JSON")


def test_a_good_generation_config_becomes_the_defaults(folder, tmp_path):
    generation = {"temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.1, "eos_token_id": [1, 2], "top_k": None}
    (folder / "generation_config.json").write_text(json.dumps(generation))
    out_dir = tmp_path / "out"
    configure(folder, out_dir)
    chat_config = json.loads((out_dir / "mlc-chat-config.json").read_text(), parse_constant=no_constants)
    assert (chat_config["temperature"], chat_config["top_p"], chat_config["repetition_penalty"]) == (0.6, 0.9, 1.1)
    assert chat_config["eos_token_id"] == [1, 2]
    assert json.loads((out_dir / "generation_config.json").read_text()) == generation
    assert all(math.isfinite(chat_config[key]) for key in ("temperature", "top_p", "repetition_penalty"))


# ---- 11. a mistyped local path is not a hub id; hub downloads record their commit -------------


def test_a_missing_two_part_local_path_is_not_fetched(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    assert looks_like_hub_id("org/name")
    for local in ("models/foo", "./models/foo", str(tmp_path / "models" / "foo"), "models/foo/bar"):
        assert not looks_like_hub_id(local), local
    with pytest.raises(KilnError) as error:
        ingest("models/foo", tmp_path / "work")
    assert_one_line(error.value, Path("models/foo"), "no such file or folder (not a hub id: models is a local path")


def test_a_revision_is_only_for_hub_ids(folder, tmp_path):
    with pytest.raises(KilnError) as error:
        ingest(folder, tmp_path / "work", IngestOptions(revision="main"))
    assert_one_line(error.value, folder, "--revision pins a hub download, and this is a Hugging Face folder")


INGEST_REVISION = """
import json, sys
from pathlib import Path
from kiln.compile.source.ingest import IngestOptions, ingest
model = ingest("org/tiny", Path(sys.argv[1]), IngestOptions(revision=sys.argv[2]))
print(json.dumps({"revision": model.revision, "path": str(model.path), "hash": model.source_hash}))
"""


@pytest.mark.slow
def test_a_hub_download_pins_and_records_its_revision(valid_folder, tmp_path):
    from flask import request
    from werkzeug.serving import make_server

    asked = []
    app = fake_hub({"org/tiny": {path.name: path for path in valid_folder.iterdir()}})
    app.before_request(lambda: asked.append(request.path))
    server = make_server("127.0.0.1", 0, app, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    environment = {key: value for key, value in os.environ.items() if not key.startswith(("HF_", "HUGGINGFACE_"))}
    environment.update(
        HF_ENDPOINT=f"http://127.0.0.1:{server.server_port}", HF_HOME=str(tmp_path / "hf"), HF_HUB_DISABLE_TELEMETRY="1"
    )
    try:
        result = subprocess.run(
            [sys.executable, "-c", INGEST_REVISION, str(tmp_path / "work"), "v1.0"],
            env=environment,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        server.shutdown()
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["revision"] == FAKE_COMMIT
    assert any(path.endswith("/revision/v1.0") for path in asked), asked
    # The snapshot's files link into the cache's blobs/, and that is inside the source.
    assert all((Path(summary["path"]) / name).is_symlink() for name in ("config.json", "model.safetensors"))
    assert summary["hash"] == ingest(valid_folder, tmp_path / "work").source_hash
