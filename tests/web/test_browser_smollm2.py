"""SmolLM2-135M-Instruct (q4f32_1) in the chat harness, in headless Chromium: on SwiftShader WebGPU
and, with WebGPU off, on the CPU wasm library. SwiftShader is slow, so each run is one short
question with a few tokens of answer."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.paths import ARTIFACTS_DIR
from helpers.web import RequestLog, browser_page, served, wait_for_page_state

pytestmark = [pytest.mark.slow, pytest.mark.browser]

MODEL_ID = "SmolLM2-135M-Instruct-q4f32_1"
QUESTION = "What is the capital of France?"
MAX_TOKENS = 12
LOAD_TIMEOUT_MS = 15 * 60_000
REPLY_TIMEOUT_MS = 20 * 60_000


@pytest.fixture(scope="module")
def url(smollm2_build) -> str:
    model_dir = smollm2_build("q4f32_1", ["webgpu", "webgpu-subgroups", "wasm"])
    with served(model_dir.parent) as base:
        yield base


def load(page) -> None:
    page.click("#load-button")
    assert wait_for_page_state(page, "ready", "error", timeout_ms=LOAD_TIMEOUT_MS) == "ready", page.inner_text("#error")


def ask(page, screenshot: Path | None = None) -> str:
    """Ask QUESTION greedily; optionally screenshot the page once the reply has started streaming."""
    page.click(".settings summary")
    page.fill("#temperature", "0")
    page.fill("#max-tokens", str(MAX_TOKENS))
    page.fill("#prompt", QUESTION)
    page.keyboard.press("Enter")
    reply = page.locator("#transcript .turn.assistant .content").last
    if screenshot is not None:
        page.wait_for_selector("#transcript .turn.assistant:last-child .content:not(:empty)", timeout=REPLY_TIMEOUT_MS)
        if page.evaluate("document.body.dataset.state") == "generating":
            screenshot.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(screenshot), full_page=True)
    assert wait_for_page_state(page, "ready", "error", timeout_ms=REPLY_TIMEOUT_MS) == "ready", page.inner_text(
        "#error"
    )
    return reply.inner_text()


def test_harness_answers_on_webgpu_and_loads_from_cache_the_second_time(driver, tmp_path, url):
    # ?device=webgpu: in auto the harness would take the wasm library over SwiftShader; on WebGPU it
    # takes the subgroup library, SwiftShader having subgroups.
    with browser_page(driver, tmp_path / "profile", f"{url}?model={MODEL_ID}&device=webgpu") as (context, page):
        requests = RequestLog(context)
        progress = []
        page.expose_function("recordProgress", lambda value: progress.append(value))
        page.evaluate("""new MutationObserver(() => recordProgress(document.querySelector('#load-progress').value))
                         .observe(document.querySelector('#load-text'),
                                  {childList: true, characterData: true, subtree: true})""")
        load(page)
        assert len([p for p in progress if 0 < p < 1]) >= 3, "the progress bar should move while loading"
        assert requests.matching("params_shard_"), "the first visit downloads the weights"
        assert "on webgpu-subgroups" in page.inner_text("#stats")

        screenshot = ARTIFACTS_DIR / "harness-mid-reply.png"
        screenshot.unlink(missing_ok=True)
        reply = ask(page, screenshot)
        assert "Paris" in reply
        assert screenshot.is_file(), "no screenshot: the reply was not caught mid-stream"
        assert "tok/s" in page.inner_text("#stats")

        requests.clear()
        page.reload()
        load(page)
        assert requests.matching("params_shard_") == [], "the second visit must read the weights from the Cache API"
        assert "from the browser cache" in page.inner_text("#stats")


def test_harness_answers_on_the_cpu_library_without_webgpu(driver, tmp_path, url):
    with browser_page(driver, tmp_path / "profile", f"{url}?model={MODEL_ID}", webgpu=False) as (_, page):
        load(page)
        assert "on wasm" in page.inner_text("#stats")
        assert "Paris" in ask(page)
