"""Embeddings in the browser engine (Chromium: the CPU wasm library and WebGPU on SwiftShader) against
the native engine's, a retrieval check, refusals, and one page holding a chat model beside an embedder."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from helpers.embedding_models import RETRIEVAL
from helpers.web import browser_page, wait_for_state

from kiln.browser.driver import BrowserEngineError, page_engine
from kiln.embeddings import EmbeddingEngine

LEAST_COSINE = 0.9999  # browser against native, per input
# A matmul on 8-bit activations rounds its input to 255 levels, so one ulp of difference upstream moves
# all that follows: MiniLM at q8_0_i8 natively, against itself with one LayerNorm bias nudged by one ulp,
# reaches a cosine of 0.9999 (median 0.99995), its wasm library against the native one 0.99987. The two
# engines' kernels sum the same integers (tests/compile/test_int8_decode.py); their floats round apart.
LEAST_COSINE_ON_8_BIT_ACTIVATIONS = 0.999
PASSAGES = [passage for _, passage in RETRIEVAL]
# One cut to the model's 256 tokens, and the passages the retrieval check ranks.
TEXTS = ["A kiln fires clay.", "Stoneware " * 300, *PASSAGES]

BOTH_ENGINES_JS = """async ({chatId, embeddingId}) => {
  const { createEngine } = await import("/web/src/index.js");
  const config = await (await fetch("/api/app-config.json", { cache: "no-cache" })).json();
  const chat = await createEngine(config, chatId, { device: "wasm", threads: 1 });
  const embedder = await createEngine(config, embeddingId, { device: "wasm", threads: 1 });
  try {
    const reply = await chat.chat.completions.create({ messages: [{ role: "user", content: "Hi" }], max_tokens: 4,
                                                       temperature: 0 });
    const vectors = await embedder.embeddings.create({ input: ["one", "two"] });
    return { reply: reply.choices[0].message.content, count: vectors.data.length,
             kinds: [(await chat.stats()).kind, (await embedder.stats()).kind] };
  } finally {
    await chat.unload();
    await embedder.unload();
  }
}"""


def vectors_of(reply: dict) -> np.ndarray:
    return np.array([item["embedding"] for item in reply["data"]], np.float32)


def least_cosine(browser: np.ndarray, native: np.ndarray) -> float:
    return ((browser * native).sum(1) / np.linalg.norm(browser, axis=1) / np.linalg.norm(native, axis=1)).min()


@pytest.mark.browser
def test_wasm_embeddings_match_the_native_ones_and_rank_the_passages(minilm_build, driver):
    model_dir = minilm_build(["cpu", "wasm", "webgpu"])
    native = EmbeddingEngine(model_dir)
    with page_engine(model_dir.parent, webgpu=False, driver=driver) as engine:
        engine.load(model_dir.name, "wasm")
        reply = engine.call("embeddings.create", {"input": TEXTS})
        expected = native.create({"input": TEXTS})
        browser = vectors_of(reply)
        assert least_cosine(browser, vectors_of(expected)) >= LEAST_COSINE
        assert reply["usage"] == expected["usage"]  # the same tokens, a long text cut to 256 alike
        queries, passages = zip(*RETRIEVAL)
        query_vectors = vectors_of(engine.call("embeddings.create", {"input": list(queries)}))
        assert list((query_vectors @ browser[-len(PASSAGES) :].T).argmax(axis=1)) == list(range(len(RETRIEVAL)))
        packed = engine.call("embeddings.create", {"input": TEXTS[:1], "encoding_format": "base64"})
        unpacked = np.frombuffer(base64.b64decode(packed["data"][0]["embedding"]), "<f4")
        np.testing.assert_array_equal(unpacked, browser[0])
        for bad, problem in (({"input": []}, "non-empty list"), ({"input": "x", "dimensions": 7}, "384")):
            with pytest.raises(BrowserEngineError, match=problem) as refused:
                engine.call("embeddings.create", bad)
            assert refused.value.code == "bad-request"
        with pytest.raises(BrowserEngineError, match="is an embedding model"):
            engine.chat({"messages": [{"role": "user", "content": "hi"}]})


@pytest.mark.browser
def test_minilm_on_8_bit_activations_in_wasm_matches_the_native_one_to_its_rounding(minilm_build, driver):
    model_dir = minilm_build(["cpu", "wasm"], "q8_0_i8")
    queries, _ = zip(*RETRIEVAL)
    with page_engine(model_dir.parent, webgpu=False, driver=driver) as engine:
        engine.load(model_dir.name, "wasm")
        browser = vectors_of(engine.call("embeddings.create", {"input": TEXTS}))
        query_vectors = vectors_of(engine.call("embeddings.create", {"input": list(queries)}))
    assert least_cosine(browser, EmbeddingEngine(model_dir).embed(TEXTS)) >= LEAST_COSINE_ON_8_BIT_ACTIVATIONS
    assert list((query_vectors @ browser[-len(PASSAGES) :].T).argmax(axis=1)) == list(range(len(RETRIEVAL)))


@pytest.mark.browser
def test_webgpu_embeddings_match_the_native_ones(minilm_build, driver):
    """Two short texts in one batch: WebGPU on SwiftShader runs MiniLM's matmuls at well under a GFLOP/s."""
    model_dir = minilm_build(["cpu", "wasm", "webgpu"])
    texts = ["A kiln fires clay.", PASSAGES[0]]
    with page_engine(model_dir.parent, webgpu=True, driver=driver) as engine:
        assert engine.load(model_dir.name, "webgpu")["stats"]["backend"] == "webgpu"
        reply = engine.call("embeddings.create", {"input": texts})
    expected = EmbeddingEngine(model_dir).create({"input": texts})
    assert least_cosine(vectors_of(reply), vectors_of(expected)) >= LEAST_COSINE
    assert reply["usage"] == expected["usage"]


