"""Where web developers already are (issue 44), bundled with esbuild as a web project would and run in
Chromium against `kiln serve`'s tiny model: WebLLM's entry points with only the import changed, the
engine in a service worker across pages (and recovered after the browser stops it), in an MV3
extension's service worker, and one engine holding two models."""

from __future__ import annotations

import json
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from werkzeug.middleware.shared_data import SharedDataMiddleware

from helpers.paths import WEB_DIR
from helpers.web import browser_page, serving

from kiln.browser.driver import chromium
from kiln.engine import Engine, GenerationConfig
from kiln.server import ServerConfig, create_app

pytestmark = [pytest.mark.slow, pytest.mark.browser]

NODE_ONLY = ("fs", "path", "url", "module", "perf_hooks", "ws")
MESSAGES = [{"role": "user", "content": "Tell me about the history of the city"}]
MAX_TOKENS = 8
PAGE_TIMEOUT_MS = 600_000

# WebLLM's examples/get-started, cut to a few lines: the two bundles differ in their import only.
GET_STARTED = """import * as webllm from "%(package)s";
const progress = [];
const appConfig = await (await fetch("/api/app-config.json")).json();
const engineConfig = { appConfig, initProgressCallback: (report) => progress.push(report), logLevel: "WARN" };
const engine = await %(create)s;
const reply = await engine.chat.completions.create({
  messages: %(messages)s, temperature: 0, max_tokens: %(max_tokens)d,
});
let streamed = "";
for await (const chunk of await engine.chat.completions.create({
  messages: %(messages)s, temperature: 0, max_tokens: %(max_tokens)d, stream: true,
})) streamed += chunk.choices[0]?.delta?.content ?? "";
globalThis.result = {
  text: reply.choices[0].message.content, usage: reply.usage, streamed, message: await engine.getMessage(),
  stats: await engine.runtimeStatsText(), progress: progress.at(-1),
};
"""

# How each page makes its engine: on the page, or in a worker of its own running WebLLM's handler.
CREATE = {
    "main": "webllm.CreateMLCEngine(%(model)s, engineConfig)",
    "worker": 'webllm.CreateWebWorkerMLCEngine(new Worker(new URL("./%(name)s-handler.js", import.meta.url), '
    '{ type: "module" }), %(model)s, engineConfig)',
}
WORKER_HANDLER = """import * as webllm from "%(package)s";
const handler = new webllm.WebWorkerMLCEngineHandler();
self.onmessage = (message) => handler.onmessage(message);
"""
PACKAGES = {"webllm": "@mlc-ai/web-llm", "kiln": "kiln-web/webllm"}

# WebLLM's service worker example: the handler is made on `activate`, which the browser does not run
# again when it restarts a stopped worker.
SERVICE_WORKER = """import { ServiceWorkerMLCEngineHandler } from "kiln-web/webllm";
let handler;
self.addEventListener("activate", () => { handler = new ServiceWorkerMLCEngineHandler(); });
"""
SERVICE_WORKER_PAGE = """import { CreateServiceWorkerMLCEngine } from "kiln-web/webllm";
// The tokens the worker's engine holds in its KV cache once the page is connected: an earlier page's
// chat where the worker kept the model, none where it loaded it again.
globalThis.connect = async (model) => {
  await navigator.serviceWorker.register("/site/sw.js", { type: "module" });
  const appConfig = await (await fetch("/api/app-config.json")).json();
  globalThis.engine = await CreateServiceWorkerMLCEngine(model, { appConfig });
  return (await globalThis.engine.loaded().stats(model)).cached_tokens;
};
globalThis.chat = async (messages, maxTokens) => {
  const reply = await globalThis.engine.chat.completions.create({ messages, temperature: 0, max_tokens: maxTokens });
  return reply.choices[0].message.content;
};
// The worker's instance id (a new one each time the browser starts it), through Kiln's ping.
globalThis.instance = async () => {
  const { active } = await navigator.serviceWorker.ready;
  const channel = new MessageChannel();
  const answered = new Promise((resolve) => { channel.port1.onmessage = ({ data }) => resolve(data.data.instance); });
  active.postMessage({ kilnCall: { id: 0, method: "ping" } }, [channel.port2]);
  return answered;
};
"""

