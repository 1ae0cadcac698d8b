"""`kiln bench compile`: seconds per build stage, and what quantization costs in perplexity: the
float build (q0f32), the requested quantization and, for a GGUF source, the file's own blocks
(gguf_f32) side by side."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

import kiln
from kiln.compile.pipeline import BuildRequest, build
from kiln.compile.source.ingest import is_gguf_file
from kiln.errors import KilnError
from kiln.runtime import NativeModel

# Package data, so an installed Kiln has it too (the tests train their tiny tokenizers on it).
DEFAULT_TEXT = Path(kiln.__file__).parent / "data" / "english.txt"
CONVERT_AND_COMPILE_GOAL_S = 180
PERPLEXITY_GOAL = 0.15


def perplexity(model_dir: Path, text: str) -> tuple[float, int]:
    """exp(mean negative log-likelihood of each next token) over the whole text, in one pass."""
    ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    model = NativeModel(model_dir)
    if len(ids) > model.context_window_size:
        raise KilnError(f"the text has {len(ids)} tokens, more than the context window of {model.context_window_size}")
    logits = model.all_logits(ids)[:-1].astype(np.float64)
    log_probs = logits - logits.max(axis=1, keepdims=True)
    log_probs -= np.log(np.exp(log_probs).sum(axis=1, keepdims=True))
    nll = -log_probs[np.arange(len(ids) - 1), ids[1:]]
    return float(np.exp(nll.mean())), len(ids)


def bench_compile(
    source: str, quantization: str, targets: list[str], text_path: Path | None, output: Path | None
) -> dict:
    text_path = text_path or DEFAULT_TEXT
    if not text_path.is_file():
        raise KilnError("no such text file (pass --text FILE)", text_path)
    text = text_path.read_text()
    with tempfile.TemporaryDirectory(prefix="kiln-bench-") as scratch:
        dist = output or Path(scratch)
        timed = build(BuildRequest(source, quantization, targets, dist, f"bench-{quantization}"))
        stages = timed.timings
        if not timed.reused_weights:
            convert_and_compile = stages.get("convert", 0) + sum(stages[f"compile {t}"] for t in targets)
        else:
            convert_and_compile = None
        perplexities = {}
        for compared in compared_quantizations(source, quantization):
            model_dir = build(BuildRequest(source, compared, ["cpu"], dist, f"bench-{compared}")).model_dir
            perplexities[compared], tokens = perplexity(model_dir, text)

    float_ppl = perplexities["q0f32"]
    increase = perplexities[quantization] / float_ppl - 1
    lines = [f"build {source} {quantization} → {', '.join(targets)}"]
    lines += [f"  {stage:<16} {seconds:8.1f} s" for stage, seconds in stages.items()]
    if convert_and_compile is not None:
        lines.append(f"  convert + compile {convert_and_compile:6.1f} s (goal ≤ {CONVERT_AND_COMPILE_GOAL_S} s)")
    lines.append(f"perplexity on {text_path.name} ({tokens} tokens)")
    for compared, ppl in perplexities.items():
        line = f"  {compared:<8} {ppl:8.3f}"
        if compared != "q0f32":
            goal = f", goal ≤ +{PERPLEXITY_GOAL:.0%}" if compared == quantization else ""
            line += f" ({ppl / float_ppl - 1:+.1%}{goal})"
        lines.append(line)
    return {
        "source": source,
        "quantization": quantization,
        "targets": targets,
        "stage_seconds": stages,
        "convert_and_compile_seconds": convert_and_compile,
        "text": str(text_path),
        "tokens": tokens,
        "perplexity": perplexities,
        "perplexity_increase": increase,
        "lines": lines,
    }


def compared_quantizations(source: str, quantization: str) -> list[str]:
    """q0f32, the requested quantization and, for a GGUF file, gguf_f32 (its blocks as they are)."""
    names = ["q0f32", quantization, *(["gguf_f32"] if is_gguf_file(source) else [])]
    return list(dict.fromkeys(names))
