"""Gemma 4 beyond what every family's tests hold of its tiny model (tests/models/test_families.py: every
feature on, against transformers at q0f32, q4f32_1 and in float16, as a GGUF, past its window, and
in the browser): the multimodal checkpoints' text decoder, the kinds Kiln refuses, the KV cache the
shared layers leave out, E2B's head sizes (256 and 512) natively and in the browser, and WebLLM."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from helpers.failures import assert_clean_failure
from helpers.reference import LOGIT_TOLERANCE, PROMPTS, reference_model
from helpers.tiny_families import GEMMA4_HEAD_DIMS, GEMMA4_KV_HEADS
from helpers.webllm import assert_kiln_replies_the_same, webllm_replies

from kiln.app_config import model_needs, read_compiled_model
from kiln.browser.model import browser_model
from kiln.model_memory import kv_cache_bytes
from kiln.runtime import NativeModel


@pytest.mark.slow
def test_the_text_decoder_of_a_multimodal_gemma4_checkpoint_builds_as_its_gemma4_text(
    builds, family_build, family_source, tmp_path
):
    """A `gemma4` checkpoint (E2B, E4B) made with transformers' own classes, with tiny vision and audio
    towers around the tiny Gemma 4: the decoder builds, the towers and their projections are left out."""
    from transformers import AutoConfig, Gemma4Config, Gemma4ForConditionalGeneration

    text_source = family_source("gemma4")
    text = reference_model(text_source)
    config = Gemma4Config(
        text_config=AutoConfig.from_pretrained(text_source),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2),
        audio_config=dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2),
    )
    torch.manual_seed(0)
    model = Gemma4ForConditionalGeneration(config).eval()
    model.model.language_model.load_state_dict(text.model.state_dict())
    folder = tmp_path / "gemma4-multimodal"
    shutil.copytree(text_source, folder)
    (folder / "model.safetensors").unlink()
    model.save_pretrained(folder, safe_serialization=True)

    multimodal = NativeModel(builds.model_dir(folder, "tiny-gemma4-multimodal", "q0f32", ["cpu"]))
    decoder = NativeModel(family_build("gemma4", "q0f32"))
    for ids in PROMPTS:
        multimodal.reset()
        decoder.reset()
        assert np.array_equal(multimodal.all_logits(ids), decoder.all_logits(ids))


@pytest.mark.parametrize("model_type", ["gemma4_assistant", "gemma4_unified", "gemma4_unified_assistant"])
def test_the_gemma4_kinds_kiln_does_not_build_are_refused_saying_what_they_are(
    model_type, family_source, tmp_path, run_compile
):
    folder = tmp_path / model_type
    shutil.copytree(family_source("gemma4"), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    result = run_compile(folder, tmp_path / "out")
    assert_clean_failure(result, tmp_path / "out", "config.json", model_type, "Gemma 4")


def test_the_kv_cache_holds_the_layers_with_their_own_kv_at_the_largest_head(family_build):
    """The last 2 of 5 layers read earlier layers' K/V: the cache holds 3 layers, each sized for the
    global layers' 32-wide heads and the local layers' 2 KV heads (the padding the family's
    docstring explains)."""
    model = read_compiled_model(family_build("gemma4", "q0f32"))
    config = model.chat_config["model_config"]
    assert config["kv_shared_layers"] == [3, 4]
    assert (config["head_dim"], config["num_key_value_heads"]) == (GEMMA4_HEAD_DIMS[1], GEMMA4_KV_HEADS[0])
    cache, layer = kv_cache_bytes(config, 4)
    assert cache == 3 * layer
    assert model_needs(model).kv_cache == cache


def gemma4_variant(source, folder, **changes):
    """The tiny Gemma 4 with `changes` to its config, and new random weights made by transformers."""
    from transformers import AutoConfig, Gemma4ForCausalLM

    config = AutoConfig.from_pretrained(source)
    fields = {k: v for k, v in config.to_dict().items() if k != "per_layer_config"}  # made again from the heads
    fields |= {"global_head_dim": GEMMA4_HEAD_DIMS[1], "num_global_key_value_heads": GEMMA4_KV_HEADS[1]}
    torch.manual_seed(0)
    shutil.copytree(source, folder)
    (folder / "model.safetensors").unlink()
    Gemma4ForCausalLM(type(config)(**{**fields, **changes})).eval().save_pretrained(folder, safe_serialization=True)
    return folder


def e2b_heads(source, folder):
    """The tiny Gemma 4 with E2B's attention: 8 query heads and 1 KV head, 256 wide on the local
    layers and 512 on the global ones (the rest stays tiny)."""
    return gemma4_variant(
        source,
        folder,
        num_attention_heads=8,
        num_key_value_heads=1,
        head_dim=256,
        global_head_dim=512,
        num_global_key_value_heads=1,
    )


@pytest.fixture(scope="module")
def e2b_heads_build(builds, family_source, tmp_path_factory):
    source = e2b_heads(family_source("gemma4"), tmp_path_factory.mktemp("gemma4-e2b-heads") / "source")
    return source, builds.model_dir(source, "tiny-gemma4-e2b-heads", "q4f32_1", ["cpu", "webgpu", "wasm"])


@pytest.mark.slow
def test_e2bs_heads_of_256_and_512_match_transformers(e2b_heads_build):
    source, model_dir = e2b_heads_build
    native = NativeModel(model_dir)
    reference = reference_model(source, "q4f32_1")
    for ids in PROMPTS:
        native.reset()
        with torch.no_grad():
            expected = reference(torch.tensor([ids])).logits[0].numpy()
        assert np.abs(native.all_logits(ids) - expected).max() <= LOGIT_TOLERANCE


@pytest.mark.browser
@pytest.mark.parametrize("backend", ["webgpu", "wasm"])
def test_e2bs_heads_of_256_and_512_run_in_the_browser_as_natively(backend, e2b_heads_build, driver):
    """On WebGPU, TVM's prefill attention tiled to fit its workgroup memory (kv_cache/gpu_wide_heads.py)
    and its decode attention with enough threads for a 512-wide head; the build checks every kernel
    against WebGPU's limits (kiln/compile/lower/webgpu_limits.py). Logits at every position of the
    longest prompt (past the window), then 8 decode steps, within 1e-3 of the native build's."""
    _, model_dir = e2b_heads_build
    native = NativeModel(model_dir)
    ids = PROMPTS[2]
    with browser_model(model_dir, backend, driver=driver) as browser:
        assert np.abs(browser.all_logits(ids) - native.all_logits(ids)).max() < 1e-3
        browser.reset()
        native.reset()
        ours, theirs = browser.prefill(ids[:8]), native.prefill(ids[:8])
        for _ in range(8):
            assert np.abs(ours - theirs).max() < 1e-3
            token = int(theirs.argmax())
            ours, theirs = browser.decode(token), native.decode(token)


