"""Integrity in the browser: every file the engine loads is checked against its SHA-256 in the build
record, whether it comes from the server or the Cache API, and a file without a digest is refused.
The tiny model's folder is copied and tampered with; the engine runs its CPU (wasm) library in
headless Chromium, so no shaders compile."""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
from pathlib import Path

import pytest

from helpers.web import served

from kiln.browser.driver import BrowserEngineError, PageEngine, chromium

MODEL_ID = "tiny-llama-q4f32_1"
LIBRARY = f"libs/{MODEL_ID}-wasm.wasm"
# One of each kind of file the engine loads: weights, the model library, the tokenizer, configs.
LOADED_FILES = ["params_shard_0.bin", LIBRARY, "tokenizer.json", "mlc-chat-config.json", "tensor-cache.json"]
PUT_IN_CACHE_JS = """async ({cacheName, path, base64}) => {
  const cache = await caches.open(cacheName);
  const request = (await cache.keys()).find((key) => key.url.endsWith(`/${path}`));
  await cache.put(request, new Response(Uint8Array.from(atob(base64), (char) => char.charCodeAt(0))));
}"""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def recorded_digests(model_dir: Path) -> dict[str, str]:
    return json.loads((model_dir / "kiln-build.json").read_text())["files"]


def copy_model(tiny_dir: Path, tmp_path: Path) -> Path:
    """A copy of the tiny model in a dist folder of its own (tampering must not reach the shared build)."""
    copy = tmp_path / "dist" / MODEL_ID
    shutil.copytree(tiny_dir, copy)
    return copy


def tamper(path: Path) -> bytes:
    """Change one bit in the middle of a binary file, add a key to a JSON file (the server reads the
    JSON files, and someone altering a model would keep them valid); returns the new bytes."""
    if path.suffix == ".json":
        path.write_text(json.dumps({**json.loads(path.read_text()), "tampered": True}))
    else:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
    return path.read_bytes()


def remove_digest(model_dir: Path, relative: str) -> None:
    record_path = model_dir / "kiln-build.json"
    record = json.loads(record_path.read_text())
    del record["files"][relative]
    record_path.write_text(json.dumps(record, indent=2))


def assert_refused(error: BrowserEngineError, *fragments: str) -> None:
    assert error.code == "integrity", error
    for fragment in fragments:
        assert fragment in str(error), (fragment, str(error))


def test_the_build_record_holds_the_sha256_of_every_other_file(tiny_build):
    model_dir = tiny_build("q4f32_1", ["cpu", "webgpu", "wasm"])
    on_disk = {
        path.relative_to(model_dir).as_posix(): sha256(path.read_bytes())
        for path in model_dir.rglob("*")
        if path.is_file() and path.name != "kiln-build.json"
    }
    assert recorded_digests(model_dir) == on_disk
    assert {*LOADED_FILES, f"libs/{MODEL_ID}-webgpu.wasm"} <= set(on_disk)


@pytest.fixture(scope="module")
def page(driver, tmp_path_factory):
    """One headless Chromium without WebGPU; each test serves its own copy on a new port, a new origin
    with an empty Cache API."""
    with chromium(tmp_path_factory.mktemp("profile"), webgpu=False, driver=driver) as context:
        yield context.pages[0] if context.pages else context.new_page()


def load(page, dist: Path) -> dict:
    """Serve `dist`, load the tiny model on the CPU library; returns the engine's load stats."""
    with served(dist) as url:
        page.goto(url)
        return PageEngine(page).load(MODEL_ID, device="wasm")["stats"]["load"]


@pytest.mark.browser
def test_an_untampered_model_loads_then_loads_from_the_cache(page, tiny_dir, tmp_path):
    model_dir = copy_model(tiny_dir, tmp_path)
    with served(model_dir.parent) as url:
        page.goto(url)
        engine = PageEngine(page)
        first = engine.load(MODEL_ID, device="wasm")["stats"]["load"]
        again = engine.load(MODEL_ID, device="wasm")["stats"]["load"]
    assert first["build_id"] == sha256((model_dir / "kiln-build.json").read_bytes())
    assert not first["from_cache"] and again["from_cache"]
    assert again["cached_bytes"] >= sum(len((model_dir / name).read_bytes()) for name in LOADED_FILES)


