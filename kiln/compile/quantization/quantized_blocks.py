"""`q8_0_i8`: float weights quantized into llama.cpp's Q8_0 blocks at conversion (gguf-py's
`quants.quantize`, the rounding of llama.cpp's reference quantizer), then compiled as `gguf_i8`
compiles a GGUF's blocks: matmuls on 8-bit activations (int8_decode.py, int8_prefill.py; x86-64 cpu
and wasm). For a checkpoint what `gguf_i8` is for a .gguf file; an encoder's batches of inputs take
the prefill kernels too. (Q4_0 blocks were tried: all-MiniLM-L6-v2's cosine to sentence-transformers
fell to 0.950, under the 0.98 asked of 4-bit embeddings.)

A matrix whose rows are not whole blocks keeps its float weights, as llama.cpp keeps such tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np
from tvm.relax.frontend import nn

from kiln.compile.quantization import int8_decode
from kiln.compile.quantization.ggml_blocks import BLOCK_TYPES, BlockType
from kiln.compile.quantization.gguf_blocks import GGUFEmbedding, GGUFLinear
from kiln.compile.quantization.stored import Stored
from kiln.compile.source.source_weights import SourceWeights
from kiln.models.layers import Embedding, Linear


@dataclass(frozen=True)
class QuantizedBlocks:
    name: str
    block_type_name: str  # a ggml block type int8_decode.KERNEL_BLOCKS has kernels for
    model_dtype = "float32"
    int8_activations = True
    cpu_variants = (int8_decode.Avx512Vnni.name,)
    factored_decode = False

    @property
    def block_type(self) -> BlockType:
        return BLOCK_TYPES[self.block_type_name]

    @property
    def describe(self) -> str:
        return (
            f"weights quantized into llama.cpp's {self.block_type_name} blocks, matmuls on 8-bit activations "
            "(x86-64 cpu and wasm only)"
        )

    def fits(self, width: int) -> bool:
        return width % self.block_type.elements == 0

    def quantize_model(self, model: nn.Module, weights: SourceWeights) -> nn.Module:
        scheme, block_type, dtype, int8 = self, self.block_type, self.model_dtype, self.int8_activations

        class Rewriter(nn.Mutator):
            def visit_module(self, name: str, node: nn.Module):
                if isinstance(node, Linear):
                    fitting = scheme.fits(node.in_features)
                    return GGUFLinear(node, [(block_type, node.out_features)], dtype, int8) if fitting else node
                if isinstance(node, Embedding):
                    return GGUFEmbedding(node, block_type, dtype, int8) if scheme.fits(node.hidden_size) else node
                return self.visit(name, node)

        return Rewriter().visit("", model)

    def pack(self, name: str, weights: SourceWeights, expected: set[str]) -> dict[str, Stored]:
        module = name.removesuffix(".weight")
        stored_as = [key for key in (f"{module}.blocks", f"{module}.parts.0.blocks") if key in expected]
        if not stored_as:
            return {name: Stored(weights.load(name).astype(self.model_dtype))}
        weight = weights.load(name)
        block_type = self.block_type
        layout = {"gguf_type": block_type.name, "gguf_shape": list(weight.shape)}
        return {stored_as[0]: Stored(block_type.words(quantized_rows(weight, block_type)), layout)}


# Weights quantized per pass: ~4 MB of float32 at a time, however large the matrix (gguf-py's
# quantizer holds several temporaries the size of what it is given).
WEIGHTS_PER_PASS = 1 << 20


def quantized_rows(weight: np.ndarray, block_type: BlockType) -> np.ndarray:
    """A [rows, cols] weight's rows of `block_type` blocks, [rows, row_bytes] uint8."""
    quant_type = gguf.GGMLQuantizationType[block_type.name]
    rows, cols = weight.shape
    out = np.empty((rows, block_type.row_bytes(cols)), np.uint8)
    step = max(1, WEIGHTS_PER_PASS // cols)
    for start in range(0, rows, step):
        out[start : start + step] = gguf.quants.quantize(
            np.asarray(weight[start : start + step], np.float32), quant_type
        )
    return out


SCHEMES = (QuantizedBlocks("q8_0_i8", "Q8_0"),)
