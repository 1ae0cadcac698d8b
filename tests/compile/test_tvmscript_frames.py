"""TVMScript's parser walks the stack without reading source lines while Kiln compiles
(kiln/compile/lower/tvmscript_frames.py): the same frames, the same kernels, less time."""

from __future__ import annotations

import contextlib
import inspect
import json

import pytest
import tvm

from kiln.compile.lower.library import exported_module, schedule, target_metadata
from kiln.compile.lower.tvmscript_frames import frames_without_source, frames_without_source_lines
from kiln.models import MODELS
from kiln.models.kv_cache import kernel_memo
from kiln.targets import target_named


def test_the_frames_are_inspects_without_their_source_lines():
    frame = inspect.currentframe()
    ours, inspects = frames_without_source(frame), inspect.getouterframes(frame)
    assert [(f.frame, f.filename, f.lineno, f.function) for f in ours] == [
        (f.frame, f.filename, f.lineno, f.function) for f in inspects
    ]
    assert inspects[0].code_context is not None and all(f.code_context is None for f in ours)


@pytest.mark.slow
@pytest.mark.parametrize("target", ["cpu", "webgpu"])
def test_kernels_parsed_without_source_lines_are_those_parsed_with_them(target, tiny_source, monkeypatch):
    config_path = tiny_source / "config.json"
    config = MODELS["llama"].parse_config(json.loads(config_path.read_text()), config_path, {})
    model, entry = MODELS["llama"].build(config, "float32"), target_named(target)

    def scheduled(parsing) -> dict[str, tvm.ir.BaseFunc]:
        """The scheduled module's functions but the shape functions, which TVM numbers in no fixed order."""
        monkeypatch.setattr(kernel_memo, "_made", {})  # every kernel of the KV cache parsed again
        metadata = target_metadata(model, {"quantization": "q0f32"}, entry)
        with parsing:
            module = schedule(exported_module(model, entry, metadata), entry)
        return {g.name_hint: f for g, f in module.functions.items() if not g.name_hint.startswith("shape_func")}

    with_source_lines, without = scheduled(contextlib.nullcontext()), scheduled(frames_without_source_lines())
    assert sorted(with_source_lines) == sorted(without)
    for name, function in with_source_lines.items():
        tvm.ir.assert_structural_equal(function, without[name], map_free_vars=True)
