"""Compiling untrusted safetensors files (issue 12): corrupt headers and headers mutated at random,
all generated here.

Every case must end in one KilnError naming the file and the problem, without allocating what
a lying length asks for.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.untrusted import assert_refused, write

from kiln.compile.source.ingest import SAFETENSORS_ITEM_SIZES, read_safetensors_header
from kiln.errors import KilnError


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


# ---- property-based: mutated and truncated inputs parse or raise KilnError -----------------

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
