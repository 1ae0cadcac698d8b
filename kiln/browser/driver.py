"""Headless Chromium for driving the browser engine (tests, `kiln bench browser`, parity runs).

Without a GPU, Chromium's WebGPU runs on SwiftShader; it needs `--enable-unsafe-webgpu` in
headless mode. The other flags keep the browser off the network. Each run gets its own
profile folder, so the Cache API starts empty unless a run reuses the folder on purpose.
"""

from __future__ import annotations

import base64
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
from werkzeug.serving import WSGIRequestHandler, make_server

from kiln.compile.toolchain.wasm_toolchain import CHROMIUM_FIX, find_chromium
from kiln.errors import KilnError
from kiln.server import ServerConfig, create_app

OFFLINE_FLAGS = [
    "--no-sandbox",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
    "--disable-extensions",
    "--disable-dev-shm-usage",
]
WEBGPU_FLAG = "--enable-unsafe-webgpu"
# WebGPU timestamps to the nanosecond (Chromium otherwise rounds them to 0.1 ms): for kernel times.
PRECISE_TIMESTAMP_FLAGS = ["--enable-dawn-features=allow_unsafe_apis", "--disable-dawn-features=timestamp_quantization"]


_running = threading.local()


@contextmanager
def playwright_driver() -> Iterator:
    """Playwright's driver: the one this thread runs already, or a new one for the block (a thread
    can run one sync driver, which can launch any number of browsers)."""
    if getattr(_running, "driver", None) is not None:
        yield _running.driver
        return
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        raise KilnError(
            "driving Chromium needs the Python package playwright (pip install playwright); "
            "the system Chromium is used, no browser download is needed"
        ) from None
    with sync_playwright() as playwright:
        _running.driver = playwright
        try:
            yield playwright
        finally:
            _running.driver = None


@contextmanager
def chromium(
    profile_dir: Path,
    webgpu: bool = True,
    driver=None,
    extra_args: tuple[str, ...] = (),
    extension: Path | None = None,
) -> Iterator:
    """A headless Chromium (a Playwright BrowserContext) with its profile in `profile_dir`.

    `webgpu=False` leaves WebGPU off: `navigator.gpu.requestAdapter()` then gives no adapter.
    `driver` is a running playwright_driver(); without one, a driver is started for this browser.
    `extension`: an unpacked extension's folder, loaded (the only extension the browser runs).
    """
    if driver is None:
        with (
            playwright_driver() as own_driver,
            chromium(profile_dir, webgpu, own_driver, extra_args, extension) as context,
        ):
            yield context
        return
    executable = find_chromium()
    if executable is None:
        raise KilnError(f"Chromium is not installed ({CHROMIUM_FIX})")
    args = OFFLINE_FLAGS + ([WEBGPU_FLAG] if webgpu else []) + list(extra_args)
    if extension is not None:
        args = [arg for arg in args if arg != "--disable-extensions"]
        args += [f"--disable-extensions-except={extension}", f"--load-extension={extension}"]
    context = driver.chromium.launch_persistent_context(
        str(profile_dir),
        executable_path=str(executable),
        headless=True,
        args=args,
        ignore_default_args=["--disable-extensions"] if extension is not None else None,
    )
    try:
        yield context
    finally:
        context.close()


class QuietRequestHandler(WSGIRequestHandler):
    def log_request(self, *args) -> None:
        """Requests of a page driven by a program are not news."""


@contextmanager
def serving(app) -> Iterator[str]:
    """Run a Flask app on a free local port in a background thread; yields its base URL."""
    server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=QuietRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/"
    finally:
        server.shutdown()
        thread.join()


class BrowserEngineError(KilnError):
    """The browser engine failed; `code` is its EngineError code (see web/src/errors.js)."""

    def __init__(self, code: str, message: str):
        super().__init__(f"browser engine: {message} [{code}]")
        self.code = code


