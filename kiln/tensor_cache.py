"""TVM's tensor cache: `tensor-cache.json` + `params_shard_N.bin`, as tvmjs and WebLLM read it.

Shards hold at most 32 MiB; a single tensor larger than that gets a shard of its own (the
format has no way to split a record across shards). Every shard carries its md5.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kiln.errors import KilnError

SHARD_CAP_BYTES = 32 << 20
JSON_NAMES = ("tensor-cache.json", "ndarray-cache.json")
RECORD_FIELDS = ("name", "shape", "dtype", "format", "nbytes", "byteOffset")


def md5_of(path: Path) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class TensorCacheWriter:
    """Streams tensors into shards; `finish` writes the json."""

    def __init__(self, out_dir: Path, shard_cap_bytes: int = SHARD_CAP_BYTES):
        self.out_dir = out_dir
        self.shard_cap_bytes = shard_cap_bytes
        self.shards: list[dict] = []
        self.pending: list[tuple[dict, bytes]] = []
        self.pending_bytes = 0
        self.param_count = 0

    def add(self, name: str, array: np.ndarray, layout: dict | None = None) -> None:
        """`layout`: extra record fields saying how to read bytes that are not plain values of the dtype."""
        data = np.ascontiguousarray(array).tobytes()
        record = {
            "name": name,
            "shape": list(array.shape),
            "dtype": str(array.dtype),
            "format": "raw",
            "nbytes": len(data),
            **(layout or {}),
        }
        self.param_count += int(array.size)
        if self.pending_bytes + len(data) > self.shard_cap_bytes:
            self._flush()
        self.pending.append((record, data))
        self.pending_bytes += len(data)

    def _flush(self) -> None:
        if not self.pending:
            return
        path = self.out_dir / f"params_shard_{len(self.shards)}.bin"
        offset = 0
        with open(path, "wb") as f:
            for record, data in self.pending:
                record["byteOffset"] = offset
                f.write(data)
                offset += len(data)
        self.shards.append(
            {
                "dataPath": path.name,
                "format": "raw-shard",
                "nbytes": offset,
                "records": [record for record, _ in self.pending],
                "md5sum": md5_of(path),
            }
        )
        self.pending, self.pending_bytes = [], 0

    def finish(self) -> dict:
        self._flush()
        total = sum(shard["nbytes"] for shard in self.shards)
        cache = {
            "metadata": {
                "ParamSize": self.param_count,
                "ParamBytes": total,
                "BitsPerParam": 8 * total / max(self.param_count, 1),
            },
            "records": self.shards,
        }
        (self.out_dir / "tensor-cache.json").write_text(json.dumps(cache, indent=2))
        return cache


@dataclass(frozen=True)
class TensorRecord:
    name: str
    shape: tuple[int, ...]
    dtype: str
    shard: Path
    byte_offset: int
    nbytes: int
    layout: dict  # the record's other fields: how to read bytes that are not plain values (gguf_type)


def read_index(model_dir: Path) -> tuple[Path, dict]:
    for name in JSON_NAMES:
        path = model_dir / name
        if path.is_file():
            try:
                return path, json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise KilnError(f"malformed tensor cache index: {e}", path) from None
    raise KilnError("no tensor-cache.json (or ndarray-cache.json): not a compiled model folder", model_dir)


def verify_shards(model_dir: Path) -> None:
    """Raise a KilnError naming the first shard that is missing, truncated or fails its md5."""
    _, index = read_index(model_dir)
    for shard in index["records"]:
        path = model_dir / shard["dataPath"]
        if not path.is_file():
            raise KilnError("weight shard is missing", path)
        if path.stat().st_size != shard["nbytes"]:
            raise KilnError(f"weight shard has {path.stat().st_size} bytes, expected {shard['nbytes']}", path)
        if "md5sum" in shard and md5_of(path) != shard["md5sum"]:
            raise KilnError("weight shard does not match its md5 in the tensor cache (corrupt or replaced)", path)


def records(model_dir: Path) -> list[TensorRecord]:
    _, index = read_index(model_dir)
    return [
        TensorRecord(
            r["name"],
            tuple(r["shape"]),
            r["dtype"],
            model_dir / shard["dataPath"],
            r["byteOffset"],
            r["nbytes"],
            {key: value for key, value in r.items() if key not in RECORD_FIELDS},
        )
        for shard in index["records"]
        for r in shard["records"]
    ]
