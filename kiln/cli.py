"""The `kiln` command line: parses arguments and calls into the library; no logic lives here."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from kiln.compile.quantization import QUANTIZATIONS
from kiln.errors import KilnError
from kiln.mobile.package import PLATFORMS
from kiln.models import MODELS
from kiln.targets import BROWSER_TARGETS, CPU_TUNINGS, NATIVE_TARGETS, TARGETS


def comma_list(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def one_of(names) -> str:
    """'a, b or c'."""
    *rest, last = names
    return f"{', '.join(rest)} or {last}" if rest else last


def described(registry: dict) -> str:
    """Each entry of a registry with what it is: 'name: describe; …'."""
    return "; ".join(f"{name}: {entry.describe}" for name, entry in registry.items())


def add_compile(sub) -> None:
    p = sub.add_parser("compile", help="build a model for one or more targets")
    p.add_argument(
        "source",
        help=f"Hugging Face folder, hub id (org/name) or .gguf file of a model whose model_type is {one_of(MODELS)}",
    )
    p.add_argument("--quantization", "-q", required=True, help=described(QUANTIZATIONS))
    p.add_argument("--target", "-t", type=comma_list, default=["cpu"], help=f"comma-separated: {described(TARGETS)}")
    p.add_argument("--output", "-o", type=Path, default=Path("dist"), help="output folder (default dist/)")
    p.add_argument("--model-id", help="folder name under the output (default <source name>-<quantization>)")
    p.add_argument("--context-window-size", type=int, help="an embedding model's: its longest input")
    p.add_argument("--prefill-chunk-size", type=int)
    p.add_argument(
        "--matryoshka-dimensions",
        type=comma_list,
        default=[],
        metavar="N,N",
        help="an embedding model's shorter lengths it was trained to give (Matryoshka): requests may ask for them "
        "(`dimensions`)",
    )
    p.add_argument(
        "--cpu-tuning",
        choices=CPU_TUNINGS,
        default="portable",
        help="the cpu library's instruction set: portable (default; x86-64-v3 — AVX2, every x86-64 CPU "
        "since 2013–2015 — or ARMv8-A), legacy (x86-64-v2: any x86-64 since 2009, 2.5x slower "
        "decode) or host (this machine's CPU; may not run elsewhere)",
    )
    p.add_argument("--revision", help="of a hub id: the commit, branch or tag to download (default main)")
    p.add_argument(
        "--jobs",
        "-j",
        type=int,
        help="targets compiled side by side, one process each (default: one per CPU core, at most one per "
        "target; 1: one after another in this process)",
    )
    p.add_argument(
        "--library-cache",
        type=Path,
        metavar="DIR",
        help="keep compiled libraries in DIR and reuse them: a target whose compile would be one made before "
        "(the same family, config, quantization and target, by the same Kiln, TVM and toolchain: a fine-tune of "
        "a model built before) is copied instead of compiled",
    )
    p.add_argument(
        "--allow-pickle",
        action="store_true",
        help="read pytorch_model*.bin (a pickle) even with a torch older than 2.10, whose loader can run "
        "code from a crafted file (CVE-2025-32434, CVE-2026-24747): only for files you trust",
    )
    p.set_defaults(run=run_compile)


def dimension_list(values: list[str]) -> list[int]:
    if not all(value.isdigit() for value in values):
        raise KilnError(f"--matryoshka-dimensions should be whole numbers, got {','.join(values)}")
    return [int(value) for value in values]


def run_compile(args) -> int:
    from kiln.compile.pipeline import BuildRequest, build

    result = build(
        BuildRequest(
            source=args.source,
            quantization=args.quantization,
            targets=args.target,
            output=args.output,
            model_id=args.model_id,
            context_window_size=args.context_window_size,
            prefill_chunk_size=args.prefill_chunk_size,
            cpu_tuning=args.cpu_tuning,
            revision=args.revision,
            allow_pickle=args.allow_pickle,
            jobs=args.jobs,
            library_cache=args.library_cache,
            matryoshka_dimensions=tuple(dimension_list(args.matryoshka_dimensions)),
        )
    )
    print(result.model_dir)
    for target, path in result.libraries.items():
        print(f"  {target}: {path}")
    return 0


def add_doctor(sub) -> None:
    p = sub.add_parser(
        "doctor",
        help="check the toolchain (TVM, emscripten, node, Chromium, web runtime, LLVM tools, mobile runtime, PoCL)",
    )
    p.add_argument("--build-runtime", action="store_true", help="build the TVM web runtime if it is missing")
    p.add_argument(
        "--build-mobile-runtime",
        action="store_true",
        help="build the mobile runtime (libkiln) for every platform this machine can, if it is missing",
    )
    p.set_defaults(run=run_doctor)


def run_doctor(args) -> int:
    from kiln.compile.toolchain import mobile_runtime, opencl_check, system_lib, wasm_toolchain

    if args.build_runtime:
        wasm_toolchain.build_web_runtimes()
    if args.build_mobile_runtime:
        mobile_runtime.build_mobile_runtimes()
    statuses = [
        *wasm_toolchain.toolchain_status(),
        *system_lib.toolchain_status(),
        *mobile_runtime.toolchain_status(),
        opencl_check.pocl_status(),
    ]
    for s in statuses:
        state = "ok " if s.ok else "MISSING (optional)" if s.optional else "MISSING"
        print(f"{state} {s.name}: {s.detail}" + ("" if s.ok else f"\n        fix: {s.fix}"))
    return doctor_exit_code(statuses)


def doctor_exit_code(statuses) -> int:
    """0 when every tool a build needs is there; an optional one (PoCL's kernel check) may be missing."""
    return 0 if all(s.ok or s.optional for s in statuses) else 1


def add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks that print numbers")
    bench = p.add_subparsers(dest="bench", required=True)
    c = bench.add_parser(
        "compile",
        help="seconds per build stage, and the perplexity of q0f32, the quantization "
        "and, for a .gguf source, gguf_f32 (its own blocks)",
    )
    c.add_argument("source")
    c.add_argument(
        "--quantization",
        "-q",
        default="q4f32_1",
        help=f"the quantization to time and compare: {one_of(QUANTIZATIONS)} (default q4f32_1)",
    )
    c.add_argument(
        "--target",
        "-t",
        type=comma_list,
        default=["webgpu"],
        help=f"the targets to build, comma-separated: {one_of(TARGETS)} (default webgpu)",
    )
    c.add_argument("--text", type=Path, help="perplexity text (default: the bundled English sample)")
    c.add_argument("--output", "-o", type=Path, help="where to build (default: a temporary folder)")
    c.add_argument("--json", action="store_true")
    c.set_defaults(run=run_bench_compile)
    add_bench_native(bench)
    add_bench_browser(bench)
    add_bench_report(bench)
    add_bench_embeddings(bench)


def run_bench_compile(args) -> int:
    from kiln.bench.compile import bench_compile

    report = bench_compile(args.source, args.quantization, args.target, args.text, args.output)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for line in report["lines"]:
            print(line)
    return 0


def add_sampling_options(p) -> None:
    p.add_argument("--target", "-t", choices=NATIVE_TARGETS, default="cpu", help="which library to run (default cpu)")
    add_threads_option(p)
    add_speculative_option(p)
    add_generation_options(p)


def add_speculative_option(p) -> None:
    from kiln.speculative import Speculation

    p.add_argument(
        "--speculative",
        type=Speculation.parse,
        metavar="METHOD",
        help="decode speculatively: prompt-lookup (propose what followed the reply's last tokens earlier on) "
        "or draft:MODEL_DIR (a small model with the same tokenizer proposes); off (default): one token a step",
    )


def add_threads_option(p) -> None:
    p.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="threads of the cpu library (default: this machine's physical cores, or TVM_NUM_THREADS)",
    )


