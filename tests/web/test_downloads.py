"""Downloads at real sizes, shown on the tiny model: progress per file and in all with the time left,
a download that breaks off resumes on the next load from the files stored before it, a full storage
quota is `quota-exceeded` with nothing of the model left stored, and a model the CPU library cannot
hold is refused before anything of it is downloaded."""

from __future__ import annotations

import json
import shutil

import pytest

from helpers.web import RequestLog, browser_page

from kiln.browser.driver import BrowserEngineError, PageEngine, serving
from kiln.server import ServerConfig, create_app

pytestmark = pytest.mark.browser

MODEL_ID = "tiny-llama-q4f32_1"
SHARD = "params_shard_0.bin"
LIBRARY = f"libs/{MODEL_ID}-wasm.wasm"
CACHES_JS = """async () => Object.fromEntries(await Promise.all((await caches.keys()).map(
  async (name) => [name, (await (await caches.open(name)).keys()).map((request) => request.url)])))"""
PROGRESS_JS = """async ({modelId}) => {
  const { createEngine } = await import("/web/src/index.js");
  const events = [];
  const engine = await createEngine(await (await fetch("/api/app-config.json")).json(), modelId,
    { device: "wasm", onProgress: (event) => events.push(event) });
  await engine.unload();
  return events.filter((event) => event.phase === "fetch");
}"""


class BreaksOff:
    """WSGI middleware: the first answer for a URL ending in `suffix` stops halfway through its body
    (the connection closes short of its Content-Length, as when a network drops)."""

    def __init__(self, app, suffix: str):
        self.app, self.suffix, self.broken = app, suffix, False

    def __call__(self, environ, start_response):
        body = self.app(environ, start_response)
        if self.broken or not environ["PATH_INFO"].endswith(self.suffix):
            return body
        self.broken = True
        data = b"".join(body)

        def half_then_drop():
            yield data[: len(data) // 2]
            raise ConnectionAbortedError("the test drops the connection")

        return half_then_drop()


@pytest.fixture
def dist(tiny_dir, tmp_path):
    """A copy of the tiny model's folder (for tests that change its files)."""
    folder = tmp_path / "dist"
    shutil.copytree(tiny_dir, folder / MODEL_ID)
    return folder


def test_a_download_that_breaks_off_resumes_from_the_stored_files_on_the_next_load(dist, driver, tmp_path):
    app = create_app(ServerConfig(dist=dist))
    app.wsgi_app = BreaksOff(app.wsgi_app, SHARD)
    with serving(app) as url, browser_page(driver, tmp_path / "profile", url) as (context, page):
        requests = RequestLog(context)
        engine = PageEngine(page)
        with pytest.raises(BrowserEngineError) as broken:
            engine.load(MODEL_ID, device="wasm")
        assert broken.value.code == "network" and SHARD in str(broken.value)
        stored = page.evaluate(CACHES_JS)
        assert not any(url.endswith(SHARD) for urls in stored.values() for url in urls), "a partial shard was kept"
        assert any(url.endswith(LIBRARY) for urls in stored.values() for url in urls)

        requests.clear()
        load = engine.load(MODEL_ID, device="wasm")["stats"]["load"]
    assert load["downloaded_bytes"] == (dist / MODEL_ID / SHARD).stat().st_size  # only what broke off
    assert load["cached_bytes"] >= (dist / MODEL_ID / LIBRARY).stat().st_size
    assert requests.matching(LIBRARY) == []


def test_progress_names_each_file_and_the_time_left(dist, driver, tmp_path):
    with serving(create_app(ServerConfig(dist=dist))) as url, browser_page(driver, tmp_path / "p", url) as (_, page):
        events = page.evaluate(PROGRESS_JS, {"modelId": MODEL_ID})
    last = events[-1]
    files = {file["name"]: file for file in last["files"]}
    library = (dist / MODEL_ID / LIBRARY).stat().st_size
    assert files[LIBRARY.split("/")[-1]] == {
        "name": LIBRARY.split("/")[-1],
        "loadedBytes": library,
        "totalBytes": library,
    }
    assert files[SHARD]["loadedBytes"] == files[SHARD]["totalBytes"] == (dist / MODEL_ID / SHARD).stat().st_size
    assert last["loadedBytes"] == last["totalBytes"] == sum(file["totalBytes"] for file in last["files"])
    timed = [event for event in events if event["secondsLeft"] is not None]
    assert timed and all(event["secondsLeft"] >= 0 for event in timed)
    assert "left" in timed[0]["text"] and " of " in timed[0]["text"]


@pytest.mark.parametrize("quota", ["below the weights", "below the library"])
def test_a_full_storage_quota_is_quota_exceeded_and_keeps_nothing_of_the_model(quota, dist, driver, tmp_path):
    """Below the weights, the engine refuses before downloading them; below the library (the weights
    fit), the Cache API refuses to store it and the files stored before it are removed."""
    shard = (dist / MODEL_ID / SHARD).stat().st_size
    quota_bytes = {"below the weights": shard // 2, "below the library": shard + (1 << 20)}[quota]
    with serving(create_app(ServerConfig(dist=dist))) as url, browser_page(driver, tmp_path / "p", url) as (ctx, page):
        ctx.new_cdp_session(page).send(
            "Storage.overrideQuotaForOrigin", {"origin": url.rstrip("/"), "quotaSize": quota_bytes}
        )
        with pytest.raises(BrowserEngineError) as full:
            PageEngine(page).load(MODEL_ID, device="wasm")
        stored = page.evaluate(CACHES_JS)
    assert full.value.code == "quota-exceeded"
    assert "Not enough browser storage" in str(full.value) and "it needs" in str(full.value)
    assert all(urls == [] for urls in stored.values()), stored


def test_a_model_too_big_for_the_cpu_library_is_refused_before_anything_is_downloaded(dist, driver, tmp_path):
    """Weights of 5 GiB (the tensor cache says so; no shard of that size needs to exist): wasm32's
    4 GiB cannot hold them."""
    cache_file = dist / MODEL_ID / "tensor-cache.json"
    cache = json.loads(cache_file.read_text())
    cache["records"][0]["records"][0]["nbytes"] = 5 << 30
    cache_file.write_text(json.dumps(cache))
    app = create_app(ServerConfig(dist=dist))
    with serving(app) as url, browser_page(driver, tmp_path / "profile", url, webgpu=False) as (context, page):
        requests = RequestLog(context)
        with pytest.raises(BrowserEngineError) as refused:
            PageEngine(page).load(MODEL_ID)
    assert refused.value.code == "out-of-memory"
    assert "needs 5" in str(refused.value) and "4096 MB" in str(refused.value)
    assert requests.matching(f"/models/{MODEL_ID}/") == []