@pytest.mark.browser
@pytest.mark.parametrize("relative", LOADED_FILES)
def test_a_tampered_file_is_refused_naming_it_and_both_digests(page, tiny_dir, tmp_path, relative):
    model_dir = copy_model(tiny_dir, tmp_path)
    expected = recorded_digests(model_dir)[relative]
    tampered = tamper(model_dir / relative)
    with pytest.raises(BrowserEngineError) as refused:
        load(page, model_dir.parent)
    assert_refused(refused.value, f"{relative} from the server", sha256(tampered), expected)


@pytest.mark.browser
@pytest.mark.parametrize("relative", LOADED_FILES)
def test_a_file_without_a_digest_is_refused(page, tiny_dir, tmp_path, relative):
    model_dir = copy_model(tiny_dir, tmp_path)
    remove_digest(model_dir, relative)
    with pytest.raises(BrowserEngineError) as refused:
        load(page, model_dir.parent)
    assert_refused(refused.value, f"{relative} has no SHA-256 in kiln-build.json")


@pytest.mark.browser
@pytest.mark.parametrize("relative", ["params_shard_0.bin", LIBRARY, "tokenizer.json"])
def test_a_poisoned_cache_entry_is_refused_then_downloaded_again(page, tiny_dir, tmp_path, relative):
    model_dir = copy_model(tiny_dir, tmp_path)
    with served(model_dir.parent) as url:
        page.goto(url)
        engine = PageEngine(page)
        build_id = engine.load(MODEL_ID, device="wasm")["stats"]["load"]["build_id"]
        poisoned = bytearray((model_dir / relative).read_bytes())
        poisoned[len(poisoned) // 2] ^= 0x01
        page.evaluate(
            PUT_IN_CACHE_JS,
            {
                "cacheName": f"kiln-model:{MODEL_ID}:{build_id}",
                "path": relative,
                "base64": base64.b64encode(poisoned).decode(),
            },
        )
        with pytest.raises(BrowserEngineError) as refused:
            engine.load(MODEL_ID, device="wasm")
        assert_refused(
            refused.value, f"{relative} in the browser cache", sha256(poisoned), recorded_digests(model_dir)[relative]
        )
        healed = engine.load(MODEL_ID, device="wasm")["stats"]["load"]
    assert healed["downloaded_bytes"] == (model_dir / relative).stat().st_size


@pytest.mark.browser
def test_a_pinned_build_record_is_the_root_of_trust(page, tiny_dir, tmp_path):
    model_dir = copy_model(tiny_dir, tmp_path)
    record_path = model_dir / "kiln-build.json"
    pinned = sha256(record_path.read_bytes())
    with served(model_dir.parent) as url:
        page.goto(url)
        app_config = page.evaluate("fetch('/api/app-config.json').then((r) => r.json())")
        for record in app_config["model_list"]:
            record["kiln_build_sha256"] = pinned
        engine = PageEngine(page)
        assert engine.load(MODEL_ID, device="wasm", app_config=app_config)["stats"]["load"]["build_id"] == pinned

        # Whoever can change a file on the server can change its digest in the record too: the pin catches it.
        tampered = tamper(model_dir / "tokenizer.json")
        record = json.loads(record_path.read_text())
        record["files"]["tokenizer.json"] = sha256(tampered)
        record_path.write_text(json.dumps(record, indent=2))
        with pytest.raises(BrowserEngineError) as refused:
            engine.load(MODEL_ID, device="wasm", app_config=app_config)
    assert_refused(refused.value, "kiln-build.json has SHA-256", sha256(record_path.read_bytes()), pinned)
