"""The browser engine's parts that need no browser, run in Node: SHA-256 checks of a model's files
(served by `kiln serve`), token choice, chat prompts from conv_template (token ids compared with
`transformers`' jinja chat template), streamed text and stop strings."""

from __future__ import annotations

import hashlib
import json
import shutil
import urllib.request
from pathlib import Path

import pytest
from tokenizers import Tokenizer, processors
from transformers import AutoTokenizer

from helpers.tiny_llama import LLAMA_2_TOKENS, RAW_TEXTS, write_tokenizer
from helpers.simulated_reply import REPLIES, simulated_reply
from helpers.web import run_node_module, served

from kiln.compile.chat_config.conv_template import raw_completion_template
from kiln.speculative import PassCosts

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Hello!"}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke about GPUs 🎮 — ünïcödé, 12345."},
    ],
    [{"role": "system", "content": ""}, {"role": "user", "content": "  spaced  \n\nlines\n"}],
    [{"role": "user", "content": [{"type": "text", "text": "Two "}, {"type": "text", "text": "parts"}]}],
]


def test_sha256_hex_matches_hashlib():
    payloads = [b"", b"\x00\x0f", bytes(range(256)) * 4099]
    result = run_node_module(
        """
        import { sha256Hex } from "./src/loader.js";
        const bytes = (hex) => Uint8Array.from(hex.match(/../g) ?? [], (pair) => parseInt(pair, 16));
        console.log(JSON.stringify(await Promise.all(input.map((hex) => sha256Hex(bytes(hex))))));
    """,
        [p.hex() for p in payloads],
    )
    assert result == [hashlib.sha256(p).hexdigest() for p in payloads]


LOAD_MODEL_FILES_JS = """
    import { ModelFiles } from "./src/loader.js";
    const outcomes = {};
    for (const [name, record] of Object.entries(input)) {
      try {
        const files = await ModelFiles.open(record, () => {});
        const library = await files.bytes(record.model_lib);
        await files.fetchShards();
        let shardBytes = 0;
        for await (const { bytes } of files.storedShards()) shardBytes += bytes.length;
        outcomes[name] = { buildId: files.buildId, libraryBytes: library.length, shardBytes };
      } catch (error) {
        outcomes[name] = { code: error.code, message: error.message };
      }
    }
    console.log(JSON.stringify(outcomes));
"""


def test_model_files_are_checked_against_the_build_record_it_pins(tiny_build, tmp_path):
    """The loader in Node (no Cache API: files kept in memory) against `kiln serve`."""
    model_dir = tiny_build("q4f32_1", ["cpu", "webgpu", "wasm"])
    dist = tmp_path / "dist"
    shutil.copytree(model_dir, dist / model_dir.name)
    legacy = dist / "legacy"
    shutil.copytree(model_dir, legacy)
    build = json.loads((legacy / "kiln-build.json").read_text())
    del build["files"]
    (legacy / "kiln-build.json").write_text(json.dumps(build))
    record_digest = hashlib.sha256((model_dir / "kiln-build.json").read_bytes()).hexdigest()
    with served(dist) as url:
        with urllib.request.urlopen(f"{url}api/app-config.json") as response:
            records = {r["model_id"]: r for r in json.load(response)["model_list"]}
        record = records[model_dir.name]
        outcomes = run_node_module(
            LOAD_MODEL_FILES_JS,
            {
                "unpinned": record,
                "pinned": {**record, "kiln_build_sha256": record_digest.upper()},
                "pinned to another build": {**record, "kiln_build_sha256": "0" * 64},
                "library outside the folder": {**record, "model_lib": f"{url}elsewhere/model.wasm"},
                "record without digests": records["legacy"],
            },
        )
    shards = json.loads((model_dir / "tensor-cache.json").read_text())["records"]
    shard_bytes = sum(shard["nbytes"] for shard in shards)
    library_bytes = (model_dir / "libs" / record["model_lib"].rsplit("/", 1)[1]).stat().st_size
    loaded = {"buildId": record_digest, "libraryBytes": library_bytes, "shardBytes": shard_bytes}
    assert outcomes["unpinned"] == outcomes["pinned"] == loaded
    assert outcomes["pinned to another build"] == {
        "code": "integrity",
        "message": f"kiln-build.json has SHA-256 {record_digest}, but the app config pins "
        f"{'0' * 64}: the model on the server is not the build this page expects.",
    }
    assert outcomes["library outside the folder"]["code"] == "integrity"
    assert outcomes["library outside the folder"]["message"].startswith(
        f"{url}elsewhere/model.wasm has no SHA-256 in kiln-build.json"
    )
    assert outcomes["record without digests"]["code"] == "integrity"
    assert "lists no file digests" in outcomes["record without digests"]["message"]


