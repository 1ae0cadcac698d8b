"""The engine host (web/src/engine-host.js) in Node, with stand-in engines: which model a call
reaches, a model loaded again only when its options change, and the memory budget."""

from __future__ import annotations

from helpers.web import run_node_module

MiB = 2**20

# Stand-in engines: Engine.load's contract (admit sees the chosen record and library first).
HOST = """
import { EngineHost, memoryBudgetFor } from "./src/engine-host.js";
const loads = [];
const record = (id) => input.appConfig.model_list.find((entry) => entry.model_id === id);
async function loadEngine({ modelId, appConfig, device, admit }) {
  admit({ record: record(modelId), library: device });
  loads.push(modelId);
  return {
    record: record(modelId), backend: device, failure: null, disposed: false,
    stats() { return { model_id: modelId, kind: "chat" }; },
    dispose() { this.disposed = true; },
    chatCompletion: async (request) => ({ answeredBy: modelId, request }),
  };
}
const host = new EngineHost(loadEngine, () => {});
const call = async (method, params) => {
  let answer;
  await host.answer({ id: 1, method, params }, (message) => { answer = message; });
  return answer.kind === "result" ? { value: answer.data } : answer.error;
};
const load = (modelId, extra = {}) => call("load", { appConfig: input.appConfig, modelId, device: "wasm", ...extra });
"""

APP_CONFIG = {
    "model_list": [
        {"model_id": "chat", "kiln": {"memory_bytes": {"wasm": 300 * MiB}}},
        {"model_id": "embedder", "kiln": {"memory_bytes": {"wasm": 100 * MiB}}},
        {"model_id": "old-style", "vram_required_MB": 50},
    ]
}


def run_host(script: str) -> dict:
    return run_node_module(HOST + script, {"appConfig": APP_CONFIG})


def test_a_call_reaches_the_model_it_names_or_the_only_one():
    result = run_host("""
    await load("chat");
    const only = await call("chatCompletion", { request: {} });
    await load("embedder");
    console.log(JSON.stringify({
      only, named: await call("chatCompletion", { request: { model: "embedder" } }),
      unnamed: await call("chatCompletion", { request: {} }),
      unknown: await call("chatCompletion", { request: { model: "other" } }),
      models: (await call("models", {})).value.map((model) => [model.id, model.accounted_bytes]),
    }));
    """)
    assert result["only"]["value"]["answeredBy"] == "chat"
    assert result["named"]["value"]["answeredBy"] == "embedder"
    assert result["unnamed"] == {
        "code": "bad-request",
        "message": "This engine holds several models (chat, embedder): name one in the request's `model`.",
    }
    assert result["unknown"] == {
        "code": "not-loaded",
        "message": 'The model "other" is not loaded (this engine holds chat, embedder).',
    }
    assert result["models"] == [["chat", 300 * MiB], ["embedder", 100 * MiB]]


def test_a_model_held_with_the_same_options_is_not_loaded_again():
    result = run_host("""
    const first = await load("chat");
    const again = await load("chat");
    const other = await load("chat", { speculative: "prompt-lookup" });
    await call("unload", { model: "chat" });
    const gone = await call("chatCompletion", { request: { model: "chat" } });
    console.log(JSON.stringify({ reused: [first.value.reused, again.value.reused, other.value.reused], loads, gone }));
    """)
    assert result["reused"] == [False, True, False]
    assert result["loads"] == ["chat", "chat"]
    assert result["gone"]["code"] == "not-loaded"


def test_a_model_past_the_memory_budget_is_refused_before_it_loads():
    result = run_host(f"""
    const budget = {350 * MiB};
    await load("chat", {{ memoryBudget: budget }});
    const refused = await load("embedder", {{ memoryBudget: budget }});
    const fits = await load("old-style", {{ memoryBudget: budget }});
    const bad = await load("embedder", {{ memoryBudget: -1 }});
    console.log(JSON.stringify({{
      refused, fits: fits.value.model_id, bad, loads,
      defaults: [memoryBudgetFor(undefined, {{ deviceMemory: 8 }}), memoryBudgetFor(null, {{}})],
    }}));
    """)
    assert result["refused"] == {
        "code": "out-of-memory",
        "message": "embedder needs about 100 MiB, which does not fit the engine's memory budget of 350 MiB beside "
        "chat (300 MiB). Unload a model, or give the engine a larger memoryBudget.",
    }
    assert result["fits"] == "old-style"  # 50 MB from vram_required_MB
    assert result["bad"]["code"] == "bad-request"
    assert result["loads"] == ["chat", "old-style"]
    assert result["defaults"] == [4 * 2**30, None]  # half of 8 GiB; no limit (Infinity is null in JSON)
