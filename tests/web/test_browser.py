"""The browser engine and the chat harness in headless Chromium (SwiftShader WebGPU, or the CPU
wasm library with WebGPU off), on the tiny Llama: loading with progress and the Cache API,
chat completions against the native build, multi-turn KV reuse, interrupts, clear errors."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers.web import RequestLog, browser_page, served, wait_for_state

from kiln.browser.driver import BrowserEngineError, PageEngine
from kiln.runtime import NativeModel

pytestmark = pytest.mark.browser

MODEL_ID = "tiny-llama-q4f32_1"
QUESTION = [{"role": "user", "content": "Tell me about the history of the city"}]
GREEDY_TOKENS = 8


@pytest.fixture(scope="module")
def webgpu_engine(driver, tmp_path_factory, url) -> PageEngine:
    """The tiny model loaded once on WebGPU; tests start from a fresh chat."""
    with browser_page(driver, tmp_path_factory.mktemp("profile"), url) as (_, page):
        engine = PageEngine(page)
        engine.load(MODEL_ID, device="webgpu")
        yield engine


@pytest.fixture
def engine(webgpu_engine) -> PageEngine:
    webgpu_engine.call("resetChat")
    return webgpu_engine


def native_greedy(model_dir: Path, prompt_ids: list[int], count: int) -> list[int]:
    model = NativeModel(model_dir)
    logits = model.prefill(prompt_ids)
    tokens = []
    for _ in range(count):
        tokens.append(int(np.argmax(logits)))
        logits = model.decode(tokens[-1])
    return tokens


def streamed_text(chunks: list[dict]) -> str:
    return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])


def check_greedy_parity(engine: PageEngine, model_dir: Path) -> None:
    prompt_ids = engine.call("session.encodeChat", QUESTION)
    expected = native_greedy(model_dir, prompt_ids, GREEDY_TOKENS)
    first = engine.call("session.prefill", prompt_ids, {"topK": 3})
    tokens = [first["top"]["ids"][0]]
    while len(tokens) < GREEDY_TOKENS:
        tokens.append(engine.call("session.decode", tokens[-1], {"topK": 1})["top"]["ids"][0])
    assert tokens == expected

    # The chat API picks the same tokens at temperature 0 and streams their text.
    engine.call("resetChat")
    result = engine.chat({"messages": QUESTION, "stream": True, "temperature": 0, "max_tokens": GREEDY_TOKENS})
    stop_token = json.loads((model_dir / "mlc-chat-config.json").read_text())["conv_template"]["stop_token_ids"][0]
    replied = expected[: expected.index(stop_token)] if stop_token in expected else expected
    assert streamed_text(result["chunks"]) == engine.call("session.decodeText", replied)
    usage = result["chunks"][-1]["usage"]
    assert usage["prompt_tokens"] == len(prompt_ids)
    assert usage["completion_tokens"] == len(replied)


def test_webgpu_generates_what_the_native_build_generates(engine, tiny_dir):
    assert engine.call("stats")["backend"] == "webgpu"
    check_greedy_parity(engine, tiny_dir)


def test_on_swiftshader_shaders_compile_on_first_use_and_at_load_when_asked(driver, tmp_path, url, tiny_dir):
    """A software adapter compiles each shader when its kernel first runs; asked to, every shader of the
    library at load, as WebLLM does and as the engine does on a GPU. Both generate the native tokens."""
    library = tiny_dir / "libs" / f"{MODEL_ID}-webgpu.wasm"
    kernels = library.read_bytes().count(b"@compute")
    compiled = {}
    for shaders in ("on-first-use", "at-load"):
        with browser_page(driver, tmp_path / shaders, url) as (_, page):
            engine = PageEngine(page)
            loaded = engine.load(MODEL_ID, device="webgpu", shaders=None if shaders == "on-first-use" else shaders)
            assert (loaded["stats"]["shaders"], "compile" in loaded["progress_events"]) == (
                shaders,
                shaders == "at-load",
            )
            compiled[shaders] = [loaded["stats"]["compiled_shaders"]]
            check_greedy_parity(engine, tiny_dir)
            compiled[shaders].append(engine.call("stats")["compiled_shaders"])
    assert compiled["at-load"] == [kernels, kernels] and kernels > 40, compiled
    assert compiled["on-first-use"][0] == 0 and 0 < compiled["on-first-use"][1] < kernels / 2, compiled


def test_an_unknown_shader_compilation_is_a_bad_request(driver, tmp_path, url):
    with browser_page(driver, tmp_path / "profile", url) as (_, page):
        with pytest.raises(BrowserEngineError, match="shaders must be one of at-load, on-first-use") as error:
            PageEngine(page).load(MODEL_ID, device="webgpu", shaders="eventually")
    assert error.value.code == "bad-request"


def test_without_webgpu_the_cpu_library_generates_the_same(driver, tmp_path, url, tiny_dir):
    with browser_page(driver, tmp_path / "profile", url, webgpu=False) as (_, page):
        engine = PageEngine(page)
        stats = engine.load(MODEL_ID)["stats"]
        assert stats["backend"] == "wasm"
        assert "WebGPU" in stats["fallback_reason"]
        check_greedy_parity(engine, tiny_dir)
        check_verify_passes(engine, tiny_dir)


def check_verify_passes(engine: PageEngine, model_dir: Path) -> None:
    """A CPU library's verify functions (speculative decoding's passes of up to 5 tokens, padded to
    the next of their row counts, the padding rolled back) give the native library's rows."""
    engine.call("resetChat")
    native = NativeModel(model_dir)
    prompt = engine.call("session.encode", "The history of the city is long")
    engine.call("session.prefill", prompt)
    native.prefill(prompt)
    for count in (1, 3, 4, 6):  # 6: more than a verify function takes, prefill_all_logits
        ids = prompt[:count]
        rows = np.stack([row["logits"] for row in engine.call("session.allLogits", ids, {"full": True})])
        np.testing.assert_allclose(rows, native.all_logits(ids), atol=1e-4)
        after = engine.call("session.decode", ids[0], {"full": True})["logits"]
        np.testing.assert_allclose(after, native.decode(ids[0]), atol=1e-4)  # the padding left no trace


