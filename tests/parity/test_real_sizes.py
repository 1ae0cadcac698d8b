"""Models at real sizes in the browser: random weights at published configs, made by transformers (no
hub), built once each for cpu, wasm and webgpu. The tiny models and SmolLM2 (a 49k vocabulary) never
showed what real sizes do: Gemma 3 270M's prefill asked a helper thread of the CPU library for more
workspace than its arena held (two threads stopped with `exit(1)`), TVM's KV cache took 256 MB of wasm
memory for tables of a few KB, every new prompt length took new blocks, and Qwen2.5 0.5B's 7 query
heads per KV head lost one in TVM's narrowed WebGPU decode kernel. Each library gives the native
greedy tokens, holding the memory the app config accounts for (kiln/model_memory.py) within 15%.
(Past 2 GiB of wasm memory: tests/web/test_browser.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from helpers.real_sizes import REAL_SIZES
from helpers.session_builds import built_from_made_source

from kiln.app_config import model_record, read_compiled_model
from kiln.browser.model import browser_model
from kiln.browser.parity import greedy
from kiln.model_memory import MIB
from kiln.runtime import NativeModel

pytestmark = pytest.mark.browser

GREEDY_TOKENS = 8
PROMPT = [5, 6, 7, 8, 9]  # the tokenizer is the tiny one: its ids are below 384
ACCOUNTING_TOLERANCE = 0.15
LIBRARIES = [("wasm", 1), ("wasm", 2), ("webgpu", None)]


@pytest.fixture(scope="module", params=REAL_SIZES)
def real_size(request, builds, sources):
    """(the model's q4f32_1 build for cpu, wasm and webgpu, its native greedy tokens after PROMPT)."""
    model_dir = built_from_made_source(
        builds, sources, request.param, f"{request.param}-sized", "q4f32_1", ["cpu", "wasm", "webgpu"]
    )
    return model_dir, greedy_tokens(NativeModel(model_dir))


def greedy_tokens(model) -> list[int]:
    return [int(np.argmax(logits)) for logits in greedy(model, PROMPT, GREEDY_TOKENS)]


def browser_greedy_tokens(browser) -> list[int]:
    """The browser engine's own greedy generation (its sampler at temperature 0, in the page)."""
    return browser.engine.call("session.generate", PROMPT, {"max_tokens": GREEDY_TOKENS, "temperature": 0})["token_ids"]


@pytest.mark.parametrize("library, threads", LIBRARIES, ids=["wasm-1-thread", "wasm-2-threads", "webgpu"])
def test_a_real_sized_model_gives_the_native_tokens_in_the_memory_the_app_config_gives_it(
    real_size, library, threads, driver
):
    model_dir, expected = real_size
    record = model_record(read_compiled_model(model_dir), "")
    with browser_model(model_dir, library, driver=driver, threads=threads) as browser:
        assert browser.engine.call("stats")["threads"] == (threads or 1)
        assert browser_greedy_tokens(browser) == expected
        memory = browser.engine.call("stats")["memory"]
    if library == "webgpu":
        measured, accounted = memory["gpu_peak_bytes"], record["vram_required_MB"] * MIB
    else:
        measured, accounted = memory["wasm_bytes"], record["kiln"]["memory_bytes"]["wasm"]
    assert memory["accounted_bytes"] == record["kiln"]["memory_bytes"][library]
    assert abs(measured - accounted) <= ACCOUNTING_TOLERANCE * accounted, (measured / MIB, accounted / MIB)


CPU_LIBRARY_OUT_OF_MEMORY_JS = """
import { join } from "node:path";
import tvmjs from "@mlc-ai/web-runtime";
import { ModelSession, cpuLibraryFailure } from "./src/engine.js";
import { instantiateLibrary } from "./src/wasm-threads.js";

const folder = input.folder;
const read = (name) => new Uint8Array(readFileSync(join(folder, name)));
const tensorCache = JSON.parse(readFileSync(join(folder, "tensor-cache.json"), "utf8"));
async function* shards() {
  for (const shard of tensorCache.records) yield { shard, bytes: read(shard.dataPath) };
}
async function load(maximumBytes) {
  const library = await instantiateLibrary(tvmjs, read(input.library), { maximumBytes });
  const session = new ModelSession(library.tvm, library.tvm.cpu(), "wasm");
  try {
    await session.initialize(shards(), () => {});
    return { loaded: true, logits: (await session.prefill([5, 6, 7])).length };
  } catch (error) {
    const failure = cpuLibraryFailure(error, {
      usedBytes: library.tvm.memory.memory.buffer.byteLength, maximumBytes: library.maximumBytes,
      largestBuffer: input.largestBuffer, neededBytes: input.neededBytes,
    });
    return { loaded: false, exited: error.name, code: failure.code, message: failure.message };
  }
}
console.log(JSON.stringify({ short: await load([input.shortBytes]), again: await load([Infinity]) }));
"""


@pytest.mark.parametrize("real_size", ["gemma3-270m"], indirect=True)
def test_a_cpu_library_out_of_memory_is_a_clear_error_and_the_model_loads_again(real_size):
    """The CPU library's memory capped below the model's needs (as a browser that cannot reserve more
    would cap it): TVM's failed allocation stops the library, which the engine reports as out-of-memory;
    a new library loads the model."""
    from helpers.web import run_node_module

    model_dir, _ = real_size
    record = model_record(read_compiled_model(model_dir), "")
    needed = record["kiln"]["memory_bytes"]["wasm"]
    result = run_node_module(
        CPU_LIBRARY_OUT_OF_MEMORY_JS,
        {
            "folder": str(model_dir),
            "library": read_compiled_model(model_dir).libraries["wasm"],
            "shortBytes": needed // 2,
            "largestBuffer": record["buffer_size_required_bytes"],
            "neededBytes": needed,
        },
    )
    assert result["short"]["exited"] == "ExitStatus" and result["short"]["code"] == "out-of-memory"
    assert (
        "ran out of memory" in result["short"]["message"] and f"{round(needed / MIB)} MiB" in result["short"]["message"]
    )
    assert result["again"] == {"loaded": True, "logits": read_compiled_model(model_dir).chat_config["vocab_size"]}