def add_generation_options(p) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 (default) = off")
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--seed", type=int, help="makes sampling reproducible")
    p.add_argument("--stop", nargs="+", default=[], metavar="STR", help="end the text before any of these")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")


def generation_config(args, logits_top_k: int = 0):
    from kiln.engine import GenerationConfig

    return GenerationConfig(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed,
        stop=args.stop,
        logits_top_k=logits_top_k,
        ignore_eos=args.ignore_eos,
    )


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="complete a prompt with a compiled model on this machine")
    p.add_argument("model_dir", type=Path, help="a compiled model folder (dist/<model-id>)")
    p.add_argument("--prompt", "-p", required=True, help="the text to complete, as is (see --chat)")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message in the model's chat template")
    p.add_argument("--json", action="store_true", help="print prompt and output token ids, text and usage as JSON")
    p.add_argument("--logits", type=int, default=0, metavar="K", help="with --json: the top-K logits of every step")
    p.add_argument(
        "--device",
        choices=("native", "browser"),
        default="native",
        help="native (default): the TVM runtime here; browser: the browser engine in headless Chromium",
    )
    p.add_argument(
        "--target",
        "-t",
        choices=("auto", *NATIVE_TARGETS, *BROWSER_TARGETS),
        help=f"the library to run: {one_of(NATIVE_TARGETS)} natively (default cpu); "
        f"{one_of(('auto', *BROWSER_TARGETS))} in the browser (default auto)",
    )
    add_threads_option(p)
    add_speculative_option(p)
    add_generation_options(p)
    constrained = p.add_mutually_exclusive_group()
    constrained.add_argument(
        "--json-schema",
        type=Path,
        metavar="FILE",
        help="reply with JSON that fits this JSON Schema (needs kiln-llm[structured])",
    )
    constrained.add_argument(
        "--grammar",
        type=Path,
        metavar="FILE",
        help="reply in the language of this EBNF grammar (XGrammar's dialect, rule root)",
    )
    p.set_defaults(run=run_generate)


