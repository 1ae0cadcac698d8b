"""kiln-web/ai-sdk, the Vercel AI SDK's provider over the browser engine (web/src/ai-sdk.js): a page bundled
with esbuild from kiln-web and `ai` 7 runs the tiny Llama, a tiny Llama with Qwen2.5's tool-calling
template and a tiny BERT on wasm in Chromium, one page for every test; replies are the native engine's."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from werkzeug.exceptions import NotFound
from werkzeug.middleware.shared_data import SharedDataMiddleware

from helpers.paths import WEB_DIR
from helpers.web import browser_page, served, serving

from kiln.embeddings import EmbeddingEngine
from kiln.engine import Engine, GenerationConfig

pytestmark = [pytest.mark.slow, pytest.mark.browser]

# Node's modules, which tvmjs and the tokenizers' emscripten code require only when they run in Node.
NODE_ONLY = ("fs", "path", "url", "module", "perf_hooks", "ws")
MESSAGES = [{"role": "user", "content": "Hi!"}]
MAX_TOKENS = 16
LONG_REPLY = 256  # tokens: what an aborted stream would have run to
LEAST_COSINE = 0.9999  # browser against native embeddings
TEXTS = ["A kiln fires clay.", "Stoneware fires at 1200 °C.", "Glaze melts into glass."]
INDEX_HTML = """<!doctype html>
<script>addEventListener("error", (event) => { globalThis.failure = String(event.error?.message ?? event.message); });
</script>
<script type="module" src="page.js"></script>
"""
# The page's engines, each with its provider and the requests the provider made of it; the tests call
# its functions. `stops` records the engine's last request each time the provider ends a stream early.
PAGE_JS = """
import { createEngine } from "kiln-web";
import { createKiln } from "kiln-web/ai-sdk";
import {
  AISDKError, InvalidArgumentError, NoSuchModelError, Output, UnsupportedFunctionalityError, embed, embedMany,
  generateText, stepCountIs, streamText, tool,
} from "ai";
import { z } from "zod";

const engines = {};

function recorded(engine) {
  const requests = [];
  const stops = [];
  const create = async (request) => {
    requests.push(request);
    const reply = await engine.chat.completions.create(request);
    if (!request.stream) return reply;
    const stop = reply.return.bind(reply);
    reply.return = async () => {
      const stopped = await stop();
      stops.push((await engine.stats()).last_request);
      return stopped;
    };
    return reply;
  };
  const embeddings = { create: (request) => (requests.push(request), engine.embeddings.create(request)) };
  const wrapped = Object.assign(Object.create(engine), { chat: { completions: { create } }, embeddings });
  return { engine, requests, stops, kiln: createKiln({ engine: wrapped }) };
}

globalThis.load = async ({ models, ids }) => {
  const config = await (await fetch(`${models}api/app-config.json`)).json();
  for (const [name, id] of Object.entries(ids)) {
    engines[name] = recorded(await createEngine(config, id, { device: "wasm" }));
  }
};

globalThis.streamReply = async ({ messages, maxTokens }) => {
  const result = streamText({ model: engines.chat.kiln(), messages, maxOutputTokens: maxTokens, temperature: 0 });
  const deltas = [];
  for await (const delta of result.textStream) deltas.push(delta);
  return { deltas, finishReason: await result.finishReason, usage: await result.usage };
};

globalThis.generateReply = async ({ messages, maxTokens }) => {
  const result = await generateText({
    model: engines.chat.kiln(), messages, maxOutputTokens: maxTokens, temperature: 0,
  });
  return { text: result.text, finishReason: result.finishReason, usage: result.usage };
};

const PIECE = z.object({
  glaze: z.string().min(1).max(12), cone: z.number().int().min(1).max(12), fired: z.boolean(),
});

globalThis.generatePiece = async () => {
  const result = await generateText({
    model: engines.chat.kiln(), prompt: "Describe a pot.", output: Output.object({ schema: PIECE }),
    maxOutputTokens: 256, temperature: 0,
  });
  return { piece: result.output, parsed: PIECE.safeParse(result.output).success,
           responseFormat: engines.chat.requests.at(-1).response_format };
};

const WEATHER = z.object({ city: z.string().max(12), unit: z.enum(["celsius", "fahrenheit"]) });

globalThis.callTool = async ({ streamed }) => {
  const calls = [];
  const settings = {
    model: engines.tools.kiln(), prompt: "What is the weather in Paris?", maxOutputTokens: 128, temperature: 0,
    toolChoice: "required", stopWhen: stepCountIs(2),
    prepareStep: ({ stepNumber }) => (stepNumber === 1 ? { toolChoice: "none" } : {}),
    tools: {
      get_weather: tool({
        description: "The weather in a city", inputSchema: WEATHER,
        execute: async (input, { toolCallId }) => {
          calls.push({ input, toolCallId });
          return { temperature: 21, unit: input.unit };
        },
      }),
    },
  };
  let steps;
  if (streamed) {
    const result = streamText(settings);
    await result.consumeStream();
    steps = await result.steps;
  } else {
    steps = (await generateText(settings)).steps;
  }
  return { calls, finishReasons: steps.map((step) => step.finishReason), requests: engines.tools.requests.slice(-2) };
};

