"""The `kiln` command line: parses arguments and calls into the library; no logic lives here."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kiln.errors import KilnError


def comma_list(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def add_compile(sub) -> None:
    p = sub.add_parser("compile", help="build a model for one or more targets")
    p.add_argument("source", help="Hugging Face folder, hub id (org/name) or .gguf file")
    p.add_argument("--quantization", "-q", required=True, help="q0f32, q0f16, q4f32_1, q4f16_1, q8f32_1, q8f16_1")
    p.add_argument("--target", "-t", type=comma_list, default=["cpu"], help="cpu, cuda, webgpu, wasm (comma-separated)")
    p.add_argument("--output", "-o", type=Path, default=Path("dist"), help="output folder (default dist/)")
    p.add_argument("--model-id", help="folder name under the output (default <source name>-<quantization>)")
    p.add_argument("--context-window-size", type=int)
    p.add_argument("--prefill-chunk-size", type=int)
    p.set_defaults(run=run_compile)


def run_compile(args) -> int:
    from kiln.compile.pipeline import BuildRequest, build

    result = build(BuildRequest(
        source=args.source, quantization=args.quantization, targets=args.target, output=args.output,
        model_id=args.model_id, context_window_size=args.context_window_size,
        prefill_chunk_size=args.prefill_chunk_size,
    ))
    print(result.model_dir)
    for target, path in result.libraries.items():
        print(f"  {target}: {path}")
    return 0


def add_doctor(sub) -> None:
    p = sub.add_parser("doctor", help="check the toolchain (TVM, emscripten, node, Chromium, web runtime)")
    p.add_argument("--build-runtime", action="store_true", help="build the TVM web runtime if it is missing")
    p.set_defaults(run=run_doctor)


def run_doctor(args) -> int:
    from kiln.compile import wasm_toolchain

    if args.build_runtime:
        wasm_toolchain.build_web_runtime()
    statuses = wasm_toolchain.toolchain_status()
    for s in statuses:
        print(f"{'ok ' if s.ok else 'MISSING'} {s.name}: {s.detail}" + ("" if s.ok else f"\n        fix: {s.fix}"))
    return 0 if all(s.ok for s in statuses) else 1


def add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks that print numbers")
    bench = p.add_subparsers(dest="bench", required=True)
    c = bench.add_parser("compile", help="seconds per build stage, and q0f32 vs q4f32_1 perplexity")
    c.add_argument("source")
    c.add_argument("--quantization", "-q", default="q4f32_1")
    c.add_argument("--target", "-t", type=comma_list, default=["webgpu"])
    c.add_argument("--text", type=Path, help="perplexity text (default: the bundled English sample)")
    c.add_argument("--output", "-o", type=Path, help="where to build (default: a temporary folder)")
    c.add_argument("--json", action="store_true")
    c.set_defaults(run=run_bench_compile)


def run_bench_compile(args) -> int:
    from kiln.compile.bench import bench_compile

    report = bench_compile(args.source, args.quantization, args.target, args.text, args.output)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for line in report["lines"]:
            print(line)
    return 0


COMMANDS = (add_compile, add_doctor, add_bench)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kiln", description="Compile LLMs with TVM for the browser, native and mobile.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(sub)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except KilnError as e:
        if args.debug:
            raise
        print(f"kiln: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("kiln: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