# WebLLM's Chrome extension example (the engine in the extension's service worker, a page of it
# chatting) beside Kiln's own extension engine: each serves its own port.
EXTENSION_BACKGROUND = """import "kiln-web/extension-service-worker";
import { ExtensionServiceWorkerMLCEngineHandler } from "kiln-web/webllm";
let handler;
chrome.runtime.onConnect.addListener((port) => {
  if (port.name !== "web_llm_service_worker") return;
  if (handler === undefined) handler = new ExtensionServiceWorkerMLCEngineHandler(port);
  else handler.setPort(port);
  port.onMessage.addListener(handler.onmessage.bind(handler));
});
"""
EXTENSION_PAGE = """import { CreateExtensionServiceWorkerMLCEngine } from "kiln-web/webllm";
import { createExtensionEngine } from "kiln-web";
globalThis.chat = async (models, model, messages, maxTokens) => {
  const appConfig = await (await fetch(models + "api/app-config.json")).json();
  const replies = [];
  for (const engine of [await CreateExtensionServiceWorkerMLCEngine(model, { appConfig }),
    await createExtensionEngine(appConfig, model)]) {
    const reply = await engine.chat.completions.create({ messages, temperature: 0, max_tokens: maxTokens });
    replies.push(reply.choices[0].message.content);
    await engine.unload();
  }
  return replies;
};
"""
EXTENSION_MANIFEST = {
    "manifest_version": 3,
    "name": "Kiln engine test",
    "version": "1.0",
    "background": {"service_worker": "background.js", "type": "module"},
    "host_permissions": ["http://127.0.0.1/*"],
    # An extension may compile WebAssembly only where its policy says so (the model's library is wasm).
    "content_security_policy": {"extension_pages": "script-src 'self' 'wasm-unsafe-eval'; object-src 'self'"},
}

# Kiln's own API: one engine, a chat model and an embedding model, each addressed by its id.
TWO_MODELS = """import { createEngine } from "kiln-web";
globalThis.twoModels = async ({ chatId, embeddingId, messages, maxTokens }) => {
  const appConfig = await (await fetch("/api/app-config.json")).json();
  const engine = await createEngine(appConfig, [chatId, embeddingId], { device: "wasm", threads: 1 });
  const outcome = async (call) => {
    try {
      return { value: await call() };
    } catch (error) {
      return { code: error.code, message: error.message };
    }
  };
  const chat = () => engine.chat.completions.create({ model: chatId, messages, temperature: 0, max_tokens: maxTokens })
    .then((reply) => reply.choices[0].message.content);
  const embed = () => engine.embeddings.create({ model: embeddingId, input: ["one", "two"] })
    .then((reply) => reply.data.length);
  const result = {
    models: (await engine.models()).map((model) => [model.id, model.kind]),
    reply: await chat(), embedded: await embed(),
    unnamed: await outcome(() => engine.chat.completions.create({ messages })),
  };
  await engine.unload(chatId);
  Object.assign(result, {
    afterUnload: await outcome(embed), unloadedChat: await outcome(chat),
    left: (await engine.models()).map((model) => model.id),
  });
  await engine.unload();
  const small = await createEngine(appConfig, embeddingId, { device: "wasm", threads: 1, memoryBudget: 2 ** 30 });
  result.tooBig = await outcome(() => small.load(chatId, { memoryBudget: 1 }));
  result.stillEmbeds = await outcome(() => small.embeddings.create({ input: "three" })
    .then((reply) => reply.data.length));
  await small.unload();
  return result;
};
"""


