"""Models at real sizes in the browser's CPU library: random weights at a published config, made by
transformers (no hub). SmolLM2 and the tiny models never ask a helper thread of the wasm library for
more workspace than its 4 MB arena; Gemma 3 270M's prefill does, and on two threads it stopped with
`exit(1)` (compile/kiln_threads.cc now takes such a workspace from the heap)."""

from __future__ import annotations

import numpy as np
import pytest

from tiny_llama import write_tokenizer

from kiln.browser.model import browser_model
from kiln.browser.parity import greedy
from kiln.runtime import NativeModel

pytestmark = pytest.mark.browser

GREEDY_TOKENS = 8
PROMPT = list(range(5, 21))
# google/gemma-3-270m's config.json (its tokenizer is the tiny one: the ids fed here are below 384).
GEMMA3_270M = dict(
    vocab_size=262144,
    hidden_size=640,
    intermediate_size=2048,
    num_hidden_layers=18,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=256,
    query_pre_attn_scalar=256,
    sliding_window=512,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)],
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
    },
    tie_word_embeddings=True,
    bos_token_id=0,
    eos_token_id=2,
    pad_token_id=0,
)


@pytest.fixture(scope="module")
def gemma3_270m(builds, tmp_path_factory):
    """(the q4f32_1 build for cpu and wasm, the native greedy tokens after PROMPT)."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    source = tmp_path_factory.mktemp("real-sizes") / "gemma3-270m"
    source.mkdir()
    write_tokenizer(source)
    torch.manual_seed(0)
    Gemma3ForCausalLM(Gemma3TextConfig(**GEMMA3_270M)).save_pretrained(source, safe_serialization=True)
    model_dir = builds.model_dir(source, "gemma3-270m-sized", "q4f32_1", ["cpu", "wasm"])
    return model_dir, greedy_tokens(NativeModel(model_dir))


def greedy_tokens(model) -> list[int]:
    return [int(np.argmax(logits)) for logits in greedy(model, PROMPT, GREEDY_TOKENS)]


@pytest.mark.parametrize("threads", [1, 2])
def test_a_270m_model_gives_the_native_tokens_in_the_cpu_library(threads, gemma3_270m, driver):
    model_dir, expected = gemma3_270m
    with browser_model(model_dir, "wasm", driver=driver, threads=threads) as browser:
        assert browser.engine.call("stats")["threads"] == threads
        assert greedy_tokens(browser) == expected
