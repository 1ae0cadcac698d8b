"""`kiln bench browser`: the browser engine's speed in headless Chromium (WebGPU, or the CPU
wasm library), with the keys of `kiln bench native` plus the cold and warm load times.

Cold load is a first visit (download, SHA-256 check, shader compilation, upload); warm load is the
next visit, from the Cache API — comparable to the native engine's load from disk, so `load_s`
is the warm one. The prompt is the native benchmark's (the same seeded random ordinary tokens);
generation is greedy through the engine's token-level API, timed inside the page.
"""

from __future__ import annotations

import statistics
import threading
from dataclasses import dataclass
from pathlib import Path

from kiln.app_config import model_needs, read_compiled_model
from kiln.browser.driver import PRECISE_TIMESTAMP_FLAGS, page_engine
from kiln.errors import KilnError
from kiln.model_folder import read_json
from kiln.model_memory import MIB
from kiln.text import load_tokenizer

from .native import benchmark_prompt

RSS_SAMPLE_S = 0.25
SLOWEST_KERNELS_SHOWN = 8
# Sampling as chats commonly ask for it (WebLLM's defaults): every token weighed, the top ones sorted.
TOP_P_SAMPLING = {"temperature": 0.7, "top_p": 0.95, "seed": 0}
RUN_JS = """async ({promptIds, decodeTokens, sampling}) => {
  const engine = globalThis.kilnDriven;
  await engine.resetChat();
  const run = await engine.session.generate(promptIds, { max_tokens: decodeTokens, ...sampling });
  const stepMs = run.model_ms_per_token + run.sample_ms_per_token;
  return {
    ttft_s: run.prefill_s,
    prefill_tokens_per_s: promptIds.length / run.prefill_s,
    decode_tokens_per_s: decodeTokens > 1 ? 1000 / stepMs : null,
    model_ms_per_token: run.model_ms_per_token,
    sample_ms_per_token: run.sample_ms_per_token,
  };
}"""
# A prefill of the prompt and the decode step after it, with each kernel's GPU time (timestamp
# queries) and workgroup barriers.
KERNEL_TIMES_JS = """async ({promptIds}) => {
  const engine = globalThis.kilnDriven;
  await engine.resetChat();
  const prefill = await engine.session.timePrefill(promptIds, { topK: 1 });
  const decode = await engine.session.timeDecode(prefill.top.ids[0], { topK: 1 });
  return { prefill: prefill.kernels, decode: decode.kernels };
}"""


class PeakMemory:
    """The largest total RSS of this process's Chromium processes, sampled in the background.

    RSS double-counts memory the processes share, so this is an upper bound.
    """

    def __init__(self):
        self.peak_bytes = 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)

    def sample(self) -> None:
        import psutil

        me = psutil.Process()
        while not self.stopped.wait(RSS_SAMPLE_S):
            total = 0
            for process in me.children(recursive=True):
                try:
                    if "chrom" in process.name():
                        total += process.memory_info().rss
                except psutil.Error:
                    continue
            self.peak_bytes = max(self.peak_bytes, total)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stopped.set()
        self.thread.join()

    @property
    def peak_mb(self) -> float | None:
        return self.peak_bytes / 2**20 if self.peak_bytes else None


@dataclass
class PageRuns:
    """What the page measured: its two loads, the greedy runs, one top-p run, the engine's stats after
    them and, where the GPU gives timestamps, each kernel's time in a prefill and a decode step."""

    cold: dict
    warm: dict
    greedy: list[dict]
    top_p: dict
    stats: dict
    kernels: dict | None
    peak_rss_mb: float | None


def bench_browser(
    model_dir: Path,
    device: str = "auto",
    prompt_tokens: int = 32,
    decode_tokens: int = 16,
    runs: int = 1,
    threads: int | None = None,
) -> dict:
    """`threads`: of the CPU wasm library (default: the engine's choice); the harness page is cross-origin
    isolated, as `kiln serve` serves it, so it can have them."""
    model_dir = Path(model_dir)
    if not (model_dir / "kiln-build.json").is_file():
        raise KilnError("not a compiled model folder (no kiln-build.json)", model_dir)
    chat_config = read_json(model_dir / "mlc-chat-config.json")
    prompt = benchmark_prompt(load_tokenizer(model_dir), chat_config["vocab_size"], prompt_tokens)
    page_runs = run_in_chromium(model_dir, device, prompt, decode_tokens, runs, threads)
    report = browser_report(page_runs, model_dir, chat_config["model_config"]["num_hidden_layers"])
    report.update(prompt_tokens=prompt_tokens, decode_tokens=decode_tokens, runs=runs)
    report["lines"] = report_lines(report, page_runs.stats["memory"])
    return report