def test_token_choice():
    result = run_node_module(
        """
        import { Sampler, argmax, topK, seededRandom } from "./src/sampler.js";
        const logits = Float32Array.from([1, 5, 3, 5, -2, 4]);
        const off = { topK: 0, repetitionPenalty: 1, presencePenalty: 0, frequencyPenalty: 0 };
        const counts = (settings, seed) => {
          const sampler = new Sampler({ ...off, ...settings, seed }, []);
          const seen = {};
          for (let i = 0; i < 2000; ++i) {
            const token = sampler.sample(logits);
            seen[token] = (seen[token] ?? 0) + 1;
          }
          return seen;
        };
        const sequence = (seed) => { const r = seededRandom(seed); return [r(), r(), r()]; };
        console.log(JSON.stringify({
          argmax: argmax(logits),
          top3: topK(logits, 3),
          greedy: new Sampler({ ...off, temperature: 0, topP: 1, seed: 1 }, []).sample(logits),
          nucleus: counts({ temperature: 1, topP: 0.5 }, 3),
          hot: counts({ temperature: 1, topP: 1 }, 3),
          top2: counts({ temperature: 1, topP: 1, topK: 2 }, 3),
          sameSeed: JSON.stringify(sequence(42)) === JSON.stringify(sequence(42)),
          otherSeed: JSON.stringify(sequence(42)) !== JSON.stringify(sequence(43)),
        }));
    """,
        None,
    )
    assert result["argmax"] == 1  # the first of two equal maxima, as numpy's argmax
    assert result["top3"] == {"ids": [1, 3, 5], "logits": [5, 5, 4]}
    assert result["greedy"] == 1
    # p(1) = p(3) ≈ 0.39 each: together they pass top_p 0.5, so nothing else is ever drawn.
    assert set(result["nucleus"]) == {"1", "3"}
    assert {"0", "1", "2", "3", "5"} <= set(result["hot"])
    assert abs(result["hot"]["5"] / 2000 - 0.144) < 0.03  # e^4 / Σ e^x
    assert set(result["top2"]) == {"1", "3"}  # the two 5s; the 4 is third
    assert result["sameSeed"] and result["otherSeed"]


def reference_ids(model_dir: Path, messages: list[dict]) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def browser_prompt_ids(model_dir: Path, conversations: list[list[dict]]) -> list[list[int]]:
    chat_config = json.loads((model_dir / "mlc-chat-config.json").read_text())
    return run_node_module(
        """
        import { createRequire } from "node:module";
        import { encodePrompt, formatChat } from "./src/chat-format.js";
        // The tokenizers' UMD bundle expects CommonJS globals when it runs under Node.
        globalThis.require = createRequire(import.meta.url);
        globalThis.__filename = "node_modules/@mlc-ai/web-tokenizers/lib/index.js";
        await import("./node_modules/@mlc-ai/web-tokenizers/lib/index.js");
        const json = new Uint8Array(readFileSync(input.tokenizer)).buffer;
        const tokenizer = await globalThis.tokenizers.Tokenizer.fromJSON(json);
        const encode = (text) => Array.from(tokenizer.encode(text));
        const ids = input.conversations.map((messages) =>
          encodePrompt(input.conv, formatChat(input.conv, messages), encode));
        console.log(JSON.stringify(ids));
    """,
        {
            "tokenizer": str(model_dir / "tokenizer.json"),
            "conv": chat_config["conv_template"],
            "conversations": conversations,
        },
    )


def plain(messages: list[dict]) -> list[dict]:
    """The messages with list contents joined, as transformers' templates expect strings."""
    return [
        {**m, "content": m["content"] if isinstance(m["content"], str) else "".join(p["text"] for p in m["content"])}
        for m in messages
    ]


