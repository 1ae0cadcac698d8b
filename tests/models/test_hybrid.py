"""The hybrid families, LFM2 (short convolutions and attention) and Qwen3.5 (Gated DeltaNet and gated
attention), beyond what every family's tests hold of their tiny models (tests/models/test_families.py:
against transformers at q0f32 and q4f32_1, LFM2 as a GGUF, in the browser; tests/mobile/test_arm64.py:
on arm64): the recurrent state across chunks, rollbacks and turns in every engine, the library WebLLM
reads as "hybrid" and WebLLM's replies, the multimodal Qwen3.5 checkpoint's text tower, LFM2-350M's
released config, and the configs Kiln refuses."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from helpers.failures import assert_clean_failure
from helpers.real_sizes import QWEN3_5_08B_CONFIG
from helpers.reference import PROMPTS
from helpers.webllm import assert_kiln_replies_the_same, webllm_replies

from kiln.browser.model import browser_model
from kiln.engine import Engine, GenerationConfig
from kiln.model_memory import RECURRENT_HISTORY, RECURRENT_SNAPSHOTS, recurrent_snapshot_bytes, recurrent_state_bytes
from kiln.runtime import NativeModel

QUESTION = [{"role": "user", "content": "Tell me about the history of the city"}]
HYBRID_FAMILIES = ["lfm2", "qwen3_5"]
RECURRENT_LAYERS = {"lfm2": [0, 2, 3], "qwen3_5": [0, 1, 2]}


@pytest.fixture(params=HYBRID_FAMILIES)
def hybrid(request, family_build):
    return family_build(request.param, "q0f32")


@pytest.mark.parametrize("chunk", [1, 3, 5])
def test_chunks_of_a_prompt_give_the_logits_of_one_pass(hybrid, chunk):
    """Each chunk's recurrent layers start from the state the chunk before left: LFM2's last conv
    inputs; Qwen3.5's conv inputs and delta-rule state."""
    native = NativeModel(hybrid)
    ids = PROMPTS[2]
    whole = native.all_logits(ids)
    native.reset()
    pieces = np.concatenate([native.all_logits(ids[i : i + chunk]) for i in range(0, len(ids), chunk)])
    assert np.abs(pieces - whole).max() <= 1e-5


def rollbacks(model) -> tuple[list[int], list[np.ndarray], list[np.ndarray]]:
    """What rollbacks leave: the cached counts; the logits of the step after each rollback, and those of
    a fresh prefill of the same tokens."""
    prompt, reply = PROMPTS[0], [40, 41, 42, 43]
    model.prefill(prompt)  # snapshot at P
    for token in reply:
        model.decode(token)
    kept = [model.rollback(3)]  # single-token steps: the state's history undoes them
    ours = [model.decode(50)]
    model.prefill(reply)  # snapshot at P + 6
    for token in range(RECURRENT_HISTORY):
        model.decode(token)
    kept.append(model.rollback(RECURRENT_HISTORY))  # beyond the history: the snapshot at the point
    ours.append(model.decode(51))
    for token in range(3):
        model.decode(token)
    kept.append(model.rollback(7))  # to P + 3: the latest snapshot before it, P; the caller prefills on
    ours.append(model.prefill(reply[:3]))
    kept.append(model.rollback(len(prompt)))  # before every snapshot: the sequence starts over
    fresh = []
    for tokens in ([*prompt, 40, 50], [*prompt, 40, 50, *reply, 51], [*prompt, *reply[:3]]):
        model.reset()
        fresh.append(model.prefill(tokens))
    return kept, ours, fresh


def test_a_rollback_continues_as_a_fresh_prefill_would(hybrid):
    """The recurrent state undoes the last single-token steps it keeps; further back, the model goes
    back to its latest snapshot (one after each prompt's prefill) at or before the point, and the
    next prefill starts there; before the first snapshot it starts the sequence over."""
    kept, ours, fresh = rollbacks(NativeModel(hybrid))
    prompt = len(PROMPTS[0])
    assert kept == [prompt + 1, prompt + 6, prompt, 0]
    for after, expected in zip(ours, fresh, strict=True):
        assert np.abs(after - expected).max() <= 1e-4  # a decode kernel's rounding against a prefill's


@pytest.mark.browser
@pytest.mark.parametrize("backend", ["webgpu", "wasm"])
@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_the_browser_engine_rolls_back_as_the_native_one(family, backend, family_build, driver):
    model_dir = family_build(family, "q4f32_1", ["cpu", "webgpu", "wasm"])
    kept, ours, fresh = rollbacks(NativeModel(model_dir))
    with browser_model(model_dir, backend, driver=driver) as browser:
        browser_kept, browser_ours, browser_fresh = rollbacks(browser)
    assert browser_kept == kept
    for browser_logits, native_logits in zip([*browser_ours, *browser_fresh], [*ours, *fresh], strict=True):
        assert np.abs(browser_logits - native_logits).max() < 1e-3