def test_the_cpu_library_runs_on_two_threads_with_one_threads_logits(driver, tmp_path, url, tiny_dir):
    prompt = "Tell me about the history of the city of Paris, and then about its bridges"
    logits = {}
    with browser_page(driver, tmp_path / "profile", url, webgpu=False) as (_, page):
        engine = PageEngine(page)
        assert page.evaluate("crossOriginIsolated")
        for threads in (1, 2):
            assert engine.load(MODEL_ID, device="wasm", threads=threads)["stats"]["threads"] == threads
            ids = engine.call("session.encode", prompt)
            logits[threads] = np.stack(
                [step["logits"] for step in engine.call("session.allLogits", ids, {"full": True})]
            )
    # A task is a slice of a parallel loop's iterations: the same sums in the same order on any thread.
    np.testing.assert_array_equal(logits[2], logits[1])
    with served(tiny_dir.parent, cross_origin_isolation=False) as plain_url:
        with browser_page(driver, tmp_path / "plain-profile", plain_url, webgpu=False) as (_, page):
            assert not page.evaluate("crossOriginIsolated")
            engine = PageEngine(page)
            assert engine.load(MODEL_ID, device="wasm", threads=2)["stats"]["threads"] == 1
            step = engine.call("session.allLogits", ids, {"full": True})
            np.testing.assert_array_equal(np.stack([s["logits"] for s in step]), logits[1])


CHOOSE_JS = """async ({modelId, device, withF16}) => {
  const { chooseBackend } = await import("/web/src/loader.js");
  const config = await (await fetch("/api/app-config.json")).json();
  const f32 = config.model_list.find((record) => record.model_id === modelId);
  const f16 = { ...f32, model_id: f32.model_id.replace("f32", "f16"), required_features: ["shader-f16"] };
  if (withF16) config.model_list.push(f16);
  const choice = await chooseBackend(config, withF16 ? f16.model_id : modelId, device);
  const { record, backend, library, fallbackReason } = choice;
  return { model_id: record.model_id, backend, library, fallbackReason };
}"""


def test_swiftshader_has_no_shader_f16_so_the_f32_variant_is_chosen_with_its_subgroup_kernels(engine):
    choice = engine.page.evaluate(CHOOSE_JS, {"modelId": MODEL_ID, "device": "webgpu", "withF16": True})
    assert choice == {"model_id": MODEL_ID, "backend": "webgpu", "library": "webgpu-subgroups", "fallbackReason": None}