@pytest.mark.parametrize("model", ["tiny", pytest.param("smollm2", marks=pytest.mark.slow)])
def test_chat_prompt_ids_match_the_jinja_template(model, tiny_build, request):
    if model == "tiny":
        model_dir = tiny_build("q4f32_1", ["cpu", "webgpu", "wasm"])
    else:
        model_dir = request.getfixturevalue("smollm2_build")("q4f32_1", ["webgpu", "wasm"])
    ours = browser_prompt_ids(model_dir, CONVERSATIONS)
    for messages, ids in zip(CONVERSATIONS, ours):
        assert ids == reference_ids(model_dir, plain(messages)), messages


def test_bad_messages_are_rejected():
    result = run_node_module(
        """
        import { formatChat } from "./src/chat-format.js";
        const conv = { system_template: "{system_message}", system_message: "", roles: { user: "U", assistant: "A" },
                       seps: ["\\n"], role_content_sep: ":", role_empty_sep: ":" };
        const errors = input.map((messages) => {
          try { formatChat(conv, messages); return null; } catch (error) { return [error.code, error.message]; }
        });
        console.log(JSON.stringify(errors));
    """,
        [
            [],
            [{"role": "wizard", "content": "x"}],
            [{"role": "user", "content": 3}],
            [{"role": "user", "content": "a"}, {"role": "system", "content": "late"}],
        ],
    )
    assert [code for code, _ in result] == ["bad-request"] * 4
    assert "role" in result[1][1] and "content" in result[2][1] and "first" in result[3][1]


def test_conv_template_fields_are_honoured_as_webllm_honours_them():
    result = run_node_module(
        """
        import { encodePrompt, formatChat, piecesFrom } from "./src/chat-format.js";
        const base = { system_template: "<S>{system_message}</S>", system_message: "default",
                       roles: { user: "U", assistant: "A" }, seps: ["|", "#"] };
        const sep = { ...base, role_content_sep: "=" };
        const chat = [{ role: "user", content: "u1" }, { role: "assistant", content: "a1" },
                      { role: "user", content: "$& $' u2" }];
        const system = (content) => [{ role: "system", content }, { role: "user", content: "u" }];
        console.log(JSON.stringify({
          defaultSeps: formatChat(base, chat),
          seps: formatChat({ ...sep, role_empty_sep: "" }, chat),
          noRoleAfterSystem: formatChat({ ...sep, add_role_after_system_message: false }, system("s")),
          emptySystemShown: formatChat(sep, system("")),
          emptySystemHidden: formatChat({ ...sep, render_empty_system_message: false }, system("")),
          roleTemplates: formatChat({ ...sep, role_templates: { user: "[{user_message}]{function_string}" } },
                                    system("s")),
          prefix: encodePrompt({ ...base, system_prefix_token_ids: [7] }, ["text", "", "ab"], (text) => [text.length]),
          rest: piecesFrom(["<S>", "U=u1|", "A=a1#", "U=u2|", "A"], 6),
        }));
    """,
        None,
    )
    # The pieces WebLLM encodes one by one. Without role_content_sep / role_empty_sep WebLLM puts ": ".
    assert result["defaultSeps"] == ["<S>default</S>", "U: u1|", "A: a1#", "U: $& $' u2|", "A: "]
    assert result["seps"] == ["<S>default</S>", "U=u1|", "A=a1#", "U=$& $' u2|", "A"]
    assert result["noRoleAfterSystem"] == ["<S>s</S>", "u|", "A: "]
    assert result["emptySystemShown"] == ["<S></S>", "U=u|", "A: "]
    assert result["emptySystemHidden"] == ["U=u|", "A: "]
    assert result["roleTemplates"] == ["<S>s</S>", "U=[u]|", "A: "]
    # Each piece encoded on its own (here into its length).
    assert result["prefix"] == [7, 4, 0, 2]
    # A continued conversation's new text, cut where the pieces meet.
    assert result["rest"] == ["1|", "A=a1#", "U=u2|", "A"]


