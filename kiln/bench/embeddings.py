"""`kiln bench embeddings`: how many texts an embedding model embeds per second natively and, on
request, in headless Chromium (the CPU wasm library, WebGPU), and the peers on the checkpoint it was
compiled from: sentence-transformers natively, transformers.js in the same Chromium
(kiln/bench/transformers_js.py) — one sitting, one set of texts, the same thread count — with the
cosine of each engine's vectors to the native ones.

The texts are the sentences of the bundled English sample, as many as asked (repeated when it has
fewer), sent as one request: the engines batch them as they would any request.
"""

from __future__ import annotations

import re
import statistics
import time
from pathlib import Path
from typing import Callable

import numpy as np

from kiln.bench.transformers_js import transformers_js_runs
from kiln.browser.driver import page_engine
from kiln.embeddings import EmbeddingEngine
from kiln.errors import KilnError
from kiln.runtime import set_cpu_threads

# Each Kiln engine's peer, by the start of their rows' names (a browser library: wasm, webgpu, webgpu-subgroups).
PEERS = {
    "native": "sentence-transformers",
    "browser wasm": "transformers.js wasm",
    "browser webgpu": "transformers.js webgpu",
}
SAMPLE_TEXT = Path(__file__).resolve().parent.parent / "data" / "english.txt"
# Timed inside the page: one warm-up request, then `runs` requests, each one's seconds.
PAGE_RUNS_JS = """async ({texts, runs}) => {
  const engine = globalThis.kilnDriven;
  const seconds = [];
  let reply;
  for (let run = 0; run <= runs; run += 1) {
    const start = performance.now();
    reply = await engine.embeddings.create({ input: texts });
    if (run > 0) seconds.push((performance.now() - start) / 1000);
  }
  return { seconds, vectors: reply.data.map((item) => item.embedding), usage: reply.usage };
}"""


def sample_sentences(count: int) -> list[str]:
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", SAMPLE_TEXT.read_text()) if s.strip()]
    return [sentences[i % len(sentences)] for i in range(count)]


def timed(embed: Callable[[], np.ndarray], runs: int) -> tuple[np.ndarray, list[float]]:
    """One warm-up call, then `runs` timed ones: the last vectors and each call's seconds."""
    vectors = embed()
    seconds = []
    for _ in range(runs):
        start = time.perf_counter()
        vectors = embed()
        seconds.append(time.perf_counter() - start)
    return np.asarray(vectors, np.float32), seconds


def least_cosine(vectors: np.ndarray, reference: np.ndarray) -> float:
    dots = (vectors * reference).sum(1)
    return float((dots / np.linalg.norm(vectors, axis=1) / np.linalg.norm(reference, axis=1)).min())


def engine_row(name: str, seconds: list[float], texts: int, tokens: int, vectors, native) -> dict:
    median = statistics.median(seconds)
    return {
        "engine": name,
        "texts_per_s": texts / median,
        "tokens_per_s": tokens / median,
        "seconds": seconds,
        "least_cosine_to_native": least_cosine(vectors, native),
    }


def sentence_transformers_run(checkpoint: Path, texts: list[str], threads: int, runs: int, batch_size: int):
    """sentence-transformers' vectors and seconds on `checkpoint`, torch on `threads` threads."""
    try:
        import torch
        from sentence_transformers import SentenceTransformer
    except ImportError as error:
        raise KilnError(f"--reference needs sentence-transformers and torch ({error})") from None
    torch.set_num_threads(threads)
    model = SentenceTransformer(str(checkpoint), device="cpu")
    with torch.inference_mode():
        return timed(lambda: model.encode(texts, batch_size=batch_size, convert_to_numpy=True), runs)


