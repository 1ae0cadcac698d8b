"""What the tests of untrusted inputs share: the tiny Llama's dimensions (its GGUF's and its Hugging
Face folder's), the valid folder they break, and how a refusal must end, in Python (one KilnError
naming the file, a small peak of memory) and through `kiln compile` (exit code 1, one error line,
nothing left behind)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from helpers.tiny_llama import write_tokenizer

from kiln.errors import KilnError

MAX_PEAK_BYTES = 64 << 20  # hashing a source reads it in 16 MB chunks
HIDDEN, HEADS, KV_HEADS, INTERMEDIATE = 32, 2, 1, 64
KV_WIDTH = HIDDEN // HEADS * KV_HEADS
TINY_CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": HIDDEN,
    "intermediate_size": INTERMEDIATE,
    "num_hidden_layers": 1,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "vocab_size": 384,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
}
TINY_TENSORS = {
    "model.embed_tokens.weight": (384, HIDDEN),
    "model.norm.weight": (HIDDEN,),
    "model.layers.0.input_layernorm.weight": (HIDDEN,),
    "model.layers.0.post_attention_layernorm.weight": (HIDDEN,),
    "model.layers.0.self_attn.q_proj.weight": (HIDDEN, HIDDEN),
    "model.layers.0.self_attn.k_proj.weight": (KV_WIDTH, HIDDEN),
    "model.layers.0.self_attn.v_proj.weight": (KV_WIDTH, HIDDEN),
    "model.layers.0.self_attn.o_proj.weight": (HIDDEN, HIDDEN),
    "model.layers.0.mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
    "model.layers.0.mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
    "model.layers.0.mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
}


def write_hf_folder(folder: Path) -> Path:
    """A 1-layer Llama folder: config.json, a trained tokenizer with a ChatML template, random weights."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(TINY_CONFIG))
    write_tokenizer(folder)
    rng = np.random.default_rng(0)
    save_file(
        {name: rng.standard_normal(shape).astype(np.float32) * 0.1 for name, shape in TINY_TENSORS.items()},
        str(folder / "model.safetensors"),
    )
    return folder


def write(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def assert_refused(read, path: Path, problem: str) -> KilnError:
    """`read()` raises one KilnError naming `path` and `problem`, on one line, with a small peak of memory."""
    tracemalloc.start()
    try:
        with pytest.raises(KilnError) as error:
            read()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(error.value)
    assert message.startswith(f"{path}: ") and problem in message, message
    assert "\n" not in message
    assert peak < MAX_PEAK_BYTES, f"{peak} bytes allocated"
    return error.value


def run_kiln_compile(source: Path, tmp_path: Path) -> tuple[subprocess.CompletedProcess, Path, Path]:
    output, temp = tmp_path / "out", tmp_path / "tmp"
    output.mkdir()
    temp.mkdir()
    environment = {**os.environ, "TMPDIR": str(temp)}
    result = subprocess.run(
        [Path(sys.executable).parent / "kiln", "compile", str(source), "-q", "q0f32", "-t", "cpu", "-o", str(output)],
        capture_output=True,
        text=True,
        env=environment,
        timeout=300,
    )
    return result, output, temp


def assert_clean_cli_failure(source: Path, tmp_path: Path, named_file: Path, problem: str) -> None:
    result, output, temp = run_kiln_compile(source, tmp_path)
    errors = [line for line in result.stderr.splitlines() if line.startswith("kiln: error: ")]
    others = [line for line in result.stderr.splitlines() if not line.startswith("kiln: ")]
    assert result.returncode == 1, result.stderr
    assert len(errors) == 1 and errors[0].startswith(f"kiln: error: {named_file}: ") and problem in errors[0], errors
    assert others == [] and "Traceback" not in result.stderr, result.stderr
    assert list(output.iterdir()) == [] and list(temp.iterdir()) == []
