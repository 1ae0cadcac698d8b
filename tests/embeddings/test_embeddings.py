"""Embedding models natively: Kiln's vectors against sentence-transformers (on transformers) for tiny
random BERTs at q0f32, q8f32_1, q4f32_1 and q8_0_i8 and for the real all-MiniLM-L6-v2 (q0f32, q8_0_i8);
truncation, Matryoshka lengths, the OpenAI response shape, refusals and a retrieval sanity check."""

from __future__ import annotations

import base64
import json
import re
import shutil

import numpy as np
import pytest
from helpers.embedding_models import RETRIEVAL
from helpers.failures import assert_clean_failure

from kiln.cli import main
from kiln.embeddings import MOST_INPUTS, EmbeddingEngine
from kiln.engine import EngineError
from kiln.errors import KilnError

# Cosine to sentence-transformers each input's vector must reach, by quantization (the bar).
LEAST_COSINE = {"q0f32": 0.99999, "q8f32_1": 0.995, "q4f32_1": 0.98, "q8_0_i8": 0.995}
WORDS = "the kiln fires clay pots slowly while potters glaze bowls cups and plates for the market".split()


def texts_of_lengths(engine: EmbeddingEngine, lengths: list[int]) -> list[str]:
    """Texts whose token counts (special tokens included) are `lengths`; longer ones are truncated."""
    texts = []
    for length in lengths:
        words = [WORDS[i % len(WORDS)] for i in range(length)]
        while len(engine.token_ids([" ".join(words)])[0]) > length and len(words) > 1:
            words.pop()
        texts.append(" ".join(words))
    return texts


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def reference(source, texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(source), device="cpu").encode(texts, batch_size=len(texts), convert_to_numpy=True)


@pytest.mark.parametrize("quantization", list(LEAST_COSINE))
def test_tiny_bert_gives_sentence_transformers_embeddings(embedder_build, sources, quantization):
    engine = EmbeddingEngine(embedder_build("tiny-bert", quantization))
    longest = engine.settings.max_sequence_length
    texts = texts_of_lengths(engine, [3, 4, 9, 17, 30, longest - 1, longest])
    expected = reference(sources.path("tiny-bert"), texts)
    batched = engine.embed(texts)  # padded to one length
    alone = np.concatenate([engine.embed([text]) for text in texts])
    least = LEAST_COSINE[quantization]
    assert cosines(batched, expected).min() >= least
    assert cosines(alone, expected).min() >= least
    np.testing.assert_allclose(np.linalg.norm(batched, axis=1), 1, rtol=1e-5)  # the checkpoint normalizes
    np.testing.assert_allclose(batched, alone, atol=1e-6)  # padding changes nothing


@pytest.mark.parametrize("name", ["tiny-qwen3-embedder", "tiny-qwen2-embedder", "tiny-gemma3-embedder"])
@pytest.mark.parametrize("quantization", ["q0f32", "q8f32_1", "q8_0_i8"])
def test_decoder_embedders_give_sentence_transformers_embeddings(embedder_build, sources, name, quantization):
    """Qwen3-Embedding's shape (last-token pooling, <|endoftext|> appended, padded on the left by
    sentence-transformers and on the right by Kiln), a Qwen2 with mean pooling (causal attention over
    each input of a batch), and EmbeddingGemma's (Gemma 3 attending both ways, within a window of 16 on
    its local layers that inputs of up to 48 tokens pass, then two Dense modules)."""
    engine = EmbeddingEngine(embedder_build(name, quantization))
    longest = engine.settings.max_sequence_length
    texts = texts_of_lengths(engine, [2, 3, 9, 17, 30, longest - 1, longest])
    expected = reference(sources.path(name), texts)
    batched = engine.embed(texts)
    alone = np.concatenate([engine.embed([text]) for text in texts])
    assert cosines(batched, expected).min() >= LEAST_COSINE[quantization]
    np.testing.assert_allclose(batched, alone, atol=1e-6)


@pytest.mark.parametrize("family, problem", [("llama3", "rope_type 'llama3'"), ("gemma2", "for chat only")])
def test_embedding_checkpoints_kiln_cannot_run_are_refused(tmp_path, run_compile, family, problem):
    from helpers.embedding_models import make_tiny_decoder_embedder

    source = make_tiny_decoder_embedder(tmp_path / "source", family)
    assert_clean_failure(run_compile(source, tmp_path / "out"), tmp_path / "out", problem)


