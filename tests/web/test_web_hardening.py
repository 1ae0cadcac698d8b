"""The browser side's defences, run in Node: a weight shard longer than tensor-cache.json says is
refused as soon as it shows, the worker answers only the methods it lists, and the harness reads
app configs and models of its own origin only (and clears only the cached builds of the model it
loaded)."""

from __future__ import annotations

import hashlib
import json
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlparse

import pytest

from helpers.web import RequestLog, browser_page, run_node_module, served

SHARD = "params_shard_0.bin"
SHARD_BYTES = 64 << 10
# What the misbehaving server sends at most: a loader that reads all of it has not stopped.
SERVER_CAP = 128 << 20
READ_BOUND = 32 << 20  # well above what the sockets' buffers hold, well below SERVER_CAP

FETCH_SHARDS_JS = """
    import { ModelFiles } from "./src/loader.js";
    const outcomes = {};
    for (const [name, model] of Object.entries(input)) {
      try {
        const files = await ModelFiles.open({ model, model_id: name }, () => {});
        await files.fetchShards();
        outcomes[name] = { loaded: true };
      } catch (error) {
        outcomes[name] = { code: error.code, message: error.message };
      }
    }
    console.log(JSON.stringify(outcomes));
"""


def model_folder_files(shard: bytes) -> dict[str, bytes]:
    """A model folder as the loader reads it, whose one shard is SHARD_BYTES long by tensor-cache.json
    and whose build record holds the digests of the files given (`shard` may be longer)."""
    files = {
        "tensor-cache.json": json.dumps(
            {"records": [{"dataPath": SHARD, "format": "raw-shard", "nbytes": SHARD_BYTES, "records": []}]}
        ).encode(),
        "mlc-chat-config.json": b"{}",
        SHARD: shard,
    }
    build = {
        "kiln_version": "0.1.0",
        "versions": {"tvm": "0.27.0"},
        "files": {name: hashlib.sha256(data).hexdigest() for name, data in files.items()},
    }
    return {**files, "kiln-build.json": json.dumps(build).encode()}


def test_a_shard_longer_than_its_record_is_refused_before_it_is_read(tmp_path):
    """`kiln serve` sends the file whole with its Content-Length; its digest is even the build record's."""
    folder = tmp_path / "dist" / "long"
    folder.mkdir(parents=True)
    for name, data in model_folder_files(b"\x01" * (SHARD_BYTES + 4096)).items():
        (folder / name).write_bytes(data)
    with served(tmp_path / "dist") as url:
        outcome = run_node_module(FETCH_SHARDS_JS, {"long": f"{url}models/long/"})["long"]
    assert outcome == {
        "code": "integrity",
        "message": f"{url}models/long/resolve/main/{SHARD} is longer than the {SHARD_BYTES} bytes tensor-cache.json "
        f"gives it (its Content-Length is {SHARD_BYTES + 4096}): the file is corrupt, was altered, or belongs to "
        "another build. Reload the page.",
    }


