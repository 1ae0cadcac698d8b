"""Compiling untrusted files (issue 12): a corpus of broken inputs, all generated here.

Every case must end in one KilnError naming the file and the problem, without allocating what
a lying length asks for, and through `kiln compile` in exit code 1 with one error line, no
traceback, no model folder and no temporary files. The GGUF cut points and lies are placed with
gguf-py's own reader (an independent parser) on a tiny GGUF written by gguf-py's writer.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GGMLType
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import pre_tokenizers

from helpers.untrusted import HEADS, HIDDEN, INTERMEDIATE, KV_HEADS, KV_WIDTH, TINY_CONFIG, write_hf_folder

from kiln.chat_template import ChatTemplate
from kiln.compile.source.gguf_file import read_gguf
from kiln.compile.source.gguf_source import GGUFModel
from kiln.compile.source.ingest import SAFETENSORS_ITEM_SIZES, ingest, read_config, read_safetensors_header
from kiln.errors import KilnError
from kiln.models import architecture_for

MAX_PEAK_BYTES = 64 << 20  # hashing a source reads it in 16 MB chunks
LIE = 2**60

# ---- a tiny valid GGUF, and where its sections are -----------------------------------------


def write_valid_gguf(path: Path, alignment: int | None = None) -> None:
    """A 1-layer Llama with a 257-token byte-level vocabulary, F32 and Q8_0 tensors."""
    rng = np.random.default_rng(0)
    tokens = [*sorted(pre_tokenizers.ByteLevel.alphabet()), "ab"]
    writer = gguf.GGUFWriter(path, "llama")
    if alignment is not None:
        writer.add_uint32("general.alignment", alignment)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    shapes = {
        "token_embd.weight": (len(tokens), HIDDEN),
        "blk.0.attn_norm.weight": (HIDDEN,),
        "blk.0.attn_q.weight": (HIDDEN, HIDDEN),
        "blk.0.attn_k.weight": (KV_WIDTH, HIDDEN),
        "blk.0.attn_v.weight": (KV_WIDTH, HIDDEN),
        "blk.0.attn_output.weight": (HIDDEN, HIDDEN),
        "blk.0.ffn_norm.weight": (HIDDEN,),
        "blk.0.ffn_gate.weight": (INTERMEDIATE, HIDDEN),
        "blk.0.ffn_up.weight": (INTERMEDIATE, HIDDEN),
        "blk.0.ffn_down.weight": (HIDDEN, INTERMEDIATE),
        "output_norm.weight": (HIDDEN,),
    }
    for name, shape in shapes.items():
        values = rng.standard_normal(shape).astype(np.float32)
        if name == "blk.0.attn_q.weight":
            writer.add_tensor(name, gguf.quants.quantize(values, GGMLType.Q8_0), raw_dtype=GGMLType.Q8_0)
        else:
            writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def field_starts(field) -> list[int]:
    """The offset of each part of a gguf-py ReaderField (its parts lie back to back)."""
    starts, offset = [], field.offset
    for part in field.parts:
        starts.append(offset)
        offset += part.nbytes
    return [*starts, offset]


def gguf_layout() -> tuple[bytes, dict[str, int], list[int]]:
    """The valid GGUF's bytes, named offsets for the lies, and cut points in every section."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "valid.gguf"
        write_valid_gguf(path)
        data = path.read_bytes()
        reader = gguf.GGUFReader(path)
        fields, tensors = reader.fields, reader.tensors
        tokens, types = field_starts(fields["tokenizer.ggml.tokens"]), field_starts(fields["tokenizer.ggml.token_type"])
        arch = field_starts(fields["general.architecture"])
        first, second = field_starts(tensors[0].field), field_starts(tensors[1].field)
        tensor_names = {tensor.name: field_starts(tensor.field)[1] for tensor in tensors}
        header_end = field_starts(tensors[-1].field)[-1]
        offsets = {
            "tensor count": 8,
            "kv count": 16,
            "key length": arch[0],
            "string length": arch[3],
            "value type": arch[2],
            "string array count": tokens[4],
            "string array item length": tokens[5],
            "int array count": types[4],
            "ndim": first[2],
            "dim": first[3],
            "type": first[4],
            "offset": first[5],
            "second tensor offset": second[5],
            "ffn_down name": tensor_names["blk.0.ffn_down.weight"],
            "merges key": field_starts(fields["tokenizer.ggml.merges"])[1],
            "header end": header_end,
        }
        cuts = {0, 2, 4, 6, 8, 12, 16, 20}
        for field in list(fields.values())[3:] + [tensor.field for tensor in tensors]:
            starts = field_starts(field)[:-1]
            starts = starts[:8] + starts[-2:]  # an array's type, count and first items, and its last item
            cuts.update(starts)
            cuts.update(start + 1 for start in starts)
        assert reader.data_offset > header_end + 1  # a cut inside the alignment padding
        cuts.add(header_end + 1)
        for tensor in tensors:
            cuts.update(
                {tensor.data_offset, tensor.data_offset + tensor.n_bytes // 2, tensor.data_offset + tensor.n_bytes - 1}
            )
        return data, offsets, sorted(cuts)


VALID_GGUF, GGUF_OFFSETS, GGUF_CUTS = gguf_layout()


def patched(data: bytes, offset: int, fmt: str, value) -> bytes:
    size = struct.calcsize(fmt)
    return data[:offset] + struct.pack(fmt, value) + data[offset + size :]


def lie(name: str, value: int = LIE, fmt: str = "<Q") -> bytes:
    return patched(VALID_GGUF, GGUF_OFFSETS[name], fmt, value)


def renamed(data: bytes, name_offset: int, new_name: bytes) -> bytes:
    return data[:name_offset] + new_name + data[name_offset + len(new_name) :]


def write(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def assert_refused(read, path: Path, problem: str) -> KilnError:
    """`read()` raises one KilnError naming `path` and `problem`, on one line, with a small peak of memory."""
    tracemalloc.start()
    try:
        with pytest.raises(KilnError) as error:
            read()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(error.value)
    assert message.startswith(f"{path}: ") and problem in message, message
    assert "\n" not in message
    assert peak < MAX_PEAK_BYTES, f"{peak} bytes allocated"
    return error.value


def test_the_valid_gguf_reads():
    with tempfile.TemporaryDirectory() as folder:
        path = write(Path(folder), "valid.gguf", VALID_GGUF)
        model = GGUFModel(path)
        assert model.config["hidden_size"] == HIDDEN and len(model.names()) == 11
        assert model.load("model.layers.0.self_attn.q_proj.weight").shape == (HIDDEN, HIDDEN)


# ---- GGUF: truncated at every section ------------------------------------------------------


@pytest.mark.parametrize("cut", GGUF_CUTS)
def test_gguf_truncated_anywhere_is_refused(tmp_path, cut):
    path = write(tmp_path, "cut.gguf", VALID_GGUF[:cut])
    problem = "it is empty" if cut == 0 else "not a readable GGUF file: "
    assert_refused(lambda: read_gguf(path), path, problem)


# ---- GGUF: lying lengths, counts, alignment, names, dimensions -----------------------------

GGUF_LIES = {
    "tensor count 2**60": (lie("tensor count"), "tensors cannot fit"),
    "kv count 2**60": (lie("kv count"), "metadata keys cannot fit"),
    "key length 2**60": (lie("key length"), "needs 1152921504606846976 bytes"),
    "string length 2**60": (lie("string length"), "needs 1152921504606846976 bytes"),
    "string array count 2**60": (lie("string array count"), "items of tokenizer.ggml.tokens cannot fit"),
    "string array item length 2**60": (lie("string array item length"), "an item of tokenizer.ggml.tokens"),
    "int array count 2**60": (lie("int array count"), "items of tokenizer.ggml.token_type cannot fit"),
    "unknown value type": (lie("value type", 99, "<I"), "unknown value type 99"),
    "ndim 2**31": (lie("ndim", 2**31, "<I"), "dimensions (1 to 4 allowed)"),
    "ndim 5": (lie("ndim", 5, "<I"), "has 5 dimensions"),
    "ndim 0": (lie("ndim", 0, "<I"), "has 0 dimensions"),
    "dim 2**60": (lie("dim"), "ends at byte"),
    "dim 0": (lie("dim", 0), "an empty dimension"),
    "unknown tensor type": (lie("type", 999, "<I"), "unknown ggml type 999"),
    "data past the end": (lie("offset", 2**40), "truncated, tensor token_embd.weight ends at byte"),
    "unaligned offset": (lie("second tensor offset", 4), "is not aligned to 32 bytes"),
    "overlapping tensors": (lie("second tensor offset", 0), "overlap"),
    "duplicate tensor name": (
        renamed(VALID_GGUF, GGUF_OFFSETS["ffn_down name"], b"blk.0.ffn_gate.weight"),
        "tensor blk.0.ffn_gate.weight appears twice",
    ),
    "duplicate metadata key": (
        renamed(VALID_GGUF, GGUF_OFFSETS["merges key"], b"tokenizer.ggml.tokens"),
        "metadata key tokenizer.ggml.tokens appears twice",
    ),
    "wrong magic": (b"GGML" + VALID_GGUF[4:], "it starts with b'GGML'"),
    "version 1": (patched(VALID_GGUF, 4, "<I", 1), "unsupported GGUF version 1"),
    "big-endian version": (patched(VALID_GGUF, 4, ">I", 3), "unsupported GGUF version 50331648"),
}


def test_renames_replace_names_of_the_same_length():
    ffn_down, merges = GGUF_OFFSETS["ffn_down name"], GGUF_OFFSETS["merges key"]
    assert VALID_GGUF[ffn_down : ffn_down + 21] == b"blk.0.ffn_down.weight"
    assert VALID_GGUF[merges : merges + 21] == b"tokenizer.ggml.merges"


@pytest.mark.parametrize("case", GGUF_LIES)
def test_gguf_lies_are_refused_without_allocating(tmp_path, case):
    data, problem = GGUF_LIES[case]
    path = write(tmp_path, "lying.gguf", data)
    assert_refused(lambda: read_gguf(path), path, problem)


@pytest.mark.parametrize(
    "alignment, problem",
    [(0, "general.alignment 0 is not a power of two"), (48, "general.alignment 48 is not a power of two")],
)
def test_gguf_bad_alignment_is_refused(tmp_path, alignment, problem):
    path = tmp_path / "aligned.gguf"
    write_valid_gguf(path, alignment=alignment)
    assert_refused(lambda: read_gguf(path), path, problem)


GGUF_METADATA_LIES = {
    "architecture not a string": ("general.architecture", 7, "general.architecture should be str, got 7"),
    "hidden size zero": ("llama.embedding_length", 0, "llama.embedding_length should be positive, got 0"),
    "hidden size a string": ("llama.embedding_length", "32", "llama.embedding_length should be int"),
    "heads not dividing": ("llama.attention.head_count", 3, "head_count 3 does not divide"),
    "layers absurd": ("llama.block_count", 10**6, "'num_hidden_layers' is 1000000, beyond any real model's"),
    "tokens not strings": ("tokenizer.ggml.tokens", [1, 2], "tokenizer.ggml.tokens should be list[str]"),
    "token types too few": ("tokenizer.ggml.token_type", [1], "has 1 entries for 257 tokens"),
    "bos id a string": ("tokenizer.ggml.bos_token_id", "zero", "bos_token_id should be int"),
}


def value_types(value) -> tuple[gguf.GGUFValueType, gguf.GGUFValueType | None]:
    scalar = {str: gguf.GGUFValueType.STRING, int: gguf.GGUFValueType.INT64}
    if isinstance(value, list):
        return gguf.GGUFValueType.ARRAY, scalar[type(value[0])]
    return scalar[type(value)], None


@pytest.mark.parametrize("case", GGUF_METADATA_LIES)
def test_gguf_metadata_of_the_wrong_kind_is_refused(tmp_path, case):
    key, value, problem = GGUF_METADATA_LIES[case]
    reader = gguf.GGUFReader(write(tmp_path, "valid.gguf", VALID_GGUF))
    path = tmp_path / "lying.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.kv_data[0].clear()
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        if name == key:
            writer.add_key_value(name, value, *value_types(value))
        else:
            writer.add_key_value(
                name, field.contents(), field.types[0], sub_type=field.types[-1] if len(field.types) > 1 else None
            )
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    def read():
        model = GGUFModel(path)
        architecture_for(model.config, path).parse_config(model.config, path, {})
        model.write_tokenizer_files(tmp_path / "tokenizer")

    assert_refused(read, path, problem)


# ---- safetensors -----------------------------------------------------------------------------


def safetensors_bytes(header: dict | bytes, data: bytes = bytes(16), size: int | None = None) -> bytes:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return (len(text) if size is None else size).to_bytes(8, "little") + text + data


def entry(shape=(2, 2), offsets=(0, 16), dtype="F32") -> dict:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


SAFETENSORS_CASES = {
    "shorter than its header length": (b"\x01\x02", "truncated safetensors file: 2 bytes"),
    "header length beyond the file": (safetensors_bytes({"a": entry()}, size=10**6), "does not fit"),
    "header length 2**63": (safetensors_bytes({"a": entry()}, size=2**63), "does not fit"),
    "header not JSON": (safetensors_bytes(b"{not json"), "corrupt safetensors header"),
    "header not UTF-8": (safetensors_bytes(b"\xff\xfe"), "corrupt safetensors header"),
    "header not an object": (safetensors_bytes([1, 2]), "not a JSON object"),
    "header deeply nested": (safetensors_bytes(b"[" * 100000 + b"]" * 100000), "corrupt safetensors header"),
    "entry not an object": (safetensors_bytes({"a": 5}), "entry for a: no known dtype"),
    "unknown dtype": (safetensors_bytes({"a": entry(dtype="F128")}), "no known dtype"),
    "shape not a list": (safetensors_bytes({"a": {**entry(), "shape": 4}}), "shape 4 is not a list of sizes"),
    "negative shape": (safetensors_bytes({"a": entry(shape=(-2, -2))}), "is not a list of sizes"),
    "float shape": (safetensors_bytes({"a": entry(shape=(2.0, 2))}), "is not a list of sizes"),
    "bool shape": (safetensors_bytes({"a": entry(shape=(True, 4))}), "is not a list of sizes"),
    "dtype and shape not the byte length": (
        safetensors_bytes({"a": entry(shape=(3, 2))}),
        "takes 16 bytes, its shape and dtype need 24",
    ),
    "offsets past the end": (safetensors_bytes({"a": entry(shape=(4, 2), offsets=(0, 32))}), "tensor a ends at byte"),
    "offsets reversed": (safetensors_bytes({"a": entry(offsets=(16, 0))}), "are not [begin, end]"),
    "negative offsets": (safetensors_bytes({"a": entry(offsets=(-16, 0))}), "are not [begin, end]"),
    "float offsets": (safetensors_bytes({"a": entry(offsets=(0.0, 16.0))}), "are not [begin, end]"),
    "three offsets": (safetensors_bytes({"a": entry(offsets=(0, 8, 16))}), "are not [begin, end]"),
    "huge offsets": (safetensors_bytes({"a": entry(shape=(2**60, 2), offsets=(0, 2**63))}), "ends at byte"),
    "overlapping tensors": (safetensors_bytes({"a": entry(), "b": entry(shape=(2,), offsets=(8, 16))}), "overlap"),
    "duplicate names": (
        safetensors_bytes(b'{"a": ' + json.dumps(entry()).encode() + b', "a": ' + json.dumps(entry()).encode() + b"}"),
        "'a' appears twice",
    ),
}


@pytest.mark.parametrize("case", SAFETENSORS_CASES)
def test_corrupt_safetensors_is_refused(tmp_path, case):
    data, problem = SAFETENSORS_CASES[case]
    path = write(tmp_path, "model.safetensors", data)
    assert_refused(lambda: read_safetensors_header(path), path, problem)


def test_a_valid_safetensors_header_reads(tmp_path):
    path = write(tmp_path, "model.safetensors", safetensors_bytes({"a": entry(), "__metadata__": {"format": "pt"}}))
    assert read_safetensors_header(path)["a"].shape == (2, 2)


# ---- Hugging Face folders: config.json, tokenizer files, weight index ----------------------


@pytest.fixture(scope="module")
def valid_folder(tmp_path_factory) -> Path:
    return write_hf_folder(tmp_path_factory.mktemp("untrusted") / "tiny")


@pytest.fixture
def folder(valid_folder, tmp_path) -> Path:
    return Path(shutil.copytree(valid_folder, tmp_path / "tiny"))


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


# ---- chat templates --------------------------------------------------------------------------

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


@pytest.mark.parametrize("case", TEMPLATE_CASES)
def test_hostile_or_broken_chat_template_is_refused(tmp_path, case):
    source, problem = TEMPLATE_CASES[case]
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


# ---- property-based: mutated and truncated inputs parse or raise KilnError -----------------

HEADER_END = GGUF_OFFSETS["header end"]


@settings(max_examples=250, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_mutated_gguf_parses_or_raises_kiln_error(data):
    content = bytearray(VALID_GGUF)
    for _ in range(data.draw(st.integers(1, 4), label="mutations")):
        position = data.draw(st.integers(0, HEADER_END), label="position")
        content[position] = data.draw(st.integers(0, 255), label="byte")
    content = content[: data.draw(st.integers(0, len(content)), label="length")]
    with tempfile.TemporaryDirectory() as folder:
        path = write(Path(folder), "mutated.gguf", bytes(content))
        tracemalloc.start()
        try:
            GGUFModel(path).write_tokenizer_files(Path(folder) / "tokenizer")
        except KilnError as error:
            assert str(error).startswith(f"{path}: ") and "\n" not in str(error)
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
    assert peak < 64 << 20


VALID_SAFETENSORS = safetensors_bytes(
    {"a": entry(), "b": entry(shape=(2,), dtype="F64", offsets=(16, 32)), "__metadata__": {"format": "pt"}},
    data=bytes(32),
)


@settings(max_examples=250, deadline=None, database=None)
@given(st.data())
def test_mutated_safetensors_header_parses_or_raises_kiln_error(data):
    content = bytearray(VALID_SAFETENSORS)
    header_end = 8 + int.from_bytes(VALID_SAFETENSORS[:8], "little")
    for _ in range(data.draw(st.integers(1, 4), label="mutations")):
        position = data.draw(st.integers(0, header_end - 1), label="position")
        content[position] = data.draw(st.sampled_from(b'{}[]",:0123456789-.eE aFU_'), label="byte")
    content = content[: data.draw(st.integers(0, len(content)), label="length")]
    with tempfile.TemporaryDirectory() as folder:
        path = write(Path(folder), "model.safetensors", bytes(content))
        try:
            tensors = read_safetensors_header(path)
        except KilnError as error:
            assert str(error).startswith(f"{path}: ") and "\n" not in str(error)
        else:
            for tensor in tensors.values():
                assert tensor.offset + math.prod(tensor.shape) * SAFETENSORS_ITEM_SIZES[tensor.dtype] <= len(content)


# ---- through `kiln compile`: one line, exit 1, nothing left behind -------------------------


def run_kiln_compile(source: Path, tmp_path: Path) -> tuple[subprocess.CompletedProcess, Path, Path]:
    output, temp = tmp_path / "out", tmp_path / "tmp"
    output.mkdir()
    temp.mkdir()
    environment = {**os.environ, "TMPDIR": str(temp)}
    result = subprocess.run(
        [Path(sys.executable).parent / "kiln", "compile", str(source), "-q", "q0f32", "-t", "cpu", "-o", str(output)],
        capture_output=True,
        text=True,
        env=environment,
        timeout=300,
    )
    return result, output, temp


def assert_clean_cli_failure(source: Path, tmp_path: Path, named_file: Path, problem: str) -> None:
    result, output, temp = run_kiln_compile(source, tmp_path)
    errors = [line for line in result.stderr.splitlines() if line.startswith("kiln: error: ")]
    others = [line for line in result.stderr.splitlines() if not line.startswith("kiln: ")]
    assert result.returncode == 1, result.stderr
    assert len(errors) == 1 and errors[0].startswith(f"kiln: error: {named_file}: ") and problem in errors[0], errors
    assert others == [] and "Traceback" not in result.stderr, result.stderr
    assert list(output.iterdir()) == [] and list(temp.iterdir()) == []


CLI_CASES = {
    "gguf truncated": (
        lambda tmp: write(tmp, "cut.gguf", VALID_GGUF[: GGUF_CUTS[len(GGUF_CUTS) // 2]]),
        "",
        "not a readable GGUF file: truncated",
    ),
    "gguf lying count": (
        lambda tmp: write(tmp, "lying.gguf", GGUF_LIES["string array count 2**60"][0]),
        "",
        "cannot fit",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", CLI_CASES)
def test_kiln_compile_refuses_a_broken_gguf_in_one_line(tmp_path, case):
    make, _, problem = CLI_CASES[case]
    source = make(tmp_path)
    assert_clean_cli_failure(source, tmp_path, source, problem)


FOLDER_CLI_CASES = ["layers 10**6", "tokenizer.json wrong structure", "index outside the folder"]


@pytest.mark.slow
@pytest.mark.parametrize("case", FOLDER_CLI_CASES)
def test_kiln_compile_refuses_a_broken_folder_in_one_line(folder, tmp_path, case):
    break_folder, named_file, problem = FOLDER_CASES[case]
    break_folder(folder)
    assert_clean_cli_failure(folder, tmp_path, folder / named_file, problem)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["nested range loops", "namespace doubling", "cycler globals"])
def test_kiln_compile_refuses_a_hostile_chat_template_in_one_line(folder, tmp_path, case):
    """The template is read at ingest but rendered when the conv_template is derived, after the
    weights are converted (it gets ChatML's marker, for a family to be tried)."""
    source, problem = TEMPLATE_CASES[case]
    (folder / "chat_template.jinja").write_text("<|im_start|>" + source)
    assert_clean_cli_failure(folder, tmp_path, folder / "chat_template.jinja", problem)