def esbuild(project: Path, entries: list[str], outdir: Path) -> None:
    command = [
        WEB_DIR / "node_modules" / ".bin" / "esbuild",
        *entries,
        "--bundle",
        "--format=esm",
        f"--outdir={outdir}",
        "--log-level=warning",
        *[f"--external:{name}" for name in NODE_ONLY],
    ]
    result = subprocess.run([str(part) for part in command], cwd=project, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


@pytest.fixture(scope="module")
def project(tmp_path_factory, tiny_dir) -> Path:
    """A web project using kiln-web (web/, linked) and WebLLM, its pages bundled into site/ and extension/."""
    project = tmp_path_factory.mktemp("web-conventions")
    (project / "node_modules").mkdir()
    (project / "node_modules" / "kiln-web").symlink_to(WEB_DIR)
    (project / "node_modules" / "@mlc-ai").symlink_to(WEB_DIR / "node_modules" / "@mlc-ai")
    sources = {
        "worker.js": 'import "kiln-web/worker";\n',
        "sw.js": SERVICE_WORKER,
        "sw-page.js": SERVICE_WORKER_PAGE,
        "two-models.js": TWO_MODELS,
    }
    for name, package in PACKAGES.items():
        sources[f"{name}-handler.js"] = WORKER_HANDLER % {"package": package}
        for way, create in CREATE.items():
            values = {"model": json.dumps(tiny_dir.name), "name": name}
            sources[f"{name}-{way}.js"] = GET_STARTED % page_values(package, create % values)
    for name, source in sources.items():
        (project / name).write_text(source)
    esbuild(project, list(sources), project / "site")
    for name in [*(f"{name}-{way}" for name in PACKAGES for way in CREATE), "sw-page", "two-models"]:
        (project / "site" / f"{name}.html").write_text(
            f'<!doctype html><script type="module" src="{name}.js"></script>\n'
        )

    (project / "background.js").write_text(EXTENSION_BACKGROUND)
    (project / "extension-page.js").write_text(EXTENSION_PAGE)
    esbuild(project, ["background.js", "extension-page.js"], project / "extension")
    (project / "extension" / "manifest.json").write_text(json.dumps(EXTENSION_MANIFEST))
    (project / "extension" / "page.html").write_text(
        '<!doctype html><script type="module" src="extension-page.js"></script>\n'
    )
    return project


def page_values(package: str, create: str) -> dict:
    return {
        "package": package,
        "create": create,
        "messages": json.dumps(MESSAGES),
        "max_tokens": MAX_TOKENS,
    }


class RequestPaths:
    """The paths a WSGI app was asked for, whoever asked (a service worker's fetches too)."""

    def __init__(self, app):
        self.app = app
        self.paths: list[str] = []

    def __call__(self, environ, start_response):
        self.paths.append(environ["PATH_INFO"])
        return self.app(environ, start_response)

    def shards(self) -> list[str]:
        return [path for path in self.paths if "params_shard" in path]


@contextmanager
def site(project: Path, dist: Path):
    """`kiln serve` over `dist`, with the project's bundles under /site/: one origin, as a deployed app."""
    requests = RequestPaths(SharedDataMiddleware(create_app(ServerConfig(dist=dist)), {"/site": str(project / "site")}))
    with serving(requests) as url:
        yield url, requests


def native_reply(model_dir: Path, messages=MESSAGES, max_tokens=MAX_TOKENS):
    return Engine(model_dir).generate_chat(messages, GenerationConfig(max_tokens=max_tokens))


@pytest.mark.parametrize("way", list(CREATE))
def test_webllms_get_started_runs_on_kiln_by_changing_its_import(project, tiny_dir, driver, tmp_path, way):
    expected = native_reply(tiny_dir)
    results = {}
    with site(project, tiny_dir.parent) as (url, _):
        for package in PACKAGES:
            with browser_page(driver, tmp_path / package, "about:blank") as (_, page):
                errors = []
                page.on("pageerror", lambda error, errors=errors: errors.append(str(error)))
                page.goto(f"{url}site/{package}-{way}.html")
                page.wait_for_function("() => globalThis.result !== undefined", timeout=PAGE_TIMEOUT_MS, polling=500)
                assert not errors
                results[package] = page.evaluate("() => globalThis.result")
    for result in results.values():
        assert result["text"] == result["streamed"] == result["message"] == expected.text
        assert result["usage"]["completion_tokens"] == len(expected.tokens)
        assert result["stats"].startswith("prefill: ") and "tokens/sec, decoding: " in result["stats"]
        assert result["progress"]["progress"] == 1 and result["progress"]["timeElapsed"] > 0
    # WebLLM counts the prompt without the conv_template's system prefix; Kiln counts every token it ran.
    assert results["kiln"]["usage"]["prompt_tokens"] == len(expected.prompt_tokens)


def test_a_service_worker_keeps_the_model_across_pages_and_recovers_when_stopped(project, tiny_dir, driver, tmp_path):
    expected = native_reply(tiny_dir).text
    with (
        site(project, tiny_dir.parent) as (url, requests),
        browser_page(driver, tmp_path / "profile", f"{url}site/sw-page.html", webgpu=False) as (context, page),
    ):
        page.wait_for_function("() => globalThis.connect !== undefined")
        assert page.evaluate("(model) => globalThis.connect(model)", tiny_dir.name) == 0
        assert requests.shards(), "the first page's load fetches the weights"
        assert page.evaluate("([messages, n]) => globalThis.chat(messages, n)", [MESSAGES, MAX_TOKENS]) == expected

        # Another page of the site in the same tab, then in a tab of its own: the worker's model, at once.
        requests.paths.clear()
        page.goto(f"{url}site/sw-page.html?second")
        second = context.new_page()
        second.goto(f"{url}site/sw-page.html?tab")
        for shown in (page, second):
            shown.wait_for_function("() => globalThis.connect !== undefined")
            held_tokens = shown.evaluate("(model) => globalThis.connect(model)", tiny_dir.name)
            assert shown.evaluate("([messages, n]) => globalThis.chat(messages, n)", [MESSAGES, MAX_TOKENS]) == expected
            assert requests.shards() == [] and held_tokens > 0, (requests.paths, held_tokens)
        page.close()

        before = second.evaluate("() => globalThis.instance()")
        devtools = context.new_cdp_session(second)
        devtools.send("ServiceWorker.enable")
        devtools.send("ServiceWorker.stopAllWorkers")
        time.sleep(1)
        # The restarted worker holds no model: the page's engine loads it again before it chats.
        assert second.evaluate("([messages, n]) => globalThis.chat(messages, n)", [MESSAGES, MAX_TOKENS]) == expected
        assert second.evaluate("() => globalThis.instance()") != before


def test_an_extension_service_worker_runs_a_chat(project, tiny_dir, driver, tmp_path):
    expected = native_reply(tiny_dir).text
    with (
        site(project, tiny_dir.parent) as (url, _),
        chromium(tmp_path / "profile", webgpu=False, driver=driver, extension=project / "extension") as context,
    ):
        worker = context.service_workers[0] if context.service_workers else context.wait_for_event("serviceworker")
        extension_id = worker.url.split("/")[2]
        page = context.new_page()
        page.goto(f"chrome-extension://{extension_id}/page.html")
        page.wait_for_function("() => globalThis.chat !== undefined")
        page.set_default_timeout(PAGE_TIMEOUT_MS)
        replies = page.evaluate(
            "([models, model, messages, n]) => globalThis.chat(models, model, messages, n)",
            [url, tiny_dir.name, MESSAGES, MAX_TOKENS],
        )
    assert replies == [expected, expected]


def test_one_engine_holds_two_models_addressed_by_id(project, tiny_dir, minilm_build, driver, tmp_path):
    embedder = minilm_build(["cpu", "wasm", "webgpu"])
    assert embedder.parent == tiny_dir.parent
    with (
        site(project, tiny_dir.parent) as (url, _),
        browser_page(driver, tmp_path / "profile", f"{url}site/two-models.html", webgpu=False) as (_, page),
    ):
        page.wait_for_function("() => globalThis.twoModels !== undefined")
        page.set_default_timeout(PAGE_TIMEOUT_MS)
        result = page.evaluate(
            "(args) => globalThis.twoModels(args)",
            {"chatId": tiny_dir.name, "embeddingId": embedder.name, "messages": MESSAGES, "maxTokens": MAX_TOKENS},
        )
    assert result["models"] == [[tiny_dir.name, "chat"], [embedder.name, "embedding"]]
    assert result["reply"] == native_reply(tiny_dir).text
    assert result["embedded"] == 2
    assert result["unnamed"]["code"] == "bad-request" and "name one" in result["unnamed"]["message"]
    assert result["afterUnload"] == {"value": 2}
    assert result["unloadedChat"]["code"] == "not-loaded"
    assert tiny_dir.name in result["unloadedChat"]["message"]
    assert result["left"] == [embedder.name]
    assert result["tooBig"]["code"] == "out-of-memory"
    assert f"beside {embedder.name}" in result["tooBig"]["message"], result["tooBig"]
    assert result["stillEmbeds"] == {"value": 1}