@pytest.mark.browser
def test_one_page_holds_a_chat_model_and_an_embedding_model(minilm_build, tiny_dir, driver):
    model_dir = minilm_build(["cpu", "wasm", "webgpu"])
    assert tiny_dir.parent == model_dir.parent
    with page_engine(model_dir.parent, webgpu=False, driver=driver) as engine:
        both = engine.page.evaluate(BOTH_ENGINES_JS, {"chatId": tiny_dir.name, "embeddingId": model_dir.name})
    assert both["count"] == 2 and both["kinds"] == ["chat", "embedding"] and isinstance(both["reply"], str)


@pytest.mark.browser
@pytest.mark.parametrize("name", ["tiny-qwen3-embedder", "tiny-gemma3-embedder"])
def test_a_decoder_embedder_in_the_browser_matches_the_native_one(embedder_build, driver, name):
    model_dir = embedder_build(name, "q0f32", ["cpu", "wasm"])
    texts = ["A kiln fires clay.", "Glaze " * 60, *PASSAGES]  # one cut to the model's 48 tokens
    with page_engine(model_dir.parent, webgpu=False, driver=driver) as engine:
        engine.load(model_dir.name, "wasm")
        reply = engine.call("embeddings.create", {"input": texts})
    expected = EmbeddingEngine(model_dir).create({"input": texts})
    assert least_cosine(vectors_of(reply), vectors_of(expected)) >= LEAST_COSINE
    assert reply["usage"] == expected["usage"]


@pytest.mark.browser
def test_the_harness_search_tab_ranks_pasted_paragraphs(minilm_build, tiny_dir, url, driver, tmp_path):
    model_dir = minilm_build(["cpu", "wasm", "webgpu"])
    assert tiny_dir.parent == model_dir.parent  # the `url` server's dist
    with browser_page(driver, tmp_path / "profile", f"{url}?model={model_dir.name}", webgpu=False) as (_, page):
        page.click("#load-button")
        wait_for_state(page, "ready")
        assert page.is_hidden("#chat-form") and page.is_visible("#search")
        page.fill("#paragraphs", "\n\n".join(PASSAGES))
        for query, passage in RETRIEVAL:
            page.fill("#query", query)
            page.keyboard.press("Enter")
            wait_for_state(page, "ready")
            assert page.locator("#ranking li .content").first.inner_text() == passage
        assert page.locator("#ranking li").count() == len(PASSAGES)
        assert f"{len(PASSAGES) + 1} texts" in page.inner_text("#stats")