@pytest.mark.browser
def test_webllm_generates_what_kiln_generates_on_gemma4(driver, builds, family_source, tmp_path):
    """WebLLM 0.2.86 runs a Kiln Gemma 4 library as it is: it takes a token's row width from what
    `embed` returns (the embedding and the per-layer inputs beside it), and the library's runtime
    reads the shared layers' K/V. Within its context (the window, 64 here), as for Gemma 3; with
    per-layer inputs 32 wide (real models' are 256): with the 8-wide ones of the tiny model, whose
    projections stay float, SwiftShader lost WebLLM's device while it compiled the shaders (Kiln's
    engine runs that library)."""
    source = gemma4_variant(
        family_source("gemma4"), tmp_path / "gemma4-webllm", sliding_window=64, hidden_size_per_layer_input=32
    )
    model_dir = builds.model_dir(source, "tiny-gemma4-webllm", "q4f32_1", ["cpu", "webgpu"])
    conversations = [[{"role": "user", "content": "Hi"}]]
    replies = webllm_replies(driver, tmp_path / "profile", model_dir, conversations)
    assert 32 < replies[0]["usage"]["prompt_tokens"] < 64 - 8
    assert_kiln_replies_the_same(model_dir, conversations, replies)


# google/gemma-4-E2B-it's text_config as released (the fields it gives; transformers' defaults for the rest).
E2B_TEXT_CONFIG = dict(
    hidden_size=1536,
    num_hidden_layers=35,
    num_attention_heads=8,
    num_key_value_heads=1,
    head_dim=256,
    global_head_dim=512,
    num_global_key_value_heads=None,
    attention_k_eq_v=False,
    sliding_window=512,
    vocab_size=262144,
    vocab_size_per_layer_input=262144,
    hidden_size_per_layer_input=256,
    num_kv_shared_layers=20,
    use_double_wide_mlp=True,
    intermediate_size=6144,
    max_position_embeddings=131072,
    final_logit_softcapping=30.0,
    layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 7,
)