class EndlessShardServer(ThreadingHTTPServer):
    """Serves model_folder_files under /<mode>/resolve/main/, except the shard: an endless body
    (up to SERVER_CAP), without a Content-Length ("endless") or with a huge one ("lying").
    `sent[mode]` counts the shard bytes the client took before it hung up."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), EndlessShardHandler)
        self.files = model_folder_files(b"\x02" * SHARD_BYTES)
        self.sent: dict[str, int] = {}
        self.finished: list[str] = []
        self.done = threading.Event()


class EndlessShardHandler(BaseHTTPRequestHandler):
    server: EndlessShardServer

    def log_message(self, *args):
        pass

    def do_GET(self):
        mode, _, name = self.path.lstrip("/").partition("/resolve/main/")
        if name != SHARD:
            self.send_response(200)
            self.send_header("Content-Length", str(len(self.server.files[name])))
            self.end_headers()
            self.wfile.write(self.server.files[name])
            return
        self.send_response(200)
        if mode == "lying":
            self.send_header("Content-Length", str(1 << 40))
        self.end_headers()
        self.server.sent[mode] = 0
        chunk = b"\x02" * (64 << 10)
        try:
            while self.server.sent[mode] < SERVER_CAP:
                self.wfile.write(chunk)
                self.server.sent[mode] += len(chunk)
        except OSError:
            pass  # the client hung up
        finally:
            self.close_connection = True
            self.server.finished.append(mode)
            if len(self.server.finished) == 2:
                self.server.done.set()


@contextmanager
def endless_shard_server():
    server = EndlessShardServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server, f"http://127.0.0.1:{server.server_port}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_an_endless_shard_is_cut_off_once_it_passes_its_size():
    with endless_shard_server() as (server, url):
        outcomes = run_node_module(FETCH_SHARDS_JS, {"endless": f"{url}endless/", "lying": f"{url}lying/"})
        assert server.done.wait(5)
    assert server.sent["endless"] < READ_BOUND and server.sent["lying"] < READ_BOUND, server.sent
    assert outcomes["endless"] == {
        "code": "integrity",
        "message": f"{url}endless/resolve/main/{SHARD} is longer than the {SHARD_BYTES} bytes tensor-cache.json "
        "gives it (the download passed them): the file is corrupt, was altered, or belongs to another build. "
        "Reload the page.",
    }
    assert outcomes["lying"]["code"] == "integrity"
    assert f"(its Content-Length is {1 << 40})" in outcomes["lying"]["message"]


def test_the_worker_answers_only_the_methods_it_lists():
    names = ["constructor", "__proto__", "toString", "hasOwnProperty", "valueOf", "isPrototypeOf", "stats"]
    replies = run_node_module(
        """
        import { serveEngine } from "./src/engine-host.js";
        const replies = [];
        const scope = { postMessage: (message) => replies.push(message) };
        serveEngine(scope, async () => { throw new Error("not used"); });
        for (const [id, method] of input.entries()) await scope.onmessage({ data: { id, method, params: {} } });
        console.log(JSON.stringify(replies));
    """,
        names,
    )
    unknown = [
        {"id": id, "kind": "error", "error": {"code": "bad-request", "message": f'unknown method "{name}"'}}
        for id, name in enumerate(names[:-1])
    ]
    # A listed method is still dispatched: `stats` before `load` is the engine's own refusal.
    not_loaded = {"code": "not-loaded", "message": "The model is not loaded."}
    listed = {"id": len(names) - 1, "kind": "error", "error": not_loaded}
    assert replies == [*unknown, listed]


PAGE = "http://127.0.0.1:8000/?model=tiny"


def test_the_harness_reads_an_app_config_of_its_own_origin_only():
    accepted = {
        None: "http://127.0.0.1:8000/api/app-config.json",
        "/dist/app-config.json": "http://127.0.0.1:8000/dist/app-config.json",
        "configs/app.json": "http://127.0.0.1:8000/configs/app.json",
        "http://127.0.0.1:8000/api/app-config.json?v=2": "http://127.0.0.1:8000/api/app-config.json?v=2",
    }
    refused = [
        "https://evil.example/app-config.json",
        "//evil.example/x",
        "/\\evil.example/x",
        "javascript:alert(1)",
        "data:application/json,{}",
        "http://127.0.0.1:8001/api/app-config.json",
        "https://127.0.0.1:8000/api/app-config.json",
        "http://[",
    ]
    results = run_node_module(
        """
        import { appConfigUrl } from "./harness/app-config.js";
        console.log(JSON.stringify(input.values.map((value) => {
          try {
            return { url: appConfigUrl(value, input.page).href };
          } catch (error) {
            return { error: error.message };
          }
        })));
    """,
        {"values": [*accepted, *refused], "page": PAGE},
    )
    assert results[: len(accepted)] == [{"url": url} for url in accepted.values()]
    assert results[len(accepted) :] == [
        {
            "error": f"?config={value} is not on this page's origin (http://127.0.0.1:8000); "
            "the harness reads app configs from its own server only."
        }
        for value in refused
    ]


def test_the_harness_refuses_an_app_config_with_models_elsewhere():
    def record(model="/models/tiny/", model_lib="/models/tiny/libs/tiny-webgpu.wasm", wasm="libs/tiny-wasm.wasm"):
        return {"model_id": "tiny", "model": model, "model_lib": model_lib, "kiln": {"libraries": {"wasm": wasm}}}

    configs = {
        "own": [record(), record(model="http://127.0.0.1:8000/models/tiny/")],
        "model elsewhere": [record(), record(model="//evil.example/models/tiny/")],
        "library elsewhere": [record(model_lib="https://evil.example/tiny.wasm")],
        "wasm library elsewhere": [record(wasm="http://127.0.0.1:9000/tiny.wasm")],
        "data library": [record(model_lib="data:application/wasm;base64,AGFzbQ==")],
    }
    results = run_node_module(
        """
        import { checkAppConfigOrigins } from "./harness/app-config.js";
        const results = {};
        for (const [name, model_list] of Object.entries(input.configs)) {
          try {
            checkAppConfigOrigins({ model_list }, input.page);
            results[name] = "accepted";
          } catch (error) {
            results[name] = error.message;
          }
        }
        console.log(JSON.stringify(results));
    """,
        {"configs": configs, "page": PAGE},
    )
    assert results.pop("own") == "accepted"
    foreign = {
        "model elsewhere": "//evil.example/models/tiny/",
        "library elsewhere": "https://evil.example/tiny.wasm",
        "wasm library elsewhere": "http://127.0.0.1:9000/tiny.wasm",
        "data library": "data:application/wasm;base64,AGFzbQ==",
    }
    assert results == {
        name: f"The app config's model tiny lies at {url}, not on this page's origin (http://127.0.0.1:8000); "
        "the harness loads models from its own server only."
        for name, url in foreign.items()
    }


def test_only_the_loaded_model_s_other_builds_are_cleared():
    """Node has no Cache API: a Map of cache name → stored URLs stands in for the browser's."""
    folder = "http://127.0.0.1:8000/models/tiny/"
    caches = {
        "kiln-model:tiny:new": [f"{folder}resolve/main/{SHARD}"],
        "kiln-model:tiny:old": [f"{folder}resolve/main/{SHARD}", f"{folder}libs/tiny-webgpu.wasm"],
        "kiln-model:tiny:elsewhere": [f"https://evil.example/tiny/resolve/main/{SHARD}"],
        "kiln-model:tiny:mixed": [f"{folder}resolve/main/{SHARD}", "https://evil.example/tiny.wasm"],
        "kiln-model:tiny:sibling": [f"http://127.0.0.1:8000/models/tiny-chat/resolve/main/{SHARD}"],
        "kiln-model:tiny-chat:old": [f"http://127.0.0.1:8000/models/tiny-chat/resolve/main/{SHARD}"],
    }
    kept = run_node_module(
        """
        import { ModelFiles, modelBaseUrl } from "./src/loader.js";
        const store = new Map(Object.entries(input.caches));
        globalThis.caches = {
          keys: async () => [...store.keys()],
          open: async (name) => ({ keys: async () => store.get(name).map((url) => new Request(url)) }),
          delete: async (name) => store.delete(name),
        };
        const record = { model: input.folder, model_id: "tiny" };
        const files = new ModelFiles(record, modelBaseUrl(record), { digest: "new", files: {} }, () => {});
        await files.forgetOtherBuilds();
        console.log(JSON.stringify([...store.keys()]));
    """,
        {"caches": caches, "folder": folder},
    )
    assert kept == [name for name in caches if name != "kiln-model:tiny:old"]