globalThis.abortStream = async ({ messages, maxTokens, followingTokens }) => {
  const controller = new AbortController();
  const result = streamText({
    model: engines.chat.kiln(), messages, maxOutputTokens: maxTokens, temperature: 0, abortSignal: controller.signal,
  });
  const deltas = [];
  let failure = null;
  try {
    for await (const delta of result.textStream) {
      deltas.push(delta);
      controller.abort();
    }
  } catch (error) {
    failure = error.name;
  }
  // No retries: a busy engine would fail it.
  const following = await generateText({
    model: engines.chat.kiln(), messages, maxOutputTokens: followingTokens, temperature: 0, maxRetries: 0,
  });
  return { deltas, failure, stopped: engines.chat.stops.at(-1) ?? null, following: following.text };
};

function described(error) {
  return {
    name: error.name, message: error.message, sdk: AISDKError.isInstance(error),
    unsupported: UnsupportedFunctionalityError.isInstance(error), noSuchModel: NoSuchModelError.isInstance(error),
    invalidArgument: InvalidArgumentError.isInstance(error), argument: error.argument ?? null,
    cause: error.cause?.code ?? null,
  };
}

const refusal = (promise) => promise.then(() => null, described);

globalThis.refusals = async () => {
  const model = engines.chat.kiln();
  const image = { type: "file", data: new Uint8Array([137, 80, 78, 71]), mediaType: "image/png" };
  const question = [{ role: "user", content: [{ type: "text", text: "What is it?" }, image] }];
  return {
    image: await refusal(generateText({ model, messages: question })),
    unknownModel: await refusal(generateText({ model: engines.chat.kiln("no-such-model"), prompt: "Hi" })),
    embedderChats: await refusal(generateText({ model: engines.embedder.kiln(), prompt: "Hi" })),
    temperature: await refusal(generateText({ model, prompt: "Hi", temperature: 5, maxRetries: 0 })),
    tools: await refusal(generateText({
      model, prompt: "Hi", maxRetries: 0, toolChoice: "required",
      tools: { get_weather: tool({ inputSchema: WEATHER }) },
    })),
  };
};

globalThis.embedTexts = async ({ texts }) => {
  const model = engines.embedder.kiln.embeddingModel();
  const many = await embedMany({ model, values: texts });
  const one = await embed({ model, value: texts[0] });
  const direct = await engines.embedder.engine.embeddings.create({ input: texts });
  return { many: many.embeddings, usage: many.usage, one: one.embedding, direct,
           request: engines.embedder.requests[0] };
};
"""


def run(command: list, cwd: Path) -> None:
    result = subprocess.run(
        [str(part) for part in command], cwd=cwd, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, f"{command} failed:\n{result.stdout}\n{result.stderr}"


def bundled_site(folder: Path) -> Path:
    """The page and the engine's worker bundled in a project that has kiln-web, `ai` and zod installed
    (links to web/ and its node_modules); returns the folder to serve."""
    modules = folder / "node_modules"
    modules.mkdir(parents=True)
    os.symlink(WEB_DIR, modules / "kiln-web")
    for name in ("ai", "zod"):
        os.symlink(WEB_DIR / "node_modules" / name, modules / name)
    (folder / "page.js").write_text(PAGE_JS)
    (folder / "worker.js").write_text('import "kiln-web/worker";\n')
    esbuild = WEB_DIR / "node_modules" / ".bin" / "esbuild"
    externals = [f"--external:{name}" for name in NODE_ONLY]
    run([esbuild, "page.js", "worker.js", "--bundle", "--format=esm", "--outdir=public", *externals], cwd=folder)
    (folder / "public" / "index.html").write_text(INDEX_HTML)
    return folder / "public"


@pytest.fixture(scope="module")
def models(tiny_dir, tool_build, embedder_build) -> dict[str, Path]:
    """The chat model, the tool-calling one and the embedder, with their wasm libraries, in one dist."""
    dist = tool_build(["wasm"])
    embedder = embedder_build("tiny-bert", "q0f32", ["wasm"])
    assert tiny_dir.parent == embedder.parent == dist
    return {"chat": tiny_dir, "tools": dist / "tools-qwen-q4f32_1", "embedder": embedder}


@pytest.fixture(scope="module")
def page(models, driver, tmp_path_factory):
    """One page with the three engines loaded; its functions are the PAGE_JS globals."""
    folder = tmp_path_factory.mktemp("ai-sdk")
    site = SharedDataMiddleware(NotFound(), {"/": str(bundled_site(folder / "project"))})
    with (
        served(models["chat"].parent) as models_url,
        serving(site) as page_url,
        browser_page(driver, folder / "profile", "about:blank", webgpu=False) as (_, page),
    ):
        page.goto(f"{page_url}index.html")
        page.wait_for_function("() => globalThis.load !== undefined || globalThis.failure !== undefined")
        assert page.evaluate("() => globalThis.failure ?? null") is None
        ids = {name: model_dir.name for name, model_dir in models.items()}
        page.evaluate("(args) => globalThis.load(args)", {"models": models_url, "ids": ids})
        yield page


def call(page, function: str, args: dict | None = None):
    return page.evaluate(f"(args) => globalThis.{function}(args)", args or {})


@pytest.fixture(scope="module")
def native(models):
    """native(max_tokens) → the native engine's greedy reply to MESSAGES."""
    engine = Engine(models["chat"])
    return lambda max_tokens: engine.generate_chat(MESSAGES, GenerationConfig(max_tokens=max_tokens))