def test_auto_prefers_the_cpu_library_to_swiftshader(engine):
    choice = engine.page.evaluate(CHOOSE_JS, {"modelId": MODEL_ID, "device": "auto", "withF16": False})
    assert choice["backend"] == "wasm" and "renders in software" in choice["fallbackReason"]
    assert "swiftshader" in choice["fallbackReason"].lower()


def test_the_subgroup_library_generates_what_the_native_build_generates(driver, tmp_path, url, tiny_dir):
    with browser_page(driver, tmp_path / "profile", url) as (_, page):
        engine = PageEngine(page)
        stats = engine.load(MODEL_ID, device="webgpu-subgroups")["stats"]
        assert (stats["backend"], stats["library_target"]) == ("webgpu", "webgpu-subgroups")
        check_greedy_parity(engine, tiny_dir)
        engine.call("resetChat")
        ids = engine.call("session.encode", "The history of the city is long")
        engine.call("session.prefill", ids)
        kernels = engine.call("session.timeDecode", ids[0], {"topK": 1})["kernels"]
    gemvs = {k["kernel"]: k["barriers"] + k["loopBarriers"] for k in kernels if "matmul" in k["kernel"]}
    assert len(gemvs) >= 4 and not any(gemvs.values()), gemvs  # qkv, o, gate_up, down: no barrier


def test_all_logits_match_step_by_step_logits(engine):
    ids = engine.call("session.encode", "The history of the city is long")
    forced = engine.call("session.allLogits", ids, {"full": True})
    engine.call("resetChat")
    stepwise = [engine.call("session.prefill", ids[:1], {"full": True})]
    stepwise += [engine.call("session.decode", token, {"full": True}) for token in ids[1:]]
    assert len(forced) == len(ids)
    for row, (a, b) in enumerate(zip(forced, stepwise)):
        assert np.abs(np.array(a["logits"]) - np.array(b["logits"])).max() < 1e-3, row


def test_stats_count_the_gpu_dispatches_of_a_decode_step(engine, tiny_dir):
    """Issue 15's dispatch budget starts from this count (tvmjs counts each compute dispatch)."""
    layers = json.loads((tiny_dir / "mlc-chat-config.json").read_text())["model_config"]["num_hidden_layers"]
    ids = engine.call("session.encode", "The history of the city is long")
    engine.call("session.prefill", ids)
    counts, issue_ms = [], []
    for token in ids[:3]:
        engine.call("session.decode", token)
        stats = engine.call("stats")
        counts.append(stats["decode_step_dispatches"])
        issue_ms.append(stats["decode_step_issue_ms"])
    # every layer runs a norm, a qkv projection, attention, an output projection, a norm and an MLP
    assert counts[0] == counts[1] == counts[2] and counts[0] > 6 * layers, counts
    assert all(ms >= 0 for ms in issue_ms) and sum(issue_ms) > 0, issue_ms


def test_kernel_times_cover_every_dispatch_of_a_step(engine):
    ids = engine.call("session.encode", "The history of the city is long")
    untimed_prefill = engine.call("session.prefill", ids, {"topK": 3})
    engine.call("resetChat")
    timed_prefill = engine.call("session.timePrefill", ids, {"topK": 3})
    assert timed_prefill["top"]["ids"] == untimed_prefill["top"]["ids"]
    assert any("prefill" in kernel["kernel"] for kernel in timed_prefill["kernels"])
    untimed = engine.call("session.decode", ids[0], {"topK": 3})
    engine.call("session.rollback", 1)
    timed = engine.call("session.timeDecode", ids[0], {"topK": 3})
    assert timed["top"]["ids"] == untimed["top"]["ids"]  # timing does not change the step
    kernels = timed["kernels"]
    assert sum(kernel["dispatches"] for kernel in kernels) == engine.call("stats")["decode_step_dispatches"]
    names = [kernel["kernel"] for kernel in kernels]
    assert len(set(names)) == len(names) and not {"(no kernel)", "(unnamed)"} & set(names)
    assert any("matmul" in name for name in names) and any("rms_norm" in name for name in names), names
    times = [kernel["ms"] for kernel in kernels]
    assert all(ms >= 0 for ms in times) and sum(times) > 0 and times == sorted(times, reverse=True)
    barriers = {kernel["kernel"]: (kernel["barriers"], kernel["loopBarriers"]) for kernel in kernels}
    # the norms are summed by the threads of the GEMVs they merged into; the attention reduces
    # across its workgroup, and per KV tile in its loop
    assert all(barriers[name] == (0, 0) for name in names if "rms_norm" in name), barriers
    attention = [counts for name, counts in barriers.items() if "decode" in name]
    assert any(outside > 0 and in_loops > 0 for outside, in_loops in attention), barriers