def test_a_chat_with_a_model_without_a_chat_template_is_an_engine_error():
    result = run_node_module(
        """
        import { formatChat } from "./src/chat-format.js";
        const conv = JSON.parse(input);
        try {
          formatChat(conv, [{ role: "user", content: "Hi" }]);
        } catch (error) {
          console.log(JSON.stringify([error.name, error.code, error.message]));
        }
    """,
        json.dumps(raw_completion_template([2], [])),
    )
    assert result[:2] == ["EngineError", "no-chat-template"]
    assert "no chat template" in result[2]


def test_streamed_text_holds_back_stop_strings_and_split_characters():
    # A fake tokenizer whose tokens are byte strings: decoding an incomplete UTF-8 sequence gives U+FFFD.
    result = run_node_module(
        """
        import { TextStream } from "./src/engine.js";
        const pieces = input.pieces.map((hex) => Uint8Array.from(hex.match(/../g), (pair) => parseInt(pair, 16)));
        const bytesOf = (ids) => Uint8Array.from(Array.from(ids).flatMap((id) => [...pieces[id]]));
        const tokenizer = { decode: (ids) => new TextDecoder().decode(bytesOf(ids)) };
        const stream = new TextStream(tokenizer, ["<END>"]);
        const deltas = [];
        for (const id of input.ids) {
          const { delta, stopped } = stream.push(id);
          deltas.push(delta);
          if (stopped) break;
        }
        console.log(JSON.stringify({ deltas, text: stream.text }));
    """,
        {
            "pieces": [
                p.encode().hex() if isinstance(p, str) else p.hex()
                for p in ["Hello", " wor", "ld <", "EN", "D> never", "é".encode()[:1], "é".encode()[1:]]
            ],
            "ids": [0, 5, 6, 1, 2, 3, 4],
        },
    )
    # "é" arrives in two tokens: nothing is emitted for the first half. "<", "<EN" could start
    # the stop string, so they wait; the stop string and what follows it are never emitted.
    assert result["deltas"] == ["Hello", "", "é", " wor", "ld ", "", ""]
    assert result["text"] == "Helloé world "


def choose(
    adapter: dict | None,
    device: str = "auto",
    model_id: str = "m-q4f16_1",
    libraries=("webgpu", "wasm"),
    library: str | None = None,
):
    """Run chooseBackend against a fake navigator.gpu whose adapter has `adapter`'s features and limits."""

    def record(model_id: str, f16: bool, buffer_bytes: int) -> dict:
        return {
            "model": f"https://x/{model_id}/",
            "model_id": model_id,
            "model_lib": f"https://x/{model_id}.wasm",
            "required_features": ["shader-f16"] if f16 else [],
            "buffer_size_required_bytes": buffer_bytes,
            "kiln": {
                "family": model_id.split("-")[0],
                "libraries": {t: f"https://x/{model_id}-{t}.wasm" for t in libraries},
            },
        }

    # Two variants of model "m", and an unrelated model that any GPU could run.
    config = {
        "model_list": [
            record("m-q4f32_1", False, 200 << 20),
            record("m-q4f16_1", True, 100 << 20),
            record("other-q4f32_1", False, 1),
        ]
    }
    return run_node_module(
        """
        import { chooseBackend } from "./src/loader.js";
        const { adapter, config, modelId, device, library } = input;
        const fake = adapter && {
          features: new Set(adapter.features), limits: adapter.limits, info: adapter.info ?? {},
        };
        Object.defineProperty(globalThis, "navigator", { value: { gpu: { requestAdapter: async () => fake } } });
        try {
          const choice = await chooseBackend(config, modelId, device, library);
          const { record, backend, fallbackReason } = choice;
          console.log(JSON.stringify({ model_id: record.model_id, backend, library: choice.library, fallbackReason }));
        } catch (error) {
          console.log(JSON.stringify({ code: error.code, message: error.message }));
        }
    """,
        {"adapter": adapter, "config": config, "modelId": model_id, "device": device, "library": library},
    )


# What Kiln's kernels need of an adapter (loader.js KERNEL_LIMITS), with room for the models' buffers.
LIMITS = {
    "maxStorageBufferBindingSize": 1 << 30,
    "maxStorageBuffersPerShaderStage": 10,
    "maxComputeInvocationsPerWorkgroup": 256,
    "maxComputeWorkgroupStorageSize": 32 << 10,
}


