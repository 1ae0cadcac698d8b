"""Gemmas whose layers are all local (a window, no global layer) against transformers. TVM's
per-layer windows need a layer without one, so their KV cache gets an extra layer no layer of the
model uses (kiln/models/decoder.py `cache_layer_kinds`): 32 greedy tokens after a prompt inside the
window and one past it, natively and in the browser engine on wasm and WebGPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.reference import reference_model
from helpers.tiny_families import ALL_LOCAL_FAMILIES, GEMMA_WINDOW

from kiln.browser.model import browser_model
from kiln.browser.parity import greedy
from kiln.runtime import NativeModel

GREEDY_TOKENS = 32
PROMPTS = {"inside the window": [5, 17, 100, 42, 7, 250, 3], "past the window": list(range(40, 140, 3))}
assert len(PROMPTS["inside the window"]) < GEMMA_WINDOW < len(PROMPTS["past the window"])


@pytest.fixture(scope="module")
def all_local_models(builds, sources) -> dict[str, tuple]:
    """family → (its transformers greedy tokens per prompt, its q0f32 build for cpu, wasm and webgpu)."""
    models = {}
    for name in sorted(ALL_LOCAL_FAMILIES):
        source = sources.path(name)
        reference = reference_model(source)
        expected = {prompt: transformers_greedy(reference, ids) for prompt, ids in PROMPTS.items()}
        models[name] = expected, builds.model_dir(source, f"tiny-{name}", "q0f32", ["cpu", "wasm", "webgpu"])
    return models


def transformers_greedy(model, ids: list[int]) -> list[int]:
    ids = list(ids)
    with torch.no_grad():
        for _ in range(GREEDY_TOKENS):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-GREEDY_TOKENS:]


def greedy_tokens(model, ids: list[int]) -> list[int]:
    return [int(np.argmax(logits)) for logits in greedy(model, ids, GREEDY_TOKENS)]


@pytest.mark.parametrize("family", sorted(ALL_LOCAL_FAMILIES))
def test_an_all_local_gemma_runs_natively_as_transformers_does(family, all_local_models):
    expected, model_dir = all_local_models[family]
    native = NativeModel(model_dir)
    assert native.layer_window_size == GEMMA_WINDOW and native.sliding_window_size == -1  # per-layer windows
    for prompt, ids in PROMPTS.items():
        assert greedy_tokens(native, ids) == expected[prompt], (family, prompt)


@pytest.mark.browser
@pytest.mark.parametrize("backend", ["wasm", "webgpu"])
@pytest.mark.parametrize("family", sorted(ALL_LOCAL_FAMILIES))
def test_an_all_local_gemma_runs_in_the_browser_as_transformers_does(family, backend, all_local_models, driver):
    expected, model_dir = all_local_models[family]
    with browser_model(model_dir, backend, driver=driver) as browser:
        for prompt, ids in PROMPTS.items():
            assert greedy_tokens(browser, ids) == expected[prompt], (family, backend, prompt)
