"""Where a cpu decode step's time goes, per stored matrix type (`kiln bench native`).

Each type of matrix a decode step reads (a GGUF block type, an MLC group format, float32 or
float16 weights) gets a decode GEMV of each of its shapes, built by this Kiln with the cpu
library's schedules for the CPU the library was built for, and run once over every matrix of that
type and shape in the model, its own stored bytes, in the order of the layers: as a decode step
reads them, so a type larger than the CPU's caches streams from memory. Its bytes over its time
are the type's GB/s, set beside the same copy bandwidth the whole step is measured against.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tvm
from tvm import DataType, te

from kiln.app_config import read_json
from kiln.runtime import cpu_variant, weight_placer
from kiln.tensor_cache import TensorRecord, records

PASSES = 5  # the fastest pass over a type's matrices is reported


@dataclass(frozen=True)
class Matrix:
    """One stored matrix a decode step reads as a whole: its type and shape, and its parameters."""

    kind: str
    rows: int
    cols: int
    parameters: tuple[TensorRecord, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parameters)


def read_whole_by_decode(record: TensorRecord, tied: bool) -> bool:
    """Whether a decode step reads all of a stored parameter: all but the embedding tables, of which
    it gathers one row each, unless the embedding is tied (it is also the output projection; Gemma
    4's per-layer table never is)."""
    parts = record.name.split(".")  # "model.embed_tokens.q_weight", "model.embed_tokens_per_layer.q_scale"
    if "embed_tokens" in parts:
        return tied
    return not any(part.startswith("embed_tokens") for part in parts)


def decode_matrices(model_dir: Path, tied: bool, quantization: str) -> list[Matrix]:
    """The stored matrices a decode step reads whole, in the tensor cache's order."""
    from kiln.compile.quantization import quantization_named

    by_name = {r.name: r for r in records(model_dir)}
    matrices = []
    for r in by_name.values():
        if not read_whole_by_decode(r, tied):
            continue
        if "gguf_type" in r.layout:
            rows, cols = r.layout["gguf_shape"]
            matrices.append(Matrix(r.layout["gguf_type"], rows, cols, (r,)))
        elif r.name.endswith(".q_weight"):
            fmt = quantization_named(quantization).group_format
            scales = by_name[r.name.removesuffix("q_weight") + "q_scale"]
            matrices.append(Matrix(quantization, r.shape[0], r.shape[1] * fmt.values_per_word, (r, scales)))
        elif r.name.endswith(".weight") and len(r.shape) == 2:  # a float weight, not quantized
            matrices.append(Matrix(r.dtype, *r.shape, (r,)))
    return matrices


def gemv_kernel(matrix: Matrix, quantization: str, target: tvm.target.Target):
    """A decode GEMV of `matrix`'s type and shape, scheduled as the cpu library's (for `gguf_i8`, the
    8-bit activation kernel of the types that have one)."""
    from kiln.compile.lower import cpu_schedules
    from kiln.compile.quantization import int8_decode, quantization_named
    from kiln.compile.quantization.ggml_blocks import BLOCK_TYPES
    from kiln.models.layers import matmul_transposed

    rows, cols = matrix.rows, matrix.cols
    with target:
        x = te.placeholder((1, 1, cols), "float32", name="x")
        if matrix.kind in BLOCK_TYPES:
            block_type = BLOCK_TYPES[matrix.kind]
            (words,) = matrix.parameters
            units = words.nbytes // DataType(block_type.unit).itemsize // rows
            int8 = getattr(quantization_named(quantization), "int8_activations", False)
            if int8 and matrix.kind in int8_decode.KERNEL_BLOCKS:
                isa = int8_decode.instruction_set(target)
                kernel = int8_decode.gemv(matrix.kind, rows, cols, units, isa).with_attr("global_symbol", "main")
                return tvm.compile(tvm.IRModule({"main": kernel}), target=target)
            stored = [te.placeholder((rows, units), block_type.unit, name="blocks")]
            y = block_type.matmul_te(x, *stored, rows, cols, "float32", "float32")
        elif matrix.kind == quantization:
            stored = [te.placeholder(p.shape, p.dtype, name=p.name) for p in matrix.parameters]
            y = quantization_named(quantization).group_format.matmul_te(x, *stored, rows, cols, "float32")
        else:
            x = te.placeholder((1, 1, cols), matrix.kind, name="x")
            stored = [te.placeholder((rows, cols), matrix.kind, name="weight")]
            y = matmul_transposed(x, stored[0], matrix.kind)
        args = [x, *stored, y]
        module = cpu_schedules()(tvm.IRModule({"main": te.create_prim_func(args)}))
    return tvm.compile(module, target=target)


def stored_units(record: TensorRecord, data: bytes) -> np.ndarray:
    """A stored parameter as the cpu kernels read it: GGUF words as their block type's units."""
    from kiln.compile.quantization.ggml_blocks import BLOCK_TYPES

    array = np.frombuffer(data, dtype=record.dtype).reshape(record.shape)
    if "gguf_type" in record.layout:
        return array.view(BLOCK_TYPES[record.layout["gguf_type"]].unit).reshape(record.shape[0], -1)
    return array


def parameter_tensors(matrix: Matrix, device) -> list[tvm.runtime.Tensor]:
    place = weight_placer(device, [p.nbytes for p in matrix.parameters])
    tensors = []
    for p in matrix.parameters:
        with open(p.shard, "rb") as f:
            f.seek(p.byte_offset)
            tensors.append(place(stored_units(p, f.read(p.nbytes))))
    return tensors


def kernels_as_built(model_dir: Path) -> bool:
    """Whether this Kiln's GEMVs are the library's: it was built by the same Kiln code."""
    from kiln.compile.pipeline import kiln_code_digest

    return read_json(model_dir / "kiln-build.json").get("kiln_code_digest") == kiln_code_digest()


def time_matrix_types(model_dir: Path, bandwidth: float) -> list[dict]:
    """Per matrix type: its bytes a decode step reads, the time and GB/s of its GEMVs, and that
    rate's share of `bandwidth` (bytes per second of a copy on the same threads)."""
    chat_config = read_json(model_dir / "mlc-chat-config.json")
    quantization = chat_config["quantization"]
    tied = chat_config["model_config"].get("tie_word_embeddings", False)
    _, library = cpu_variant(read_json(model_dir / "kiln-build.json")["targets"]["cpu"], model_dir)
    features = [f"+{feature}" for feature in library.get("features", [])]
    target = tvm.target.Target({"kind": "llvm", "mcpu": library["mcpu"], "mattr": features})
    device = tvm.cpu()

    by_shape: dict[tuple[str, int, int], list[Matrix]] = defaultdict(list)
    for matrix in decode_matrices(model_dir, tied, quantization):
        by_shape[matrix.kind, matrix.rows, matrix.cols].append(matrix)

    seconds: dict[str, float] = defaultdict(float)
    nbytes: dict[str, int] = defaultdict(int)
    for (kind, rows, _), matrices in by_shape.items():
        kernel = gemv_kernel(matrices[0], quantization, target)["main"]
        activations = "float16" if kind == "float16" else "float32"
        x = tvm.runtime.tensor(np.random.default_rng(0).standard_normal((1, 1, matrices[0].cols)).astype(activations))
        y = tvm.runtime.tensor(np.zeros((1, 1, rows), activations))
        weights = [parameter_tensors(m, device) for m in matrices]
        fastest = float("inf")
        for _ in range(PASSES):
            start = time.perf_counter()
            for stored in weights:
                kernel(x, *stored, y)
            fastest = min(fastest, time.perf_counter() - start)
        seconds[kind] += fastest
        nbytes[kind] += sum(m.nbytes for m in matrices)
    return [
        {
            "kind": kind,
            "bytes": nbytes[kind],
            "ms": seconds[kind] * 1e3,
            "gb_per_s": nbytes[kind] / seconds[kind] / 1e9,
            "bandwidth_fraction": nbytes[kind] / seconds[kind] / bandwidth,
        }
        for kind in sorted(seconds, key=lambda k: -seconds[k])
    ]