def bench_browser_speculative(
    model_dir: Path, device: str = "auto", max_tokens: int = 256, runs: int = 3, threads: int | None = None
) -> dict:
    """kiln.bench.speculative's tasks on the browser engine's chat completions, plain and with prompt lookup."""
    from kiln.bench.speculative import bench_speculative, browser_replies

    model_dir = Path(model_dir)
    with page_engine(model_dir.resolve().parent, device != "wasm") as engine:
        stats = engine.load(model_dir.name, device, threads=threads)["stats"]
        where = stats["library_target"] + (f" ({stats['threads']} threads)" if stats["backend"] == "wasm" else "")
        replies = browser_replies(engine, max_tokens)
        return bench_speculative(replies, stats["model_id"], where, "prompt-lookup", runs)


def run_in_chromium(
    model_dir: Path, device: str, prompt: list[int], decode_tokens: int, runs: int, threads: int | None
) -> PageRuns:
    webgpu = device != "wasm"
    with (
        page_engine(model_dir.resolve().parent, webgpu, extra_args=PRECISE_TIMESTAMP_FLAGS if webgpu else ()) as engine,
        PeakMemory() as rss,
    ):
        page = engine.page
        cold = engine.load(model_dir.name, device, threads=threads)
        page.reload()
        warm = engine.load(model_dir.name, device, threads=threads)
        if not warm["stats"]["load"]["from_cache"]:
            raise KilnError("the second load did not come from the browser cache", model_dir)
        greedy = {"promptIds": prompt, "decodeTokens": decode_tokens, "sampling": {"temperature": 0}}
        measured = [page.evaluate(RUN_JS, greedy) for _ in range(runs + 1)][1:]  # the first run warms up
        top_p = page.evaluate(RUN_JS, {**greedy, "sampling": TOP_P_SAMPLING})
        stats = page.evaluate("globalThis.kilnDriven.stats()")
        timed = stats["decode_step_dispatches"] is not None
        kernels = page.evaluate(KERNEL_TIMES_JS, {"promptIds": prompt}) if timed else None
    return PageRuns(cold, warm, measured, top_p, stats, kernels, rss.peak_mb)


def browser_report(page_runs: PageRuns, model_dir: Path, layers: int) -> dict:
    """`kiln bench native`'s keys (medians of the greedy runs) with the page's own."""
    loaded = page_runs.warm["stats"]
    needs = model_needs(read_compiled_model(model_dir), loaded["library_target"])
    memory, kernels = page_runs.stats["memory"], page_runs.kernels
    dispatches = page_runs.stats["decode_step_dispatches"]

    def median(key: str) -> float | None:
        values = [run[key] for run in page_runs.greedy if run[key] is not None]
        return statistics.median(values) if values else None

    # workgroup barriers each invocation passes in a decode step, not counting those inside loops
    barriers = sum(k["dispatches"] * k["barriers"] for k in kernels["decode"]) if kernels else None
    return {
        "model_id": loaded["model_id"],
        "device": loaded["backend"],
        "library": loaded["library_target"],
        "adapter": loaded["adapter"],
        "threads": loaded["threads"] if loaded["backend"] == "wasm" else None,
        "layers": layers,
        "load_s": page_runs.warm["seconds"],
        "cold_load_s": page_runs.cold["seconds"],
        "warm_load_s": page_runs.warm["seconds"],
        "ttft_s": median("ttft_s"),
        "prefill_tokens_per_s": median("prefill_tokens_per_s"),
        "decode_tokens_per_s": median("decode_tokens_per_s"),
        "model_ms_per_token": median("model_ms_per_token"),
        "sample_ms_per_token": median("sample_ms_per_token"),
        "top_p_sample_ms_per_token": page_runs.top_p["sample_ms_per_token"],
        "peak_rss_mb": page_runs.peak_rss_mb,
        "weight_bytes": needs.weights,
        "accounted_bytes": needs.total,
        "accounted": needs.describe(),
        "wasm_memory_bytes": memory["wasm_bytes"],
        "wasm_maximum_bytes": memory["wasm_maximum_bytes"],
        "gpu_peak_bytes": memory["gpu_peak_bytes"],
        "bandwidth_fraction": None,
        "decode_step_dispatches": dispatches,
        "dispatches_per_layer": dispatches / layers if dispatches is not None else None,
        "decode_step_issue_ms": page_runs.stats["decode_step_issue_ms"],
        "decode_step_barriers": barriers,
        "barriers_per_layer": barriers / layers if barriers is not None else None,
        "decode_step_kernels": kernels and kernels["decode"],
        "prefill_kernels": kernels and kernels["prefill"],
    }


