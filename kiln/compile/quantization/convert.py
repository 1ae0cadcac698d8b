"""The convert stage: source tensors → the quantization scheme's stored parameters, in the tensor cache."""

from __future__ import annotations

import re
from pathlib import Path

from tqdm import tqdm

from kiln.compile.lower.library import ParamSpec
from kiln.compile.quantization import Scheme
from kiln.compile.source.source_weights import SourceWeights
from kiln.errors import KilnError
from kiln.models import Architecture
from kiln.tensor_cache import TensorCacheWriter


def check_all_consumed(weights: SourceWeights, arch: Architecture, float_names: list[str]) -> None:
    """Every source tensor is converted or deliberately ignored by the family: none is dropped silently."""
    source = weights.source
    consumed = {part for name in float_names for part in weights.parts(name)}
    ignored = re.compile("|".join(arch.ignored_tensors) or "(?!)")
    left = sorted(n for n in source.tensor_names() if n not in consumed and not ignored.fullmatch(n))
    if left:
        more = f" (and {len(left) - 1} more)" if len(left) > 1 else ""
        raise KilnError(
            f"tensor {left[0]!r}{more} is not used by Kiln's {arch.model_type} family: "
            "the checkpoint holds something this family does not compute",
            source.path,
        )


def convert_weights(
    weights: SourceWeights,
    arch: Architecture,
    scheme: Scheme,
    float_names: list[str],
    params: list[ParamSpec],
    out_dir: Path,
) -> dict:
    """Write every parameter the library expects, from the float model's weights `float_names`;
    returns the tensor-cache json."""
    expected = {p.name: p for p in params}
    check_all_consumed(weights, arch, float_names)
    writer = TensorCacheWriter(out_dir)
    written = set()
    for name in tqdm(float_names, desc="convert", unit="tensor", leave=False, disable=None):
        for param_name, stored in scheme.pack(name, weights, set(expected)).items():
            spec = expected[param_name]
            if tuple(stored.array.shape) != spec.shape:
                raise KilnError(
                    f"tensor for {param_name} has shape {tuple(stored.array.shape)}, the config implies {spec.shape}",
                    weights.source.path,
                )
            writer.add(param_name, stored.array.astype(spec.dtype, copy=False), stored.layout)
            written.add(param_name)
    if missing := [name for name in expected if name not in written]:
        raise KilnError(f"no source tensor gives the library's parameter {missing[0]}", weights.source.path)
    return writer.finish()