# The page-side halves of PageEngine's methods. The engine lives in `globalThis.kilnDriven`;
# failures come back as {error: {code, message}} so Python sees the engine's own codes.
LOAD_JS = """async ({modelId, device, library, threads, shaders, appConfig, appConfigUrl}) => {
  const { createEngine } = await import("/web/src/index.js");
  try {
    const config = appConfig ?? await (await fetch(appConfigUrl, { cache: "no-cache" })).json();
    const phases = {};
    const started = performance.now();
    await globalThis.kilnDriven?.unload();
    globalThis.kilnDriven = await createEngine(config, modelId, {
      device, library: library ?? undefined, threads: threads ?? undefined, shaders: shaders ?? undefined,
      onProgress: ({ phase }) => { phases[phase] = (phases[phase] ?? 0) + 1; },
    });
    return { seconds: (performance.now() - started) / 1000, progress_events: phases,
             stats: await globalThis.kilnDriven.stats() };
  } catch (error) {
    return { error: { code: error.code ?? "internal", message: error.message ?? String(error) } };
  }
}"""
CHAT_JS = """async (request) => {
  const started = performance.now();
  const chunks = [];
  let firstContentAt = null;
  try {
    const engine = globalThis.kilnDriven;
    if (!request.stream) {
      const completion = await engine.chat.completions.create(request);
      return { completion, seconds: (performance.now() - started) / 1000 };
    }
    for await (const chunk of await engine.chat.completions.create(request)) {
      chunks.push(chunk);
      if (firstContentAt === null && chunk.choices[0]?.delta?.content) firstContentAt = performance.now();
    }
  } catch (error) {
    return { error: { code: error.code ?? "internal", message: error.message ?? String(error) } };
  }
  return { chunks, first_content_s: firstContentAt === null ? null : (firstContentAt - started) / 1000,
           seconds: (performance.now() - started) / 1000 };
}"""
CALL_JS = """async ({path, args}) => {
  // Logits go to Python as base64 float32 (a JSON array of 49152 numbers per step is slow).
  const float32Base64 = (array) => {
    const bytes = new Uint8Array(array.buffer, array.byteOffset, array.byteLength);
    let text = "";
    for (let i = 0; i < bytes.length; i += 0x8000) text += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
    return { float32_base64: btoa(text) };
  };
  const plain = (value) => value instanceof Float32Array ? float32Base64(value)
    : ArrayBuffer.isView(value) ? Array.from(value)
    : Array.isArray(value) ? value.map(plain)
    : value && typeof value === "object" ? Object.fromEntries(Object.entries(value).map(([k, v]) => [k, plain(v)]))
    : value;
  try {
    const names = path.split(".");
    const method = names.pop();
    const owner = names.reduce((object, name) => object[name], globalThis.kilnDriven);
    return { result: plain(await owner[method](...args)) };
  } catch (error) {
    return { error: { code: error.code ?? "internal", message: error.message ?? String(error) } };
  }
}"""


def _unwrap(answer: dict):
    if "error" in answer:
        raise BrowserEngineError(answer["error"]["code"], answer["error"]["message"])
    return answer


def _arrays(value):
    """CALL_JS's answer with its base64 float32 arrays as numpy arrays."""
    if isinstance(value, dict):
        if set(value) == {"float32_base64"}:
            return np.frombuffer(base64.b64decode(value["float32_base64"]), dtype=np.float32)
        return {key: _arrays(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_arrays(item) for item in value]
    return value


class PageEngine:
    """The browser engine (web/src) in a Playwright page served by Kiln's server, driven from Python."""

    def __init__(self, page):
        self.page = page

    def load(
        self,
        model_id: str,
        device: str = "auto",
        app_config: dict | None = None,
        app_config_url: str = "/api/app-config.json",
        threads: int | None = None,
        shaders: str | None = None,
    ) -> dict:
        """Load a model; returns {seconds, progress_events: {phase: count}, stats}. `device`: "auto"
        or the target of the library to run (webgpu, webgpu-subgroups, wasm). `threads`: for the CPU
        wasm library, `shaders`: when WebGPU compiles them, "at-load" or "on-first-use" (default: the
        engine's choice)."""
        return _unwrap(
            self.page.evaluate(
                LOAD_JS,
                {
                    "modelId": model_id,
                    "device": "auto",
                    "library": None if device == "auto" else device,
                    "threads": threads,
                    "shaders": shaders,
                    "appConfig": app_config,
                    "appConfigUrl": app_config_url,
                },
            )
        )

    def chat(self, request: dict) -> dict:
        """A chat completion; streamed requests give {chunks, first_content_s, seconds}."""
        return _unwrap(self.page.evaluate(CHAT_JS, request))

    def call(self, path: str, *args):
        """Call an engine method by path, e.g. call("session.encodeChat", messages)."""
        return _arrays(_unwrap(self.page.evaluate(CALL_JS, {"path": path, "args": list(args)}))["result"])


@contextmanager
def page_engine(dist: Path, webgpu: bool = True, driver=None, extra_args: tuple[str, ...] = ()) -> Iterator[PageEngine]:
    """Kiln's server for `dist` and a fresh headless Chromium on its harness page; yields a
    PageEngine with no model loaded yet."""
    app = create_app(ServerConfig(dist=dist))
    with (
        tempfile.TemporaryDirectory(prefix="kiln-browser-profile-") as profile,
        serving(app) as url,
        chromium(Path(profile), webgpu=webgpu, driver=driver, extra_args=extra_args) as context,
    ):
        page = context.pages[0] if context.pages else context.new_page()
        page.goto(url)
        yield PageEngine(page)
