"""SmolLM2-135M-Instruct q0f32 on the native engine against `transformers` on the same weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

KILN = str(Path(sys.executable).with_name("kiln"))
NEW_TOKENS = 32
PROMPTS = [
    ("raw", "Once upon a time, in a small village,"),
    ("raw", "def fibonacci(n):\n"),
    ("chat", "Write a short story about a dragon who learns to bake bread."),
]


@pytest.fixture(scope="module")
def model_dir(smollm2_build) -> Path:
    return smollm2_build("q0f32")


@pytest.fixture(scope="module")
def reference(smollm2_source):
    """transformers' model and tokenizer, from the GGUF the build started from (dequantized to f32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = smollm2_source.parent, smollm2_source.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return model, tokenizer


@pytest.mark.parametrize("mode,prompt", PROMPTS)
def test_greedy_tokens_match_transformers(model_dir, reference, mode, prompt):
    import torch

    model, tokenizer = reference
    run = subprocess.run(
        [
            KILN,
            "generate",
            str(model_dir),
            "--prompt",
            prompt,
            "--max-tokens",
            str(NEW_TOKENS),
            "--json",
            *(["--chat"] if mode == "chat" else []),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)

    if mode == "chat":
        expected_prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )["input_ids"]
    else:
        expected_prompt = tokenizer(prompt).input_ids
    assert out["prompt_tokens"] == expected_prompt

    with torch.no_grad():
        generated = model.generate(
            torch.tensor([out["prompt_tokens"]]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=2,
            pad_token_id=2,
        )
    expected = generated[0, len(out["prompt_tokens"]) :].tolist()
    assert len(expected) == NEW_TOKENS, "pick a prompt whose reply is at least 32 tokens long"
    assert out["tokens"] == expected
    assert out["text"] == tokenizer.decode(expected)
    assert out["usage"]["completion_tokens"] == NEW_TOKENS


def test_second_turn_reuses_the_cache_and_equals_a_fresh_run(model_dir):
    from kiln.engine import Engine, GenerationConfig

    engine = Engine(model_dir)
    config = GenerationConfig(max_tokens=24)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    first = engine.generate_chat(messages, config)
    assert first.finish_reason == "stop" and "Paris" in first.text
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And of Germany?"}]
    second = engine.generate_chat(messages, config)
    assert second.prompt_tokens == engine.encode_chat(messages)
    new_tokens = len(second.prompt_tokens) - (len(first.prompt_tokens) + len(first.tokens) - 1)
    assert second.usage.prefilled_tokens == new_tokens < 20

    engine.reset()
    fresh = engine.generate_chat(messages, config)
    assert fresh.usage.prefilled_tokens == len(fresh.prompt_tokens) == len(second.prompt_tokens)
    assert fresh.tokens == second.tokens and fresh.text == second.text
    assert "Berlin" in fresh.text
