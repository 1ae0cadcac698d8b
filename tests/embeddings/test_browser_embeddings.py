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
PASSAGES = [passage for _, passage in RETRIEVAL]
# WebGPU on SwiftShader runs a batch's matmuls at well under a GFLOP/s: it gets short texts only, the
# CPU library also one cut to the model's 256 tokens.
TEXTS = {"wasm": ["A kiln fires clay.", "Stoneware " * 300, *PASSAGES], "webgpu": ["A kiln fires clay.", *PASSAGES]}

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


@pytest.mark.browser
@pytest.mark.parametrize("library", ["wasm", "webgpu"])
def test_browser_embeddings_match_the_native_ones(minilm_build, driver, library):
    model_dir = minilm_build(["cpu", "wasm", "webgpu"])
    native = EmbeddingEngine(model_dir)
    with page_engine(model_dir.parent, webgpu=library == "webgpu", driver=driver) as engine:
        engine.load(model_dir.name, library)
        texts = TEXTS[library]
        reply = engine.call("embeddings.create", {"input": texts})
        expected = native.create({"input": texts})
        browser, plain = vectors_of(reply), vectors_of(expected)
        cosines = (browser * plain).sum(1) / np.linalg.norm(browser, axis=1) / np.linalg.norm(plain, axis=1)
        assert cosines.min() >= LEAST_COSINE, cosines
        assert reply["usage"] == expected["usage"]  # the same tokens, a long text cut to 256 alike
        queries, passages = zip(*RETRIEVAL)
        query_vectors = vectors_of(engine.call("embeddings.create", {"input": list(queries)}))
        assert list((query_vectors @ browser[-len(PASSAGES) :].T).argmax(axis=1)) == list(range(len(RETRIEVAL)))
        packed = engine.call("embeddings.create", {"input": texts[:1], "encoding_format": "base64"})
        unpacked = np.frombuffer(base64.b64decode(packed["data"][0]["embedding"]), "<f4")
        np.testing.assert_array_equal(unpacked, browser[0])
        for bad, problem in (({"input": []}, "non-empty list"), ({"input": "x", "dimensions": 7}, "384")):
            with pytest.raises(BrowserEngineError, match=problem) as refused:
                engine.call("embeddings.create", bad)
            assert refused.value.code == "bad-request"
        with pytest.raises(BrowserEngineError, match="is an embedding model"):
            engine.chat({"messages": [{"role": "user", "content": "hi"}]})


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
    browser, plain = vectors_of(reply), vectors_of(expected)
    assert ((browser * plain).sum(1)).min() >= LEAST_COSINE  # both unit length
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
