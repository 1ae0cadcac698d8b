"""The convert stage: source tensors → fused, quantized parameters in the tensor cache."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from tqdm import tqdm

from kiln.errors import KilnError
from kiln.models import Architecture, DecoderConfig
from kiln.tensor_cache import TensorCacheWriter

from .ingest import SourceModel
from .library import ParamSpec
from .quantization import Quantization

QUANTIZED_SUFFIX = ".q_weight"
SCALE_SUFFIX = ".q_scale"


def float_weights(params: list[ParamSpec]) -> list[tuple[str, bool]]:
    """(float weight name, quantized?) in parameter order; a packed pair comes from one weight."""
    weights = []
    for p in params:
        if p.name.endswith(QUANTIZED_SUFFIX):
            weights.append((p.name.removesuffix(QUANTIZED_SUFFIX) + ".weight", True))
        elif not p.name.endswith(SCALE_SUFFIX):
            weights.append((p.name, False))
    return weights


def load_weight(source: SourceModel, names: list[str]) -> np.ndarray:
    available = set(source.tensor_names())
    missing = [n for n in names if n not in available]
    if missing:
        raise KilnError(f"the weights lack tensor {missing[0]!r}", source.path)
    arrays = [source.load_tensor(n) for n in names]
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=0)


def check_all_consumed(source: SourceModel, arch: Architecture, consumed: set[str]) -> None:
    """Every source tensor is converted or deliberately ignored by the family: none is dropped silently."""
    ignored = re.compile("|".join(arch.ignored_tensors) or "(?!)")
    left = sorted(n for n in source.tensor_names() if n not in consumed and not ignored.fullmatch(n))
    if left:
        more = f" (and {len(left) - 1} more)" if len(left) > 1 else ""
        raise KilnError(f"tensor {left[0]!r}{more} is not used by Kiln's {arch.model_type} family: "
                        "the checkpoint holds something this family does not compute", source.path)


def convert_weights(
    source: SourceModel, arch: Architecture, config: DecoderConfig, quantization: Quantization,
    params: list[ParamSpec], out_dir: Path,
) -> dict:
    """Write every parameter the library expects; returns the tensor-cache json."""
    expected = {p.name: p for p in params}
    fused = arch.fused_sources(config)
    weights = float_weights(params)
    check_all_consumed(source, arch, {source_name for name, _ in weights for source_name in fused.get(name, [name])})
    writer = TensorCacheWriter(out_dir)
    for name, quantized in tqdm(weights, desc="convert", unit="tensor", leave=False, disable=None):
        weight = load_weight(source, fused.get(name, [name]))
        for param_name, array in quantization.pack(name, weight, quantized).items():
            spec = expected[param_name]
            if tuple(array.shape) != spec.shape:
                raise KilnError(
                    f"tensor for {param_name} has shape {tuple(array.shape)}, the config implies {spec.shape}",
                    source.path,
                )
            writer.add(param_name, array.astype(spec.dtype, copy=False))
    return writer.finish()