def test_the_library_is_chosen_by_what_the_gpu_offers():
    limits = LIMITS
    with_f16 = {"features": ["shader-f16"], "limits": limits}
    without_f16 = {"features": [], "limits": limits}
    assert choose(with_f16, model_id="m-q4f32_1")["model_id"] == "m-q4f16_1"
    assert choose(without_f16) == {
        "model_id": "m-q4f32_1",
        "backend": "webgpu",
        "library": "webgpu",
        "fallbackReason": None,
    }

    small_buffers = {"features": [], "limits": {**limits, "maxStorageBufferBindingSize": 128 << 20}}
    fallback = choose(small_buffers)
    assert fallback["backend"] == "wasm"
    assert "maxStorageBufferBindingSize" in fallback["fallbackReason"] and "200 MB" in fallback["fallbackReason"]
    refused = choose(small_buffers, device="webgpu")
    assert refused["code"] == "unsupported-gpu" and "128 MB" in refused["message"]

    few_buffers = {"features": [], "limits": {**limits, "maxStorageBuffersPerShaderStage": 8}}
    assert "maxStorageBuffersPerShaderStage" in choose(few_buffers)["fallbackReason"]

    swiftshader = {**without_f16, "info": {"vendor": "google", "architecture": "swiftshader"}}
    software = choose(swiftshader)
    assert software["backend"] == "wasm" and "renders in software (google swiftshader)" in software["fallbackReason"]
    assert choose({**without_f16, "info": {"isFallbackAdapter": True}})["backend"] == "wasm"
    assert choose(swiftshader, device="webgpu")["backend"] == "webgpu"
    assert choose(swiftshader, libraries=("webgpu",))["backend"] == "webgpu"  # nothing faster to fall back to

    assert choose(None)["backend"] == "wasm"
    assert choose(with_f16, device="wasm")["backend"] == "wasm"
    no_gpu = choose(None, libraries=("webgpu",))
    assert no_gpu["code"] == "no-webgpu" and "-t wasm" in no_gpu["message"]


def test_the_subgroup_library_is_chosen_where_the_gpu_has_subgroups():
    built = ("webgpu", "webgpu-subgroups", "wasm")
    with_subgroups, without = {"features": ["subgroups"], "limits": LIMITS}, {"features": [], "limits": LIMITS}
    assert choose(with_subgroups, libraries=built)["library"] == "webgpu-subgroups"
    assert choose(without, libraries=built)["library"] == "webgpu"
    assert choose(with_subgroups, libraries=built, library="webgpu")["library"] == "webgpu"  # pinned
    assert choose(with_subgroups, libraries=built, library="wasm")["backend"] == "wasm"
    refused = choose(without, libraries=built, library="webgpu-subgroups")
    assert refused["code"] == "unsupported-gpu" and "lacks the WebGPU feature subgroups" in refused["message"]
    assert choose(without, library="webgpu-fast")["code"] == "bad-request"
    only_subgroups = choose(without, libraries=("webgpu-subgroups", "wasm"))
    assert (
        only_subgroups["backend"] == "wasm" and "lacks the WebGPU feature subgroups" in only_subgroups["fallbackReason"]
    )
    assert choose(None, model_id="nope")["code"] == "model-not-found"


WGSL_BARRIERS = {
    "straight-line": ("workgroupBarrier();\nx = 1;\nif (a) {\n  storageBarrier();\n}\n", [2, 0]),
    "a for loop, semicolons in its header": (
        "for (var i : i32 = 0i; i < 4i; i++) {\n  workgroupBarrier();\n  if (i == 0i) { workgroupBarrier(); }\n}\n"
        "workgroupBarrier();\n",
        [1, 2],
    ),
    "loop and while": (
        "loop {\n  if (x) { break; }\n  workgroupBarrier();\n}\nwhile (y < 3) { workgroupBarrier(); }\n",
        [0, 2],
    ),
    "else, comments, look-alike names": (
        "// workgroupBarrier();\nformula = 2;\nif (a) {\n  workgroupBarrier();\n} else {\n  workgroupBarrier();\n}\n"
        "myworkgroupBarrier();\n",
        [2, 0],
    ),
}


