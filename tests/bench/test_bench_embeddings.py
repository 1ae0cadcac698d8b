"""`kiln bench embeddings`: every engine and peer it times gives a row, with the cosine of its vectors to
the native ones (the numbers themselves are the benchmark's to print, not the test's to judge)."""

from __future__ import annotations

import json

import pytest

from kiln.cli import main


@pytest.mark.browser
def test_the_bench_times_kiln_beside_sentence_transformers_and_transformers_js(embedder_build, sources, capsys):
    model_dir = embedder_build("tiny-bert", "q0f32", ["cpu", "wasm", "webgpu"])
    # The sample's first 6 sentences fit the tiny model's 48 tokens (transformers.js cuts the 7th elsewhere).
    args = ["bench", "embeddings", str(model_dir), "--reference", str(sources.path("tiny-bert")), "--texts", "6"]
    capsys.readouterr()
    assert main([*args, "--browser", "wasm", "--transformers-js", "wasm", "--runs", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {row["engine"].split(" (")[0]: row for row in report["engines"]}
    assert list(rows) == ["native cpu", "sentence-transformers", "browser wasm", "transformers.js wasm"]
    assert report["texts"] == 6 and report["tokens"] > 6
    assert list(report["kiln_over_peer"]) == [
        "native cpu / sentence-transformers",
        "browser wasm / transformers.js wasm",
    ]
    for row in rows.values():
        assert row["texts_per_s"] > 0 and len(row["seconds"]) == 1
        assert row["least_cosine_to_native"] >= 0.9999, row


@pytest.mark.parametrize(
    "extra, problem",
    [
        (["--transformers-js", "wasm"], "--reference"),
        (["--transformers-js", "webgl"], "--transformers-js webgl: choose from wasm or webgpu"),
        (["--browser", "cuda"], "--browser cuda"),
    ],
)
def test_the_bench_refuses_what_it_cannot_time(tmp_path, capsys, extra, problem):
    assert main(["bench", "embeddings", str(tmp_path), *extra]) == 1
    assert problem in capsys.readouterr().err
