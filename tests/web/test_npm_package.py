"""web/ as a web developer gets it: `npm pack`, installed into a project of its own, a three-line page
bundled with esbuild, run in Chromium against `kiln serve`'s models (the tiny Llama's wasm library)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from werkzeug.exceptions import NotFound
from werkzeug.middleware.shared_data import SharedDataMiddleware

from helpers.paths import WEB_DIR
from helpers.web import browser_page, served, serving

from kiln.engine import Engine, GenerationConfig

pytestmark = [pytest.mark.slow, pytest.mark.browser]

# Node's modules, which tvmjs and the tokenizers' emscripten code require only when they run in Node.
NODE_ONLY = ("fs", "path", "url", "module", "perf_hooks", "ws")
MESSAGES = [{"role": "user", "content": "Hi!"}]
MAX_TOKENS = 8
# A module script's failure (a rejected top-level await too) is reported to the window's error listeners.
INDEX_HTML = """<!doctype html>
<script>addEventListener("error", (event) => { globalThis.failure = String(event.error?.message ?? event.message); });
</script>
<script type="module" src="page.js"></script>
"""


def run(command: list, cwd: Path) -> str:
    result = subprocess.run(
        [str(part) for part in command], cwd=cwd, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, f"{command} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A web project with the packed kiln-web installed; its dependencies are copied from web/node_modules
    (the registry is not needed: npm finds them installed)."""
    tmp = tmp_path_factory.mktemp("npm-package")
    tarball = tmp / run(["npm", "pack", "--silent", "--pack-destination", tmp], cwd=WEB_DIR).strip()
    project = tmp / "project"
    package = json.loads((WEB_DIR / "package.json").read_text())
    for name in package["dependencies"]:
        shutil.copytree(WEB_DIR / "node_modules" / name, project / "node_modules" / name)
    (project / "package.json").write_text(json.dumps({"name": "kiln-web-consumer", "private": True, "type": "module"}))
    run(["npm", "install", "--offline", "--no-audit", "--no-fund", tarball], cwd=project)
    return project


def test_the_tarball_holds_the_engine_and_declares_what_it_needs(project):
    installed = json.loads((project / "node_modules" / "kiln-web" / "package.json").read_text())
    assert "private" not in installed
    assert installed["exports"] == {
        ".": "./src/index.js",
        "./worker": "./src/bundle-worker.js",
        "./wasm-thread": "./src/wasm-thread.js",
        "./ai-sdk": "./src/ai-sdk.js",
        "./webllm": "./src/webllm.js",
        "./service-worker": "./src/bundle-service-worker.js",
        "./extension-service-worker": "./src/bundle-extension-worker.js",
    }
    assert (project / "node_modules" / "kiln-web" / "src" / "wasm-thread.js").is_file()
    assert set(installed["dependencies"]) == {
        "@ai-sdk/provider",
        "@mlc-ai/web-runtime",
        "@mlc-ai/web-tokenizers",
        "@mlc-ai/web-xgrammar",
        "@huggingface/jinja",
    }
    assert (project / "node_modules" / "kiln-web" / "README.md").is_file()


def test_a_bundled_page_chats_with_a_served_model(project, tiny_dir, driver, tmp_path):
    with served(tiny_dir.parent) as models:
        (project / "page.js").write_text(
            'import { createEngine } from "kiln-web";\n'
            f'const engine = await createEngine(await (await fetch("{models}api/app-config.json")).json(), '
            f'"{tiny_dir.name}", {{ device: "wasm" }});\n'
            f"globalThis.reply = await engine.chat.completions.create({{ messages: {json.dumps(MESSAGES)}, "
            f"max_tokens: {MAX_TOKENS}, temperature: 0 }});\n"
        )
        (project / "worker.js").write_text('import "kiln-web/worker";\n')
        run(
            [
                WEB_DIR / "node_modules" / ".bin" / "esbuild",
                "page.js",
                "worker.js",
                "--bundle",
                "--format=esm",
                "--outdir=public",
                *[f"--external:{name}" for name in NODE_ONLY],
            ],
            cwd=project,
        )
        (project / "public" / "index.html").write_text(INDEX_HTML)
        site = SharedDataMiddleware(NotFound(), {"/": str(project / "public")})
        with (
            serving(site) as page_url,
            browser_page(driver, tmp_path / "profile", "about:blank", webgpu=False) as (_, page),
        ):
            page.goto(f"{page_url}index.html")
            page.wait_for_function(
                "() => globalThis.reply !== undefined || globalThis.failure !== undefined", timeout=300_000
            )
            failure, reply = page.evaluate("() => [globalThis.failure ?? null, globalThis.reply ?? null]")
    assert failure is None
    expected = Engine(tiny_dir).generate_chat(MESSAGES, GenerationConfig(max_tokens=MAX_TOKENS))
    assert reply["choices"][0]["message"]["content"] == expected.text
    assert reply["usage"]["completion_tokens"] == len(expected.tokens)