def response_format(args):
    """The --json-schema or --grammar file as a ResponseFormat (None without either)."""
    from kiln.structured import ResponseFormat, ResponseFormatError

    path = args.json_schema or args.grammar
    if path is None:
        return None
    try:
        text = path.read_text(encoding="utf-8")
        return ResponseFormat.from_schema(text) if args.json_schema else ResponseFormat.from_grammar(text)
    except (OSError, UnicodeDecodeError) as e:
        raise KilnError(f"cannot read the file: {e.strerror if isinstance(e, OSError) else e}", path) from None
    except ResponseFormatError as e:
        raise KilnError(e.problem, path) from None


def run_generate(args) -> int:
    from kiln.browser.model import engine_on

    with engine_on(args.model_dir, args.device, args.target, args.speculative) as (engine, device):
        return generate(engine, args, device)


def generate(engine, args, device: str) -> int:
    from kiln.structured import ResponseFormatError

    config = generation_config(args, args.logits)
    config.response_format = response_format(args)
    try:
        return print_generation(engine, args, device, config)
    except ResponseFormatError as e:  # the schema or grammar does not compile
        raise KilnError(e.problem, args.json_schema or args.grammar) from None


def print_generation(engine, args, device: str, config) -> int:
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    if args.json:
        result = engine.generate_chat(prompt, config) if args.chat else engine.generate(prompt, config)
        print(json.dumps({"model": engine.model_id, "device": device, **result.to_json()}))
        return 0
    for delta in engine.stream_chat(prompt, config) if args.chat else engine.stream(prompt, config):
        print(delta.text, end="", flush=True)
    print()
    return 0


def add_chat(sub) -> None:
    p = sub.add_parser("chat", help="chat with a compiled model in the terminal")
    p.add_argument("model_dir", type=Path, help="a compiled model folder (dist/<model-id>)")
    add_sampling_options(p)
    p.set_defaults(run=run_chat)


def run_chat(args) -> int:
    from kiln.chat import chat_in_terminal
    from kiln.engine import Engine

    chat_in_terminal(Engine(args.model_dir, args.target, speculation=args.speculative), generation_config(args))
    return 0


def print_report(report: dict, as_json: bool) -> None:
    """A benchmark report: its numbers as JSON, or its lines for people."""
    if as_json:
        print(json.dumps({k: v for k, v in report.items() if k != "lines"}, indent=2))
    else:
        for line in report["lines"]:
            print(line)


def add_run_options(p, prompt_tokens: int, decode_tokens: int, runs: int) -> None:
    """What a speed benchmark measures, and how it prints."""
    p.add_argument("--prompt-tokens", type=int, default=prompt_tokens)
    p.add_argument("--decode-tokens", type=int, default=decode_tokens)
    p.add_argument("--runs", type=int, default=runs, help="measured runs, after one warm-up run")
    p.add_argument("--json", action="store_true")


