"""LFM2, a hybrid of short convolutions and attention, beyond what every family's tests hold of its tiny
model (tests/models/test_families.py: against transformers at q0f32 and q4f32_1, as a GGUF, in the
browser; tests/mobile/test_arm64.py: on arm64): its recurrent state across chunks, rollbacks and
turns, the library WebLLM reads as "hybrid", the released config, and the configs Kiln refuses."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from helpers.failures import assert_clean_failure
from helpers.reference import PROMPTS
from helpers.webllm import assert_kiln_replies_the_same, webllm_replies

from kiln.browser.model import browser_model
from kiln.engine import Engine, GenerationConfig
from kiln.runtime import RECURRENT_HISTORY, NativeModel

QUESTION = [{"role": "user", "content": "Tell me about the history of the city"}]


@pytest.fixture(scope="module")
def lfm2(family_build):
    return family_build("lfm2", "q0f32")


@pytest.mark.parametrize("chunk", [1, 3, 5])
def test_chunks_of_a_prompt_give_the_logits_of_one_pass(lfm2, chunk):
    """Each chunk's conv layers start from the state the chunk before left (the last 2 inputs)."""
    native = NativeModel(lfm2)
    ids = PROMPTS[2]
    whole = native.all_logits(ids)
    native.reset()
    pieces = np.concatenate([native.all_logits(ids[i : i + chunk]) for i in range(0, len(ids), chunk)])
    assert np.abs(pieces - whole).max() <= 1e-5


def rollbacks(model) -> tuple[list[int], np.ndarray, np.ndarray]:
    """What rollbacks leave: the cached counts; the logits after undoing 3 of 4 decode steps and one
    more step, and those of a fresh prefill of the same tokens."""
    prompt, reply = PROMPTS[0], [40, 41, 42, 43]
    model.prefill(prompt)
    for token in reply:
        model.decode(token)
    kept = [model.rollback(3)]
    ours = model.decode(50)
    model.reset()
    fresh = model.prefill([*prompt, reply[0], 50])
    kept.append(model.rollback(3))  # 2 tokens after a prefill: the prefill cannot be undone
    model.prefill(prompt)
    for token in range(RECURRENT_HISTORY):
        model.decode(token)
    kept.append(model.rollback(RECURRENT_HISTORY))  # beyond the history kept
    return kept, ours, fresh


def test_a_rollback_continues_as_a_fresh_prefill_would(lfm2):
    """The recurrent state undoes the last single-token steps it keeps; past a step of several tokens,
    or its history, the model starts the sequence over (and says it keeps nothing)."""
    kept, ours, fresh = rollbacks(NativeModel(lfm2))
    assert kept == [len(PROMPTS[0]) + 1, 0, 0]
    assert np.abs(ours - fresh).max() <= 1e-5


@pytest.mark.browser
@pytest.mark.parametrize("backend", ["webgpu", "wasm"])
def test_the_browser_engine_rolls_back_as_the_native_one(backend, family_build, driver):
    model_dir = family_build("lfm2", "q4f32_1", ["cpu", "webgpu", "wasm"])
    kept, ours, fresh = rollbacks(NativeModel(model_dir))
    with browser_model(model_dir, backend, driver=driver) as browser:
        browser_kept, browser_ours, browser_fresh = rollbacks(browser)
    assert browser_kept == kept
    assert max(np.abs(browser_ours - ours).max(), np.abs(browser_fresh - fresh).max()) < 1e-3


