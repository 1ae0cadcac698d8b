"""`kiln bench native`: how fast a compiled model runs on this machine, and how close decoding
comes to the memory bandwidth bound.

Decoding one token reads every weight once (a tied embedding too: the output projection reads it
whole) plus the KV cache so far, so bytes-per-token × tokens/s ÷ the machine's copy bandwidth
says how much of the hardware a decode step uses.
"""

from __future__ import annotations

import resource
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import tvm

from kiln.app_config import model_needs, read_compiled_model
from kiln.bench.matrices import kernels_as_built, read_whole_by_decode, time_matrix_types
from kiln.engine import Engine, GenerationConfig
from kiln.model_folder import read_json
from kiln.model_memory import cache_layers, float_bytes
from kiln.runtime import cpu_variant, set_cpu_threads
from kiln.tensor_cache import records

BANDWIDTH_BYTES = 512 << 20
BANDWIDTH_REPEATS = 5
PROMPT_SEED = 0


def measure_memory_bandwidth(threads: int, nbytes: int = BANDWIDTH_BYTES, repeats: int = BANDWIDTH_REPEATS) -> float:
    """Bytes per second of a large numpy copy on `threads` threads, a slice each (numpy copies
    without the GIL), best of a few, counting the read and the write: the engine's thread count
    can read no faster."""
    source = np.ones(nbytes // 8, dtype=np.float64)
    destination = np.empty_like(source)
    slices = [slice(start, start + len(source) // threads) for start in range(0, len(source), len(source) // threads)]
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            start = time.perf_counter()
            list(pool.map(lambda part: np.copyto(destination[part], source[part]), slices))
            best = min(best, time.perf_counter() - start)
    return 2 * source.nbytes / best


def benchmark_prompt(tokenizer, vocab_size: int, prompt_tokens: int) -> list[int]:
    """The benchmarks' prompt (native and browser): seeded random tokens that are not special tokens."""
    special = set(tokenizer.get_added_tokens_decoder())
    ordinary = np.array([t for t in range(vocab_size) if t not in special])
    return np.random.default_rng(PROMPT_SEED).choice(ordinary, prompt_tokens).tolist()


def decode_bytes_per_token(engine: Engine, context_tokens: float) -> float:
    """Weight bytes read by one decode step, plus the KV cache at `context_tokens`."""
    model_config = engine.chat_config["model_config"]
    tied = model_config.get("tie_word_embeddings", False)
    weights = sum(r.nbytes for r in records(engine.model_dir) if read_whole_by_decode(r, tied))
    kv_itemsize = float_bytes(engine.chat_config["quantization"])
    layers = len(cache_layers(model_config))
    kv_per_token = 2 * layers * model_config["num_key_value_heads"] * model_config["head_dim"] * kv_itemsize
    return weights + kv_per_token * context_tokens


def bench_native(
    model_dir: Path,
    target: str = "cpu",
    prompt_tokens: int = 128,
    decode_tokens: int = 128,
    runs: int = 3,
    bandwidth_bytes: int = BANDWIDTH_BYTES,
    response_format=None,
) -> dict:
    """`response_format` (a ResponseFormat): decode under its token mask, and report the mask's cost."""
    start = time.perf_counter()
    engine = Engine(model_dir, target)
    load_s = time.perf_counter() - start
    threads = set_cpu_threads() if target == "cpu" else None

    prompt = benchmark_prompt(engine.tokenizer, engine.model.vocab_size, prompt_tokens)
    config = GenerationConfig(max_tokens=decode_tokens, ignore_eos=True, response_format=response_format)
    usages = []
    for _ in range(runs + 1):  # the first run warms up (allocations, caches) and is not counted
        engine.reset()
        usages.append(engine.generate(prompt, config).usage)
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # before the bandwidth buffers

    def median(key: str) -> float:
        return statistics.median(getattr(usage, key) for usage in usages[1:])

    decode_tokens_per_s = median("decode_tokens_per_s")
    bytes_per_token = decode_bytes_per_token(engine, prompt_tokens + decode_tokens / 2)
    needs = model_needs(read_compiled_model(engine.model_dir), target)
    report = {
        "model_id": engine.model_id,
        "response_format": response_format.kind if response_format else "text",
        "target": target,
        "threads": threads,
        "prompt_tokens": prompt_tokens,
        "decode_tokens": decode_tokens,
        "runs": runs,
        "load_s": load_s,
        "ttft_s": median("ttft_s"),
        "prefill_tokens_per_s": median("prefill_tokens_per_s"),
        "decode_tokens_per_s": decode_tokens_per_s,
        "peak_rss_mb": peak_rss_mb,
        "weight_bytes": needs.weights,
        "accounted_bytes": needs.total,
        "decode_bytes_per_token": bytes_per_token,
        "decoded_tokens": median("completion_tokens"),
        "mask_ms_per_token": median("mask_ms_per_token"),
    }
    on_threads = f" ({threads} thread{'s' if threads > 1 else ''})" if threads else ""
    if target == "cpu":
        variant, _ = cpu_variant(read_json(engine.model_dir / "kiln-build.json")["targets"]["cpu"], engine.model_dir)
        report["cpu_library"] = variant
        on_threads += f", the {variant} library, a {tvm.target.codegen.llvm_get_system_cpu()} CPU"
    report["lines"] = [
        f"{engine.model_id} on {target}{on_threads}: {prompt_tokens} prompt + "
        f"{report['decoded_tokens']:.0f} decoded tokens{' held to a JSON schema' if response_format else ''}, "
        f"median of {runs} runs after a warm-up",
        f"  load                 {report['load_s']:8.2f} s",
        f"  time to first token  {report['ttft_s']:8.3f} s",
        f"  prefill              {report['prefill_tokens_per_s']:8.1f} tokens/s",
        f"  decode               {report['decode_tokens_per_s']:8.1f} tokens/s",
        *([f"  token mask           {report['mask_ms_per_token']:8.3f} ms/token"] if response_format else []),
        f"  peak RSS             {report['peak_rss_mb']:8.0f} MB   (the whole process: Python, TVM, the tokenizer)",
        f"  the model accounts for {needs.describe()}",
    ]
    if threads:  # a GPU's memory is not the host's: its bandwidth is not measured here
        bandwidth = measure_memory_bandwidth(threads, bandwidth_bytes)
        report.update(
            bandwidth_gb_per_s=bandwidth / 1e9, bandwidth_fraction=bytes_per_token * decode_tokens_per_s / bandwidth
        )
        report["lines"].append(
            f"  decode reads         {bytes_per_token / 1e6:8.1f} MB/token → "
            f"{bytes_per_token * decode_tokens_per_s / 1e9:.2f} GB/s = {report['bandwidth_fraction']:.0%} of the "
            f"{report['bandwidth_gb_per_s']:.1f} GB/s a {threads}-thread numpy copy reaches here (read + write)"
        )
        report["matrix_types"] = time_matrix_types(engine.model_dir, bandwidth)
        report["matrix_kernels_as_built"] = kernels_as_built(engine.model_dir)
        report["lines"] += matrix_type_lines(
            report["matrix_types"], 1e3 / decode_tokens_per_s, report["matrix_kernels_as_built"]
        )
    return report


def matrix_type_lines(types: list[dict], step_ms: float, as_built: bool) -> list[str]:
    if not types:
        return []
    return [
        "  per matrix type, a decode GEMV of each of its shapes over the model's own weights"
        + (":" if as_built else " (this Kiln's GEMVs: the library was built by other Kiln code):"),
        *(
            f"    {t['kind']:10} {t['bytes'] / 1e6:8.1f} MB {t['ms']:7.2f} ms {t['gb_per_s']:7.2f} GB/s "
            f"= {t['bandwidth_fraction']:4.0%} of the copy's"
            for t in types
        ),
        f"    {'together':10} {sum(t['bytes'] for t in types) / 1e6:8.1f} MB "
        f"{sum(t['ms'] for t in types):7.2f} ms of the {step_ms:.2f} ms a decode step takes",
    ]