def test_barriers_are_counted_in_and_outside_loops():
    from helpers.wgsl import matmul_wgsl

    kernels = {name: code for name, (code, _) in WGSL_BARRIERS.items()}
    kernels["dlight's decode GEMV"] = matmul_wgsl(576, 1536 + 128)  # rows too long for Kiln's
    counted = run_node_module(
        """
        import { countBarriers } from "./src/kernel-timer.js";
        const counts = Object.entries(input).map(([name, code]) => [name, Object.values(countBarriers(code))]);
        console.log(JSON.stringify(Object.fromEntries(counts)));
    """,
        kernels,
    )
    expected = {name: counts for name, (_, counts) in WGSL_BARRIERS.items()}
    assert counted == {**expected, "dlight's decode GEMV": [8, 0]}


def test_builds_of_another_kiln_series_or_tvm_series_are_refused(tiny_build, tmp_path):
    """The rule of kiln/runtime.py's check_build_versions, with TVM compared by series (tvmjs's)."""
    model_dir = tiny_build("q4f32_1", ["cpu", "webgpu", "wasm"])
    build = json.loads((model_dir / "kiln-build.json").read_text())
    kiln_major, kiln_minor, _ = build["kiln_version"].split(".")
    records = {
        "another-patch": {**build, "kiln_version": f"{kiln_major}.{kiln_minor}.99"},
        "another-minor": {**build, "kiln_version": f"{kiln_major}.{int(kiln_minor) + 1}.0"},
        "another-tvm": {**build, "versions": {**build["versions"], "tvm": "0.99.0"}},
        "unrecorded": {key: value for key, value in build.items() if key != "kiln_version"},
    }
    dist = tmp_path / "dist"
    for name, record in records.items():
        shutil.copytree(model_dir, dist / name)
        (dist / name / "kiln-build.json").write_text(json.dumps(record))
    with served(dist) as url:
        with urllib.request.urlopen(f"{url}api/app-config.json") as response:
            app_records = {r["model_id"]: r for r in json.load(response)["model_list"]}
        outcomes = run_node_module(LOAD_MODEL_FILES_JS, app_records)
    assert "buildId" in outcomes["another-patch"]
    for name in ("another-minor", "another-tvm", "unrecorded"):
        assert outcomes[name]["code"] == "incompatible-model"
    assert outcomes["another-tvm"]["message"].startswith(
        f"The model was built by Kiln {build['kiln_version']} with TVM 0.99.0, but this engine is Kiln "
    )
    assert "(not recorded)" in outcomes["unrecorded"]["message"]


def leb128(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def wasm_importing(memory_limits: bytes) -> bytes:
    """A module importing a function, a table, a global and then a memory with `memory_limits`."""

    def name(text: str) -> bytes:
        return leb128(len(text)) + text.encode()

    def section(section_id: int, body: bytes) -> bytes:
        return bytes([section_id]) + leb128(len(body)) + body

    imports = [
        name("env") + name("f") + b"\x00\x00",  # function of type 0
        name("env") + name("t") + b"\x01\x70\x01\x01\x02",  # funcref table, limits 1..2
        name("env") + name("g") + b"\x03\x7f\x00",  # immutable i32
        name("env") + name("memory") + b"\x02" + memory_limits,
    ]
    return b"\0asm\x01\0\0\0" + section(1, b"\x01\x60\x00\x00") + section(2, leb128(len(imports)) + b"".join(imports))


def test_the_memory_import_is_read_and_can_be_unshared():
    shared = wasm_importing(b"\x03" + leb128(2560) + leb128(32768))
    result = run_node_module(
        """
        import { importedMemory } from "./src/wasm-threads.js";
        const bytes = Uint8Array.from(input.shared);
        const spec = importedMemory(bytes);
        const table = new WebAssembly.Table({ initial: 1, maximum: 2, element: "anyfunc" });
        const instantiates = (wasm, shared) => {
          const memory = new WebAssembly.Memory({ initial: spec.initial, maximum: spec.maximum, shared });
          try {
            new WebAssembly.Instance(new WebAssembly.Module(wasm), { env: { f() {}, t: table, g: 7, memory } });
            return true;
          } catch { return false; }
        };
        const unshared = bytes.slice();
        unshared[spec.flagsOffset] &= ~0x02;
        console.log(JSON.stringify({
          spec,
          exported: importedMemory(Uint8Array.from(input.plain)),
          sharedTakesShared: instantiates(bytes, true), sharedTakesPlain: instantiates(bytes, false),
          unsharedTakesPlain: instantiates(unshared, false), unsharedSpec: importedMemory(unshared),
        }));
    """,
        {"shared": list(shared), "plain": list(b"\0asm\x01\0\0\0")},
    )
    assert result["spec"] == {
        "initial": 2560,
        "maximum": 32768,
        "shared": True,
        "flagsOffset": shared.index(b"\x03\x80\x14"),
    }
    assert result["exported"] is None
    assert result["sharedTakesShared"] and not result["sharedTakesPlain"]
    assert result["unsharedTakesPlain"]
    assert result["unsharedSpec"]["shared"] is False


POST_PROCESSORS = {
    "none": None,
    "bos": processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)]),
    "bos-and-eos": processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)]),
    # Llama 3's: byte-level offsets, then the BOS.
    "sequence": processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)]),
        ]
    ),
    "bert": processors.BertProcessing(("</s>", 2), ("<s>", 1)),
    "roberta": processors.RobertaProcessing(("</s>", 2), ("<s>", 1)),
}