def test_multi_turn_chat_reuses_the_kv_cache(engine):
    first = engine.chat({"messages": QUESTION, "temperature": 0, "max_tokens": 6})["completion"]
    cached = engine.call("stats")["cached_tokens"]
    conversation = QUESTION + [first["choices"][0]["message"], {"role": "user", "content": "And then?"}]
    second = engine.chat({"messages": conversation, "temperature": 0, "max_tokens": 6})["completion"]
    prompt_tokens = second["usage"]["prompt_tokens"]
    # Everything of the first turn stayed in the cache; only the new turn's tokens ran.
    assert cached >= first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"] - 1
    assert second["usage"]["extra"]["prefilled_tokens"] == prompt_tokens - cached

    # The reply from the reused cache is the one a fresh start on the same tokens gives.
    sequence = engine.call("session.cachedTokenIds")
    prompt, reply = sequence[:prompt_tokens], sequence[prompt_tokens:]
    engine.call("resetChat")
    fresh = [engine.call("session.prefill", prompt, {"topK": 1})["top"]["ids"][0]]
    while len(fresh) < len(reply):
        fresh.append(engine.call("session.decode", fresh[-1], {"topK": 1})["top"]["ids"][0])
    assert fresh == reply


def test_interrupt_ends_a_generation(engine):
    result = engine.page.evaluate(
        """async (messages) => {
      const chunks = [];
      const stream = await globalThis.kilnDriven.chat.completions.create(
        { messages, stream: true, temperature: 1, seed: 3, max_tokens: 400 });
      for await (const chunk of stream) {
        chunks.push(chunk);
        if (chunks.length === 3) await globalThis.kilnDriven.interrupt();
      }
      return chunks;
    }""",
        QUESTION,
    )
    finish = [c["choices"][0]["finish_reason"] for c in result if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finish == ["abort"]
    assert result[-1]["usage"]["completion_tokens"] < 20


def test_leaving_a_stream_early_stops_the_generation(engine):
    result = engine.page.evaluate(
        """async (messages) => {
      const engine = globalThis.kilnDriven;
      const stream = await engine.chat.completions.create({
        messages, stream: true, temperature: 1, seed: 3, max_tokens: 400,
      });
      let seen = 0;
      for await (const chunk of stream) if (++seen === 3) break;
      const stopped = (await engine.stats()).last_request;
      const next = await engine.chat.completions.create({ messages, temperature: 0, max_tokens: 2 });
      return { stopped, next };
    }""",
        QUESTION,
    )
    assert result["stopped"]["finish_reason"] == "abort"
    assert result["stopped"]["completion_tokens"] < 20
    assert result["next"]["usage"]["completion_tokens"] == 2  # not refused as busy


def test_sampling_is_seeded(engine):
    request = {"messages": QUESTION, "temperature": 1.0, "top_p": 0.9, "max_tokens": 12}
    texts = [
        engine.chat({**request, "seed": seed})["completion"]["choices"][0]["message"]["content"] for seed in (1, 1, 2)
    ]
    assert texts[0] == texts[1] != texts[2]
    with pytest.raises(BrowserEngineError) as bad:
        engine.chat({**request, "top_p": 0})
    assert bad.value.code == "bad-request"


def test_the_harness_holds_a_reply_to_a_json_schema_and_pretty_prints_it(driver, tmp_path, url):
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 8},
            "founded": {"type": "integer", "minimum": 0, "maximum": 2000},
        },
        "required": ["city", "founded"],
    }
    with browser_page(driver, tmp_path / "profile", f"{url}?model={MODEL_ID}", webgpu=False) as (_, page):
        page.click("#load-button")
        wait_for_state(page, "ready")
        page.click(".settings summary")
        page.select_option("#response-format", "json_schema")
        page.fill("#json-schema", json.dumps(schema))
        page.fill("#max-tokens", "64")
        page.fill("#prompt", "Which city, and when was it founded?")
        page.keyboard.press("Enter")
        wait_for_state(page, "ready")
        reply = page.locator("#transcript .turn.assistant .content").last.inner_text()
        assert reply.startswith("{\n  ")  # pretty-printed
        answer = json.loads(reply)
        assert answer.keys() == {"city", "founded"} and 0 <= answer["founded"] <= 2000
        assert "format mask" in page.inner_text("#stats")

        page.fill("#json-schema", '{"type": "objekt"}')
        page.fill("#prompt", "Again?")
        page.keyboard.press("Enter")
        wait_for_state(page, "ready")
        assert "Unsupported type" in page.inner_text("#error")