def test_stream_text_streams_the_native_reply(page, native):
    streamed = call(page, "streamReply", {"messages": MESSAGES, "maxTokens": MAX_TOKENS})
    expected = native(MAX_TOKENS)
    assert "".join(streamed["deltas"]) == expected.text
    assert len(streamed["deltas"]) > 1
    assert streamed["finishReason"] == "length"
    usage = streamed["usage"]
    assert (usage["inputTokens"], usage["outputTokens"]) == (len(expected.prompt_tokens), len(expected.tokens))


def test_generate_text_gives_the_native_reply_and_stops_at_max_tokens(page, native):
    generated = call(page, "generateReply", {"messages": MESSAGES, "maxTokens": MAX_TOKENS // 2})
    expected = native(MAX_TOKENS // 2)
    assert generated["text"] == expected.text
    assert generated["finishReason"] == "length"
    assert generated["usage"]["outputTokens"] == len(expected.tokens)


def test_an_object_output_is_valid_for_its_schema(page):
    generated = call(page, "generatePiece")
    response_format = generated["responseFormat"]
    assert response_format["type"] == "json_schema"
    jsonschema.validate(generated["piece"], response_format["json_schema"]["schema"])
    assert generated["parsed"]


@pytest.mark.parametrize("streamed", [False, True])
def test_a_tool_call_reaches_execute_and_its_result_the_next_step(page, streamed):
    result = call(page, "callTool", {"streamed": streamed})
    first, second = result["requests"]
    assert first["stream"] == second["stream"] == streamed
    assert first["tool_choice"] == "required" and second["tool_choice"] == "none"
    [executed] = result["calls"]
    jsonschema.validate(executed["input"], first["tools"][0]["function"]["parameters"])
    assistant, tool_message = second["messages"][-2:]
    [sent_call] = assistant["tool_calls"]
    assert sent_call["id"] == executed["toolCallId"]
    assert json.loads(sent_call["function"]["arguments"]) == executed["input"]
    expected_result = {"temperature": 21, "unit": executed["input"]["unit"]}
    assert tool_message == {
        "role": "tool",
        "tool_call_id": executed["toolCallId"],
        "content": json.dumps(expected_result, separators=(",", ":")),
    }
    assert result["finishReasons"][0] == "tool-calls" and result["finishReasons"][1] in ("stop", "length")


def test_an_abort_stops_the_generation_and_the_next_request_runs(page, native):
    aborted = call(page, "abortStream", {"messages": MESSAGES, "maxTokens": LONG_REPLY, "followingTokens": 8})
    assert aborted["deltas"]
    assert aborted["failure"] in (None, "AbortError")
    stopped = aborted["stopped"]
    assert stopped is not None and stopped["finish_reason"] == "abort"
    assert stopped["completion_tokens"] < LONG_REPLY
    assert aborted["following"] == native(8).text


def test_refusals_are_the_sdk_errors(page):
    refused = call(page, "refusals")
    image = refused["image"]
    assert image["unsupported"] and image["sdk"] and "image/png" in image["message"]
    unknown = refused["unknownModel"]
    assert unknown["noSuchModel"] and "no-such-model" in unknown["message"]
    assert refused["embedderChats"]["noSuchModel"] and "embedding model" in refused["embedderChats"]["message"]
    temperature = refused["temperature"]
    assert temperature["invalidArgument"] and temperature["argument"] == "temperature"
    assert temperature["cause"] == "bad-request" and "temperature must be" in temperature["message"]
    tools = refused["tools"]
    assert tools["unsupported"] and tools["cause"] == "no-tool-support"


def test_embed_many_gives_the_engine_s_and_the_native_vectors(page, models):
    embedded = call(page, "embedTexts", {"texts": TEXTS})
    direct = np.array([item["embedding"] for item in embedded["direct"]["data"]], np.float32)
    many = np.array(embedded["many"], np.float32)
    np.testing.assert_array_equal(many, direct)
    np.testing.assert_array_equal(np.array(embedded["one"], np.float32), direct[0])
    assert embedded["usage"]["tokens"] == embedded["direct"]["usage"]["prompt_tokens"]
    request = embedded["request"]
    assert (request["model"], request["input"], request["encoding_format"]) == (models["embedder"].name, TEXTS, "float")
    native = EmbeddingEngine(models["embedder"]).create({"input": TEXTS})
    expected = np.array([item["embedding"] for item in native["data"]], np.float32)
    cosines = (many * expected).sum(1) / np.linalg.norm(many, axis=1) / np.linalg.norm(expected, axis=1)
    assert cosines.min() >= LEAST_COSINE