def test_a_raw_text_is_encoded_with_the_special_tokens_the_tokenizer_adds_as_natively(tmp_path):
    """The browser engine's raw prompt (engine.encodeText, what `kiln parity` compares) gets the ids
    tokenizer.json's post-processor puts around a text, as `tokenizers` with add_special_tokens."""
    write_tokenizer(tmp_path, LLAMA_2_TOKENS, None)
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    jobs, expected = [], []
    for name, post_processor in POST_PROCESSORS.items():
        tokenizer.post_processor = post_processor
        path = tmp_path / f"{name}.json"
        tokenizer.save(str(path))
        jobs.append({"tokenizer": str(path), "texts": RAW_TEXTS})
        expected.append([tokenizer.encode(text, add_special_tokens=True).ids for text in RAW_TEXTS])
    result = run_node_module(
        """
        import { createRequire } from "node:module";
        import { specialTokensAround } from "./src/chat-format.js";
        globalThis.require = createRequire(import.meta.url);
        globalThis.__filename = "node_modules/@mlc-ai/web-tokenizers/lib/index.js";
        await import("./node_modules/@mlc-ai/web-tokenizers/lib/index.js");
        const results = [];
        for (const job of input) {
          const json = readFileSync(job.tokenizer, "utf8");
          const tokenizer = await globalThis.tokenizers.Tokenizer.fromJSON(new TextEncoder().encode(json).buffer);
          const { before, after } = specialTokensAround(JSON.parse(json).post_processor);
          results.push(job.texts.map((text) => [...before, ...Array.from(tokenizer.encode(text)), ...after]));
        }
        console.log(JSON.stringify(results));
    """,
        jobs,
    )
    assert dict(zip(POST_PROCESSORS, result)) == dict(zip(POST_PROCESSORS, expected))


def test_verify_passes_pause_as_natively():
    """speculative.js's PassCosts against kiln/speculative.py's, on helpers/simulated_reply.py's replies."""
    result = run_node_module(
        """
        import { PassCosts } from "./src/speculative.js";
        const reply = ([tokens, passSteps, accepted]) => {
          const costs = new PassCosts();
          let time = 0, made = 0, passes = 0;
          const steps = [];
          while (made < tokens) {
            if (costs.mayPropose()) {
              const taken = accepted[passes++ % accepted.length];
              time += passSteps;
              costs.verified(passSteps, taken);
              steps.push(taken);
              made += 1 + taken;
            } else {
              time += 1;
              costs.decoded(1);
              steps.push(-1);
              made += 1;
            }
          }
          return [time, steps];
        };
        console.log(JSON.stringify(input.map(reply)));
    """,
        REPLIES,
    )
    assert result == [list(simulated_reply(PassCosts(), *reply)) for reply in REPLIES]
