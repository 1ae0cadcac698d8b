"""YaRN as transformers computes it: the frequencies and attention factor Kiln computes at build time
against transformers' own, for the ways config.json writes YaRN, and tiny YaRN models of every family
that reads `rope_scaling` against transformers at every position, prompted past their original
context (Ministral 3's with its query scale, which steps up there). (TVM's YaRN kernel, which the KV
cache would run, is not transformers' YaRN: these models were 3.6 to 7.1 of logits apart from
transformers with both betas written, and did not build without.)"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from transformers import AutoConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from helpers.failures import assert_clean_failure
from helpers.reference import reference_model
from helpers.tiny_families import COMMON, MISTRAL_WINDOW, YARN_FAMILIES, YARN_ORIGINAL_CONTEXT

from kiln.compile.source.gguf_source import GGUFMetadata
from kiln.models import MODELS, GGUFTensors
from kiln.models.decoder import yarn_inv_freq
from kiln.runtime import NativeModel

# Measured: 1.5e-5 on the tiny Mistral, 5e-6 to 1e-5 the others (as without YaRN); the tiny Ministral 3
# without betas 1.9e-5 at its last decoded positions (1.6e-5 with its query scale's β set to 0).
YARN_TOLERANCE = 2e-5
PAST_ORIGINAL_CONTEXT = [int(i) for i in np.random.default_rng(0).integers(3, COMMON["vocab_size"], 160)]
assert len(PAST_ORIGINAL_CONTEXT) > YARN_ORIGINAL_CONTEXT


def qwen2_config(**fields) -> dict:
    return {"model_type": "qwen2", **{k: v for k, v in COMMON.items() if "token_id" not in k}, **fields}


# config.json's YaRN as released models write it: rope_scaling (Qwen2.5's model cards, no betas),
# transformers 5's rope_parameters, the original context at the top level (transformers reads it
# first), no factor (transformers: trained / original positions), DeepSeek's mscale pair.
CONFIGS = {
    "qwen2.5 card": qwen2_config(
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    ),
    "rope_parameters": qwen2_config(
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1e6,
            "factor": 8.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 16,
            "beta_slow": 2,
            "truncate": False,
        }
    ),
    "top-level original": qwen2_config(
        original_max_position_embeddings=48,
        rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256},
    ),
    "no factor": qwen2_config(
        rope_scaling={"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 64}
    ),
    "mscale pair": qwen2_config(
        head_dim=32,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 64,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
        },
    ),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_yarn_frequencies_and_attention_factor_are_transformers(name, tmp_path):
    hf_config = CONFIGS[name]
    config = MODELS["qwen2"].parse_config(hf_config, tmp_path / "config.json", {})
    expected_inv_freq, expected_factor = ROPE_INIT_FUNCTIONS["yarn"](AutoConfig.for_model(**hf_config))
    inv_freq, factor = yarn_inv_freq(config)
    np.testing.assert_allclose(inv_freq, expected_inv_freq.numpy(), rtol=1e-6)
    assert factor == pytest.approx(expected_factor, rel=1e-12)


def converted_yarn_metadata(hf_config: dict) -> dict:
    """A qwen2 GGUF's metadata as llama.cpp's converter writes `hf_config` (its YaRN fields as they are)."""
    arch, scaling = "qwen2", hf_config["rope_scaling"]
    sizes = dict(embedding_length=COMMON["hidden_size"], feed_forward_length=COMMON["intermediate_size"])
    sizes |= dict(block_count=2, context_length=COMMON["max_position_embeddings"], vocab_size=COMMON["vocab_size"])
    yarn = dict(
        type="yarn", factor=scaling["factor"], original_context_length=scaling["original_max_position_embeddings"]
    )
    for field, key in (
        ("attention_factor", "yarn_attn_factor"),
        ("beta_fast", "yarn_beta_fast"),
        ("beta_slow", "yarn_beta_slow"),
    ):
        if field in scaling:
            yarn[key] = scaling[field]
    return {
        "general.architecture": arch,
        **{f"{arch}.{key}": value for key, value in sizes.items()},
        f"{arch}.attention.head_count": COMMON["num_attention_heads"],
        f"{arch}.attention.head_count_kv": COMMON["num_key_value_heads"],
        f"{arch}.attention.layer_norm_rms_epsilon": COMMON["rms_norm_eps"],
        f"{arch}.rope.freq_base": hf_config.get("rope_theta", COMMON["rope_theta"]),
        **{f"{arch}.rope.scaling.{key}": value for key, value in yarn.items()},
    }


# A low rope_theta and a long original context: there beta_fast and beta_slow move the ramp.
GGUF_YARN = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256}


@pytest.mark.parametrize(
    "scaling", [GGUF_YARN, {**GGUF_YARN, "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 1.25}]
)
def test_a_yarn_gguf_gives_the_frequencies_of_the_config_json_it_was_converted_from(scaling, tmp_path):
    """llama.cpp's converter writes YaRN's fields for any family (rope.scaling.type "yarn"); the fields it
    leaves out take transformers' defaults, as llama.cpp's own loader gives them."""
    hf_config = qwen2_config(rope_theta=100.0, rope_scaling=scaling)
    path = tmp_path / "tiny.gguf"
    tensors = GGUFTensors({"token_embd.weight", "output.weight"}, lambda name: None)
    from_gguf = MODELS["qwen2"].gguf.config(GGUFMetadata(converted_yarn_metadata(hf_config), path), tensors)
    parsed = MODELS["qwen2"].parse_config(from_gguf, path, {})
    expected_inv_freq, expected_factor = ROPE_INIT_FUNCTIONS["yarn"](AutoConfig.for_model(**hf_config))
    inv_freq, factor = yarn_inv_freq(parsed)
    np.testing.assert_allclose(inv_freq, expected_inv_freq.numpy(), rtol=1e-6)
    assert factor == pytest.approx(expected_factor, rel=1e-7)


@pytest.mark.parametrize("family", sorted(YARN_FAMILIES))
def test_a_yarn_model_matches_transformers_past_its_original_context(family, family_build, family_source):
    native = NativeModel(family_build(family, "q0f32"))
    with torch.no_grad():
        expected = reference_model(family_source(family))(torch.tensor([PAST_ORIGINAL_CONTEXT])).logits[0].numpy()
    assert np.abs(native.all_logits(PAST_ORIGINAL_CONTEXT) - expected).max() <= YARN_TOLERANCE, "every position"
    native.reset()
    assert np.abs(native.prefill(PAST_ORIGINAL_CONTEXT[:-4]) - expected[-5]).max() <= YARN_TOLERANCE, "prefill"
    for position in range(-4, 0):
        decoded = native.decode(PAST_ORIGINAL_CONTEXT[position])
        assert np.abs(decoded - expected[position]).max() <= YARN_TOLERANCE, ("decode", position)


def test_yarn_with_a_sliding_window_that_binds_is_refused(family_source, tmp_path, run_compile):
    source = tmp_path / "mistral-yarn-window"
    shutil.copytree(family_source("mistral-yarn"), source)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "sliding_window": MISTRAL_WINDOW}))
    result = run_compile(source, tmp_path / "out")
    assert_clean_failure(result, tmp_path / "out", "config.json", "sliding_window", "yarn", "--context-window-size")
    assert run_compile(source, tmp_path / "out", "--context-window-size", str(MISTRAL_WINDOW)).returncode == 0
