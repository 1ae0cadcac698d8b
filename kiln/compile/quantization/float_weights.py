"""`q0f32` and `q0f16`: no quantization, every weight stored in the model's float dtype."""

from __future__ import annotations

from dataclasses import dataclass

from tvm.relax.frontend import nn

from kiln.compile.quantization.stored import Stored
from kiln.compile.source.source_weights import SourceWeights


@dataclass(frozen=True)
class FloatWeights:
    name: str
    model_dtype: str
    cpu_variants = ()
    factored_decode = False

    @property
    def describe(self) -> str:
        return f"{self.model_dtype} weights, not quantized"

    def quantize_model(self, model: nn.Module, weights: SourceWeights) -> nn.Module:
        return model

    def pack(self, name: str, weights: SourceWeights, expected: set[str]) -> dict[str, Stored]:
        return {name: Stored(weights.load(name).astype(self.model_dtype))}


SCHEMES = (FloatWeights("q0f32", "float32"), FloatWeights("q0f16", "float16"))