@pytest.mark.browser
def test_the_harness_page_shows_the_refusals_and_fetches_nothing_elsewhere(driver, tmp_path: Path):
    """The page itself (it imports /web/src/, so only a browser runs it), over a dist without models:
    a foreign `?config=` is never fetched; a served config naming a foreign model is refused."""
    (tmp_path / "dist").mkdir()
    foreign_model = {"model_id": "tiny", "model": "https://evil.example/models/tiny/", "model_lib": "x.wasm"}
    with served(tmp_path / "dist") as url, browser_page(driver, tmp_path / "profile", url, webgpu=False) as opened:
        context, page = opened
        requests = RequestLog(context)
        page.goto(f"{url}?config=//evil.example/app-config.json")
        page.wait_for_selector("#error:not([hidden])")
        refused_config = page.text_content("#error")
        page.route(f"{url}api/app-config.json", lambda route: route.fulfill(json={"model_list": [foreign_model]}))
        page.goto(url)
        page.wait_for_selector("#error:not([hidden])")
        refused_model = page.text_content("#error")
        options = page.eval_on_selector_all("#model-select option", "options => options.length")
    assert refused_config == (
        "Could not read the app config: ?config=//evil.example/app-config.json is not on this page's origin "
        f"({url.rstrip('/')}); the harness reads app configs from its own server only."
    )
    assert refused_model == (
        "Could not read the app config: The app config's model tiny lies at https://evil.example/models/tiny/, "
        f"not on this page's origin ({url.rstrip('/')}); the harness loads models from its own server only."
    )
    assert options == 0
    assert [request for request in requests.urls if urlparse(request).hostname == "evil.example"] == []