def test_e2bs_config_as_released_reads_as_transformers_reads_it(tmp_path):
    """Each layer's head size, KV heads, K/V source and MLP width, and the RoPE frequencies of both
    kinds, as transformers' Gemma4TextConfig and its rotary embedding give them."""
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

    from kiln.models import MODELS
    from kiln.models.gemma4 import proportional_inv_freq

    path = tmp_path / "config.json"
    config = MODELS["gemma4"].parse_config(
        {"model_type": "gemma4", "text_config": E2B_TEXT_CONFIG, "tie_word_embeddings": True}, path, {}
    )
    reference = Gemma4TextConfig(**E2B_TEXT_CONFIG)
    layers = range(reference.num_hidden_layers)
    assert config.layer_head_dims == tuple(reference.per_layer_config[i].head_dim for i in layers)
    assert config.layer_kv_heads == tuple(reference.per_layer_config[i].num_key_value_heads for i in layers)
    first_shared = reference.num_hidden_layers - reference.num_kv_shared_layers
    modes, kinds = reference.kv_sharing_modes, reference.layer_types
    stores = {kinds[i]: i for i, mode in enumerate(modes) if mode == "store"}  # each kind's K/V for the shared layers
    assert config.kv_sources == tuple(stores[kinds[i]] if mode == "reuse" else i for i, mode in enumerate(modes))
    assert config.layer_intermediate_sizes == tuple(6144 * (2 if i >= first_shared else 1) for i in layers)
    assert (config.per_layer_input_size, config.head_dim, config.num_key_value_heads) == (256, 512, 1)
    rotary = Gemma4TextRotaryEmbedding(reference)
    for kind, layer in (("sliding_attention", 0), ("full_attention", 4)):
        expected = getattr(rotary, f"{kind}_inv_freq").numpy()
        ours = proportional_inv_freq(config.layer_ropes[layer], config.layer_head_dims[layer])
        assert np.allclose(ours, expected, rtol=1e-6, atol=0), kind


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"per_layer_config": {"2": {"head_dim": "wide"}}}, "head_dim"),
        ({"per_layer_config": {"2": {"num_key_value_heads": -1}}}, "num_key_value_heads"),
        ({"per_layer_config": {"9": {"head_dim": 32}}}, "per_layer_config"),
        ({"global_head_dim": 1 << 20}, "global_head_dim"),
    ],
)
def test_a_bad_per_layer_head_is_refused_naming_the_field(changes, named, family_source, tmp_path, run_compile):
    folder = tmp_path / "bad-heads"
    shutil.copytree(family_source("gemma4"), folder)
    config = json.loads((folder / "config.json").read_text())
    if "global_head_dim" in changes:
        del config["per_layer_config"]
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    assert_clean_failure(run_compile(folder, tmp_path / "out"), tmp_path / "out", "config.json", named)
