"""Helpers for tests of the browser engine, the harness and the server: running JS in Node,
serving a dist folder, a headless Chromium with a fresh profile."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from helpers.paths import WEB_DIR

from kiln.browser.driver import chromium, playwright_driver, serving  # noqa: F401 (playwright_driver: for conftest)
from kiln.compile.toolchain import wasm_toolchain
from kiln.server import ServerConfig, create_app


# The UMD bundles expect CommonJS globals when they run under Node; there `loadXgrammar` reads
# the bundle once per instance, as the worker does with a fresh URL.
NODE_PRELUDE = """
    import { createRequire } from "node:module";
    globalThis.require = createRequire(import.meta.url);
    globalThis.__filename = "node_modules/@mlc-ai/web-tokenizers/lib/index.js";
    await import("./node_modules/@mlc-ai/web-tokenizers/lib/index.js");
    const XGRAMMAR = new URL("./node_modules/@mlc-ai/web-xgrammar/lib/index.js", import.meta.url);
    let instances = 0;
    const loadXgrammar = async ({ fresh = false } = {}) => {
      if (fresh || instances === 0) await import(`${XGRAMMAR}?instance=${++instances}`);
      return globalThis.xgrammar;
    };
    const loadTokenizer = async (path) => {
      const bytes = new Uint8Array(readFileSync(path));
      return { bytes, tokenizer: await globalThis.tokenizers.Tokenizer.fromJSON(bytes.slice().buffer) };
    };
"""


def require_web_packages() -> None:
    if shutil.which("node") is None:
        pytest.skip("node is not installed (apt-get install -y nodejs)")
    if not (WEB_DIR / "node_modules" / "@mlc-ai" / "web-runtime").is_dir():
        pytest.fail(f"npm packages are not installed: run `cd {WEB_DIR} && npm ci`")


def run_node_module(source: str, data) -> object:
    """Run ES-module `source` in Node (from web/) with `data` as the global `input`; it prints one JSON result."""
    require_web_packages()
    with tempfile.NamedTemporaryFile("w", suffix=".json") as data_file:
        json.dump(data, data_file)
        data_file.flush()
        script = (
            f'import {{ readFileSync }} from "node:fs";\n'
            f'globalThis.input = JSON.parse(readFileSync({json.dumps(data_file.name)}, "utf8"));\n{source}'
        )
        result = subprocess.run(
            ["node", "--input-type=module"],
            input=script,
            capture_output=True,
            text=True,
            cwd=WEB_DIR,
            timeout=120,
            check=False,
        )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def require_tools() -> None:
    """emcc and node, and the npm packages, for tests that link wasm libraries and run them in Node."""
    fixes = {"emcc": wasm_toolchain.EMSCRIPTEN_FIX, "node": wasm_toolchain.NODE_FIX}
    for program, fix in fixes.items():
        if shutil.which(program) is None:
            pytest.skip(f"{program} is not installed ({fix})")
    if not (WEB_DIR / "node_modules" / "@mlc-ai" / "web-runtime").is_dir():
        pytest.fail(f"npm packages are not installed: run `cd {WEB_DIR} && npm ci`")


def node_tool(tool: str, *args: str, expect_status: int = 0) -> dict:
    """Run one of web/tools/ in Node; it prints one JSON report."""
    result = subprocess.run(
        ["node", str(WEB_DIR / "tools" / tool), *args],
        capture_output=True,
        text=True,
        env=wasm_toolchain.dawn_node_environment(),
        timeout=300,
        check=False,
    )
    assert result.returncode == expect_status, result.stderr[-3000:]
    return json.loads(result.stdout)


def run_function(library: Path, function: str, arrays: list, tmp_path: Path, device: str = "cpu") -> tuple[dict, list]:
    """Call a Relax function of a wasm library in Node (web/tools/run-function.mjs): its report and outputs."""
    inputs = tmp_path / "inputs.json"
    inputs.write_text(
        json.dumps([{"shape": list(a.shape), "dtype": str(a.dtype), "data": a.ravel().tolist()} for a in arrays])
    )
    result = node_tool("run-function.mjs", str(library), function, str(inputs), "--device", device)
    outputs = [np.array(o["data"], dtype=o["dtype"]).reshape(o["shape"]) for o in result["outputs"]]
    return result, outputs


def run_kiln(*args: str, timeout_s: float = 3600) -> subprocess.CompletedProcess:
    """The `kiln` command line in a process of its own (it drives its own Chromium)."""
    return subprocess.run(
        [sys.executable, "-m", "kiln.cli", *args], capture_output=True, text=True, timeout=timeout_s, check=False
    )


@contextmanager
def served(dist: Path, **config):
    """The Kiln server for `dist` on a free port; yields its base URL (ends with '/')."""
    with serving(create_app(ServerConfig(dist=dist, **config))) as url:
        yield url


@contextmanager
def browser_page(driver, profile_dir: Path, url: str, webgpu: bool = True):
    """A page of a headless Chromium (profile in `profile_dir`) opened at `url`; yields (context, page)."""
    with chromium(profile_dir, webgpu=webgpu, driver=driver) as context:
        page = context.pages[0] if context.pages else context.new_page()
        page.goto(url)
        yield context, page


def wait_for_page_state(page, *states: str, timeout_ms: float) -> str:
    """Wait until the harness's `body[data-state]` is one of `states`; return the state. A selector,
    not a script: the harness's Content-Security-Policy lets no page script be evaluated from a string."""
    page.wait_for_selector(
        ", ".join(f'body[data-state="{state}"]' for state in states), state="attached", timeout=timeout_ms
    )
    return page.get_attribute("body", "data-state")


def wait_for_state(page, state: str, timeout_s: float = 300) -> None:
    reached = wait_for_page_state(page, state, "error", timeout_ms=timeout_s * 1000)
    if state != "error":
        assert reached == state, page.inner_text("#error")


class RequestLog:
    """URLs a browser context requested (workers' fetches included)."""

    def __init__(self, context):
        self.urls: list[str] = []
        context.on("request", lambda request: self.urls.append(request.url))

    def matching(self, fragment: str) -> list[str]:
        return [url for url in self.urls if fragment in url]

    def clear(self) -> None:
        self.urls.clear()
