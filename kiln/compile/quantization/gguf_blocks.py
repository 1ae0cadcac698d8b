"""`gguf_f32`, `gguf_f16` and `gguf_i8`: a GGUF's weights compiled as the file stores them.

Every matrix a Linear or Embedding reads keeps its GGUF type and bytes (see ggml_blocks.py);
the kernels that read it dequantize each weight where they use it. A fused weight whose parts
have different types (Q4_K_M files store some `attn_v` and `ffn_down` as Q6_K) runs as one
matmul per run of parts of one type, the outputs side by side: nothing is quantized again.
Norms and biases are stored in the model's float dtype. `gguf_i8` is `gguf_f32` whose
matmuls take 8-bit activations, for the quantized types (int8_decode.py for decode steps,
int8_prefill.py for prefills; x86-64 CPUs and wasm).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby

import numpy as np
from tvm import DataType, relax, te, tirx
from tvm.relax.frontend import nn
from tvm.target import Target

from kiln.compile.quantization import int8_decode, int8_prefill
from kiln.compile.quantization.ggml_blocks import BLOCK_TYPES, BlockType
from kiln.compile.quantization.stored import Stored
from kiln.compile.source.gguf_source import GGUFTensorBlocks
from kiln.compile.source.source_weights import SourceWeights
from kiln.errors import KilnError
from kiln.models.layers import Embedding, Linear, add_bias
from kiln.models.stage_names import GATHERED_ROWS
from kiln.targets import building


# What 8-bit activations move, against float ones (the notes of issues 41 and 42): a step's logits by
# up to INT8_LOGIT_TOLERANCE of the largest (measured: SmolLM2 5.6 %; the tiny mixed GGUF, random
# weights 64 wide in every block type, up to 19.9 % over 51 prompts with either version of the CPU
# attention kernels, where 0.15 had held for the test's three prompts only), so that greedy tokens
# may part where the float path's top two logits are within INT8_NEAR_TIE (SmolLM2's closest flips
# were 0.24 apart, the mixed GGUF's 0.83). Rounding is
# not continuous: one rounding of difference upstream of a quantized row moves what follows by as much
# (SmolLM2's logits after a prompt prefilled whole or in two chunks: up to 0.95 apart, of about 30),
# so two engines, or two chunkings, of such a model agree to this tolerance, not to float's.
INT8_LOGIT_TOLERANCE = 0.25
INT8_NEAR_TIE = 1.0


def reads_words() -> bool:
    """Whether the target being built reads the stored words and shifts bytes out of them (WGSL has
    no 8-bit type). Every other target reads bytes, which lets a CPU load a run of them as one vector."""
    entry = building()
    return entry is not None and not entry.loads_bytes


def as_units(words: relax.Expr, block_type: BlockType, rows, row_words) -> relax.Expr:
    """The stored words as [rows, row units] of the block type's unit (bytes; the values of a
    float type): a view of the same memory, not a copy."""
    unit = block_type.unit
    return relax.op.memory.view(words, shape=[rows, row_words * 4 // DataType(unit).itemsize], dtype=unit)


def readable(blocks: nn.Tensor, block_type: BlockType) -> nn.Tensor:
    """What the kernels read of a stored matrix, for the target being built."""
    if reads_words():
        return blocks
    return nn.wrap_nested(as_units(blocks._expr, block_type, *blocks.shape), "units")


def int8_matmul(x: nn.Tensor, blocks: nn.Parameter, block_type: BlockType, rows: int, cols: int) -> nn.Tensor | None:
    """A matmul on 8-bit activations, or None where there is none: the block type has no such kernel,
    or x is neither one row (int8_decode.py) nor sequences [batch, n, cols] against whole tiles of
    weights (int8_prefill.py); it then runs on float activations. A target without the
    kernels is refused: its library would round other numbers than the cpu one."""
    target = Target.current(allow_none=True)
    if not int8_decode.runs_on(target):
        entry = building()
        library = f"the {entry.name} library" if entry else "outside a target"
        raise KilnError(
            "this quantization runs matmuls on 8-bit activations, with x86-64 (AVX2) and wasm (SIMD) kernels "
            f"only, and cannot build {library}: build it with one on float activations (gguf_f32 for a .gguf "
            "source, q8f32_1 for a checkpoint)"
        )
    if block_type.name not in int8_decode.KERNEL_BLOCKS:
        return None
    units = readable(blocks, block_type)
    isa = int8_decode.instruction_set(target)

    def run(kernel: tirx.PrimFunc, name: str, x: nn.Tensor) -> nn.Tensor:
        return nn.op.tensor_ir_op(kernel, name, [x, units], nn.Tensor.placeholder((*x.shape[:-1], rows), "float32"))

    if int8_decode.one_row(x.shape):
        return run(int8_decode.gemv(block_type.name, rows, cols, units.shape[1], isa), "int8_decode_matmul", x)
    if len(x.shape) != 3 or not int8_prefill.takes(rows):
        return None
    gemm = int8_prefill.gemm(block_type.name, rows, cols, units.shape[1], isa)
    batch, seq_len, _ = x.shape
    if isinstance(batch, int) and batch == 1:
        return run(gemm, "int8_prefill_matmul", x)
    # A batch of sequences (an encoder's inputs) runs as the rows of one.
    y = run(gemm, "int8_prefill_matmul", nn.op.reshape(x, (1, batch * seq_len, cols)))
    return nn.op.reshape(y, (batch, seq_len, rows))


def blocks_matmul(
    x: nn.Tensor,
    blocks: nn.Parameter,
    block_type: BlockType,
    rows: int,
    cols: int,
    dtype: str,
    out_dtype: str,
    name: str,
    int8_activations: bool,
) -> nn.Tensor:
    """x · Wᵀ for a stored matrix: on 8-bit activations where the scheme and int8_matmul take it, else
    a kernel `name` that dequantizes the weights it reads."""
    y = int8_matmul(x, blocks, block_type, rows, cols) if int8_activations else None
    if y is not None:
        return y
    return nn.op.tensor_expr_op(
        lambda x, w: block_type.matmul_te(x, w, rows, cols, dtype, out_dtype),
        name,
        [x, readable(blocks, block_type)],
    )


class BlockMatrix(nn.Module):
    """Rows of a weight stored in one block type: `blocks` [rows, row words] (uint32)."""

    def __init__(self, block_type: BlockType, rows: int, cols: int, dtype: str, int8_activations: bool):
        self.block_type, self.rows, self.cols, self.dtype = block_type, rows, cols, dtype
        self.int8_activations = int8_activations
        self.blocks = nn.Parameter((rows, block_type.row_words(cols)), "uint32")

    def matmul(self, x: nn.Tensor) -> nn.Tensor:
        return blocks_matmul(
            x,
            self.blocks,
            self.block_type,
            self.rows,
            self.cols,
            self.dtype,
            x.dtype,
            "dequantize_matmul",
            self.int8_activations,
        )


class GGUFLinear(nn.Module):
    def __init__(self, linear: Linear, runs: list[tuple[BlockType, int]], dtype: str, int8_activations: bool):
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.parts = nn.ModuleList(
            [BlockMatrix(block_type, rows, linear.in_features, dtype, int8_activations) for block_type, rows in runs]
        )
        self.bias = linear.bias

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        outputs = [part.matmul(x) for part in self.parts]
        y = outputs[0] if len(outputs) == 1 else nn.op.concat(outputs, dim=-1)
        return add_bias(y, self.bias)


class GGUFEmbedding(nn.Module):
    def __init__(self, embedding: Embedding, block_type: BlockType, dtype: str, int8_activations: bool):
        self.vocab_size, self.hidden_size = embedding.vocab_size, embedding.hidden_size
        self.block_type, self.dtype = block_type, dtype
        self.int8_activations = int8_activations
        self.blocks = nn.Parameter((self.vocab_size, block_type.row_words(self.hidden_size)), "uint32")

    def forward(self, token_ids: nn.Tensor) -> nn.Tensor:
        def gather_rows(w, ids):
            rows = te.compute((ids.shape[0], w.shape[1]), lambda i, j: w[ids[i], j], name=GATHERED_ROWS)
            return self.block_type.dequantize_te(rows, ids.shape[0], self.hidden_size, self.dtype)

        return nn.op.tensor_expr_op(gather_rows, "dequantize_take", [readable(self.blocks, self.block_type), token_ids])

    def project(self, x: nn.Tensor) -> nn.Tensor:
        return blocks_matmul(
            x,
            self.blocks,
            self.block_type,
            self.vocab_size,
            self.hidden_size,
            self.dtype,
            "float32",
            "dequantize_lm_head",
            self.int8_activations,
        )


def runs_of_one_type(parts: list[GGUFTensorBlocks]) -> list[list[GGUFTensorBlocks]]:
    return [list(run) for _, run in groupby(parts, key=lambda part: part.type_name)]


@dataclass(frozen=True)
class GGUFBlocks:
    name: str
    model_dtype: str
    int8_activations: bool = False  # matmuls on 8-bit activations (int8_decode.py, int8_prefill.py)

    @property
    def cpu_variants(self) -> tuple[str, ...]:
        return (int8_decode.Avx512Vnni.name,) if self.int8_activations else ()

    @property
    def factored_decode(self) -> bool:
        return not self.int8_activations

    @property
    def describe(self) -> str:
        if self.int8_activations:
            return "a .gguf source's own blocks, matmuls on 8-bit activations (x86-64 cpu and wasm only)"
        return f"a .gguf source's own blocks (not quantized again), {self.model_dtype} activations"

    def block_type(self, part: GGUFTensorBlocks, path) -> BlockType:
        if part.type_name not in BLOCK_TYPES:
            raise KilnError(
                f"tensor {part.gguf_name} has type {part.type_name}, which {self.name} does not "
                f"compile (supported: {', '.join(BLOCK_TYPES)})",
                path,
            )
        block_type = BLOCK_TYPES[part.type_name]
        if part.cols % block_type.elements:
            raise KilnError(
                f"tensor {part.gguf_name} has rows of {part.cols} values, not whole "
                f"{part.type_name} blocks of {block_type.elements}",
                path,
            )
        return block_type

    def stored(self, run: list[GGUFTensorBlocks], path) -> Stored:
        """Parts of one type stacked: their rows of blocks as uint32 words, the record naming the type."""
        block_type = self.block_type(run[0], path)
        rows = np.concatenate([part.read() for part in run]) if len(run) > 1 else run[0].read()
        if rows.shape[1] != block_type.row_bytes(run[0].cols):
            raise KilnError(
                f"tensor {run[0].gguf_name} has rows of {rows.shape[1]} bytes, "
                f"{block_type.row_bytes(run[0].cols)} for its {block_type.name} shape",
                path,
            )
        return Stored(block_type.words(rows), {"gguf_type": block_type.name, "gguf_shape": [len(rows), run[0].cols]})

    def quantize_model(self, model: nn.Module, weights: SourceWeights) -> nn.Module:
        scheme = self
        path = weights.source.path

        class Rewriter(nn.Mutator):
            def visit_module(self, name: str, node: nn.Module):
                if isinstance(node, Linear):
                    runs = [
                        (scheme.block_type(run[0], path), sum(part.rows for part in run))
                        for run in runs_of_one_type(weights.gguf_blocks(f"{name}.weight", scheme.name))
                    ]
                    return GGUFLinear(node, runs, scheme.model_dtype, scheme.int8_activations)
                if isinstance(node, Embedding):
                    (table,) = weights.gguf_blocks(f"{name}.weight", scheme.name)
                    return GGUFEmbedding(
                        node, scheme.block_type(table, path), scheme.model_dtype, scheme.int8_activations
                    )
                return self.visit(name, node)

        return Rewriter().visit("", model)

    def pack(self, name: str, weights: SourceWeights, expected: set[str]) -> dict[str, Stored]:
        module = name.removesuffix(".weight")
        path = weights.source.path
        if f"{module}.blocks" in expected:
            return {f"{module}.blocks": self.stored(weights.gguf_blocks(name, self.name), path)}
        if f"{module}.parts.0.blocks" in expected:
            runs = runs_of_one_type(weights.gguf_blocks(name, self.name))
            return {f"{module}.parts.{i}.blocks": self.stored(run, path) for i, run in enumerate(runs)}
        return {name: Stored(weights.load(name).astype(self.model_dtype))}


SCHEMES = (
    GGUFBlocks("gguf_f32", "float32"),
    GGUFBlocks("gguf_f16", "float16"),
    GGUFBlocks("gguf_i8", "float32", int8_activations=True),
)