def test_a_bidirectional_model_is_refused_for_chat_and_a_residual_dense_module_for_embeddings(
    sources, tmp_path, run_compile
):
    source = tmp_path / "source"
    shutil.copytree(sources.path("tiny-gemma3-embedder"), source)
    dense_config = source / "2_Dense" / "config.json"
    dense_config.write_text(json.dumps({**json.loads(dense_config.read_text()), "use_residual": True}))
    assert_clean_failure(run_compile(source, tmp_path / "out"), tmp_path / "out", "without a residual")
    (source / "modules.json").unlink()
    assert_clean_failure(run_compile(source, tmp_path / "chat"), tmp_path / "chat", "use_bidirectional_attention")


def test_cls_pooling_without_normalization(embedder_build, sources):
    engine = EmbeddingEngine(embedder_build("tiny-bert-cls", "q0f32"))
    assert engine.settings.pooling == "cls" and not engine.settings.normalize
    texts = texts_of_lengths(engine, [5, 12, 40])
    vectors, expected = engine.embed(texts), reference(sources.path("tiny-bert-cls"), texts)
    np.testing.assert_allclose(vectors, expected, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def minilm(minilm_build):
    return EmbeddingEngine(minilm_build())


def test_minilm_gives_sentence_transformers_embeddings_up_to_its_window_and_truncates_past_it(minilm, sources):
    from helpers.embedding_models import MINILM

    assert minilm.settings.max_sequence_length == 256  # sentence_bert_config.json's, not the tokenizer's 512
    texts = texts_of_lengths(minilm, [3, 8, 31, 64, 128, 255, 256])
    texts.append(" ".join(WORDS * 30))  # ~480 tokens: kept to its first 256, as sentence-transformers keeps it
    assert cosines(minilm.embed(texts), reference(sources.path(MINILM), texts)).min() >= LEAST_COSINE["q0f32"]
    reply = minilm.create({"input": texts[-1]})
    assert reply["usage"] == {"prompt_tokens": 256, "total_tokens": 256}


def test_minilm_ranks_the_right_passage_first(minilm):
    queries, passages = zip(*RETRIEVAL)
    scores = minilm.embed(list(queries)) @ minilm.embed(list(passages)).T
    assert list(scores.argmax(axis=1)) == list(range(len(RETRIEVAL)))


def test_minilm_on_8_bit_activations_keeps_its_bound_and_ranks_the_right_passage_first(minilm_build, sources):
    """q8_0_i8: Q8_0 weights, every matmul of a batch on 8-bit activations (int8_prefill.py)."""
    from helpers.embedding_models import MINILM

    engine = EmbeddingEngine(minilm_build(quantization="q8_0_i8"))
    texts = texts_of_lengths(engine, [3, 8, 31, 64, 128, 255, 256])
    assert cosines(engine.embed(texts), reference(sources.path(MINILM), texts)).min() >= LEAST_COSINE["q8_0_i8"]
    queries, passages = zip(*RETRIEVAL)
    scores = engine.embed(list(queries)) @ engine.embed(list(passages)).T
    assert list(scores.argmax(axis=1)) == list(range(len(RETRIEVAL)))


def test_the_response_has_openai_shape_and_base64_holds_the_same_floats(minilm):
    reply = minilm.create({"input": ["first text", "second text"], "model": "whatever"})
    assert reply["object"] == "list" and reply["model"] == minilm.model_id
    assert [d["index"] for d in reply["data"]] == [0, 1]
    assert all(d["object"] == "embedding" and len(d["embedding"]) == 384 for d in reply["data"])
    encoded = minilm.create({"input": ["first text", "second text"], "encoding_format": "base64"})
    for plain, packed in zip(reply["data"], encoded["data"]):
        assert np.frombuffer(base64.b64decode(packed["embedding"]), "<f4").tolist() == plain["embedding"]
    assert reply["usage"]["prompt_tokens"] == sum(len(ids) for ids in minilm.token_ids(["first text", "second text"]))


@pytest.mark.parametrize(
    "request_body, problem",
    [
        ({"input": []}, "non-empty list"),
        ({"input": None}, "non-empty list"),
        ({"input": [1, 2]}, "input[0] should be a non-empty string"),
        ({"input": ["ok", ""]}, "input[1] should be a non-empty string"),
        ({"input": ["x"] * (MOST_INPUTS + 1)}, f"at most {MOST_INPUTS}"),
        ({"input": "x", "dimensions": 100}, "gives embeddings of 384"),
        ({"input": "x", "dimensions": "384"}, "whole number"),
        ({"input": "x", "encoding_format": "int8"}, "float or base64"),
    ],
)
def test_bad_requests_are_refused(minilm, request_body, problem):
    with pytest.raises(EngineError, match=re.escape(problem)) as refused:
        minilm.create(request_body)
    assert refused.value.code == "bad-request"


def test_matryoshka_lengths_are_cut_then_normalized(embedder_build, sources, tmp_path, run_compile):
    result = run_compile(sources.path("tiny-bert"), tmp_path, "--matryoshka-dimensions", "32,16")
    assert result.returncode == 0, result.stderr
    engine = EmbeddingEngine(tmp_path / "broken")
    full = engine.embed(["a short text"])
    for width in (32, 16):
        cut = engine.embed(["a short text"], dimensions=width)
        expected = full[:, :width] / np.linalg.norm(full[:, :width])
        np.testing.assert_allclose(cut, expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(EngineError, match="gives embeddings of 64, 32, 16"):
        engine.embed(["a short text"], dimensions=8)
    too_long = run_compile(sources.path("tiny-bert"), tmp_path / "other", "--matryoshka-dimensions", "64")
    assert_clean_failure(too_long, tmp_path / "other", "no shorter length of a 64-wide embedding")


def test_kiln_embed_prints_the_response(minilm_build, capsys):
    assert main(["embed", str(minilm_build()), "one text", "another", "--dimensions", "384"]) == 0
    reply = json.loads(capsys.readouterr().out)
    assert len(reply["data"]) == 2 and len(reply["data"][1]["embedding"]) == 384


def test_chat_and_embedding_models_refuse_each_others_engine(minilm_build, tiny_build):
    from kiln.engine import Engine

    for model_dir, kind in ((minilm_build(), "embedding"), (tiny_build("q4f32_1"), "chat")):
        assert json.loads((model_dir / "kiln-build.json").read_text())["kind"] == kind

    with pytest.raises(KilnError, match="an embedding model, not a chat model"):
        Engine(minilm_build())
    with pytest.raises(KilnError, match="a chat model, not an embedding model"):
        EmbeddingEngine(tiny_build("q4f32_1"))


@pytest.fixture(scope="module")
def server(minilm_build, tiny_build):
    """The Kiln server over the session's builds: all-MiniLM-L6-v2 beside the tiny chat Llama."""
    from helpers.web import served

    tiny_build("q4f32_1")
    with served(minilm_build().parent) as base:
        yield base


def test_openai_client_embeds_through_v1_embeddings(server, minilm):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server}v1", api_key="not-needed")
    texts = ["The kiln is hot.", "Bees make honey."]
    packed = client.embeddings.create(model=minilm.model_id, input=texts)  # the client asks for base64
    plain = client.embeddings.create(model=minilm.model_id, input=texts, encoding_format="float")
    expected = minilm.embed(texts)
    for reply in (packed, plain):
        np.testing.assert_array_equal(np.array([d.embedding for d in reply.data], np.float32), expected)
        assert reply.usage.prompt_tokens == sum(len(ids) for ids in minilm.token_ids(texts))


def test_v1_embeddings_refuses_bad_input_and_the_wrong_kind_of_model(server, minilm):
    import requests

    def post(path: str, body: dict) -> tuple[int, dict]:
        response = requests.post(f"{server}v1/{path}", json=body, timeout=60)
        return response.status_code, response.json().get("error", {})

    status, error = post("embeddings", {"model": minilm.model_id, "input": []})
    assert status == 400 and "non-empty list" in error["message"]
    status, error = post("embeddings", {"model": minilm.model_id, "input": ["x"] * (MOST_INPUTS + 1)})
    assert status == 400 and f"at most {MOST_INPUTS}" in error["message"]
    status, error = post("embeddings", {"model": "tiny-llama-q4f32_1", "input": "x"})
    assert status == 400 and error["code"] == "wrong_model_kind" and "/v1/chat/completions" in error["message"]
    chat = {"model": minilm.model_id, "messages": [{"role": "user", "content": "hi"}]}
    status, error = post("chat/completions", chat)
    assert status == 400 and error["code"] == "wrong_model_kind" and "/v1/embeddings" in error["message"]