def add_bench_native(bench) -> None:
    n = bench.add_parser("native", help="load time, time to first token, prefill and decode tokens/s, memory")
    n.add_argument("model_dir", type=Path, help="a compiled model folder (dist/<model-id>)")
    n.add_argument("--target", "-t", choices=NATIVE_TARGETS, default="cpu", help="the library to run (default cpu)")
    n.add_argument(
        "--json-schema",
        type=Path,
        metavar="FILE",
        help="decode held to this JSON Schema (a run ends early when the JSON is complete); "
        "adds the token mask's cost per token",
    )
    n.set_defaults(grammar=None)
    add_threads_option(n)
    add_speculative_option(n)
    add_run_options(n, prompt_tokens=128, decode_tokens=128, runs=3)
    n.set_defaults(run=run_bench_native)


def run_bench_native(args) -> int:
    from kiln.bench.native import bench_native

    if args.speculative:  # greedy replies to the written-down tasks, plain and speculative
        from kiln.bench.speculative import bench_speculative, native_replies
        from kiln.engine import Engine
        from kiln.runtime import set_cpu_threads

        engine = Engine(args.model_dir, args.target, speculation=args.speculative)
        replies = native_replies(engine, args.decode_tokens)
        where = f"{args.target} ({set_cpu_threads()} threads)" if args.target == "cpu" else args.target
        report = bench_speculative(replies, engine.model_id, where, args.speculative.method, args.runs)
        print_report(report, args.json)
        return 0
    report = bench_native(
        args.model_dir,
        args.target,
        args.prompt_tokens,
        args.decode_tokens,
        args.runs,
        response_format=response_format(args),
    )
    print_report(report, args.json)
    return 0


def add_bench_browser(bench) -> None:
    b = bench.add_parser(
        "browser", help="cold/warm load, time to first token, prefill and decode tokens/s in headless Chromium"
    )
    b.add_argument("model_dir", type=Path, help=f"a compiled model folder with a {one_of(BROWSER_TARGETS)} library")
    b.add_argument(
        "--target",
        "-t",
        choices=("auto", *BROWSER_TARGETS),
        default="auto",
        help="the library to run; auto: WebGPU when Chromium has a hardware adapter, else wasm",
    )
    b.add_argument(
        "--threads",
        type=int,
        metavar="N",
        dest="wasm_threads",
        help="threads of the CPU wasm library (default: the engine's choice, this machine's cores up to 4)",
    )
    b.add_argument(
        "--speculative",
        choices=("prompt-lookup",),
        help="greedy replies to three written-down tasks, plain and with prompt lookup (--decode-tokens each)",
    )
    add_run_options(b, prompt_tokens=32, decode_tokens=16, runs=1)
    b.set_defaults(run=run_bench_browser)


def run_bench_browser(args) -> int:
    from kiln.bench.browser import bench_browser, bench_browser_speculative

    if args.speculative:
        report = bench_browser_speculative(
            args.model_dir, args.target, args.decode_tokens, args.runs, args.wasm_threads
        )
        print_report(report, args.json)
        return 0
    report = bench_browser(
        args.model_dir, args.target, args.prompt_tokens, args.decode_tokens, args.runs, threads=args.wasm_threads
    )
    print_report(report, args.json)
    return 0


def add_parity(sub) -> None:
    p = sub.add_parser("parity", help="check that the browser engine generates what the native build generates")
    p.add_argument(
        "model_dir", type=Path, help=f"a compiled model folder with a native and a {one_of(BROWSER_TARGETS)} library"
    )
    p.add_argument("--prompts", type=Path, help="a text file with one prompt per line (default: 4 built-in prompts)")
    p.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt (default 32)")
    p.add_argument(
        "--forced-positions", type=int, help="compare forced-decoding argmax at the last N positions (default: all)"
    )
    p.add_argument(
        "--target",
        "-t",
        choices=("auto", *BROWSER_TARGETS),
        default="auto",
        help="the browser library (default auto: WebGPU when Chromium has it, else wasm)",
    )
    p.add_argument("--native-target", choices=NATIVE_TARGETS, default="cpu", help="the native library (default cpu)")
    p.add_argument(
        "--browser-model-dir",
        type=Path,
        help="the folder the browser loads (default MODEL_DIR), e.g. the copy deployed to a site",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run_parity)