def browser_runs(model_dir: Path, libraries: list[str], texts: list[str], runs: int, threads: int):
    """Per library: (where it ran, vectors, seconds), timed in the page."""
    results = []
    for library in libraries:
        with page_engine(model_dir.resolve().parent, webgpu=library != "wasm") as engine:
            stats = engine.load(model_dir.name, library, threads=threads if library == "wasm" else None)["stats"]
            page = engine.page.evaluate(PAGE_RUNS_JS, {"texts": texts, "runs": runs})
            adapter = stats["adapter"] or {}
            where = f"browser {stats['library_target']} " + (
                f"({stats['threads']} threads)" if stats["backend"] == "wasm" else f"({adapter.get('vendor')})"
            )
            results.append((where, np.asarray(page["vectors"], np.float32), page["seconds"]))
    return results


def bench_embeddings(
    model_dir: Path,
    target: str = "cpu",
    texts: int = 64,
    runs: int = 3,
    reference: Path | None = None,
    browser: list[str] = (),
    transformers_js: list[str] = (),
) -> dict:
    """`reference`: the sentence-transformers checkpoint compiled, timed beside; `browser`: Kiln's browser
    libraries (wasm, webgpu) to time in Chromium; `transformers_js`: its devices (wasm, webgpu) to time
    there on `reference`."""
    if transformers_js and reference is None:
        raise KilnError("--transformers-js runs the checkpoint given by --reference")
    model_dir = Path(model_dir)
    threads = set_cpu_threads()
    sentences = sample_sentences(texts)
    engine = EmbeddingEngine(model_dir, target)
    tokens = sum(len(ids) for ids in engine.token_ids(sentences))
    native, seconds = timed(lambda: engine.embed(sentences), runs)
    where = f"native {target}" + (f" ({threads} threads)" if target == "cpu" else "")
    rows = [engine_row(where, seconds, texts, tokens, native, native)]
    if reference is not None:
        vectors, seconds = sentence_transformers_run(
            reference, sentences, threads, runs, engine.settings.max_batch_size
        )
        rows.append(engine_row(f"sentence-transformers ({threads} threads)", seconds, texts, tokens, vectors, native))
    peers = browser_runs(model_dir, list(browser), sentences, runs, threads)
    if transformers_js:
        peers += transformers_js_runs(reference, engine.settings, list(transformers_js), sentences, runs, threads)
    for where, vectors, seconds in peers:
        rows.append(engine_row(where, seconds, texts, tokens, vectors, native))
    report = {
        "model_id": engine.model_id,
        "texts": texts,
        "tokens": tokens,
        "runs": runs,
        "max_batch_size": engine.settings.max_batch_size,
        "engines": rows,
        "kiln_over_peer": kiln_over_peer(rows),
    }
    report["lines"] = report_lines(report)
    return report


def kiln_over_peer(rows: list[dict]) -> dict[str, float]:
    """Kiln's texts/s over its peer's where both ran: {"browser wasm / transformers.js wasm": ratio, …}."""
    speed = {row["engine"].split(" (")[0]: row["texts_per_s"] for row in rows}
    ratios = {}
    for kiln, peer in PEERS.items():
        for name in speed:
            if name.startswith(kiln) and peer in speed:
                ratios[f"{name} / {peer}"] = speed[name] / speed[peer]
    return ratios


def report_lines(report: dict) -> list[str]:
    native = report["engines"][0]["texts_per_s"]
    lines = [
        f"{report['model_id']}: {report['texts']} texts, {report['tokens']} tokens, batches of at most "
        f"{report['max_batch_size']}, median of {report['runs']} runs",
        f"{'engine':<44} {'texts/s':>9} {'tokens/s':>9} {'vs native':>9} {'least cos':>10}",
    ]
    for row in report["engines"]:
        lines.append(
            f"{row['engine']:<44} {row['texts_per_s']:>9.4g} {row['tokens_per_s']:>9.4g} "
            f"{row['texts_per_s'] / native:>8.3g}x {row['least_cosine_to_native']:>10.6f}"
        )
    lines += [f"{pair}: {ratio:.2f}x" for pair, ratio in report["kiln_over_peer"].items()]
    return lines
