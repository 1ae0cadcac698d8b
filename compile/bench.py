"""`kiln bench compile`: seconds per build stage, and what quantization costs in perplexity."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from kiln.errors import KilnError
from kiln.runtime import NativeModel

from .pipeline import BuildRequest, build

DEFAULT_TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "english.txt"
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


def bench_compile(source: str, quantization: str, targets: list[str], text_path: Path | None,
                  output: Path | None) -> dict:
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
        quantized_dir = build(BuildRequest(source, quantization, ["cpu"], dist, f"bench-{quantization}")).model_dir
        float_dir = build(BuildRequest(source, "q0f32", ["cpu"], dist, "bench-q0f32")).model_dir
        float_ppl, tokens = perplexity(float_dir, text)
        quantized_ppl, _ = perplexity(quantized_dir, text)

    increase = quantized_ppl / float_ppl - 1
    lines = [f"build {source} {quantization} → {', '.join(targets)}"]
    lines += [f"  {stage:<16} {seconds:8.1f} s" for stage, seconds in stages.items()]
    if convert_and_compile is not None:
        lines.append(f"  convert + compile {convert_and_compile:6.1f} s (goal ≤ {CONVERT_AND_COMPILE_GOAL_S} s)")
    lines += [f"perplexity on {text_path.name} ({tokens} tokens)",
              f"  q0f32    {float_ppl:8.3f}",
              f"  {quantization:<8} {quantized_ppl:8.3f} ({increase:+.1%}, goal ≤ +{PERPLEXITY_GOAL:.0%})"]
    return {
        "source": source, "quantization": quantization, "targets": targets, "stage_seconds": stages,
        "convert_and_compile_seconds": convert_and_compile, "text": str(text_path), "tokens": tokens,
        "perplexity": {"q0f32": float_ppl, quantization: quantized_ppl}, "perplexity_increase": increase,
        "lines": lines,
    }
