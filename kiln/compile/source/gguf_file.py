"""The GGUF container, read strictly: every length, count, offset and alignment checked against the file.

A GGUF is a header (magic, version, tensor and metadata counts), metadata key/values, tensor
infos (name, dimensions innermost first, ggml type, offset), padding to the alignment, then the
tensor data. A file from the internet may lie anywhere in it, so each count is bounded by the
bytes left in the file before anything is allocated for it, and tensors must lie, aligned and
apart, inside the file. Tensor data stays in the file (memory-mapped views); a numeric metadata
array is one numpy array of the file's bytes (as Python numbers a float array took 10x its size).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT
from gguf.constants import GGMLQuantizationType as GGMLType
from gguf.constants import GGUFValueType as ValueType

from kiln.errors import KilnError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
SCALAR_FORMATS = {
    ValueType.UINT8: "<B",
    ValueType.INT8: "<b",
    ValueType.UINT16: "<H",
    ValueType.INT16: "<h",
    ValueType.UINT32: "<I",
    ValueType.INT32: "<i",
    ValueType.FLOAT32: "<f",
    ValueType.BOOL: "<?",
    ValueType.UINT64: "<Q",
    ValueType.INT64: "<q",
    ValueType.FLOAT64: "<d",
}
# The fewest bytes an item can take, to bound a count by the bytes left before reading the items.
STRING_MIN_BYTES = 8  # its length
KEY_VALUE_MIN_BYTES = STRING_MIN_BYTES + 4 + 1  # key, value type, a one-byte value
TENSOR_INFO_MIN_BYTES = STRING_MIN_BYTES + 4 + 4 + 8  # name, dimension count, type, offset


def unreadable(problem: str, path: Path) -> KilnError:
    """One line, whatever the file put in the names it quotes (a key's name may hold a newline)."""
    shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in problem)
    return KilnError(f"not a readable GGUF file: {shown}", path)


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLType
    shape: tuple[int, ...]  # ggml's order: innermost dimension first
    offset: int  # from the start of the file
    nbytes: int
    data: np.ndarray  # uint8 [rows, bytes per row], a view of the file


@dataclass
class GGUFFile:
    path: Path
    metadata: dict[str, Any]  # strings, numbers, bools, lists of strings and numpy arrays of numbers or bools
    tensors: list[GGUFTensor]


class Cursor:
    """Reads the header front to back; reading past the end of the file is a KilnError naming what."""

    def __init__(self, data: mmap.mmap, path: Path):
        self.data, self.path, self.offset = data, path, 0

    def left(self) -> int:
        return len(self.data) - self.offset

    def take(self, size: int, what: str) -> memoryview:
        if size > self.left():
            raise unreadable(
                f"truncated, {what} at byte {self.offset} needs {size} bytes, {self.left()} are left", self.path
            )
        start, self.offset = self.offset, self.offset + size
        return memoryview(self.data)[start : self.offset]

    def scalar(self, value_type: ValueType, what: str):
        fmt = SCALAR_FORMATS[value_type]
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def u32(self, what: str) -> int:
        return self.scalar(ValueType.UINT32, what)

    def u64(self, what: str) -> int:
        return self.scalar(ValueType.UINT64, what)

    def count(self, what: str, min_item_bytes: int) -> int:
        count = self.u64(f"the {what} count")
        if count * min_item_bytes > self.left():
            raise unreadable(f"{count} {what} cannot fit in the {self.left()} bytes left", self.path)
        return count

    def string(self, what: str) -> str:
        length = self.u64(f"the length of {what}")
        try:
            return str(self.take(length, what), "utf-8")
        except UnicodeDecodeError as error:
            raise unreadable(f"{what} is not UTF-8 ({error})", self.path) from None

    def value_type(self, what: str) -> ValueType:
        raw = self.u32(f"the type of {what}")
        try:
            return ValueType(raw)
        except ValueError:
            raise unreadable(f"{what} has unknown value type {raw}", self.path) from None

    def value(self, value_type: ValueType, what: str) -> Any:
        if value_type == ValueType.STRING:
            return self.string(what)
        if value_type == ValueType.ARRAY:
            return self.array(what)
        return self.scalar(value_type, what)

    def array(self, what: str) -> list[str] | np.ndarray:
        item_type = self.value_type(f"the items of {what}")
        if item_type == ValueType.ARRAY:
            raise unreadable(f"{what} is an array of arrays", self.path)
        if item_type == ValueType.STRING:
            return [self.string(f"an item of {what}") for _ in range(self.count(f"items of {what}", STRING_MIN_BYTES))]
        dtype = np.dtype(SCALAR_FORMATS[item_type])
        count = self.count(f"items of {what}", dtype.itemsize)
        # A copy: the file's mapping closes once the header is read.
        values = np.frombuffer(self.take(count * dtype.itemsize, what), dtype).copy()
        values.flags.writeable = False
        return values