def report_lines(report: dict, memory: dict) -> list[str]:
    adapter = report["adapter"]
    on = (
        f"WebGPU ({adapter['vendor']} {adapter['architecture']}, the {report['library']} library)"
        if adapter
        else f"CPU wasm ({report['threads']} thread{'s' if report['threads'] > 1 else ''})"
    )

    def rate(value: float | None) -> str:
        return "       –" if value is None else f"{value:8.1f}"

    lines = [
        f"{report['model_id']} in headless Chromium on {on}: {report['prompt_tokens']} prompt + "
        f"{report['decode_tokens']} decoded tokens, median of {report['runs']} run(s) after a warm-up",
        f"  cold load            {report['cold_load_s']:8.2f} s   (download, SHA-256, shaders, upload)",
        f"  warm load            {report['warm_load_s']:8.2f} s   (from the Cache API)",
        f"  time to first token  {report['ttft_s']:8.3f} s",
        f"  prefill              {rate(report['prefill_tokens_per_s'])} tokens/s",
        f"  decode               {rate(report['decode_tokens_per_s'])} tokens/s",
        f"  a decode step        {report['model_ms_per_token']:8.2f} ms in the model + "
        f"{report['sample_ms_per_token']:.2f} ms choosing the token (greedy; "
        f"{report['top_p_sample_ms_per_token']:.2f} ms sampling at temperature 0.7, top_p 0.95)",
        f"  peak RSS             {rate(report['peak_rss_mb'])} MB   "
        "(all Chromium processes, shared pages counted twice)",
        f"  the model's memory   {held_line(memory)}; accounted for: {report['accounted']}",
    ]
    return lines + dispatch_lines(report)


def dispatch_lines(report: dict) -> list[str]:
    """Where the GPU gives them: dispatches, the CPU time to issue them, barriers and kernel times."""
    dispatches, kernels = report["decode_step_dispatches"], report["decode_step_kernels"]
    if dispatches is None:
        return []
    issue_ms = report["decode_step_issue_ms"]
    lines = [
        f"  GPU dispatches       {dispatches:8d} per decode step ({report['dispatches_per_layer']:.1f} per layer "
        f"of {report['layers']}, embedding and head included)",
        f"  CPU time to issue    {issue_ms:8.2f} ms per decode step ({1000 * issue_ms / dispatches:.1f} µs per "
        "dispatch: the VM and tvmjs encoding it, before the GPU runs it)",
    ]
    if kernels:
        in_loops = sorted(k["kernel"] for k in kernels if k["loopBarriers"])
        lines.append(
            f"  workgroup barriers   {report['decode_step_barriers']:8d} per decode step "
            f"({report['barriers_per_layer']:.1f} per layer), not counting those inside loops "
            f"(in {', '.join(in_loops) or 'none'})"
        )
        lines += kernel_lines("decode step", kernels)
        lines += kernel_lines(f"{report['prompt_tokens']}-token prefill", report["prefill_kernels"])
    return lines


def held_line(memory: dict) -> str:
    """What the model holds in the page: its library's wasm memory (the peak: it never shrinks), and
    on WebGPU the most GPU memory its buffers took."""
    wasm = f"wasm {memory['wasm_bytes'] / MIB:.0f} MiB"
    if memory["gpu_peak_bytes"] is not None:
        return f"GPU buffers {memory['gpu_peak_bytes'] / MIB:.0f} MiB at most, host {wasm}"
    return f"{wasm} (it may grow to {memory['wasm_maximum_bytes'] / MIB:.0f})"


def kernel_lines(step: str, kernels: list[dict]) -> list[str]:
    gpu_ms = sum(kernel["ms"] for kernel in kernels)
    return [
        f"  GPU time             {gpu_ms:8.2f} ms per {step}, slowest kernels:",
        *(
            f"    {k['ms']:8.3f} ms  {k['dispatches']:3d}×  {k['kernel']}  ({barrier_count(k)})"
            for k in kernels[:SLOWEST_KERNELS_SHOWN]
        ),
    ]


def barrier_count(kernel: dict) -> str:
    in_loops = f" + {kernel['loopBarriers']} in loops" if kernel["loopBarriers"] else ""
    return f"{kernel['barriers']} barriers{in_loops}"
