"""`kiln bench report`: the native benchmark and the browser benchmark on the same model, side
by side, as a JSON file and a PNG chart, with browser ÷ native ratios.

The browser's `wasm` library runs the CPU schedules of the native `cpu` library on the same CPU,
so its decode ratio is what the browser itself costs (target: ≥ 0.7). WebGPU on a software
adapter (SwiftShader) is reported, not targeted.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
from pathlib import Path

from kiln.errors import KilnError
from kiln.model_folder import read_json
from kiln.runtime import set_cpu_threads
from kiln.targets import BROWSER_TARGETS

from .browser import bench_browser
from .native import bench_native

WASM_DECODE_TARGET = 0.7
# (report key, chart title, whether more is better)
METRICS = (
    ("load_s", "load (s)", False),
    ("ttft_s", "time to first token (s)", False),
    ("prefill_tokens_per_s", "prefill (tokens/s)", True),
    ("decode_tokens_per_s", "decode (tokens/s)", True),
)


def browser_devices_of(model_dir: Path) -> list[str]:
    built = read_json(model_dir / "kiln-build.json").get("targets", {})
    return [device for device in BROWSER_TARGETS if device in built]


def ratio(browser: float | None, native: float | None) -> float | None:
    return browser / native if browser is not None and native else None


def bench_report(
    model_dir: Path,
    output: Path,
    devices: list[str] | None = None,
    prompt_tokens: int = 32,
    decode_tokens: int = 16,
    runs: int = 1,
    threads: int | None = None,
) -> dict:
    """Benchmark `model_dir` natively (cpu) and in the browser on `devices` (default: every
    browser library it has), the cpu and wasm libraries on the same `threads` (default: the
    machine's physical cores); writes `output`.json and `output`.png."""
    model_dir = Path(model_dir)
    devices = devices or browser_devices_of(model_dir)
    unknown = [device for device in devices if device not in BROWSER_TARGETS]
    if unknown or not devices:
        raise KilnError(
            f"the browser runs {' or '.join(BROWSER_TARGETS)} libraries; this report was asked for "
            f"{', '.join(unknown) or 'none'}",
            model_dir,
        )
    announce("native cpu")
    threads = set_cpu_threads(threads)
    native = bench_native(model_dir, "cpu", prompt_tokens, decode_tokens, runs)
    browsers = {}
    for device in devices:
        announce(f"browser {device}")
        browsers[device] = bench_browser(model_dir, device, prompt_tokens, decode_tokens, runs, threads=threads)
    report = {
        "model_id": native["model_id"],
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "prompt_tokens": prompt_tokens,
        "decode_tokens": decode_tokens,
        "runs": runs,
        "native": without_lines(native),
        "browser": {device: without_lines(b) for device, b in browsers.items()},
        "ratios": {
            device: {key: ratio(b[key], native[key]) for key, _, _ in METRICS} for device, b in browsers.items()
        },
        "wasm_decode_target": WASM_DECODE_TARGET,
    }
    output = Path(output)
    report["json"], report["png"] = str(output.with_suffix(".json")), str(output.with_suffix(".png"))
    report["lines"] = report_lines(report)
    write_atomically(Path(report["json"]), lambda path: path.write_text(json.dumps(without_lines(report), indent=2)))
    write_atomically(Path(report["png"]), lambda path: draw_chart(report, path))
    return report


def announce(what: str) -> None:
    print(f"kiln: benchmarking {what} …", file=sys.stderr, flush=True)


def without_lines(report: dict) -> dict:
    return {k: v for k, v in report.items() if k != "lines"}


def write_atomically(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".kiln-report-") as scratch:
        partial = Path(scratch) / path.name
        write(partial)
        partial.replace(path)


def report_lines(report: dict) -> list[str]:
    native = report["native"]
    lines = [
        f"{report['model_id']}: native cpu ({native['threads']} threads) vs the browser, "
        f"{report['prompt_tokens']} prompt + "
        f"{report['decode_tokens']} decoded tokens, median of {report['runs']} run(s)",
        f"  {'':22}{'native cpu':>12}" + "".join(f"{'browser ' + d:>16}{'÷ native':>10}" for d in report["browser"]),
    ]
    for key, title, _ in METRICS:
        row = f"  {title:22}{number(native[key]):>12}"
        for device, browser in report["browser"].items():
            row += f"{number(browser[key]):>16}{number(report['ratios'][device][key], '×'):>10}"
        lines.append(row)
    wasm_ratio = report["ratios"].get("wasm", {}).get("decode_tokens_per_s")
    wasm_threads = report["browser"].get("wasm", {}).get("threads")
    if wasm_ratio is not None and native["threads"] != wasm_threads:
        lines.append(
            f"  no verdict on wasm decode: native ran {native['threads']} threads, wasm {wasm_threads} (TVM's "
            "thread pool was made earlier in this process, or the page could not start the helpers)"
        )
    elif wasm_ratio is not None:
        verdict = "meets" if wasm_ratio >= WASM_DECODE_TARGET else "misses"
        lines.append(
            f"  wasm decode is {wasm_ratio:.2f}× native on {native['threads']} thread"
            f"{'s' if native['threads'] > 1 else ''}: {verdict} the {WASM_DECODE_TARGET}× target"
        )
    lines.append(f"  wrote {report['json']} and {report['png']}")
    return lines


def number(value: float | None, unit: str = "") -> str:
    if value is None:
        return "–"
    return f"{value:.3g}{unit}"


def draw_chart(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = {"native cpu": report["native"], **{f"browser {d}": b for d, b in report["browser"].items()}}
    colors = ["#4c72b0", "#dd8452", "#55a868", "#c44e52"]  # native and up to three browser libraries
    figure, axes = plt.subplots(1, len(METRICS), figsize=(4 * len(METRICS), 4.2))
    for axis, (key, title, more_is_better) in zip(axes, METRICS):
        names = list(series)
        values = [series[name][key] or 0.0 for name in names]
        bars = axis.bar(range(len(names)), values, color=colors[: len(names)])
        axis.set_xticks(range(len(names)), names, rotation=20)
        axis.set_title(f"{title}\n({'higher' if more_is_better else 'lower'} is better)", fontsize=10)
        positive = [v for v in values if v > 0]
        if positive and min(positive) * 20 < max(positive):
            axis.set_yscale("log")
        for bar, name in zip(bars, names):
            label = number(series[name][key])
            if name != "native cpu":
                label += f"\n{number(report['ratios'][name.split()[-1]][key], '× native')}"
            axis.annotate(
                label,
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
                xytext=(0, 2),
                textcoords="offset points",
            )
        axis.margins(y=0.25)
    figure.suptitle(
        f"{report['model_id']}: native vs browser ({report['prompt_tokens']} prompt + "
        f"{report['decode_tokens']} decoded tokens)"
    )
    figure.tight_layout()
    figure.savefig(path, format="png", dpi=110)
    plt.close(figure)