def run_parity(args) -> int:
    from kiln.browser.parity import DEFAULT_PROMPTS, read_prompts, run_parity as parity

    prompts = read_prompts(args.prompts) if args.prompts else list(DEFAULT_PROMPTS)
    report = parity(
        args.model_dir,
        prompts,
        args.max_tokens,
        args.forced_positions,
        args.target,
        args.native_target,
        browser_model_dir=args.browser_model_dir,
    )
    print_report(report, args.json)
    return 0 if report["passed"] else 1


def add_bench_embeddings(bench) -> None:
    e = bench.add_parser(
        "embeddings",
        help="texts/s of an embedding model natively, beside sentence-transformers and in Chromium on request",
    )
    e.add_argument("model_dir", type=Path, help="a compiled embedding model folder (dist/<model-id>)")
    e.add_argument("--target", "-t", choices=NATIVE_TARGETS, default="cpu", help="the native library (default cpu)")
    e.add_argument("--texts", type=int, default=64, help="sentences of the English sample to embed (default 64)")
    e.add_argument(
        "--reference",
        type=Path,
        metavar="CHECKPOINT",
        help="a sentence-transformers checkpoint folder (the one compiled) to time beside, on the same threads",
    )
    e.add_argument(
        "--browser",
        type=comma_list,
        default=[],
        metavar="LIBRARIES",
        help=f"browser libraries to time in headless Chromium, comma-separated: {one_of(BROWSER_TARGETS)}",
    )
    e.add_argument(
        "--transformers-js",
        type=comma_list,
        default=[],
        metavar="DEVICES",
        help="time transformers.js (npm, fetched once) on an ONNX export of --reference in the same Chromium, "
        "comma-separated: wasm or webgpu",
    )
    add_threads_option(e)
    e.add_argument("--runs", type=int, default=3, help="measured runs, after one warm-up run")
    e.add_argument("--json", action="store_true")
    e.set_defaults(run=run_bench_embeddings)


def run_bench_embeddings(args) -> int:
    from kiln.bench.embeddings import bench_embeddings

    for option, asked, known in (
        ("--browser", args.browser, BROWSER_TARGETS),
        ("--transformers-js", args.transformers_js, ("wasm", "webgpu")),
    ):
        unknown = sorted(set(asked) - set(known))
        if unknown:
            raise KilnError(f"{option} {','.join(unknown)}: choose from {one_of(known)}")
    report = bench_embeddings(
        args.model_dir, args.target, args.texts, args.runs, args.reference, args.browser, args.transformers_js
    )
    print_report(report, args.json)
    return 0


def add_bench_report(bench) -> None:
    r = bench.add_parser(
        "report",
        help="bench native and bench browser on one model, side by side: "
        "a JSON file and a PNG chart with browser ÷ native ratios",
    )
    r.add_argument(
        "model_dir",
        type=Path,
        help=f"a compiled model folder with a cpu library and browser ones ({', '.join(BROWSER_TARGETS)})",
    )
    r.add_argument(
        "--target",
        "-t",
        type=comma_list,
        help=f"browser libraries to run, comma-separated: {', '.join(BROWSER_TARGETS)} (default: all built)",
    )
    r.add_argument(
        "--output",
        "-o",
        type=Path,
        help="where to write OUTPUT.json and OUTPUT.png (default: bench-report-<model-id> here)",
    )
    r.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="threads of the native cpu library and of the browser's wasm library alike "
        "(default: this machine's physical cores, or TVM_NUM_THREADS)",
    )
    add_run_options(r, prompt_tokens=32, decode_tokens=16, runs=1)
    r.set_defaults(run=run_bench_report)


def run_bench_report(args) -> int:
    from kiln.bench.report import bench_report

    output = args.output or Path(f"bench-report-{args.model_dir.resolve().name}")
    report = bench_report(
        args.model_dir, output, args.target, args.prompt_tokens, args.decode_tokens, args.runs, threads=args.threads
    )
    print_report(report, args.json)
    return 0


