"""A source's tensors as the weights of a family's float model: a fused weight (`qkv_proj`) is
its parts (q, k, v) stacked along the rows, in float32 or, from a GGUF, as the blocks the file
stores."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kiln.compile.source.gguf_source import GGUFModel, GGUFTensorBlocks
from kiln.compile.source.ingest import SourceModel
from kiln.errors import KilnError


@dataclass(frozen=True)
class SourceWeights:
    source: SourceModel
    fused: dict[str, list[str]]  # the family's `fused_sources`
    decoder_prefix: str = "model."  # where the source keeps the decoder's "model.*" tensors
    head_prefix: str = ""  # and its output head's "lm_head.*"

    def parts(self, name: str) -> list[str]:
        return [self.source_name(part) for part in self.fused.get(name, [name])]

    def source_name(self, part: str) -> str:
        if part.startswith("model."):
            return self.decoder_prefix + part.removeprefix("model.")
        if part.startswith("lm_head."):
            return self.head_prefix + part
        return part

    def _check_present(self, parts: list[str]) -> None:
        available = set(self.source.tensor_names())
        missing = [n for n in parts if n not in available]
        if missing:
            raise KilnError(f"the weights lack tensor {missing[0]!r}", self.source.path)

    def load(self, name: str) -> np.ndarray:
        parts = self.parts(name)
        self._check_present(parts)
        arrays = [self.source.load_tensor(n) for n in parts]
        return arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=0)

    def gguf_blocks(self, name: str, scheme: str) -> list[GGUFTensorBlocks]:
        """The GGUF blocks of each part, rows in Hugging Face order; the bytes are read on demand."""
        if not isinstance(self.source.tensors, GGUFModel):
            raise KilnError(
                f"quantization {scheme} keeps a GGUF's own blocks: the source must be a .gguf file", self.source.path
            )
        parts = self.parts(name)
        self._check_present(parts)
        return [self.source.tensors.blocks(n) for n in parts]
