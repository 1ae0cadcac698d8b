"""Compiling untrusted GGUF files (issue 12): a tiny GGUF written by gguf-py's writer, truncated in
every section, with lying lengths, counts, alignments, names and dimensions, metadata of the wrong
kind, and mutated at random, all generated here.

Every case must end in one KilnError naming the file and the problem, without allocating what
a lying length asks for, and through `kiln compile` in exit code 1 with one error line, no
traceback, no model folder and no temporary files. The cut points and lies are placed with
gguf-py's own reader (an independent parser).
"""

from __future__ import annotations

import struct
import tempfile
import tracemalloc
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GGMLType
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import pre_tokenizers

from helpers.untrusted import (
    HEADS,
    HIDDEN,
    INTERMEDIATE,
    KV_HEADS,
    KV_WIDTH,
    assert_clean_cli_failure,
    assert_refused,
    write,
)

from kiln.compile.source.gguf_file import read_gguf
from kiln.compile.source.gguf_source import GGUFModel
from kiln.errors import KilnError
from kiln.models import architecture_for

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


# ---- through `kiln compile`: one line, exit 1, nothing left behind -------------------------

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