def test_harness_chats_and_loads_from_cache_on_the_next_visit(driver, tmp_path, url):
    with browser_page(driver, tmp_path / "profile", f"{url}?model={MODEL_ID}") as (context, page):
        requests = RequestLog(context)
        page.click("#load-button")
        wait_for_state(page, "ready")
        assert len(requests.matching("params_shard_")) == 1
        assert "from the browser cache" not in page.inner_text("#stats")
        threads = min(page.evaluate("navigator.hardwareConcurrency"), 4)  # the engine's default
        assert f"on wasm ({threads} thread{'s' if threads > 1 else ''})" in page.inner_text("#stats")
        page.click(".settings summary")
        page.fill("#system-prompt", "You are a tiny test model.")
        page.fill("#max-tokens", "10")
        page.fill("#prompt", "Tell me about the history of the city")
        page.keyboard.press("Enter")
        wait_for_state(page, "ready")
        turns = page.locator("#transcript .turn")
        assert turns.count() == 2
        assert turns.nth(0).inner_text().endswith("Tell me about the history of the city")
        assert len(turns.nth(1).locator(".content").inner_text()) > 0
        assert "tok/s" in page.inner_text("#stats")

        # Text is text: markup typed by the user (or produced by the model) is never parsed.
        markup = '<img src=x onerror="document.body.dataset.hacked=1"><b>bold</b>'
        page.fill("#max-tokens", "2")
        page.fill("#prompt", markup)
        page.click("#send-button")
        wait_for_state(page, "ready")
        assert page.locator("#transcript .turn.user .content").nth(1).inner_text() == markup
        assert page.locator("#transcript img, #transcript b").count() == 0
        assert page.evaluate("document.body.dataset.hacked") is None

        # Speculative decoding: the stats line tells how many proposed tokens the reply took.
        assert "prompt lookup" not in page.inner_text("#stats")
        page.select_option("#speculative", "prompt-lookup")
        page.fill("#max-tokens", "10")
        page.fill("#prompt", "Say it again: the cat sat on the mat. The cat sat on the mat. The cat sat on")
        page.keyboard.press("Enter")
        wait_for_state(page, "ready")
        assert re.search(
            r"prompt lookup: \d+ of [1-9]\d* proposed tokens taken, \d+\.\d× fewer model steps",
            page.inner_text("#stats"),
        )

        requests.clear()
        page.reload()
        page.click("#load-button")
        wait_for_state(page, "ready")
        assert requests.matching("params_shard_") == [], "the weights must come from the Cache API"
        assert requests.matching("-webgpu.wasm") == []
        assert "from the browser cache" in page.inner_text("#stats")


def test_the_harness_takes_no_click_before_it_listens_to_its_model_form(driver, tmp_path, url):
    """Until the page has read the app config and listens to the model form, a click on Load would
    submit the form natively: the page would reload with nothing loading (a reload clicked at once did)."""
    held = []
    with browser_page(driver, tmp_path / "profile", "about:blank") as (_, page):
        page.route(f"{url}api/app-config.json", lambda route: held.append(route))
        page.goto(f"{url}?model={MODEL_ID}")
        for _ in range(200):
            if held:
                break
            page.wait_for_timeout(50)
        assert held, "the harness never asked for its app config"
        assert page.get_attribute("body", "data-state") == "starting"
        assert page.is_disabled("#load-button")
        held[0].continue_()
        wait_for_state(page, "idle", timeout_s=30)
        assert page.is_enabled("#load-button")
        assert page.input_value("#model-select") == MODEL_ID