def read_metadata(cursor: Cursor) -> dict[str, Any]:
    metadata = {}
    for _ in range(cursor.count("metadata keys", KEY_VALUE_MIN_BYTES)):
        key = cursor.string("a metadata key")
        value = cursor.value(cursor.value_type(key), key)
        if key in metadata:
            raise unreadable(f"metadata key {key} appears twice", cursor.path)
        metadata[key] = value
    return metadata


@dataclass(frozen=True)
class TensorInfo:
    name: str
    tensor_type: GGMLType
    shape: tuple[int, ...]
    offset: int  # from the start of the data section

    def nbytes(self, path: Path) -> int:
        block_size, block_bytes = GGML_QUANT_SIZES[self.tensor_type]
        if self.shape[0] % block_size:
            raise unreadable(
                f"tensor {self.name} has rows of {self.shape[0]} values, not whole "
                f"{self.tensor_type.name} blocks of {block_size}",
                path,
            )
        return int(np.prod(self.shape, dtype=object)) // block_size * block_bytes


def read_tensor_info(cursor: Cursor) -> TensorInfo:
    name = cursor.string("a tensor name")
    ndim = cursor.u32(f"the dimension count of tensor {name}")
    if not 1 <= ndim <= MAX_DIMS:
        raise unreadable(f"tensor {name} has {ndim} dimensions (1 to {MAX_DIMS} allowed)", cursor.path)
    shape = tuple(cursor.u64(f"the dimensions of tensor {name}") for _ in range(ndim))
    if 0 in shape:
        raise unreadable(f"tensor {name} has an empty dimension {list(shape)}", cursor.path)
    raw_type = cursor.u32(f"the type of tensor {name}")
    if raw_type not in GGMLType._value2member_map_:
        raise unreadable(f"tensor {name} has unknown ggml type {raw_type}", cursor.path)
    return TensorInfo(name, GGMLType(raw_type), shape, cursor.u64(f"the offset of tensor {name}"))


def alignment(metadata: dict[str, Any], path: Path) -> int:
    value = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value & (value - 1):
        raise unreadable(f"general.alignment {value!r} is not a power of two", path)
    return value


def checked_tensors(
    infos: list[TensorInfo],
    data_start: int,
    align: int,
    file_size: int,
    view: Callable[[int, int], np.ndarray],
    path: Path,
) -> list[GGUFTensor]:
    """The tensors, each aligned, inside the file and apart from the others."""
    tensors, names = [], set()
    for info in infos:
        if info.name in names:
            raise unreadable(f"tensor {info.name} appears twice", path)
        names.add(info.name)
        if info.offset % align:
            raise unreadable(f"tensor {info.name} at offset {info.offset} is not aligned to {align} bytes", path)
        nbytes, start = info.nbytes(path), data_start + info.offset
        if start + nbytes > file_size:
            raise unreadable(
                f"truncated, tensor {info.name} ends at byte {start + nbytes}, the file has {file_size}", path
            )
        rows = int(np.prod(info.shape[1:], dtype=object))
        tensors.append(
            GGUFTensor(
                info.name,
                info.tensor_type,
                info.shape,
                start,
                nbytes,
                view(start, nbytes).reshape(rows, nbytes // rows),
            )
        )
    by_offset = sorted(tensors, key=lambda tensor: tensor.offset)
    for before, after in zip(by_offset, by_offset[1:]):
        if before.offset + before.nbytes > after.offset:
            raise unreadable(f"tensors {before.name} and {after.name} overlap", path)
    return tensors


def read_gguf(path: Path) -> GGUFFile:
    with open(path, "rb") as file:
        file_size = file.seek(0, 2)
        if file_size == 0:
            raise KilnError("not a readable GGUF file: truncated, it is empty", path)
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            cursor = Cursor(data, path)
            if (magic := bytes(cursor.take(len(MAGIC), "the magic number"))) != MAGIC:
                raise unreadable(f"it starts with {magic!r}, not {MAGIC!r}", path)
            if (version := cursor.u32("the version")) not in VERSIONS:
                raise KilnError(
                    f"unsupported GGUF version {version} (Kiln reads {' and '.join(map(str, VERSIONS))})", path
                )
            tensor_count = cursor.count("tensors", TENSOR_INFO_MIN_BYTES)
            metadata = read_metadata(cursor)
            infos = [read_tensor_info(cursor) for _ in range(tensor_count)]
            header_end = cursor.offset
    align = alignment(metadata, path)
    data_start = -(-header_end // align) * align
    file_data = np.memmap(path, dtype=np.uint8, mode="r") if infos else np.empty(0, np.uint8)
    tensors = checked_tensors(
        infos, data_start, align, file_size, lambda start, nbytes: file_data[start : start + nbytes], path
    )
    return GGUFFile(path, metadata, tensors)