def test_a_stop_string_and_a_second_turn_give_a_fresh_engines_reply(lfm2):
    """A stop string ends the reply inside tokens the cache holds, and the next turn's prompt drops
    them: the engine rolls its states back (or starts over) and replies as one that never saw turn one."""
    engine = Engine(lfm2)
    greedy = GenerationConfig(max_tokens=16)
    text = engine.generate_chat(QUESTION, greedy).text
    stop = text[len(text) // 2 :][:3]
    first = engine.generate_chat(QUESTION, GenerationConfig(max_tokens=16, stop=[stop]))
    assert first.finish_reason == "stop" and first.text == text[: text.index(stop)]
    conversation = [*QUESTION, {"role": "assistant", "content": first.text}, {"role": "user", "content": "And then?"}]
    second = engine.generate_chat(conversation, greedy)
    fresh = Engine(lfm2).generate_chat(conversation, greedy)
    assert second.tokens == fresh.tokens and second.text == fresh.text
    assert second.usage.prefilled_tokens <= fresh.usage.prefilled_tokens


def test_the_library_is_hybrid_as_webllm_reads_it(lfm2):
    native = NativeModel(lfm2)
    assert native.metadata["kv_state_kind"] == "hybrid"
    native.vm["create_rnn_state"]  # noqa: B018 (WebLLM requires it by name)
    config = json.loads((lfm2 / "mlc-chat-config.json").read_text())["model_config"]
    assert config["recurrent_layers"] == [0, 2, 3]


@pytest.mark.browser
def test_webllm_generates_what_kiln_generates_on_lfm2(driver, family_build, tmp_path):
    """WebLLM 0.2.86 runs a hybrid library through batch_prefill and batch_decode with its own
    recurrent state (one step of history)."""
    model_dir = family_build("lfm2", "q4f32_1", ["cpu", "webgpu"])
    conversations = [[{"role": "user", "content": "Hi"}], QUESTION]
    replies = webllm_replies(driver, tmp_path / "profile", model_dir, conversations)
    assert_kiln_replies_the_same(model_dir, conversations, replies)


# LiquidAI/LFM2-350M's config.json as released (transformers 4.54 wrote it).
LFM2_350M_CONFIG = dict(
    architectures=["Lfm2ForCausalLM"],
    block_auto_adjust_ff_dim=True,
    block_dim=1024,
    block_ff_dim=6656,
    block_ffn_dim_multiplier=1.0,
    block_mlp_init_scale=1.0,
    block_multiple_of=256,
    block_norm_eps=1e-05,
    block_out_init_scale=1.0,
    block_use_swiglu=True,
    block_use_xavier_init=True,
    bos_token_id=1,
    conv_L_cache=3,
    conv_bias=False,
    conv_dim=1024,
    conv_dim_out=1024,
    conv_use_xavier_init=True,
    eos_token_id=7,
    full_attn_idxs=[2, 5, 8, 10, 12, 14],
    hidden_size=1024,
    initializer_range=0.02,
    max_position_embeddings=128000,
    model_type="lfm2",
    norm_eps=1e-05,
    num_attention_heads=16,
    num_heads=16,
    num_hidden_layers=16,
    num_key_value_heads=8,
    pad_token_id=0,
    rope_theta=1000000.0,
    torch_dtype="bfloat16",
    use_cache=True,
    use_pos_enc=True,
    vocab_size=65536,
)


def test_lfm2_350ms_config_as_released_reads_as_transformers_reads_it(tmp_path):
    from transformers import Lfm2Config
    from transformers.models.lfm2.modeling_lfm2 import Lfm2MLP

    from kiln.models import MODELS

    config = MODELS["lfm2"].parse_config(LFM2_350M_CONFIG, tmp_path / "config.json", {})
    reference = Lfm2Config(**LFM2_350M_CONFIG)
    assert config.intermediate_size == Lfm2MLP(reference).w1.out_features == 4608
    assert config.recurrent_layers == tuple(i for i, kind in enumerate(reference.layer_types) if kind == "conv")
    assert (config.tie_word_embeddings, config.rms_norm_eps, config.rope_theta) == (True, 1e-5, 1e6)


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"layer_types": ["conv", "mamba", "conv", "conv", "full_attention"]}, "mamba"),
        ({"layer_types": ["conv", "full_attention"]}, "layer_types"),
        ({"layer_types": ["conv"] * 5}, "no attention layer"),
        ({"conv_dim": 32}, "conv_dim"),
        ({"conv_L_cache": 0}, "conv_L_cache"),
    ],
)
def test_a_config_kiln_does_not_compute_is_refused_naming_the_field(
    changes, named, family_source, tmp_path, run_compile
):
    folder = tmp_path / "bad-lfm2"
    shutil.copytree(family_source("lfm2"), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    assert_clean_failure(run_compile(folder, tmp_path / "out"), tmp_path / "out", "config.json", named)
