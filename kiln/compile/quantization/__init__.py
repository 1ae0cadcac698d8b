"""Quantization schemes: how a family's float model becomes the module a library runs, and how
a source's tensors become that module's parameters. One file per kind of scheme, one registry.

A scheme
- names its float dtype (`model_dtype`: activations, KV cache, norms and biases);
- rewrites the model (`quantize_model`), swapping each Linear and Embedding for a module that
  declares its stored parameters and writes their dequantization into the kernels that read
  them (so no kernel ever sees an unpacked weight);
- packs the weights at conversion (`pack`): the stored parameters for one of the float model's
  weights, read from the source as float tensors or, for a scheme that keeps a GGUF's blocks,
  as those blocks.
"""

from __future__ import annotations

from typing import Protocol

from tvm.relax.frontend import nn

from kiln.compile.quantization import float_weights, gguf_blocks, group, quantized_blocks
from kiln.compile.quantization.stored import Stored
from kiln.compile.source.source_weights import SourceWeights
from kiln.errors import KilnError


class Scheme(Protocol):
    name: str
    model_dtype: str
    describe: str  # for people: the CLI's help
    # kiln/targets.py's CPU_VARIANTS its kernels have code of their own for: a portable x86-64 cpu
    # library is built for each of them too, and the native engine loads the one the CPU runs
    cpu_variants: tuple[str, ...]
    # whether its float32 decode matmuls are written with the scales factored out (factored_decode.py):
    # a few static input rows then run decode's kernel, for little more than one row's time
    factored_decode: bool

    def quantize_model(self, model: nn.Module, weights: SourceWeights) -> nn.Module:
        """The model with its Linear and Embedding modules replaced (in place)."""

    def pack(self, name: str, weights: SourceWeights, expected: set[str]) -> dict[str, Stored]:
        """The stored parameters for the float weight `name`, among the `expected` parameter names."""


QUANTIZATIONS: dict[str, Scheme] = {
    scheme.name: scheme
    for scheme in (*float_weights.SCHEMES, *group.SCHEMES, *gguf_blocks.SCHEMES, *quantized_blocks.SCHEMES)
}


def quantization_named(name: str) -> Scheme:
    if name not in QUANTIZATIONS:
        raise KilnError(f"unknown quantization {name!r} (supported: {', '.join(QUANTIZATIONS)})")
    return QUANTIZATIONS[name]