def test_a_rebuilt_model_is_fetched_again_and_a_corrupt_shard_is_refused(driver, tmp_path, tiny_dir):
    dist = tmp_path / "dist"
    copy = dist / MODEL_ID
    shutil.copytree(tiny_dir, copy)
    with served(dist) as url, browser_page(driver, tmp_path / "profile", url) as (context, page):
        requests = RequestLog(context)
        engine = PageEngine(page)
        # The CPU library: no shaders to compile, and files are cached the same way.
        engine.load(MODEL_ID, device="wasm")
        build_id = engine.call("stats")["load"]["build_id"]

        record = json.loads((copy / "kiln-build.json").read_text())
        record["created"] = "a later build"
        (copy / "kiln-build.json").write_text(json.dumps(record))
        requests.clear()
        reloaded = engine.load(MODEL_ID, device="wasm")["stats"]["load"]
        assert reloaded["build_id"] != build_id and not reloaded["from_cache"]
        assert len(requests.matching("params_shard_")) == 1
        assert page.evaluate("caches.keys()") == [f"kiln-model:{MODEL_ID}:{reloaded['build_id']}"]

        shard = copy / "params_shard_0.bin"
        data = bytearray(shard.read_bytes())
        data[123] ^= 0xFF
        shard.write_bytes(bytes(data))
        record["created"] = "a corrupt build"
        (copy / "kiln-build.json").write_text(json.dumps(record))
        with pytest.raises(BrowserEngineError) as corrupt:
            engine.load(MODEL_ID, device="wasm")
        assert corrupt.value.code == "integrity"
        assert "params_shard_0.bin from the server has SHA-256" in str(corrupt.value)


def test_full_storage_is_a_clear_error(driver, tmp_path, url):
    with browser_page(driver, tmp_path / "profile", f"{url}?model={MODEL_ID}") as (context, page):
        session = context.new_cdp_session(page)
        session.send("Storage.overrideQuotaForOrigin", {"origin": url.rstrip("/"), "quotaSize": 4096})
        page.click("#load-button")
        wait_for_state(page, "error")
        message = page.inner_text("#error")
        assert "Not enough browser storage" in message and "MB" in message


def test_no_webgpu_and_no_cpu_library_is_a_clear_error(driver, tmp_path, url):
    with browser_page(driver, tmp_path / "profile", url, webgpu=False) as (_, page):
        config = page.evaluate("fetch('/api/app-config.json').then((r) => r.json())")
        for record in config["model_list"]:
            record["kiln"]["libraries"].pop("wasm", None)
        with pytest.raises(BrowserEngineError) as failed:
            PageEngine(page).load(MODEL_ID, app_config=config)
        assert failed.value.code == "no-webgpu"
        assert "kiln compile" in str(failed.value) and "-t wasm" in str(failed.value)
        with pytest.raises(BrowserEngineError) as unknown:
            PageEngine(page).load("no-such-model")
        assert unknown.value.code == "model-not-found"