def add_serve(sub) -> None:
    p = sub.add_parser("serve", help="serve the chat harness, the models and an OpenAI-compatible API")
    p.add_argument("--dist", type=Path, default=Path("dist"), help="folder of compiled models (default dist/)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed at start)")
    p.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="also accept requests whose Host is NAME (e.g. behind a proxy; repeatable); others "
        "than the bound address are refused against DNS rebinding",
    )
    p.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="let pages of ORIGIN (e.g. https://app.example, or *) call /v1 and read the models and the "
        "app config (repeatable; pages on localhost, 127.0.0.1 and [::1] may read the models without it)",
    )
    key = p.add_mutually_exclusive_group()
    key.add_argument(
        "--api-key",
        default=os.environ.get("KILN_API_KEY") or None,
        metavar="KEY",
        help="require `Authorization: Bearer KEY` on /v1 (default: $KILN_API_KEY, which `ps` does not show); "
        "needed to serve a --host other than loopback",
    )
    key.add_argument(
        "--no-api-key",
        action="store_true",
        help="serve /v1 without a key even on a --host other than loopback (anyone who reaches it may use it)",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=64,
        metavar="N",
        help="let at most N requests wait for a model while it generates; more get 503 with Retry-After (default 64)",
    )
    p.add_argument(
        "--idle-unload",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="release a model's engine unused this long (default 600; 0 never)",
    )
    p.add_argument(
        "--max-loaded-models",
        type=int,
        default=2,
        metavar="N",
        help="keep at most N engines loaded, releasing the least recently used (default 2; 0 no limit)",
    )
    p.add_argument(
        "--no-isolation",
        action="store_true",
        help="do not send the COOP/COEP headers that isolate the harness (its CPU wasm library then "
        "runs on one thread); for pages that embed resources from other origins without CORS or CORP",
    )
    add_threads_option(p)
    add_speculative_option(p)
    p.set_defaults(run=run_serve)


def run_serve(args) -> int:
    from kiln.server import ServerConfig, serve

    config = ServerConfig(
        dist=args.dist,
        allowed_hosts=tuple(args.allow_host),
        cors_origins=tuple(args.cors_origin),
        idle_unload_s=args.idle_unload,
        max_loaded_models=args.max_loaded_models,
        cross_origin_isolation=not args.no_isolation,
        api_key=None if args.no_api_key else args.api_key,
        max_queue=args.max_queue,
        speculation=args.speculative,
    )
    serve(config, args.host, args.port, without_key=args.no_api_key)
    return 0


def add_package(sub) -> None:
    p = sub.add_parser("package", help=f"app bundles (static library, weights, app config) for {one_of(PLATFORMS)}")
    p.add_argument(
        "--config",
        "-c",
        type=Path,
        default=Path("kiln-package.json"),
        help="the package config (default kiln-package.json)",
    )
    p.add_argument(
        "--output", "-o", type=Path, default=Path("dist"), help="where bundle-<platform>/ folders go (default dist/)"
    )
    p.set_defaults(run=run_package)


def run_package(args) -> int:
    from kiln.mobile.package import package

    for platform, bundle in package(args.config, args.output).items():
        print(f"{platform}: {bundle}")
    return 0


def add_embed(sub) -> None:
    p = sub.add_parser("embed", help="embed texts with a compiled embedding model on this machine (JSON out)")
    p.add_argument("model_dir", type=Path, help="a compiled embedding model folder (dist/<model-id>)")
    p.add_argument("texts", nargs="+", metavar="TEXT")
    p.add_argument("--target", "-t", choices=NATIVE_TARGETS, default="cpu", help="which library to run (default cpu)")
    p.add_argument("--dimensions", type=int, help="a shorter length the model was trained to give (Matryoshka)")
    p.add_argument("--encoding-format", choices=("float", "base64"), default="float")
    add_threads_option(p)
    p.set_defaults(run=run_embed)


def run_embed(args) -> int:
    """OpenAI's embeddings response for the texts, as JSON on stdout."""
    from kiln.embeddings import EmbeddingEngine

    engine = EmbeddingEngine(args.model_dir, args.target)
    request = {"input": args.texts, "dimensions": args.dimensions, "encoding_format": args.encoding_format}
    print(json.dumps(engine.create(request)))
    return 0


COMMANDS = (
    add_compile,
    add_doctor,
    add_bench,
    add_generate,
    add_chat,
    add_embed,
    add_parity,
    add_serve,
    add_package,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kiln", description="Compile LLMs with TVM for the browser, native and mobile."
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(sub)
    args = parser.parse_args(argv)
    try:
        if getattr(args, "threads", None) is not None:
            from kiln.runtime import set_cpu_threads

            set_cpu_threads(args.threads)
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