@pytest.mark.browser
def test_a_long_prompt_on_webgpu_gives_the_native_logits_at_every_position(family_build, driver):
    """A GPU prefills Qwen3.5's delta rule in its chunked form (kiln/models/delta_rule.py): 150 tokens
    are two whole chunks and a part, in one step and in steps that start inside a chunk, then decode
    steps (the token-by-token kernel) go on from the state the chunks left."""
    model_dir = family_build("qwen3_5", "q4f32_1", ["cpu", "webgpu"])
    ids = (PROMPTS[2] * 20)[:150]

    def run(model) -> list[np.ndarray]:
        whole = model.all_logits(ids)
        model.reset()
        pieces = [model.all_logits(ids[:70]), model.all_logits(ids[70:])]
        return [whole, np.concatenate(pieces), model.decode(ids[0]), model.decode(ids[1])]

    native = run(NativeModel(model_dir))
    with browser_model(model_dir, "webgpu", driver=driver) as browser:
        webgpu = run(browser)
    for ours, expected in zip(webgpu, native, strict=True):
        assert np.abs(ours - expected).max() < 1e-3


def test_a_stop_string_and_a_second_turn_give_a_fresh_engines_reply(hybrid):
    """A stop string ends the reply inside tokens the cache holds, and the next turn's prompt drops
    them: the engine rolls its states back (or starts over) and replies as one that never saw turn one."""
    engine = Engine(hybrid)
    greedy = GenerationConfig(max_tokens=16)
    text = engine.generate_chat(QUESTION, greedy).text
    stop = text[len(text) // 2 :][:3]
    first = engine.generate_chat(QUESTION, GenerationConfig(max_tokens=16, stop=[stop]))
    assert first.finish_reason == "stop" and first.text == text[: text.index(stop)]
    conversation = [*QUESTION, {"role": "assistant", "content": first.text}, {"role": "user", "content": "And then?"}]
    second = engine.generate_chat(conversation, greedy)
    fresh = Engine(hybrid).generate_chat(conversation, greedy)
    assert second.tokens == fresh.tokens and second.text == fresh.text
    assert second.usage.prefilled_tokens <= fresh.usage.prefilled_tokens


def test_an_edited_message_prefills_from_the_snapshot_before_it(hybrid):
    """Editing a chat's last message makes the prompt differ from the cache further back than the
    state's history reaches: the engine goes back to the snapshot after the turn before it, not to the
    start, and replies as a fresh engine does."""
    engine = Engine(hybrid)
    greedy = GenerationConfig(max_tokens=8)
    turn = [*QUESTION, {"role": "assistant", "content": engine.generate_chat(QUESTION, greedy).text}]
    engine.generate_chat([*turn, {"role": "user", "content": "And then, in the old town?"}], greedy)
    edited = [*turn, {"role": "user", "content": "What came after?"}]
    again = engine.generate_chat(edited, greedy)
    fresh = Engine(hybrid).generate_chat(edited, greedy)
    assert again.tokens == fresh.tokens
    assert 0 < again.usage.prefilled_tokens < fresh.usage.prefilled_tokens - 8


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_the_library_is_hybrid_as_webllm_reads_it(family, family_build):
    native = NativeModel(family_build(family, "q0f32"))
    assert native.metadata["kv_state_kind"] == "hybrid"
    native.vm["create_rnn_state"]  # noqa: B018 (WebLLM requires it by name)
    config = json.loads((native.model_dir / "mlc-chat-config.json").read_text())["model_config"]
    assert config["recurrent_layers"] == RECURRENT_LAYERS[family]


@pytest.mark.browser
@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_webllm_generates_what_kiln_generates(family, driver, family_build, tmp_path):
    """WebLLM 0.2.86 runs a hybrid library through batch_prefill and batch_decode with its own
    recurrent state (one step of history)."""
    model_dir = family_build(family, "q4f32_1", ["cpu", "webgpu"])
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
def test_an_lfm2_config_kiln_does_not_compute_is_refused_naming_the_field(
    changes, named, family_source, tmp_path, run_compile
):
    folder = tmp_path / "bad-lfm2"
    shutil.copytree(family_source("lfm2"), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    assert_clean_failure(run_compile(folder, tmp_path / "out"), tmp_path / "out", "config.json", named)


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"layer_types": ["linear_attention", "mamba", "linear_attention", "full_attention"]}, "mamba"),
        ({"layer_types": ["linear_attention"] * 4}, "no full_attention layer"),
        ({"linear_num_value_heads": 3}, "does not divide"),
        ({"rope_parameters": {"rope_theta": 1e7, "partial_rotary_factor": 0.01}}, "partial_rotary_factor"),
    ],
)
def test_a_qwen3_5_config_kiln_does_not_compute_is_refused_naming_the_field(
    changes, named, family_source, tmp_path, run_compile
):
    folder = tmp_path / "bad-qwen3_5"
    shutil.copytree(family_source("qwen3_5"), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    assert_clean_failure(run_compile(folder, tmp_path / "out"), tmp_path / "out", "config.json", named)


@pytest.mark.slow
def test_the_text_tower_of_a_multimodal_qwen3_5_checkpoint_builds_as_its_qwen3_5_text(
    builds, family_build, family_source, tmp_path
):
    """Qwen3.5's releases are `qwen3_5` checkpoints (Qwen3_5ForConditionalGeneration, a vision tower
    beside the decoder): made with transformers' own classes around the tiny Qwen3.5, with a
    multi-token-prediction tensor as the releases carry, it builds the decoder alone."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text_source = family_source("qwen3_5")
    text_config = AutoConfig.from_pretrained(text_source)
    config = Qwen3_5Config(
        text_config=text_config.to_dict(),
        vision_config=dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=64),
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(config).eval()
    weights = load_file(text_source / "model.safetensors")
    text = {name.removeprefix("model."): values for name, values in weights.items() if name.startswith("model.")}
    model.model.language_model.load_state_dict(text)
    folder = tmp_path / "qwen3_5-multimodal"
    shutil.copytree(text_source, folder)
    (folder / "model.safetensors").unlink()
    model.save_pretrained(folder, safe_serialization=True)
    saved = load_file(folder / "model.safetensors")
    save_file({**saved, "mtp.fc.weight": torch.zeros(4, 4)}, folder / "model.safetensors", metadata={"format": "pt"})

    multimodal = NativeModel(builds.model_dir(folder, "tiny-qwen3_5-multimodal", "q0f32", ["cpu"]))
    decoder = NativeModel(family_build("qwen3_5", "q0f32"))
    for ids in PROMPTS:
        multimodal.reset()
        decoder.reset()
        assert np.array_equal(multimodal.all_logits(ids), decoder.all_logits(ids))


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_the_memory_accounting_holds_the_states_the_library_keeps(family, family_build):
    """What the app config and the browser's refusal count for the recurrent state is what the library's
    state object holds: every recurrent layer's states, RECURRENT_HISTORY steps of each; and what the
    engine keeps of it, RECURRENT_SNAPSHOTS copies of one step's."""
    import tvm

    native = NativeModel(family_build(family, "q0f32"))
    native.prefill(PROMPTS[0])
    debug_get = tvm.get_global_func("vm.builtin.rnn_state_debug_get")
    model_config = json.loads((native.model_dir / "mlc-chat-config.json").read_text())["model_config"]
    layers, states = len(model_config["recurrent_layers"]), len(model_config["recurrent_state"])

    def stored(layer: int, state: int) -> int:
        return debug_get(native.states[1], layer, state, 0).numpy().nbytes

    held = [[stored(layer, state) for state in range(states)] for layer in range(layers)]
    total, largest = recurrent_state_bytes(model_config, element_bytes=4)
    assert total == sum(map(sum, held)) * RECURRENT_HISTORY
    assert largest == max(held[0]) * RECURRENT_HISTORY
    assert [kept for kept, _ in native.snapshots] == [len(PROMPTS[0])]
    ((_, snapshot),) = native.snapshots
    assert [copy.numpy().nbytes for copy in snapshot] == [size for layer in held for size in layer]
    assert recurrent_snapshot_bytes(model_config, element_bytes=4) == sum(map(sum, held)) * RECURRENT_SNAPSHOTS


def test_qwen3_5_08bs_config_as_released_reads_as_transformers_reads_it(tmp_path):
    from transformers import Qwen3_5Config

    from kiln.models import MODELS

    config = MODELS["qwen3_5"].parse_config(QWEN3_5_08B_CONFIG, tmp_path / "config.json", {})
    reference = Qwen3_5Config(**QWEN3_5_08B_CONFIG).text_config
    kinds = reference.layer_types
    assert config.recurrent_layers == tuple(i for i, kind in enumerate(kinds) if kind == "linear_attention")
    assert len(config.recurrent_layers) == 18 and config.tie_word_embeddings
    assert config.rotary_dim == int(reference.head_dim * reference.rope_parameters["partial_rotary_factor"]) == 64
    assert config.recurrent_state == (((3, 2 * 16 * 128 + 16 * 128), None), ((16, 128, 128), "float32"))