def test_bench_browser_reports_the_native_benchmark_keys(tiny_dir):
    kiln = Path(sys.executable).with_name("kiln")
    result = subprocess.run(
        [
            str(kiln),
            "bench",
            "browser",
            str(tiny_dir),
            "--target",
            "wasm",
            "--json",
            "--prompt-tokens",
            "16",
            "--decode-tokens",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["device"] == "wasm" and report["bandwidth_fraction"] is None
    assert report["decode_step_dispatches"] is None and report["dispatches_per_layer"] is None
    assert report["decode_step_issue_ms"] is None
    assert report["decode_step_kernels"] is None and report["prefill_kernels"] is None
    assert report["decode_step_barriers"] is None and report["barriers_per_layer"] is None
    for key in (
        "load_s",
        "cold_load_s",
        "warm_load_s",
        "ttft_s",
        "prefill_tokens_per_s",
        "decode_tokens_per_s",
        "peak_rss_mb",
    ):
        assert isinstance(report[key], (int, float)) and report[key] > 0, key  # JSON from JS: 3200.0 → 3200
    assert report["load_s"] == report["warm_load_s"]


def test_a_lost_gpu_is_a_clear_error(driver, tmp_path, url):
    with browser_page(driver, tmp_path / "profile", f"{url}?model={MODEL_ID}&device=webgpu") as (context, page):
        page.click("#load-button")
        wait_for_state(page, "ready")
        # Crash Chromium's GPU process (DevTools protocol): every WebGPU device in the browser is lost.
        context.new_cdp_session(page).send("Browser.crashGpuProcess")
        wait_for_state(page, "error", timeout_s=60)
        assert "GPU device was lost" in page.inner_text("#error")
        # Chromium starts a new GPU process: loading again gets a new device.
        page.click("#load-button")
        wait_for_state(page, "ready")


# A KV cache layer (pages × 2 × 2 KV heads × 16 tokens × head_dim 16 × 4 bytes) of exactly 1 GiB: the
# maxBufferSize SwiftShader grants, which its Vulkan then cannot allocate; on the CPU, two such layers
# take the library's wasm memory past 2 GiB.
CONTEXT_FOR_A_1_GIB_CACHE_LAYER = ((1 << 30) // (2 * 2 * 16 * 16 * 4) - 1) * 16


@pytest.fixture(scope="module")
def huge_cache_dist(builds, tiny_source, tiny_dir, tmp_path_factory):
    """A folder holding the tiny model and the tiny model with a 4M-token context (1 GiB a cache layer)."""
    huge = builds.model_dir(
        tiny_source,
        "tiny-llama-1-gib-cache",
        "q4f32_1",
        ["cpu", "wasm", "webgpu"],
        context_window_size=CONTEXT_FOR_A_1_GIB_CACHE_LAYER,
    )
    dist = tmp_path_factory.mktemp("huge-cache")
    for folder in (huge, tiny_dir):
        shutil.copytree(folder, dist / folder.name)
    return dist, huge.name


def test_a_gpu_allocation_that_fails_is_out_of_memory_and_the_engine_loads_again(
    driver, tmp_path, huge_cache_dist, tiny_dir
):
    dist, huge = huge_cache_dist
    with served(dist) as url, browser_page(driver, tmp_path / "profile", url) as (_, page):
        engine = PageEngine(page)
        with pytest.raises(BrowserEngineError) as failed:
            engine.load(huge, device="webgpu")
        assert failed.value.code == "out-of-memory"
        assert "could not allocate 1024 MiB" in str(failed.value)
        engine.load(MODEL_ID, device="webgpu")
        check_greedy_parity(engine, tiny_dir)


def test_the_cpu_library_runs_past_2_gib_of_memory(driver, tmp_path, huge_cache_dist):
    """tvmjs read addresses past 2 GiB as negative numbers (web/src/wasm-memory.js)."""
    dist, huge = huge_cache_dist
    prompt = list(range(5, 21))
    expected = native_greedy(dist / huge, prompt, GREEDY_TOKENS)
    with served(dist) as url, browser_page(driver, tmp_path / "profile", url, webgpu=False) as (_, page):
        engine = PageEngine(page)
        engine.load(huge, device="wasm", threads=2)
        generated = engine.call("session.generate", prompt, {"max_tokens": GREEDY_TOKENS, "temperature": 0})
        assert generated["token_ids"] == expected
        assert engine.call("stats")["memory"]["wasm_bytes"] > 2 << 30


PAST_2_GIB_JS = """
import tvmjs from "@mlc-ai/web-runtime";
import { instantiateLibrary } from "./src/wasm-threads.js";

const { tvm } = await instantiateLibrary(tvmjs, new Uint8Array(readFileSync(input.library)));
tvm.beginScope();
// wasm memory filled past 2 GiB (in two: one allocation takes at most 2 GiB - 1, as emscripten's sbrk takes it)
const below = [0, 1].map(() => tvm.empty([(2 ** 30 + 2 ** 28) / 4], "float32", tvm.cpu()));
// small tensors fill the free room below, until one's object lies past 2 GiB
const made = [];
while ((made.at(-1)?.handle ?? 0) <= 2 ** 31 && made.length < 10000) made.push(tvm.empty([3, 5], "float32", tvm.cpu()));
const past = made.at(-1).copyFrom(Float32Array.from({ length: 15 }, (_, i) => i / 2));
console.log(JSON.stringify({
  handle: past.handle, shape: past.shape, values: Array.from(past.toArray()),
  memory: tvm.memory.memory.buffer.byteLength, below: below.map((tensor) => tensor.shape),
}));
"""


def test_tvmjs_reads_tensors_past_2_gib_of_wasm_memory(tiny_dir):
    """With wasm memory filled past 2 GiB, a new tensor's object and data lie past it: tvmjs read such
    addresses as negative numbers (web/src/wasm-memory.js)."""
    from helpers.web import run_node_module

    library = json.loads((tiny_dir / "kiln-build.json").read_text())["targets"]["wasm"]["library"]
    result = run_node_module(PAST_2_GIB_JS, {"library": str(tiny_dir / library)})
    assert result["handle"] > 2**31 and result["memory"] > 2**31
    assert result["shape"] == [3, 5] and result["values"] == [i / 2 for i in range(15)]
